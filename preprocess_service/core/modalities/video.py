"""``video``: encoder videos, uint8 [frames, h, w, 3] each at its planned size and frame count; one
flat ``video_pixels`` region. Its tokens are frames / temporal_patch x those of one h x w image;
the placeholder is the image token (the modality array tells them apart)."""

import numpy as np

from preprocess_service.core.modalities._record import Modality, register
from preprocess_service.core.sample import VideoRef

VIDEO = register(Modality(
    kind="video", segment=VideoRef, code=5, placeholder="image_id", region="video_pixels", dtype=np.uint8,
    slot=lambda ref, audio: ((ref.frames, ref.height, ref.width, 3),
                             (ref.frames, ref.height, ref.width, ref.seconds, *ref.bounds)),
    region_shape=lambda shapes, nbytes, audio: (nbytes,),
    metadata=lambda shapes: {"video_shapes": np.array(shapes, dtype=np.int32).reshape(-1, 4)},
))
