"""``audio``: log-mel clips, float16 [frames, n_mels] each; one ``mel`` region of all frames."""

import numpy as np

from preprocess_service.core.modalities._record import Modality, register
from preprocess_service.core.sample import AudioRef

AUDIO = register(Modality(
    kind="audio", segment=AudioRef, code=3, placeholder="audio_id", region="mel", dtype=np.float16,
    slot=lambda ref, audio: ((ref.frames, audio.n_mels), (ref.frames, audio)),
    region_shape=lambda shapes, nbytes, audio: (sum(s[0] for s in shapes), audio.n_mels),
    metadata=lambda shapes: {"audio_frames": np.array([s[0] for s in shapes], dtype=np.int32)},
))
