"""``gen``: images the generator must produce, uint8 [size, size, 3], one size per microbatch;
one ``gen_pixels`` region [n, size, size, 3]."""

import numpy as np

from preprocess_service.core.modalities._record import Modality, register
from preprocess_service.core.sample import GenImageRef


def _one_size(shapes):
    sizes = sorted({s[0] for s in shapes})
    if len(sizes) > 1:
        raise ValueError(f"generation targets of one microbatch have different sizes {sizes}")


GEN = register(Modality(
    kind="gen", segment=GenImageRef, code=4, placeholder="gen_id", region="gen_pixels", dtype=np.uint8,
    slot=lambda ref, audio: ((ref.size, ref.size, 3), (ref.size, ref.orientation)),
    region_shape=lambda shapes, nbytes, audio: (len(shapes), *(shapes[0][:2] if shapes else (0, 0)), 3),
    priced_by="generator",
    check=_one_size,
))
