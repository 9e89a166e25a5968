"""Parsing: a LAION-style webdataset sample becomes a planned Document (core/sample.py).

A document is priced from metadata only (JSON, captions, image and audio headers): its token count
and every media size are fixed here, before any pixel or sample is decoded, and decoding later
produces exactly these sizes.

A document is a sequence of segments laid out as ``[BOS] segment ... segment [EOS]``:
  text   ``txt``, ``1.txt``, ...                  token ids (the JSON "caption" if there is no txt member)
  image  ``jpg|jpeg|png|webp``, ``1.jpg``, ...     pixels for the encoder, dynamic resolution
  audio  ``flac|wav|mp3|ogg``, ``1.flac``, ...     log-mel frames for the audio encoder
  video  ``mp4|webm|mkv|mov``, ``1.mp4``, ...      sampled frames for the encoder (video.py)
  gen    an image the generator must produce     query tokens in the sequence, pixels at a fixed size
Segment order: the JSON's ``"order"`` (a list of member names) when it gives one, members it does
not list following in the default order; the default order is images, then audio clips, then
texts, each by member index (``jpg`` before ``1.jpg`` before ``2.png``): media first, as for
captioning. An image is a generation target when the job's generation.select is "all", or it is
"listed" and the JSON's ``"generate"`` names the member. Audio clips are priced from the JSON's
``"durations"`` (seconds, one per clip in member order) or ``"duration"`` (the first clip), else
from the file header. Every text is trained (text loss) except in a sample whose JSON holds a
conversation (conversations.py: LLaVA ``"conversations"`` or OpenAI ``"messages"``), whose text is
the conversation, one segment per role header and turn, only the assistant's turns trained.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from disttrain_api.config import AudioConfig, GenerationConfig, ImageConfig, VideoConfig
from disttrain_api.errors import SampleError
from preprocess_service.adapters.media import audio, imaging, video
from preprocess_service.adapters.media.conversations import MARKERS, MediaSlot, TextPiece, parse_conversation
from preprocess_service.core.sample import AudioRef, Document, GenImageRef, ImageRef, Segment, TextSegment, VideoRef
from preprocess_service.core.tokenizer import Tokenizer

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_MEMBER = re.compile(r"^(?:(\d+)\.)?([a-z0-9]+)$")
CAPTION_MEMBER = "json:caption"
"""Pseudo member of a caption taken from the JSON (no txt member)."""


@dataclass(frozen=True)
class Member:
    """What the parser needs of a sample to turn one media member into a segment."""

    meta: dict
    """The sample's JSON."""
    image: ImageConfig
    audio: AudioConfig
    durations: dict[str, float]
    """Audio members' durations the JSON gives (checked)."""
    video: VideoConfig = VideoConfig()


@dataclass(frozen=True)
class MemberKind:
    """A kind of tar member: the extensions that are it, its place in a sample's default order
    (lower first; text is last), and how one member becomes its Document segment (reading only
    headers, never decoding). The segment's type is a modality record's (core/modalities/)."""

    kind: str
    extensions: tuple[str, ...]
    rank: int
    read: Callable[[str, bytes, Member], Segment]


MEMBER_KINDS: dict[str, MemberKind] = {}
_KIND_OF_EXT: dict[str, str] = {"txt": "text"}


def register_member_kind(kind: MemberKind) -> MemberKind:
    """Adds a kind of member; an extension already taken is refused."""
    taken = [e for e in kind.extensions if e in _KIND_OF_EXT]
    if kind.kind in MEMBER_KINDS or taken:
        raise ValueError(f"member kind {kind.kind!r} clashes with a registered one (extensions {taken})")
    MEMBER_KINDS[kind.kind] = kind
    _KIND_OF_EXT.update(dict.fromkeys(kind.extensions, kind.kind))
    return kind


@dataclass(frozen=True, slots=True)
class KnownImage:
    """An image member planned from a manifest (an img2dataset parquet), whose pixels are read by
    offset when it is decoded: the size the manifest declares, and the member's first and last
    bytes (image_heads.py: the head holds the whole header). The bytes win: a manifest cannot know
    an EXIF orientation (img2dataset may keep the original bytes, and its sizes are the stored
    ones), nor be trusted to agree with the file."""

    width: int
    """Stored width the manifest declares, pixels."""
    height: int
    size: int
    """The member's bytes."""
    head: bytes
    """Its first bytes, holding its header (all of them for a small member)."""
    tail: bytes
    """Its last bytes (its end marker)."""


def classify_members(sample: dict) -> dict[str, str]:
    """{member: "text" | a registered kind ("image", "audio", ...)} of a raw sample's content members."""
    return {ext: _KIND_OF_EXT[m.group(2)] for ext in sample
            if isinstance(ext, str) and (m := _MEMBER.match(ext)) and m.group(2) in _KIND_OF_EXT}


