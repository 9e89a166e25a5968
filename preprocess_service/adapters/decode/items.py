"""Decoding one media item into its slot of a microbatch's output buffer, and what a decode
stage hands back (Decoded, Lent)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from preprocess_service.adapters.plugins.hooks import HookCosts
from preprocess_service.core.assemble import MediaItem
from preprocess_service.core.modalities import MODALITIES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MediaDecoder:
    """How one modality's member is decoded (core/modalities/ names the kinds)."""

    decode: Callable[[bytes, tuple, np.ndarray | None], np.ndarray]
    """(member bytes, the item's params, its slot or None) -> the item's array."""
    in_place: bool = False
    """It writes into the slot it is given (returning it), so nothing is copied after."""


DECODERS: dict[str, MediaDecoder] = {}


def register_decoder(kind: str, decode: Callable[[bytes, tuple, np.ndarray | None], np.ndarray], *,
                     in_place: bool = False) -> None:
    """Registers the decoder of the modality ``kind``."""
    if kind in DECODERS:
        raise ValueError(f"two decoders for media kind {kind!r}")
    DECODERS[kind] = MediaDecoder(decode, in_place)


def _image(data: bytes, params: tuple, out: np.ndarray | None) -> np.ndarray:
    from preprocess_service.adapters.media.imaging import decode_image

    height, width, orientation = params
    return decode_image(data, (height, width), orientation, out)


def _square(data: bytes, params: tuple, out: np.ndarray | None) -> np.ndarray:
    from preprocess_service.adapters.media.imaging import decode_square

    size, orientation = params
    return decode_square(data, size, orientation, out)


def _audio(data: bytes, params: tuple, out: np.ndarray | None) -> np.ndarray:
    from preprocess_service.adapters.media.audio import decode_audio  # torch: loaded on first use

    frames, config = params
    return decode_audio(data, config, frames)


def _video(data: bytes, params: tuple, out: np.ndarray | None) -> np.ndarray:
    from preprocess_service.adapters.media.video import decode_video  # PyAV: loaded on first use

    return decode_video(data, params, out)


register_decoder("image", _image, in_place=True)
register_decoder("video", _video, in_place=True)
register_decoder("gen", _square, in_place=True)
register_decoder("audio", _audio)


def decode_item(kind: str, data: bytes, params: tuple, out: np.ndarray | None = None) -> np.ndarray:
    """One member decoded to the array its slot holds (shape and dtype fixed by the layout). An
    in-place decoder writes into ``out`` when given, which is returned; others ignore it."""
    decoder = DECODERS.get(kind)
    if decoder is None:
        raise ValueError(f"unknown media kind {kind!r}")
    return decoder.decode(data, params, out)


def warm_up_decoders() -> None:
    """Runs every decoder once on small generated media (a JPEG, a PNG, a WAV clip), so their
    lazily built state (codec tables, resize kernels, resamplers, mel filters) exists before the
    first real sample: the first microbatch is not slower, and the server measures its idle memory
    (budget.py's baseline) with that state in it. Failures are left to the first real sample."""
    import io

    from PIL import Image

    from disttrain_api.config import AudioConfig

    try:
        pixels = (np.arange(96 * 128 * 3) % 251).astype(np.uint8).reshape(96, 128, 3)
        for fmt in ("JPEG", "PNG"):
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format=fmt)
            decode_item("image", out.getvalue(), (48, 64, 1))
            decode_item("gen", out.getvalue(), (32, 1))
        import soundfile

        config = AudioConfig()
        out = io.BytesIO()
        soundfile.write(out, np.zeros(8000, dtype=np.float32), 8000, format="WAV")
        decode_item("audio", out.getvalue(), (8, config))
    except Exception:  # a warm-up only; real samples report their own errors
        log.debug("decoder warm-up failed", exc_info=True)


def decode_into(buffer, item: MediaItem, data: bytes, base: int = 0, hooks=None, key: str = "") -> None:
    """Decodes one member into its slot of the output buffer that starts at byte ``base`` of
    ``buffer``: an image is resized straight into it, audio is decoded and copied in. ``hooks``
    (plugins/hooks.MediaHooks) then change the item, document ``key``'s, in place."""
    decoder = DECODERS.get(item.kind)
    if decoder is None:
        raise ValueError(f"unknown media kind {item.kind!r}")
    slot = None
    if decoder.in_place:
        slot = np.ndarray(item.shape, dtype=MODALITIES[item.kind].dtype, buffer=buffer, offset=base + item.offset)
    array = decoder.decode(data, item.params, slot)
    if hooks is not None:
        array = hooks.apply(item.kind, array, key, item.member)
    if array is not slot:
        _write(buffer, item, array, base)


def _write(buffer, item: MediaItem, array: np.ndarray, base: int = 0) -> None:
    """Writes ``array`` into its slot of the output buffer that starts at byte ``base`` of ``buffer``."""
    if array.nbytes != item.nbytes:
        raise ValueError(f"{item.kind} {item.member} decoded to {array.shape} {array.dtype} "
                         f"({array.nbytes} bytes), its slot holds {item.nbytes}")
    np.frombuffer(buffer, dtype=np.uint8, count=item.nbytes, offset=base + item.offset)[:] = \
        np.ascontiguousarray(array).reshape(-1).view(np.uint8)


@dataclass(slots=True)
class Decoded:
    """A filled output buffer and the documents that failed."""

    buffer: np.ndarray
    """uint8 [layout.nbytes]; valid until release()."""
    errors: dict[str, str]
    """Document key -> why it failed (its slots hold garbage)."""
    _release: Callable[[], None] = field(default=lambda: None, repr=False)
    lend: Callable[[dict[str, np.ndarray]], Lent | None] | None = field(default=None, repr=False)
    """Where the buffer is a shared-memory object a client on this host may map (DecodePool, no
    document failed): lend(arrays) puts the arrays not already in it into its spare room and lends
    it (see Lent); release() is then a no-op. None where it cannot be lent."""
    hook_costs: HookCosts = field(default_factory=dict)
    """What the job's media hooks spent decoding it."""

    def release(self) -> None:
        """Hands the buffer back for reuse; views of it must not be used afterwards."""
        self._release()


@dataclass(slots=True)
class Lent:
    """A decode arena lent to a same-host client instead of copied into a message for it
    (decode/shm.py, Microbatch.shm_token). The client maps the object ``name``, checks its first
    TOKEN_BYTES equal ``token`` (else the arena was reused and the microbatch is lost to it), holds
    a shared flock on it while its arrays live and sets byte TAKEN_AT once it has them. The pool
    reuses the arena once it is taken and unlocked, or abandoned (its stream ended before the
    client took it) and unlocked; a new token makes a stale message fail its check."""

    name: str
    token: bytes
    nbytes: int
    """Bytes the client maps: the end of the last tensor."""
    tensors: list[tuple[str, np.dtype, tuple[int, ...], int]]
    """(name, dtype, shape, byte offset in the object) of each array."""
    taken: Callable[[], bool] = field(repr=False)
    """True once the client has set the taken byte (or the pool has already taken the arena back)."""
    abandon: Callable[[], None] = field(repr=False)
    """The stream ended before the client took it: reuse it once nobody holds its lock."""


def missing_reason(doc) -> str | None:
    data = doc.media_bytes or {}
    absent = [s.member for s in doc.media if data.get(s.member) is None]
    if absent:
        return (f"encoded member(s) {absent} not found when re-reading the shard "
                "(did it change after planning?)")
    return None
