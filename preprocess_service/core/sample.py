"""The document model: a sample accepted for planning, as segments whose sizes are final.

A document is a sequence of segments laid out as ``[BOS] segment ... segment [EOS]``:
  text   token ids, trained (the text loss) or only read (a conversation's user turns, role headers)
  image  pixels for the encoder at a planned (dynamic) resolution
  audio  log-mel frames for the audio encoder
  gen    an image the generator must produce: query tokens in the sequence, pixels at a fixed size
Every size is fixed when the document is made (adapters/media/parse.py prices a webdataset sample from
its metadata and media headers) and decoding later produces exactly these sizes. Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEXT_OFFSET = "__next__"
"""Optional field of a raw sample: where its shard's next sample starts (a byte offset the reader
can seek to; -1 at the end of the shard). The planner keeps it in its shard cursor, so a resume
seeks instead of scanning the shard."""


EPOCH = "__epoch__"
"""Field of a raw sample dict (beside ``__key__`` and ``__url__``) naming the epoch it is parsed
for: the planner sets it, and a plugin's hooks are seeded by it (adapters/plugins/)."""

@dataclass(slots=True)
class TextSegment:
    member: str
    ids: np.ndarray
    """int32 token ids, possibly truncated to fit the sequence."""
    trainable: bool = True
    """Whether the model learns to predict these tokens (text loss). False for what it only reads:
    a conversation's role headers and the turns of other roles than the assistant."""

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class ImageRef:
    """One image for the encoder."""

    member: str
    """Tar member extension, e.g. ``jpg`` or ``1.png``."""
    height: int
    """Resized height, pixels."""
    width: int
    tokens: int
    orientation: int = 1
    """EXIF orientation of the stored pixels (1 = none), read with the header."""
    declared_size: tuple[int, int] | None = None
    """(width, height) a manifest declared for the stored pixels where the header disagreed (the
    header's size was used); None where they agree or there was no manifest."""


@dataclass(slots=True)
class AudioRef:
    """One audio clip for the audio encoder."""

    member: str
    seconds: float
    """Duration it was priced from (JSON or header)."""
    frames: int
    """Log-mel frames delivered = tokens * token_stride."""
    tokens: int


@dataclass(slots=True)
class GenImageRef:
    """One image the generator must produce."""

    member: str
    size: int
    """Edge of the square target, pixels."""
    tokens: int
    """Query tokens in the sequence."""
    orientation: int = 1


@dataclass(slots=True)
class VideoRef:
    """One video for the encoder: ``frames`` frames of height x width (adapters/media/video.py)."""

    member: str
    frames: int
    height: int
    width: int
    tokens: int
    seconds: float
    """Duration from its header: the frames are taken at the middles of ``frames`` equal parts."""
    bounds: tuple[int, int] = (0, 0)
    """(frames, pixels) decoding it may produce at most (VideoConfig.max_decoded_frames, _pixels)."""
    orientation: int = 1
    """Its display rotation as an EXIF orientation (1 = as stored), read with the header (its
    decode reads it again from the same bytes)."""


Segment = TextSegment | ImageRef | AudioRef | GenImageRef | VideoRef


@dataclass(slots=True)
class Document:
    """A sample accepted for planning: its token count is final."""

    key: str
    shard: str
    segments: tuple[Segment, ...]
    truncated: bool = False
    dataset: int = 0
    """Index of the job's dataset (JobConfig.mixture()) it comes from."""
    media_bytes: dict[str, bytes] | None = field(default=None, repr=False)
    """Encoded media members by extension; dropped once delivered, refetched from the shard if needed."""
    _num_tokens: int = field(default=0, init=False, repr=False, compare=False)
    """num_tokens, counted once: the planner asks for it several times per document."""

    def __post_init__(self) -> None:
        self._num_tokens = 2 + sum(s.tokens for s in self.segments)

    @property
    def images(self) -> tuple[ImageRef, ...]:
        return tuple(s for s in self.segments if isinstance(s, ImageRef))

    @property
    def audio(self) -> tuple[AudioRef, ...]:
        return tuple(s for s in self.segments if isinstance(s, AudioRef))

    @property
    def generated(self) -> tuple[GenImageRef, ...]:
        return tuple(s for s in self.segments if isinstance(s, GenImageRef))

    @property
    def media(self) -> tuple[ImageRef | AudioRef | GenImageRef | VideoRef, ...]:
        """Segments decoded from a member, in order."""
        return tuple(s for s in self.segments if not isinstance(s, TextSegment))

    @property
    def text_tokens(self) -> int:
        return sum(s.tokens for s in self.segments if isinstance(s, TextSegment))

    @property
    def num_tokens(self) -> int:
        """BOS + the segments' tokens + EOS (segments are fixed when a document is made)."""
        return self._num_tokens

    @property
    def trains_eos(self) -> bool:
        """Whether the model learns to predict this document's EOS: when its content ends with
        trainable text (so it learns to stop there) and nothing was cut off (a truncated document's
        EOS does not end its text)."""
        last = next((s for s in reversed(self.segments) if s.tokens), None)
        return not self.truncated and isinstance(last, TextSegment) and last.trainable