def _member_index(member: str) -> int:
    match = _MEMBER.match(member)
    return int(match.group(1) or 0) if match else 0


def _rank(kind: str) -> int:
    return MEMBER_KINDS[kind].rank if kind in MEMBER_KINDS else 1 << 30  # text last


def _default_order(kinds: dict[str, str]) -> list[str]:
    return sorted(kinds, key=lambda m: (_rank(kinds[m]), _member_index(m), m))


def parse_document(sample: dict, *, image_config: ImageConfig, tokenizer: Tokenizer, seq_len: int,
                   audio_config: AudioConfig = AudioConfig(),
                   generation: GenerationConfig = GenerationConfig(),
                   modalities: frozenset[str] | None = None, video_config: VideoConfig = VideoConfig()) -> Document:
    """Turns a raw webdataset sample (``__key__``, ``__url__``, ext -> bytes) into a Document.

    ``modalities`` (a dataset's member kinds, DatasetConfig.modalities; None: all) leaves the
    members of other kinds out as if the sample did not hold them: the JSON's "order" and
    "generate" may still name them, a conversation's ``<image>`` markers are dropped with the
    images, and without "text" neither text members, caption nor conversation are used.

    Raises SampleError naming the problem for anything that makes the sample unusable.
    """
    key, shard = sample["__key__"], sample.get("__url__", "")
    try:
        meta = _parse_json(sample.get("json"))
        kinds = classify_members(sample)
        if modalities is not None:
            meta, kinds = _only(meta, kinds, modalities)
        generate = _generation_targets(meta, kinds, generation)
        durations = _json_durations(meta, [m for m in _default_order(kinds) if kinds[m] == "audio"])
        segments: list[Segment | None] = []
        texts: list[tuple[int, TextPiece]] = []
        slot_kinds = frozenset(k for k in MARKERS if modalities is None or k in modalities)
        for part in _parts(sample, meta, kinds, slot_kinds, template=getattr(tokenizer, "chat_template", None)):
            if isinstance(part, TextPiece):
                texts.append((len(segments), part))
                segments.append(None)
            elif part in generate:
                segments.append(_gen_ref(part, sample[part], image_config, generation))
            else:
                context = Member(meta, image_config, audio_config, durations, video_config)
                segments.append(MEMBER_KINDS[kinds[part]].read(part, sample[part], context))
    except SampleError as exc:
        raise SampleError(key, exc.reason, shard, exc.kind) from None
    if not segments:
        raise SampleError(key, "has no image, audio or text", shard, "empty")
    media_tokens = sum(s.tokens for s in segments if s is not None)
    room = seq_len - 2 - media_tokens
    if room < 0:
        raise SampleError(key, f"needs {media_tokens + 2} tokens for its media alone, "
                               f"more than seq_len {seq_len}", shard, "too_long")
    truncated = _tokenize_into(segments, texts, tokenizer, room, seq_len * TEXT_CHARS_PER_TOKEN)
    done = [s for s in segments if s is not None]
    media = {s.member: sample[s.member] for s in done if not isinstance(s, TextSegment)}
    return Document(key=key, shard=shard, segments=tuple(done), truncated=truncated, media_bytes=media)


def _only(meta: dict, kinds: dict[str, str], modalities: frozenset[str]) -> tuple[dict, dict[str, str]]:
    """The metadata and members of a sample as seen by a dataset that uses ``modalities`` only."""
    kept = {m: k for m, k in kinds.items() if k in modalities}
    dropped = set(kinds) - set(kept)
    meta = dict(meta)
    for field in ("order", "generate"):
        if isinstance(meta.get(field), list):
            meta[field] = [m for m in meta[field] if m not in dropped]
    if "text" not in modalities:
        for field in ("caption", "conversations", "messages"):
            meta.pop(field, None)
    return meta, kept


