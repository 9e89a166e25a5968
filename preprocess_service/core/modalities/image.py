"""``image``: encoder images, uint8 [h, w, 3] each at its resized size; one flat ``pixels`` region."""

import numpy as np

from preprocess_service.core.modalities._record import Modality, register
from preprocess_service.core.sample import ImageRef

IMAGE = register(Modality(
    kind="image", segment=ImageRef, code=2, placeholder="image_id", region="pixels", dtype=np.uint8,
    slot=lambda ref, audio: ((ref.height, ref.width, 3), (ref.height, ref.width, ref.orientation)),
    region_shape=lambda shapes, nbytes, audio: (nbytes,),
    metadata=lambda shapes: {"image_shapes": np.array(shapes, dtype=np.int32).reshape(-1, 3)},
))