def _parts(sample: dict, meta: dict, kinds: dict[str, str], slot_kinds: frozenset[str] = frozenset(MARKERS),
           template=None) -> list[TextPiece | str]:
    """The document's content in order: media member names and text pieces.

    A sample with a conversation (conversations.py) is its media not placed by an ``<image>`` or
    ``<video>`` marker (default order), then the conversation, each marker taking the next image
    (video) in member order; its text members and JSON caption are not used (the conversation is
    its text). Markers of kinds not in ``slot_kinds`` (the dataset does not use them) are dropped.
    """
    pieces = parse_conversation(meta, template)
    if pieces is not None:
        pieces = [p for p in pieces if not isinstance(p, MediaSlot) or p.kind in slot_kinds]
    if pieces is None:
        parts: list[TextPiece | str] = [
            TextPiece(m, _decode_text(sample[m], m), trainable=True) if kinds[m] == "text" else m
            for m in _segment_order(meta, kinds)]
        if not any(isinstance(p, TextPiece) for p in parts) and isinstance(meta.get("caption"), str) \
                and meta["caption"]:
            parts.append(TextPiece(CAPTION_MEMBER, meta["caption"], trainable=True))
        return parts
    if "order" in meta:
        raise SampleError("", 'a conversation places its images with <image> markers; JSON "order" cannot be '
                              "combined with it", kind="invalid_conversation")
    placed, used = {}, set()
    for kind in MARKERS:
        members = [m for m in _default_order(kinds) if kinds[m] == kind]
        num_slots = sum(isinstance(p, MediaSlot) and p.kind == kind for p in pieces)
        if num_slots > len(members):
            raise SampleError("", f"conversation: {num_slots} <{kind}> markers but the sample holds {len(members)} "
                                  f"{kind}s {members}", kind="invalid_conversation")
        placed[kind] = iter(members[:num_slots])
        used.update(members[:num_slots])
    first = [m for m in _default_order(kinds) if kinds[m] != "text" and m not in used]
    return [*first, *(next(placed[p.kind]) if isinstance(p, MediaSlot) else p for p in pieces)]


def _tokenize_into(segments: list, texts: list[tuple[int, TextPiece]], tokenizer: Tokenizer, room: int,
                   max_chars: int) -> bool:
    """Fills ``segments`` at the texts' indexes with TextSegments, in order, within ``room`` tokens
    and ``max_chars`` characters in all (more cannot fit); returns whether anything was cut."""
    cut, budget = [], max_chars
    for _, piece in texts:
        cut.append(piece.text[:budget])
        budget -= len(cut[-1])
    truncated = sum(len(p.text) for _, p in texts) > max_chars
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is not None and len(cut) > 1:
        encoded = encode_batch(cut)
    else:
        encoded = [tokenizer.encode(text) for text in cut]
    encode_template = getattr(tokenizer, "encode_template", None)
    if encode_template is not None:  # a chat template's text: its special tokens are read as such
        encoded = [encode_template(text) if piece.special else ids
                   for (_, piece), text, ids in zip(texts, cut, encoded)]
    for (index, piece), ids in zip(texts, encoded):
        truncated = truncated or len(ids) > room
        segments[index] = TextSegment(member=piece.member, ids=ids[:room], trainable=piece.trainable)
        room -= len(segments[index].ids)
    return truncated


def _segment_order(meta: dict, kinds: dict[str, str]) -> list[str]:
    listed = meta.get("order")
    if listed is None:
        return _default_order(kinds)
    if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
        raise SampleError("", f'JSON "order" must be a list of member names, got {listed!r}', kind="invalid_order")
    unknown = [m for m in listed if m not in kinds]
    if unknown or len(set(listed)) != len(listed):
        problem = f"names members the sample does not hold: {unknown}" if unknown else "lists a member twice"
        raise SampleError("", f'JSON "order" {listed} {problem} (members: {sorted(kinds)})', kind="invalid_order")
    return listed + [m for m in _default_order(kinds) if m not in listed]


def _generation_targets(meta: dict, kinds: dict[str, str], generation: GenerationConfig) -> set[str]:
    images = {m for m, kind in kinds.items() if kind == "image"}
    if generation.select == "none":
        return set()
    if generation.select == "all":
        return images
    listed = meta.get("generate", [])
    if not isinstance(listed, list) or not all(isinstance(m, str) and m in images for m in listed):
        raise SampleError("", f'JSON "generate" must list image members of the sample, got {listed!r} '
                              f"(images: {sorted(images)})", kind="invalid_order")
    return set(listed)


def _json_durations(meta: dict, audio_members: list[str]) -> dict[str, float]:
    """Durations the JSON declares, by member; absent or unusable values fall back to the header."""
    values = meta.get("durations")
    if not isinstance(values, list):
        values = [meta.get("duration")]
    out = {}
    for member, value in zip(audio_members, values):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6:
            out[member] = float(value)
    return out


MAX_JSON_BYTES = 1 << 20
"""Larger .json members are refused: LAION metadata is a few hundred bytes."""
TEXT_CHARS_PER_TOKEN = 16
"""Text beyond seq_len * this many characters cannot fit a sequence with any tokenizer we use, and
is cut before tokenizing (a 64 MB caption costs nothing)."""


def _decode_text(raw: bytes, member: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SampleError("", f"{member} is not valid UTF-8 ({exc})", kind="bad_utf8") from None


def _parse_json(raw: bytes | None) -> dict:
    if raw is None:
        return {}
    if len(raw) > MAX_JSON_BYTES:
        raise SampleError("", f"JSON metadata is {len(raw)} bytes, more than {MAX_JSON_BYTES}", kind="invalid_json")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # bad UTF-8, bad JSON, an integer past Python's digit limit
        raise SampleError("", f"invalid JSON metadata ({exc})", kind="invalid_json") from None
    except RecursionError:
        raise SampleError("", "JSON metadata is nested too deeply", kind="invalid_json") from None
    if not isinstance(meta, dict):
        raise SampleError("", f"JSON metadata is a {type(meta).__name__}, expected an object", kind="invalid_json")
    return meta


def _image_ref(ext: str, data: bytes | KnownImage, config: ImageConfig) -> ImageRef:
    head, tail, size = (data.head, data.tail, data.size) if isinstance(data, KnownImage) else (data, data, len(data))
    try:
        header = imaging.read_header(head)
    except imaging.DecompressionBomb as exc:
        raise SampleError("", f"image {ext}: decompression bomb: {exc}", kind="decompression_bomb") from None
    except ValueError as exc:
        raise SampleError("", f"image {ext}: {exc}", kind="unreadable_image") from None
    pixels = header.width * header.height
    if pixels > config.max_source_pixels:
        raise SampleError("", f"image {ext}: decompression bomb: {header.width}x{header.height} = "
                              f"{pixels} pixels exceeds max_source_pixels {config.max_source_pixels}",
                          kind="decompression_bomb")
    if imaging.looks_truncated(tail, header.format):
        raise SampleError("", f"image {ext}: truncated {header.format} file ({size} bytes, no end marker)",
                          kind="truncated_image")
    height, width = imaging.target_size(header.width, header.height, config)
    return ImageRef(member=ext, height=height, width=width, orientation=header.orientation,
                    tokens=imaging.num_image_tokens(height, width, config),
                    declared_size=_disagreeing_size(data, header))


def _disagreeing_size(data: bytes | KnownImage, header: imaging.ImageHeader) -> tuple[int, int] | None:
    """The (width, height) a manifest declared for the stored pixels, when the bytes say otherwise."""
    if not isinstance(data, KnownImage):
        return None
    swapped = header.orientation >= 5  # EXIF orientations 5-8 turn the stored pixels by a quarter
    stored = (header.height, header.width) if swapped else (header.width, header.height)
    return None if stored == (data.width, data.height) else (data.width, data.height)


def _gen_ref(ext: str, data: bytes, config: ImageConfig, generation: GenerationConfig) -> GenImageRef:
    """A generation target is checked like an encoder image, then sized by the job, not the file."""
    ref = _image_ref(ext, data, config)
    return GenImageRef(member=ext, size=generation.image_size, tokens=generation.query_tokens,
                       orientation=ref.orientation)


def _audio_ref(ext: str, data: bytes, seconds: float | None, config: AudioConfig) -> AudioRef:
    if seconds is None:
        try:
            seconds = audio.header_seconds(data, config.sample_rate)
        except ValueError as exc:
            raise SampleError("", f"audio {ext}: {exc}", kind="unreadable_audio") from None
    tokens = config.num_tokens(seconds)
    return AudioRef(member=ext, seconds=seconds, frames=tokens * config.token_stride, tokens=tokens)


def _video_ref(ext: str, data: bytes, image: ImageConfig, config: VideoConfig) -> VideoRef:
    try:
        header = video.read_header(data, max_pixels=config.max_source_pixels)
    except ValueError as exc:
        raise SampleError("", f"video {ext}: {exc}", kind="unreadable_video") from None
    if header.width * header.height > config.max_source_pixels:
        raise SampleError("", f"video {ext}: decompression bomb: frames of {header.width}x{header.height} exceed "
                              f"video.max_source_pixels {config.max_source_pixels}", kind="decompression_bomb")
    try:
        planned = video.plan(header, image, config)
    except ValueError as exc:
        raise SampleError("", f"video {ext}: {exc}", kind="unreadable_video") from None
    return VideoRef(member=ext, frames=planned.frames, height=planned.height, width=planned.width,
                    tokens=planned.tokens, seconds=header.seconds,
                    bounds=(config.max_decoded_frames, config.max_decoded_pixels), orientation=header.orientation)


register_member_kind(MemberKind("image", IMAGE_EXTENSIONS, 0,
                                lambda member, data, m: _image_ref(member, data, m.image)))
register_member_kind(MemberKind("audio", audio.AUDIO_EXTENSIONS, 1,
                                lambda member, data, m: _audio_ref(member, data, m.durations.get(member), m.audio)))
register_member_kind(MemberKind("video", video.VIDEO_EXTENSIONS, 2,
                                lambda member, data, m: _video_ref(member, data, m.image, m.video)))
