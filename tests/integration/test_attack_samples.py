"""Adversarial samples: one sample's fault stays that sample's.

Every test generates many hostile variants (seeded), writes them between good samples into a few
tar shards (the raw tar bytes built here, headers edited by hand where needed), runs them through
a real server over loopback gRPC with trainer.DataClient, and checks for each variant:

(a) the report: a bad sample is skipped with its key, its shard and an expected kind (or, where
    the bytes are in fact decodable, delivered instead: never both);
(b) exactly once: every good sample arrives once (delivered keys == good keys + variants that were
    delivered, no duplicates), and the stream never fails.

Variants generated per class (each test asserts its count, so the table is real):

    class                                                       variants  test
    1  random bytes (0 B .. 3 KB, magic + garbage) and files of      93   test_random_and_mistyped_members
       another type, for jpg png webp txt json flac wav mp3 ogg
    2  hostile JSON (deep, > 1 MiB, not an object, bad UTF-8,        59   test_hostile_json
       order/generate/durations of wrong types, huge lists,
       NaN/Infinity, duplicate keys, captions from the JSON)
    3  text (bad UTF-8, 30 MB captions, NUL, blank)                  24   test_hostile_text
    4  tar structure                                                127   (the three tests below)
         duplicate members, long names (GNU, pax), keys over    42 + 26   test_tar_structure
         1024 chars, subdirectories, links/devices, meta
         members, 65 members; + 26 duplicate-key copies in a
         shard and across shards
         oversize members / samples, a 200 MB sparse member,      10   test_oversize_members_are_skipped_by_header_size
         a header claiming 8 GiB
         shards cut at 37 offsets, 4 refused header blocks,       49   test_truncated_shards
         a short member, gzip/bzip2/xz, empty/garbage shards
    5  images (header and real bombs, truncated, CMYK, 1x1,       57   test_hostile_images
       1x5000, 16-bit/palette/1-bit, EXIF, other formats)
       + a job's own max_source_pixels                            30   test_max_source_pixels_of_...
    6  audio (rates 0 .. 2^32-1 Hz, 0/65/100/65535 channels,      68   test_hostile_audio_in_the_decode_pool
       sample formats, truncated flac/wav/mp3/ogg) in the
       decode process pool
    7  error tolerance: 150 bad in a row, 60 % bad spread out,     3   test_error_tolerance
       10 % bad (800 samples)

The tests at the end are minimal reproductions of the product bugs this suite found (all fixed:
headers cut or corrupt after offset 0 were read as the end of the archive; non-UTF-8 member names
broke serialization; KEY.__key__ / KEY.__url__ members overrode the sample's fields; a job failing
on a stream's first step gave UNKNOWN, not DATA_LOSS; reading a PNG's header decoded its pixels;
NaN audio reached the trainer; a huge JSON integer was parse_failed, not invalid_json), and one
documented policy (a refused header block reports the sample it may belong to).
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.config import ImageConfig, JobConfig
from disttrain_api.errors import SampleError, ServiceUnavailableError
from helpers import jpeg_bytes
from preprocess_service.adapters.io.tarstream import TarLimits, iter_samples
from preprocess_service.adapters.media import imaging
from preprocess_service.service.server import create_server
from trainer import DataClient

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

KINDS = frozenset(SampleError.KINDS)
LOST_KINDS = KINDS - frozenset(SampleError.NOT_LOST)
SEQ_LEN = 2048
IMAGE_CONFIG = ImageConfig()


# --- tar bytes, written by hand ------------------------------------------------------------------

def tar_entry(name: str, data: bytes = b"", *, fmt: int = tarfile.GNU_FORMAT, **attrs) -> bytes:
    """One tar member: header block(s) (GNU long name / pax records as ``fmt`` needs) + data + padding."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    if info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE):
        info.size = 0
    header = info.tobuf(fmt, "utf-8", "surrogateescape")
    return header + data + b"\0" * (-len(data) % 512)


def raw_header(name: str, size: int, type_: bytes = tarfile.REGTYPE) -> bytes:
    """A bare header block claiming ``size`` bytes (GNU base-256 sizes beyond 8 GiB)."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime = size, type_, 0
    return info.tobuf(tarfile.GNU_FORMAT)


END_OF_ARCHIVE = b"\0" * 1024


def sample_entries(key: str, members: list[tuple[str, bytes]], **kw) -> bytes:
    return b"".join(tar_entry(f"{key}.{suffix}", data, **kw) for suffix, data in members)


# --- media ---------------------------------------------------------------------------------------

def image(fmt: str, width: int, height: int, *, seed: int = 0, mode: str = "RGB", **save) -> bytes:
    if not save and mode in ("RGB", "L", "CMYK"):
        return jpeg_bytes(width, height, seed=seed, fmt=fmt, mode=mode)
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    img.save(out, fmt, **save)
    return out.getvalue()


AUDIO_FORMATS = {"flac": ("FLAC", "PCM_16"), "wav": ("WAV", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
                 "ogg": ("OGG", "VORBIS")}


def audio(ext: str, *, rate: int = 16000, channels: int = 1, seconds: float = 0.3, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    wave = (0.3 * rng.standard_normal((int(rate * seconds), channels))).clip(-1, 1).astype(np.float32)
    out = io.BytesIO()
    fmt, subtype = AUDIO_FORMATS[ext]
    soundfile.write(out, wave, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def valid_member(ext: str, rng: np.random.Generator) -> bytes:
    seed = int(rng.integers(1 << 30))
    if ext in ("jpg", "png", "webp"):
        return image({"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext], int(rng.integers(20, 90)),
                     int(rng.integers(20, 90)), seed=seed)
    if ext in AUDIO_FORMATS:
        return audio(ext, seed=seed)
    if ext == "txt":
        return f"a caption {seed}".encode()
    if ext == "json":
        return json.dumps({"caption": f"json caption {seed}", "width": 10}).encode()
    raise ValueError(ext)


def patch_png_size(png: bytes, width: int, height: int) -> bytes:
    """The PNG with its IHDR declaring width x height (CRC fixed): a header-only bomb."""
    assert png[12:16] == b"IHDR"
    ihdr = png[16:29]
    ihdr = struct.pack(">II", width, height) + ihdr[8:]
    return png[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + png[33:]


def patch_jpeg_size(jpg: bytes, width: int, height: int) -> bytes:
    """The JPEG with its SOF0/SOF2 frame header declaring width x height."""
    data = bytearray(jpg)
    i = 2
    while i < len(data):
        marker, length = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5:i + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        i += 2 + length
    raise ValueError("no SOF marker")


def patch_wav(wav: bytes, *, rate: int | None = None, channels: int | None = None,
              data_size: int | None = None) -> bytes:
    """A WAV (soundfile's canonical 44-byte header) with header fields overwritten."""
    data = bytearray(wav)
    assert data[12:16] == b"fmt " and data[36:40] == b"data"
    if channels is not None:
        data[22:24] = struct.pack("<H", channels)
    if rate is not None:
        data[24:28] = struct.pack("<I", rate)
    if data_size is not None:
        data[40:44] = struct.pack("<I", data_size)
    return bytes(data)


# --- variants and the exactly-once check --------------------------------------------------------

@dataclass
class Variant:
    """One hostile sample and what may become of it."""

    key: str
    members: list[tuple[str, bytes]]
    kinds: frozenset[str] = frozenset()
    """Kinds it may be skipped with (empty: it must be delivered)."""
    deliver: bool = True
    """Whether delivering it is acceptable."""
    check: Callable[[dict], None] | None = None
    """Called with the delivered document (see _documents) when it is delivered."""
    report_key: str | None = None
    """The key the report names, when it differs from ``key`` (a key too long to repeat)."""
    raw: bytes | None = None
    """Tar bytes written instead of ``members`` (hand-made headers)."""
    shard: str = ""
    """Filled in when written."""
    delivered_key: str | None = None
    """The key it is delivered under, when it differs from ``key`` (a member in a subdirectory)."""
    absent: bool = False
    """Neither delivered nor reported: nothing in it is a sample (links, meta members, bytes past a cut)."""
    duplicate_member: bool = False
    """It repeats a member: a duplicate_member record names it (the first copy is kept)."""

    def __post_init__(self) -> None:
        assert "." not in (self.delivered_key or self.key).rsplit("/", 1)[-1], self.key  # a dot ends a key

    def tar(self) -> bytes:
        return self.raw if self.raw is not None else sample_entries(self.key, self.members)


def must_deliver(key, members, check=None, **kw) -> Variant:
    return Variant(key, members, frozenset(), True, check, **kw)


def must_skip(key, members, kinds=KINDS, **kw) -> Variant:
    return Variant(key, members, frozenset(kinds), False, **kw)


def either(key, members, kinds=KINDS, check=None, **kw) -> Variant:
    return Variant(key, members, frozenset(kinds), True, check, **kw)


def good_members(key: str, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    return [("jpg", valid_member("jpg", rng)), ("txt", f"good sample {key}".encode()),
            ("json", json.dumps({"key": key}).encode())]


def write_interleaved(path: Path, variants: list[Variant], rng: np.random.Generator, *,
                      prefix: str, goods_between: tuple[int, int] = (1, 2), good=good_members) -> list[str]:
    """A shard: good samples, a variant, good samples, a variant ...; returns the good keys."""
    goods, parts = [], []
    for i, variant in enumerate([None, *variants]):
        if variant is not None:
            variant.shard = str(path)
            parts.append(variant.tar())
        for j in range(int(rng.integers(goods_between[0], goods_between[1] + 1))):
            key = f"{prefix}{i:04d}{j}"
            goods.append(key)
            parts.append(sample_entries(key, good(key, rng)))
    path.write_bytes(b"".join(parts) + END_OF_ARCHIVE)
    return goods


def _documents(mb) -> dict[str, dict]:
    """key -> {"text": bytes, "tokens": int, "images": [(h, w, 3)], "mel_frames": [n], "gen": n} of a microbatch."""
    flat = mb.tokens.reshape(-1).numpy()
    cu = mb.cu_seqlens.numpy()
    docs: dict[str, dict] = {}
    spans = {}
    for j, d in enumerate(mb.segment_doc.numpy()):
        if d >= 0:
            spans[mb.sample_keys[d]] = (int(cu[j]), int(cu[j + 1]))
    images = [(int(s), tuple(img.shape)) for (s, _), img in zip(mb.image_spans.numpy(), mb.images, strict=True)]
    mels = [(int(s), int(m.shape[0]), bool(m.isfinite().all()))
            for (s, _), m in zip(mb.audio_spans.numpy(), mb.mels, strict=True)]
    gens = [int(s) for s, _ in mb.gen_spans.numpy()]
    for key, (start, end) in spans.items():
        ids = flat[start:end]
        docs[key] = {"text": bytes(ids[ids < 256].astype(np.uint8)), "tokens": end - start,
                     "images": [shape for s, shape in images if start <= s < end],
                     "mel_frames": [n for s, n, _ in mels if start <= s < end],
                     "mel_finite": all(ok for s, _, ok in mels if start <= s < end),
                     "gen": sum(1 for s in gens if start <= s < end)}
    return docs


@dataclass
class Outcome:
    keys: list[str] = field(default_factory=list)
    docs: dict[str, dict] = field(default_factory=dict)
    report: object = None
    errors: list[BaseException] = field(default_factory=list)
    seconds: float = 0.0

    def records(self, kinds=KINDS) -> list:
        return [s for s in self.report.skipped if s.kind in kinds]


def consume(address: str, config: JobConfig, timeout_s: float = 60.0) -> Outcome:
    """Every rank of ``config`` consumed at once (a thread each); errors are collected, not raised."""
    out, lock = Outcome(), threading.Lock()
    start = time.monotonic()

    def rank(r: int) -> None:
        try:
            with DataClient(address, config, r, connect_timeout_s=10) as client:
                for mb in client:
                    docs = _documents(mb)
                    with lock:
                        out.keys += mb.sample_keys
                        out.docs.update(docs)
                    assert time.monotonic() - start < timeout_s, "the job is too slow"
        except BaseException as exc:  # handed to the test
            with lock:
                out.errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(config.dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    out.seconds = time.monotonic() - start
    out.report = get_report(address, config.job_id())  # once every rank is done: decode failures included
    return out


def get_report(address: str, job_id: str):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.PreprocessStub(channel).GetReport(pb.ReportRequest(job_id=job_id), timeout=20)


def exactly_once(out: Outcome, good: set[str], variants: list[Variant], *,
                 keyless_ok: frozenset[str] = frozenset()) -> dict[str, str]:
    """Asserts (a) and (b) of the module docstring; returns variant key -> "delivered" or its kind.
    A record without a key (a shard problem) is accepted only for a shard in ``keyless_ok``."""
    assert not out.errors, out.errors
    assert out.report is not None
    counts = Counter(out.keys)
    duplicated = sorted(k for k, n in counts.items() if n > 1)
    assert not duplicated, f"delivered more than once: {duplicated[:10]}"
    delivered = set(counts)
    lost = {}
    for record in out.records(LOST_KINDS):
        if not record.key:
            assert record.shard in keyless_ok, f"a shard problem: {record}"
            continue
        assert record.key not in lost, f"two lost records for {record.key!r}"
        lost[record.key] = record
    missing = sorted(good - delivered)
    assert not missing, f"good samples lost: {missing[:10]} (report: {[lost.get(k) for k in missing[:3]]})"
    assert not (good & set(lost)), f"good samples reported: {[lost[k] for k in sorted(good & set(lost))][:3]}"
    fates, known = {}, set(good)
    for v in variants:
        name = v.delivered_key or v.key
        known.add(name)
        report_key = v.report_key or v.key
        if v.absent:
            assert name not in delivered and report_key not in lost, (v.key, lost.get(report_key))
            fates[v.key] = "absent"
            continue
        if name in delivered:
            assert v.deliver, f"{v.key[:80]!r} was delivered, expected a skip with one of {sorted(v.kinds)}"
            assert report_key not in lost, f"{v.key[:80]!r} both delivered and reported lost: {lost[report_key]}"
            if v.check is not None:
                v.check(out.docs[name])
            fates[v.key] = "delivered"
        else:
            record = lost.get(report_key)
            assert record is not None, (f"{v.key[:80]!r} neither delivered nor reported "
                                        f"(expected {'delivery or ' if v.deliver else ''}{sorted(v.kinds)[:6]})")
            assert v.kinds, f"{v.key[:80]!r} must be delivered, was skipped: {record.kind}: {record.reason}"
            assert record.kind in v.kinds, f"{v.key[:80]!r}: kind {record.kind} ({record.reason}), " \
                                           f"expected one of {sorted(v.kinds)}"
            assert record.shard == v.shard, (record.shard, v.shard)
            assert record.reason
            fates[v.key] = record.kind
    unexpected = sorted(delivered - known)
    assert not unexpected, f"delivered keys that are not in the data: {unexpected[:10]}"
    strays = sorted(k for k in lost if k not in {v.report_key or v.key for v in variants})
    assert not strays, f"records for keys no variant explains: {[lost[k] for k in strays[:5]]}"
    return fates


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("attack-samples")


@pytest.fixture()
def server_for():
    servers = []

    def start(decode_workers: int | None = 0, **limits) -> str:
        server, port, _ = create_server("127.0.0.1:0", decode_workers=decode_workers, **limits)
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait()


def job(*shards, **kw) -> JobConfig:
    fields = dict(shards=tuple(str(s) for s in shards), seq_len=SEQ_LEN, dp_size=1, num_microbatches=2,
                  seqs_per_microbatch=1, shuffle_buffer=1, max_error_fraction=1.0, max_consecutive_errors=1000)
    fields.update(kw)
    return JobConfig(**fields)


def run_variants(server_for, root: Path, name: str, variants: list[Variant], *, num_shards: int = 2,
                 seed: int = 0, config: dict | None = None, server: dict | None = None,
                 good=good_members) -> dict[str, str]:
    """Writes ``variants`` interleaved with good samples into ``num_shards`` shards, runs one job
    over them through a real server and checks exactly-once; returns each variant's fate."""
    rng = np.random.default_rng(seed)
    directory = root / name
    directory.mkdir()
    goods, paths = set(), []
    for s in range(num_shards):
        path = directory / f"{s:05d}.tar"
        goods |= set(write_interleaved(path, variants[s::num_shards], rng, prefix=f"good{s}x", good=good))
        paths.append(path)
    address = server_for(**(server or {"decode_workers": 0}))
    out = consume(address, job(*paths, **(config or {})))
    return exactly_once(out, goods, variants)


# --- class 1: random bytes and files of another type, per member type ----------------------------

MEMBER_TYPES = ("jpg", "png", "webp", "txt", "json", "flac", "wav", "mp3", "ogg")
MAGIC = {"jpg": b"\xff\xd8\xff\xe0", "png": b"\x89PNG\r\n\x1a\n", "webp": b"RIFF\x10\x00\x00\x00WEBPVP8 ",
         "txt": b"\xef\xbb\xbf", "json": b"{\"a\": ", "flac": b"fLaC\x00\x00\x00\x22",
         "wav": b"RIFF\x24\x00\x00\x00WAVEfmt ",
         "mp3": b"ID3\x04\x00\x00\x00\x00\x00\x00", "ogg": b"OggS\x00\x02"}
OTHER_TYPE = {"jpg": ["png", "webp"], "png": ["jpg", "wav"], "webp": ["png", "json"], "txt": ["jpg", "json"],
              "json": ["txt", "jpg"], "flac": ["wav", "jpg"], "wav": ["flac", "ogg"], "mp3": ["wav", "png"],
              "ogg": ["mp3", "flac"]}


def _with_member(ext: str, payload: bytes, rng) -> list[tuple[str, bytes]]:
    """A sample whose ``ext`` member is ``payload``, the rest valid."""
    if ext == "txt":
        return [("jpg", valid_member("jpg", rng)), ("txt", payload)]
    if ext == "json":
        return [("jpg", valid_member("jpg", rng)), ("txt", b"caption"), ("json", payload)]
    return [(ext, payload), ("txt", b"a caption")]


def class1_variants(rng) -> list[Variant]:
    out = []
    for ext in MEMBER_TYPES:
        media = ext not in ("txt", "json")
        payloads = [rng.bytes(n) for n in (0, 1, 2, 17, 512, 3000)]
        payloads.append(MAGIC[ext] + rng.bytes(int(rng.integers(1, 2000))))
        for i, payload in enumerate(payloads):
            key = f"c1-{ext}-random{i}"
            if ext == "json":
                out.append(must_skip(key, _with_member(ext, payload, rng), {"invalid_json"}))
            elif media:
                out.append(must_skip(key, _with_member(ext, payload, rng)))
            else:
                out.append(either(key, _with_member(ext, payload, rng)))
        for other in OTHER_TYPE[ext]:
            out.append(either(f"c1-{ext}-is-{other}", _with_member(ext, valid_member(other, rng), rng)))
        if ext in AUDIO_FORMATS:  # a JSON duration skips the header read: the garbage fails at decode
            for n in (0, 300):
                out.append(must_skip(f"c1-{ext}-random{n}-with-duration",
                                     [(ext, rng.bytes(n)), ("json", b'{"duration": 0.5}')], {"decode_failed"}))
    # a valid file under another image extension is decoded by content, at its real size
    png = image("PNG", 70, 30, seed=1)
    out.append(must_deliver("c1-png-named-jpg", [("jpg", png)], check=_image_check([(70, 30)])))
    out.append(must_deliver("c1-jpg-named-webp", [("webp", image("JPEG", 33, 61, seed=2))],
                            check=_image_check([(33, 61)])))
    wav = audio("wav", seed=3)
    out.append(must_deliver("c1-wav-named-flac", [("flac", wav)], check=lambda d: _one_mel(d)))
    out.append(must_deliver("c1-flac-named-mp3", [("mp3", audio("flac", seed=4))], check=lambda d: _one_mel(d)))
    return out


def _image_check(sizes: list[tuple[int, int]]) -> Callable[[dict], None]:
    """The delivered images have the planned size of sources of (width, height) ``sizes``."""
    def check(doc: dict) -> None:
        expected = [(*imaging.target_size(w, h, IMAGE_CONFIG), 3) for w, h in sizes]
        assert doc["images"] == expected, (doc["images"], expected)
    return check


def _one_mel(doc: dict, frames: int | None = None) -> None:
    assert len(doc["mel_frames"]) == 1 and doc["mel_frames"][0] > 0 and doc["mel_finite"], doc
    assert frames is None or doc["mel_frames"][0] == frames, (doc["mel_frames"], frames)


def _mel_check(frames: int) -> Callable[[dict], None]:
    return lambda doc: _one_mel(doc, frames)


def _frames(seconds: float) -> int:
    """Mel frames delivered for a clip priced at ``seconds`` (default AudioConfig)."""
    from disttrain_api.config import AudioConfig

    config = AudioConfig()
    return config.num_tokens(seconds) * config.token_stride


def test_random_and_mistyped_members(server_for, root):
    rng = np.random.default_rng(101)
    variants = class1_variants(rng)
    assert len(variants) >= 93
    fates = run_variants(server_for, root, "class1", variants, config={"dp_size": 2})
    assert sum(f != "delivered" for f in fates.values()) >= 60
    assert {"unreadable_image", "unreadable_audio", "invalid_json", "bad_utf8", "decode_failed"} <= set(fates.values())


# --- class 2: JSON metadata ----------------------------------------------------------------------

def class2_variants(rng) -> list[Variant]:
    bad_json = {"invalid_json"}
    order = {"invalid_order"}
    img = lambda: ("jpg", valid_member("jpg", rng))  # noqa: E731
    wav = lambda: ("wav", audio("wav", seed=int(rng.integers(1000))))  # noqa: E731
    cases: list[tuple[str, bytes, frozenset | set | None, list]] = [
        # name, json bytes, kinds (None: must deliver), extra members
        ("deep-open-lists", b"[" * 100_000, bad_json, []),
        ("deep-closed-lists", b"[" * 100_000 + b"]" * 100_000, bad_json, []),
        ("deep-objects", b'{"a":' * 60_000 + b"1" + b"}" * 60_000, bad_json, []),
        ("deep-in-object", b'{"order": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", bad_json, []),
        ("huge-2MiB", json.dumps({"caption": "x" * (2 << 20)}).encode(), bad_json, []),
        ("huge-1MiB+1", b'{"c": "' + b"y" * ((1 << 20) - 8) + b'"}', bad_json, []),
        ("exactly-1MiB", b'{"c": "' + b"y" * ((1 << 20) - 9) + b'"}', None, []),
        ("list", b"[1, 2]", bad_json, []), ("number", b"42", bad_json, []), ("string", b'"s"', bad_json, []),
        ("null", b"null", bad_json, []), ("true", b"true", bad_json, []), ("empty", b"", bad_json, []),
        ("whitespace", b"  \n\t ", bad_json, []), ("truncated", b'{"a": [1, 2', bad_json, []),
        ("trailing-garbage", b'{"a": 1} x', bad_json, []),
        ("invalid-utf8", b'{"caption": "\xff\xfe"}', bad_json, []),
        ("overlong-utf8", b'{"caption": "\xc0\xaf"}', bad_json, []),
        ("utf16", '{"caption": "x"}'.encode("utf-16"), bad_json, []),
        ("utf8-bom", b'\xef\xbb\xbf{"caption": "x"}', bad_json, []),
        ("nul-bytes", b'{"a": 1}\x00\x00', bad_json, []),
        ("order-string", b'{"order": "jpg"}', order, []), ("order-number", b'{"order": 5}', order, []),
        ("order-object", b'{"order": {"jpg": 1}}', order, []),
        ("order-ints", b'{"order": [1, 2]}', order, []), ("order-nested", b'{"order": [["jpg"]]}', order, []),
        ("order-unknown", b'{"order": ["nope.jpg"]}', order, []),
        ("order-twice", b'{"order": ["jpg", "jpg"]}', order, []),
        ("order-huge-unknown", json.dumps({"order": ["jpg"] + ["x"] * 100_000}).encode(), order, []),
        ("order-null", b'{"order": null}', None, []),
        ("order-valid", b'{"order": ["txt", "jpg"]}', None, []),
        ("generate-string", b'{"generate": "jpg"}', order, []),
        ("generate-ints", b'{"generate": [0]}', order, []),
        ("generate-text-member", b'{"generate": ["txt"]}', order, []),
        ("generate-null", b'{"generate": null}', order, []),
        ("generate-unhashable", b'{"generate": [["jpg"]]}', order, []),
        ("generate-huge-valid", json.dumps({"generate": ["jpg"] * 100_000}).encode(), None, []),
        ("durations-string", b'{"durations": "1.0"}', None, [wav]),
        ("durations-object", b'{"durations": {"wav": 1}}', None, [wav]),
        ("durations-nan", b'{"durations": [NaN]}', None, [wav]),
        ("durations-infinity", b'{"durations": [Infinity]}', None, [wav]),
        ("durations-negative", b'{"durations": [-1]}', None, [wav]),
        ("durations-huge", b'{"durations": [1e308]}', None, [wav]),
        ("durations-tiny", b'{"durations": [1e-300]}', None, [wav]),
        ("durations-bool", b'{"duration": true}', None, [wav]),
        ("durations-long", b'{"durations": [99999]}', None, [wav]),
        ("durations-huge-list", json.dumps({"durations": [0.5] * 100_000}).encode(), None, [wav]),
        ("nan-infinity", b'{"caption": NaN, "w": Infinity, "h": -Infinity}', None, []),
        ("big-exponent", b'{"w": 1e999999}', None, []),
        ("duplicate-keys-last-bad", b'{"order": ["jpg"], "order": 5}', order, []),
        ("duplicate-keys-last-good", b'{"order": 5, "order": ["txt", "jpg"]}', None, []),
        ("surrogate-escape-key", b'{"\\ud800": 1}', None, []),
        ("huge-integer", b'{"w": 1' + b"0" * 5000 + b"}", {"invalid_json", "parse_failed"}, []),
    ]
    out = []
    for name, raw, kinds, extra in cases:
        members = [img(), ("txt", b"caption " + name.encode())] + [make() for make in extra] + [("json", raw)]
        key = f"c2-{name}"
        if kinds is None:
            check = None
            if name == "generate-huge-valid":
                check = lambda d: (d["gen"] == 1 and not d["images"]) or pytest.fail(str(d))  # noqa: E731
            if name.startswith("durations-"):
                # the JSON's value where it is usable, else the header's 0.3 s (1e308 is not: >= 1e6)
                seconds = {"durations-tiny": 1e-300, "durations-long": 99999, "durations-huge-list": 0.5}.get(name, 0.3)
                check = _mel_check(_frames(seconds))
            out.append(must_deliver(key, members, check=check))
        else:
            out.append(must_skip(key, members, kinds))
    # captions from the JSON (no txt member)
    captions = [("caption-only", b'{"caption": "from json"}', None), ("caption-empty", b'{"caption": ""}', {"empty"}),
                ("caption-list", b'{"caption": ["x"]}', {"empty"}), ("caption-number", b'{"caption": 5}', {"empty"}),
                ("caption-huge", json.dumps({"caption": "z" * 900_000}).encode(), None),
                ("caption-lone-surrogate", b'{"caption": "a\\ud800b"}', {"parse_failed", "bad_utf8", "invalid_json"})]
    for name, raw, kinds in captions:
        key = f"c2-{name}"
        if kinds is None:
            out.append(must_deliver(key, [("json", raw)], check=lambda d: (d["text"] and set(d["text"])
                                                                            <= set(b"from jsonz"))
                                    or pytest.fail(str(d)[:200])))
        else:
            out.append(must_skip(key, [("json", raw)], kinds))
    return out


def test_hostile_json(server_for, root):
    rng = np.random.default_rng(202)
    variants = class2_variants(rng)
    assert len(variants) >= 59
    fates = run_variants(server_for, root, "class2", variants)
    assert Counter(fates.values())["invalid_json"] >= 15 and Counter(fates.values())["invalid_order"] >= 10



# --- class 3: text -------------------------------------------------------------------------------

BIG_CAPTION_BYTES = 30 << 20


def class3_variants(rng) -> list[Variant]:
    img = lambda: ("jpg", valid_member("jpg", rng))  # noqa: E731
    bad_utf8 = {"bad_utf8"}
    out = []
    invalid = {"lone-continuation": b"\x80abc", "trailing-ff": b"abc\xff", "overlong": b"\xc0\xaf",
               "surrogate": b"\xed\xa0\x80", "cut-multibyte": b"caf\xc3", "five-byte": b"\xf8\x88\x80\x80\x80",
               "above-unicode": b"\xf4\x90\x80\x80", "utf16": "caption".encode("utf-16"),
               "latin1": "café naïve".encode("latin-1"), "bad-at-1MB": b"a" * (1 << 20) + b"\xff"}
    for name, raw in invalid.items():
        out.append(must_skip(f"c3-{name}", [img(), ("txt", raw)], bad_utf8))
    out.append(must_skip("c3-second-text-bad", [img(), ("txt", b"fine"), ("1.txt", b"\xff")], bad_utf8))

    def text_is(expected: bytes) -> Callable[[dict], None]:
        def check(doc):
            assert doc["text"] == expected, (doc["text"][:60], expected[:60])
        return check

    for name, raw in {"nul-bytes": b"\x00" * 100, "nul-inside": b"a\x00b\x00c", "one-space": b" ",
                      "whitespace": b"\n\n\t \r\n", "unicode-spaces": "\u3000\u00a0\u2028".encode(),
                      "utf8-bom": b"\xef\xbb\xbfcaption", "emoji": "🙂".encode() * 300,
                      "combining": ("e" + "\u0301" * 500).encode()}.items():
        out.append(must_deliver(f"c3-{name}", [img(), ("txt", raw)], check=text_is(raw)))
    out.append(must_deliver("c3-empty-with-image", [img(), ("txt", b"")], check=text_is(b"")))
    out.append(either("c3-empty-alone", [("txt", b"")], {"empty"}))
    out.append(either("c3-whitespace-alone", [("txt", b"   ")], {"empty"}))
    # a 30 MB caption: cut before tokenizing, delivered filling the sequence, quickly
    pattern = b"0123456789abcdef"
    big = pattern * (BIG_CAPTION_BYTES // len(pattern))

    def fills_the_sequence(doc):
        assert doc["tokens"] == SEQ_LEN and doc["text"] == big[:SEQ_LEN - 2], (doc["tokens"], doc["text"][:40])
    out.append(must_deliver("c3-30MB-caption", [("txt", big)], check=fills_the_sequence))
    wide = "é".encode() * (BIG_CAPTION_BYTES // 2)
    out.append(must_deliver("c3-30MB-two-byte-chars", [img(), ("txt", wide)],
                            check=lambda d: (d["tokens"] == SEQ_LEN and wide.startswith(d["text"][:-1]))
                            or pytest.fail(str(d["tokens"]))))
    return out


def test_hostile_text(server_for, root, monkeypatch):
    from preprocess_service.adapters.media.parse import TEXT_CHARS_PER_TOKEN
    from preprocess_service.core.tokenizer import ByteTokenizer

    rng = np.random.default_rng(303)
    variants = class3_variants(rng)
    assert len(variants) >= 24
    longest = [0]  # the longest text the tokenizer was handed (the server runs in this process)
    encode = ByteTokenizer.encode

    def watched(self, text):
        longest[0] = max(longest[0], len(text))
        return encode(self, text)
    monkeypatch.setattr(ByteTokenizer, "encode", watched)
    fates = run_variants(server_for, root, "class3", variants, config={"dp_size": 2})
    # two 30 MB captions cost a read, not a tokenization: cut before the tokenizer sees them
    assert 0 < longest[0] <= SEQ_LEN * TEXT_CHARS_PER_TOKEN < BIG_CAPTION_BYTES // 2
    assert Counter(fates.values())["bad_utf8"] == 11


# --- class 4: tar structure ----------------------------------------------------------------------

def class4_variants(rng) -> list[Variant]:
    img = lambda w=40, h=30: ("jpg", image("JPEG", w, h, seed=int(rng.integers(1000))))  # noqa: E731
    out = []

    def text_has(first: bytes, *not_: bytes) -> Callable[[dict], None]:
        def check(doc):
            assert first in doc["text"] and not any(n in doc["text"] for n in not_), doc["text"][:80]
        return check

    # duplicated members inside a sample: the first copy is delivered, the copy reported
    out += [
        must_deliver("c4-dup-txt", [img(), ("txt", b"FIRST"), ("txt", b"SECOND")], check=text_has(b"FIRST", b"SECOND")),
        must_deliver("c4-dup-txt-thrice", [("txt", b"FIRST"), img(), ("txt", b"SECOND"), ("txt", b"THIRD")],
                     check=text_has(b"FIRST", b"SECOND", b"THIRD")),
        must_deliver("c4-dup-jpg", [img(40, 30), ("txt", b"x"), img(200, 20)], check=_image_check([(40, 30)])),
        must_deliver("c4-dup-png-index", [("1.png", image("PNG", 33, 44)), ("1.png", image("PNG", 90, 10)),
                                          ("txt", b"y")], check=_image_check([(33, 44)])),
        must_deliver("c4-dup-json-first-good", [img(), ("json", b'{"caption": "c"}'), ("json", b"not json")]),
        must_skip("c4-dup-json-first-bad", [img(), ("json", b"not json"), ("json", b"{}")], {"invalid_json"}),
        must_deliver("c4-dup-case", [("TXT", b"UPPER"), ("txt", b"lower")], check=text_has(b"UPPER", b"lower")),
    ]
    for v in out:
        v.duplicate_member = True
    # long names: GNU long-name blocks and pax records, up to MAX_KEY_CHARS; longer is invalid_key
    for n in (150, 500, 1024):
        key = f"c4-gnu-{n}-".ljust(n, "k")
        out.append(must_deliver(key, [img(), ("txt", b"long")]))
    key = "c4-pax-300-".ljust(300, "p")
    out.append(must_deliver(key, [], raw=sample_entries(key, [img(), ("txt", b"pax")], fmt=tarfile.PAX_FORMAT)))
    for n, fmt in ((1025, tarfile.GNU_FORMAT), (5000, tarfile.GNU_FORMAT), (500_000, tarfile.GNU_FORMAT),
                   (2000, tarfile.PAX_FORMAT)):
        key = f"c4-invalid-key-{n}-{fmt}-".ljust(n, "x")
        out.append(must_skip(key, [], {"invalid_key"}, report_key=key[:64] + "...",
                             raw=sample_entries(key, [img(), ("txt", b"too long")], fmt=fmt)))
    for key in ("c4-ключ-🙂", "c4-with space", "c4-new\nline", "c4-tab\tand'quote\"", "c4-" + "字" * 300):
        out.append(must_deliver(key, [img(), ("txt", b"unicode")]))
    # members in subdirectories (and names that would escape one if anyone extracted them)
    for path in ("dir/sub/c4-subdir", "/abs/c4-absolute", "../../etc/c4-up", "a/b.c/c4-dotted-dir", "./c4-dot"):
        out.append(must_deliver(path, [img(), ("txt", b"in a directory")], delivered_key=path))
    # links, devices and directories are never read; their names do not make samples
    passwd = b"root:"
    out.append(must_deliver("c4-symlink-txt", [], check=lambda d: (d["images"] and passwd not in d["text"])
                            or pytest.fail(str(d)), raw=tar_entry("c4-symlink-txt.jpg", image("JPEG", 30, 30))
                            + tar_entry("c4-symlink-txt.txt", type=tarfile.SYMTYPE, linkname="/etc/passwd")))
    out.append(must_deliver("c4-hardlink", [], check=lambda d: d["images"] and not d["text"] or pytest.fail(str(d)),
                            raw=tar_entry("c4-hardlink.jpg", image("JPEG", 30, 30))
                            + tar_entry("c4-hardlink.txt", type=tarfile.LNKTYPE, linkname="c4-dup-txt.txt")))
    for name, type_ in (("symlink-only", tarfile.SYMTYPE), ("fifo", tarfile.FIFOTYPE), ("chardev", tarfile.CHRTYPE),
                        ("directory", tarfile.DIRTYPE)):
        key = f"c4-{name}"
        out.append(Variant(key, [], absent=True, raw=tar_entry(f"{key}.txt", type=type_, linkname="/dev/zero")))
    # webdataset meta members are skipped, also between the members of a sample
    out.append(Variant("c4-meta-top", [], absent=True, raw=tar_entry("__meta__", b"meta")))
    out.append(Variant("c4-meta-dir", [], absent=True, raw=tar_entry("__meta__/c4-meta-dir.json", b"{}")))
    out.append(must_deliver("c4-meta-inside", [], check=lambda d: (d["images"] and b"kept" in d["text"])
                            or pytest.fail(str(d)), raw=tar_entry("c4-meta-inside.jpg", image("JPEG", 30, 30))
                            + tar_entry("__meta__", b"x") + tar_entry("c4-meta-inside.txt", b"kept")))
    out.append(must_skip("__index__", [("json", b'{"count": 3}')], {"empty"}))
    out.append(Variant("c4-hidden", [], absent=True, raw=tar_entry(".hidden.txt", b"dot file")))
    out.append(Variant("c4-no-extension", [], absent=True, raw=tar_entry("c4-no-extension", b"no suffix")))
    # unknown members are ignored; a sample of nothing known is empty; suffixes are case-folded
    out.append(must_deliver("c4-unknown-members", [("cls", b"3"), ("txt.gz", b"\x1f\x8b"), ("exe", b"MZ"),
                                                   ("txt", b"known")], check=text_has(b"known")))
    out.append(must_skip("c4-only-unknown", [("weird", b"?"), ("cls", b"1")], {"empty"}))
    out.append(must_deliver("c4-upper-case", [("JPG", image("JPEG", 30, 30)), ("TXT", b"upper")],
                            check=text_has(b"upper")))
    out.append(must_deliver("c4-64-members", [(f"{i}.txt", b"m") for i in range(1, 64)] + [("txt", b"t")]))
    out.append(must_skip("c4-65-members", [(f"{i}.txt", b"m") for i in range(1, 65)] + [("txt", b"t")], {"oversize"}))
    return out


def test_tar_structure(server_for, root):
    """Shard 0: the structure variants between good samples, and later copies of earlier keys
    (never right after the original); shards 1 and 2: their own samples and copies of keys of the
    shards before them. Shards in the order given: the first copy in planning order is kept."""
    rng = np.random.default_rng(404)
    directory = root / "class4"
    directory.mkdir()
    paths = [directory / f"{s:05d}.tar" for s in range(3)]
    variants = class4_variants(rng)
    good0 = write_interleaved(paths[0], variants, rng, prefix="s0g")
    # rewrite shard 0 with copies of earlier good keys inserted later, non-consecutively
    body = paths[0].read_bytes()[:-len(END_OF_ARCHIVE)]
    expected_copies: set[tuple[str, str]] = set()
    copies = []
    for n, key in enumerate(rng.choice(good0[:len(good0) // 2], size=12, replace=False)):
        copies.append(sample_entries(str(key), [("jpg", image("JPEG", 90, 90)), ("txt", f"COPY {n}".encode())]))
        if n % 4 == 0:  # some keys three times
            copies.append(sample_entries(str(key), [("txt", b"COPY again")]))
        copies.append(sample_entries(f"s0sep{n}", good_members(f"s0sep{n}", rng)))  # keeps copies apart
        expected_copies.add((str(key), str(paths[0])))
    # also a key whose first copy is bad: the key is lost, its later good copy is still a duplicate
    img = ("jpg", image("JPEG", 30, 30))
    first_bad = must_skip("c4-first-copy-bad", [img, ("json", b"[")], {"invalid_json"})
    first_bad.shard = str(paths[0])
    later_good = sample_entries("c4-first-copy-bad", [img, ("txt", b"a good later copy")])
    expected_copies.add(("c4-first-copy-bad", str(paths[0])))
    paths[0].write_bytes(first_bad.tar() + body + b"".join(copies) + later_good + END_OF_ARCHIVE)
    goods = set(good0) | {f"s0sep{n}" for n in range(12)}
    earlier = sorted(goods)
    for s in (1, 2):
        parts = []
        for i in range(15):
            key = f"s{s}g{i:03d}"
            goods.add(key)
            parts.append(sample_entries(key, good_members(key, rng)))
            if i % 2:
                copy = str(rng.choice(earlier))
                parts.append(sample_entries(copy, [("txt", f"CROSS COPY in shard {s}".encode())]))
                expected_copies.add((copy, str(paths[s])))
        paths[s].write_bytes(b"".join(parts) + END_OF_ARCHIVE)
        earlier = sorted(goods)
    address = server_for()
    out = consume(address, job(*paths, dp_size=2, shard_shuffle=False))
    fates = exactly_once(out, goods, [*variants, first_bad])
    assert len(variants) >= 42 and len(expected_copies) >= 26
    # the first copy of every duplicated key is the one delivered
    for key, _ in expected_copies:
        if key in goods:
            assert out.docs[key]["text"] == f"good sample {key}".encode(), (key, out.docs[key]["text"])
    # every dropped copy is reported, by key and the shard it was found in, and nothing else is
    reported = {(r.key, r.shard) for r in out.records({"duplicate_key"})}
    assert reported == expected_copies, (reported ^ expected_copies)
    members = {(r.key, r.shard) for r in out.records({"duplicate_member"})}
    assert members == {(v.key, v.shard) for v in variants if v.duplicate_member}
    assert Counter(fates.values())["invalid_key"] == 4 and fates["c4-65-members"] == "oversize"


def test_oversize_members_are_skipped_by_header_size(server_for, root):
    """A member over max_member_bytes, or a sample over max_sample_bytes, skips its sample from the
    header's size: a 200 MB member (a hole in a sparse file) is skipped through, never held."""
    rng = np.random.default_rng(505)
    limit, sample_limit = 64 << 10, 256 << 10
    img = lambda: ("jpg", valid_member("jpg", rng))  # noqa: E731
    variants = [
        must_skip("c4o-txt-over", [img(), ("txt", b"t" * (limit + 1))], {"oversize"}),
        must_deliver("c4o-txt-at-limit", [img(), ("txt", b"t" * limit)],
                     check=lambda d: d["tokens"] == SEQ_LEN or pytest.fail(str(d["tokens"]))),
        must_skip("c4o-jpg-over", [("jpg", rng.bytes(limit + 1)), ("txt", b"x")], {"oversize"}),
        must_skip("c4o-json-over", [img(), ("json", b'{"a": "' + b"j" * limit + b'"}')], {"oversize"}),
        must_skip("c4o-first-member-over", [("txt", b"t" * (3 * limit)), img()], {"oversize"}),
        must_skip("c4o-last-of-many-over", [img(), ("1.txt", b"a"), ("2.txt", b"b"), ("3.txt", b"c" * (limit + 7))],
                  {"oversize"}),
        must_skip("c4o-sample-over", [(f"{i}.txt" if i else "txt", b"s" * (60 << 10)) for i in range(5)], {"oversize"}),
        must_deliver("c4o-sample-under", [(f"{i}.txt" if i else "txt", b"s" * (60 << 10)) for i in range(4)]),
    ]
    directory = root / "class4-oversize"
    directory.mkdir()
    good = set(write_interleaved(directory / "00000.tar", variants, rng, prefix="o0g"))
    # shard 1: a 200 MB member whose data is a hole, and a header claiming 8 GiB at the very end
    path = directory / "00001.tar"
    sparse = must_skip("c4o-sparse-200MB", [], {"oversize"})
    huge = must_skip("c4o-claims-8GiB", [], {"oversize", "truncated_shard"})
    sparse.shard = huge.shard = str(path)
    with open(path, "wb") as f:
        for i in range(5):
            good.add(f"o1a{i}")
            f.write(sample_entries(f"o1a{i}", good_members(f"o1a{i}", rng)))
        f.write(raw_header("c4o-sparse-200MB.jpg", 200 << 20))
        f.seek(200 << 20, io.SEEK_CUR)  # the member's data: never written, never read into memory
        f.write(sample_entries("c4o-sparse-200MB", [("txt", b"the rest of the big sample")]))
        for i in range(5):
            good.add(f"o1b{i}")
            f.write(sample_entries(f"o1b{i}", good_members(f"o1b{i}", rng)))
        f.write(raw_header("c4o-claims-8GiB.txt", 8 << 30) + b"tiny".ljust(512, b"\0"))
    assert path.stat().st_size > 200 << 20 and path.stat().st_blocks * 512 < 10 << 20  # sparse
    address = server_for(max_member_bytes=limit, max_sample_bytes=sample_limit)
    out = consume(address, job(directory / "00000.tar", path))
    all_variants = [*variants, sparse, huge]
    assert len(all_variants) >= 10
    fates = exactly_once(out, good, all_variants)
    reasons = {r.key: r.reason for r in out.report.skipped}
    assert str(200 << 20) in reasons["c4o-sparse-200MB"] and "max_member_bytes" in reasons["c4o-sparse-200MB"]
    assert "max_sample_bytes" in reasons["c4o-sample-over"]
    assert Counter(fates.values())["oversize"] >= 7


def _truncation_base(prefix: str, rng, n: int = 8) -> tuple[bytes, list[str], list[list[tuple[int, int]]]]:
    """(tar bytes, keys, per sample the (data offset, size) of each member) of n samples."""
    parts, keys, layout, offset = [], [], [], 0
    for i in range(n):
        key = f"{prefix}-{i}"
        members = [("jpg", image("JPEG", int(rng.integers(20, 120)), int(rng.integers(20, 120)), seed=i)),
                   ("txt", bytes(rng.integers(97, 123, int(rng.integers(10, 1500)), dtype=np.uint8))),
                   ("json", json.dumps({"i": i}).encode())]
        spans = []
        for suffix, data in members:
            entry = tar_entry(f"{key}.{suffix}", data)
            assert len(entry) == 512 + len(data) + (-len(data) % 512)  # no long-name blocks
            spans.append((offset + 512, len(data)))
            parts.append(entry)
            offset += len(entry)
        keys.append(key)
        layout.append(spans)
    return b"".join(parts) + END_OF_ARCHIVE, keys, layout


def _header_bomb(type_: bytes, size: int) -> bytes:
    info = tarfile.TarInfo("././@LongLink" if type_ in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
                           else "pax_header")
    info.type, info.size = type_, size
    return info.tobuf(tarfile.USTAR_FORMAT if type_ in (tarfile.XHDTYPE, tarfile.XGLTYPE) else tarfile.GNU_FORMAT)


def test_truncated_shards(server_for, root):
    """Shards cut at many offsets (inside members' data or their padding, between samples, in the
    end-of-archive blocks) and shards ending at a refused header: every sample complete before the
    cut is delivered, the sample being read is reported by key (truncated_shard), nothing else is
    lost. A cut in the padding after a sample's last member reports that sample (more members
    might have followed); a cut exactly between samples reads as the end of the shard. Cuts inside
    a header block are the tests at the end."""
    rng = np.random.default_rng(606)
    directory = root / "class4-truncated"
    directory.mkdir()
    good: set[str] = set()
    variants: list[Variant] = []
    keyless_ok: set[str] = set()
    paths = []

    def expect(path: Path, keys: list[str], delivered: int, lost: bool) -> None:
        """keys[:delivered] delivered, keys[delivered] reported (if lost), the rest absent."""
        good.update(keys[:delivered])
        for i, key in enumerate(keys[delivered:]):
            v = must_skip(key, [], {"truncated_shard"}) if (i == 0 and lost) else Variant(key, [], absent=True)
            v.shard = str(path)
            variants.append(v)
        paths.append(path)

    cuts = []  # (category, sample index, offset)
    _, _, layout = _truncation_base("probe", np.random.default_rng(0))
    for _ in range(22):
        s = int(rng.integers(len(layout)))
        start, size = layout[s][int(rng.integers(3))]
        cuts.append(("data", s, start + int(rng.integers(size))))
    for s in (1, 3, 5, 7):
        cuts.append(("between", s, layout[s][0][0] - 512))
    for s in range(len(layout)):
        start, size = layout[s][-1]
        if (start + size) % 512:
            # the sample's data is all there, but more members might have followed: it is the one read
            cuts.append(("padding", s, start + size + int(rng.integers(-(start + size) % 512))))
    cuts += [("end", len(layout), -1024), ("end", len(layout), -700), ("end", len(layout), -1)]
    for n, (category, s, offset) in enumerate(cuts):
        data, keys, spans = _truncation_base(f"cut{n:02d}", np.random.default_rng(0))
        assert spans == layout  # same sizes whatever the prefix
        path = directory / f"cut{n:02d}.tar"
        path.write_bytes(data[:offset])
        if category not in ("data", "padding"):
            keyless_ok.add(str(path))
        expect(path, keys, s, lost=category in ("data", "padding"))
    # a refused header block in the middle of sample 3 (before its second member) ends the shard there
    bombs = {"pax-100MB": _header_bomb(tarfile.XHDTYPE, 100 << 20),
             "pax-global-50MB": _header_bomb(tarfile.XGLTYPE, 50 << 20),
             "gnu-longname-2MB": _header_bomb(tarfile.GNUTYPE_LONGNAME, 2 << 20),
             "gnu-longlink-5MB": _header_bomb(tarfile.GNUTYPE_LONGLINK, 5 << 20)}
    for name, bomb in bombs.items():
        data, keys, spans = _truncation_base(f"bomb-{name}", rng)
        at = spans[3][1][0] - 512
        path = directory / f"bomb-{name}.tar"
        path.write_bytes(data[:at] + bomb + data[at:])
        expect(path, keys, 3, lost=True)
    # a last member claiming more bytes than the shard holds
    data, keys, spans = _truncation_base("short-member", rng)
    at = spans[5][2][0] - 512
    path = directory / "short-member.tar"
    path.write_bytes(data[:at] + raw_header(f"{keys[5]}.json", 1 << 20) + b"{" * 100)
    expect(path, keys, 5, lost=True)
    # compressed shards are read whole; empty and garbage shards are reported without a key
    for name, compress in {"gzip": lambda b: __import__("gzip").compress(b),
                           "bzip2": lambda b: __import__("bz2").compress(b),
                           "xz": lambda b: __import__("lzma").compress(b)}.items():
        data, keys, _ = _truncation_base(f"compressed-{name}", rng)
        path = directory / f"compressed-{name}.tar"
        path.write_bytes(compress(data))
        expect(path, keys, len(keys), lost=False)
    for name, data in {"empty": b"", "garbage": rng.bytes(3000), "zeros": b"\0" * 100_000,
                       "end-only": END_OF_ARCHIVE}.items():
        path = directory / f"whole-{name}.tar"
        path.write_bytes(data)
        keyless_ok.add(str(path))
        paths.append(path)
    assert len(cuts) >= 37 and len(paths) >= 49
    address = server_for()
    out = consume(address, job(*paths, dp_size=2, num_microbatches=1))
    fates = exactly_once(out, good, variants, keyless_ok=frozenset(keyless_ok))
    cut_inside = sum(c in ("data", "padding") for c, _, _ in cuts)
    assert Counter(fates.values())["truncated_shard"] == cut_inside + len(bombs) + 1
    keyless = {r.shard for r in out.report.skipped if not r.key}
    assert {str(directory / "whole-empty.tar"), str(directory / "whole-garbage.tar")} <= keyless
    refused = [r.reason for r in out.report.skipped if "bomb-" in r.key]
    assert len(refused) == 4 and all("header block" in r for r in refused), refused


# --- class 5: images -----------------------------------------------------------------------------

def zero_png(width: int, height: int) -> bytes:
    """A real all-black RGB PNG, compressed row by row (a 9000x8000 one is ~200 KB)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    compressor, row = zlib.compressobj(9), b"\0" * (1 + 3 * width)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def class5_variants(rng) -> list[Variant]:
    out = []
    txt = ("txt", b"an image caption")
    bomb = {"decompression_bomb"}
    png, jpg = image("PNG", 50, 40, seed=5), image("JPEG", 300, 200, seed=6)
    gif = image("GIF", 20, 20, seed=7)
    # decompression bombs: header-only (patched sizes) and a real 72 Mpx PNG of zeros (~200 KB)
    for w, h in ((30000, 30000), (65535, 65535), (2 ** 31 - 1, 2)):
        out.append(must_skip(f"c5-png-header-{w}x{h}", [("png", patch_png_size(png, w, h)), txt], bomb))
    out.append(must_skip("c5-png-header-100000x3", [("png", patch_png_size(png, 100000, 3)), txt],
                         {"unreadable_image", "too_long"}))  # few pixels, but no data for them
    for w, h in ((10000, 10000), (9000, 8000)):  # past max_source_pixels, under Pillow's own error limit
        out.append(must_skip(f"c5-png-header-{w}x{h}", [("png", patch_png_size(png, w, h)), txt],
                             bomb | {"unreadable_image"}))
    for w, h in ((65000, 65000), (12000, 12000), (65000, 1200)):
        out.append(must_skip(f"c5-jpeg-header-{w}x{h}", [("jpg", patch_jpeg_size(jpg, w, h)), txt], bomb))
    out.append(must_skip("c5-gif-screen-65535", [("jpg", gif[:6] + struct.pack("<HH", 65535, 65535) + gif[10:]), txt],
                         bomb))
    out.append(must_skip("c5-real-png-9000x8000", [("png", zero_png(9000, 8000)), txt], bomb))
    for w, h in ((0, 0), (1, 0), (0, 7)):
        out.append(must_skip(f"c5-png-{w}x{h}", [("png", patch_png_size(png, w, h)), txt], {"unreadable_image"}))
    out.append(must_skip("c5-jpeg-0x0", [("jpg", patch_jpeg_size(jpg, 0, 0)), txt]))
    # truncated files
    cut = {"truncated_image", "unreadable_image"}
    for frac in (0.02, 0.1, 0.3, 0.5, 0.7, 0.9):
        out.append(must_skip(f"c5-jpeg-cut-{frac * 100:g}pct", [("jpg", jpg[:int(len(jpg) * frac)]), txt], cut))
    out.append(must_skip("c5-jpeg-cut-eoi", [("jpg", jpg[:-2]), txt], cut))
    out.append(must_skip("c5-jpeg-cut-zero-padded", [("jpg", jpg[:len(jpg) // 2] + b"\0" * 500), txt], cut))
    for frac in (0.5, 0.9):
        cut_jpg = jpg[:int(len(jpg) * frac)] + b"\xff\xd9"
        out.append(either(f"c5-jpeg-cut-{frac * 100:g}pct-eoi-appended", [("jpg", cut_jpg), txt],
                          cut | {"decode_failed"}, check=_image_check([(300, 200)])))
    big_png = image("PNG", 120, 90, seed=8)
    for frac in (0.1, 0.5, 0.95):
        out.append(must_skip(f"c5-png-cut-{frac * 100:g}pct", [("png", big_png[:int(len(big_png) * frac)]), txt], cut))
    broken = bytearray(big_png)
    broken[len(broken) // 2:len(broken) // 2 + 64] = rng.bytes(64)
    out.append(either("c5-png-corrupt-idat", [("png", bytes(broken)), txt], {"decode_failed", "unreadable_image"},
                      check=_image_check([(120, 90)])))
    webp = image("WEBP", 80, 60, seed=9)
    for frac in (0.5, 0.97):
        out.append(either(f"c5-webp-cut-{frac * 100:g}pct", [("webp", webp[:int(len(webp) * frac)]), txt],
                          {"unreadable_image", "decode_failed", "truncated_image"}, check=_image_check([(80, 60)])))
    out.append(either("c5-jpeg-trailing-garbage", [("jpg", jpg + rng.bytes(100)), txt], cut,
                      check=_image_check([(300, 200)])))
    # unusual but valid: must be delivered at their planned size
    valid = {"cmyk-jpeg": (image("JPEG", 64, 48, mode="CMYK"), (64, 48)),
             "gray-jpeg": (image("JPEG", 64, 48, mode="L"), (64, 48)),
             "progressive-jpeg": (image("JPEG", 64, 48, progressive=True, quality=80), (64, 48)),
             "1x1-jpeg": (image("JPEG", 1, 1), (1, 1)), "1x1-png": (image("PNG", 1, 1), (1, 1)),
             "1x1-webp": (image("WEBP", 1, 1), (1, 1)), "1x1-gif": (image("GIF", 1, 1), (1, 1)),
             "1x5000-png": (image("PNG", 1, 5000), (1, 5000)), "5000x1-png": (image("PNG", 5000, 1), (5000, 1)),
             "1x5000-jpeg": (image("JPEG", 1, 5000), (1, 5000)), "3000x2-jpeg": (image("JPEG", 3000, 2), (3000, 2)),
             "png-16bit": (image("PNG", 40, 30, mode="I;16"), (40, 30)),
             "png-la": (image("PNG", 40, 30, mode="LA"), (40, 30)),
             "png-palette": (image("PNG", 40, 30, mode="P"), (40, 30)),
             "png-1bit": (image("PNG", 40, 30, mode="1"), (40, 30)),
             "png-rgba": (image("PNG", 40, 30, mode="RGBA"), (40, 30)), "bmp-as-jpg": (image("BMP", 40, 30), (40, 30)),
             "tiff-as-png": (image("TIFF", 40, 30), (40, 30)), "gif-as-webp": (image("GIF", 40, 30), (40, 30))}
    for name, (data, size) in valid.items():
        ext = name.split("-as-")[1] if "-as-" in name else {"jpeg": "jpg"}.get(name.split("-")[-1], "png")
        ext = ext if ext in ("jpg", "png", "webp") else "png"
        out.append(must_deliver(f"c5-{name}", [(ext, data), txt], check=_image_check([size])))
    exif6 = jpeg_bytes(30, 200, exif_orientation=6)
    out.append(must_deliver("c5-exif-rotated", [("jpg", exif6), txt], check=_image_check([(200, 30)])))
    for orientation in (0, 9, 65535):
        rotated = jpeg_bytes(30, 20, exif_orientation=orientation)
        out.append(either(f"c5-exif-orientation-{orientation}", [("jpg", rotated), txt],
                          check=_image_check([(30, 20)])))
    out.append(must_skip("c5-1x65500-png", [("png", image("PNG", 1, 65500)), txt], {"too_long"}))
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="9e9" height="9e9"/>'
    out.append(must_skip("c5-svg", [("png", svg), txt], {"unreadable_image"}))
    return out


def test_hostile_images(server_for, root):
    rng = np.random.default_rng(707)
    variants = class5_variants(rng)
    assert len(variants) >= 57
    fates = run_variants(server_for, root, "class5", variants, config={"dp_size": 2})
    counts = Counter(fates.values())
    assert counts["decompression_bomb"] >= 8 and counts["delivered"] >= 20, counts


def test_max_source_pixels_of_the_job_refuses_larger_images(server_for, root):
    """The same bomb check with a job's own small max_source_pixels: every image over it is a
    decompression_bomb, every other one delivered."""
    rng = np.random.default_rng(708)
    limit = 3000
    variants = []
    for i in range(30):
        w, h = int(rng.integers(1, 120)), int(rng.integers(1, 120))
        members = [("png" if i % 2 else "jpg", image("PNG" if i % 2 else "JPEG", w, h, seed=i)), ("txt", b"c")]
        if w * h > limit:
            variants.append(must_skip(f"c5-limit-{w}x{h}-{i}", members, {"decompression_bomb"}))
        else:
            variants.append(must_deliver(f"c5-limit-{w}x{h}-{i}", members))
    assert len(variants) == 30 and 5 <= sum(not v.deliver for v in variants) <= 25
    fates = run_variants(server_for, root, "class5-limit", variants,
                         config={"image": ImageConfig(max_source_pixels=limit)},
                         good=lambda key, rng: [("txt", f"good sample {key}".encode())])
    assert sum(f == "decompression_bomb" for f in fates.values()) == sum(not v.deliver for v in variants)


# --- class 6: audio, decoded in the decode process pool -----------------------------------------

def class6_variants(rng) -> list[Variant]:
    out = []
    txt = ("txt", b"an audio caption")
    with_duration = ("json", b'{"duration": 0.3}')
    wav = audio("wav", seed=11)
    unreadable, failed = {"unreadable_audio"}, {"decode_failed"}
    # header values out of bounds: refused from the header, or at decode when a JSON duration skips it
    for rate in (2 ** 31, 2 ** 32 - 1, 0, 1, 999, 384_001, 44_101, 48_001, 96_001):
        out.append(must_skip(f"c6-wav-rate-{rate}", [("wav", patch_wav(wav, rate=rate)), txt], unreadable))
        out.append(must_skip(f"c6-wav-rate-{rate}-with-duration", [("wav", patch_wav(wav, rate=rate)), txt,
                                                                   with_duration], failed))
    for channels in (0, 65, 100, 65535):
        out.append(must_skip(f"c6-wav-channels-{channels}", [("wav", patch_wav(wav, channels=channels)), txt],
                             unreadable))
        out.append(must_skip(f"c6-wav-channels-{channels}-with-duration",
                             [("wav", patch_wav(wav, channels=channels)), txt, with_duration], failed))
    out.append(either("c6-wav-data-claims-2GB", [("wav", patch_wav(wav, data_size=2 ** 31 - 1)), txt],
                      unreadable | failed, check=_one_mel))
    out.append(either("c6-wav-data-size-0", [("wav", patch_wav(wav, data_size=0)), txt], unreadable | failed))
    # rates and layouts that are fine: delivered with the planned number of frames
    for rate in (1000, 8000, 11025, 22050, 44100, 48000, 96000, 192000):
        out.append(must_deliver(f"c6-wav-{rate}Hz", [("wav", audio("wav", rate=rate, seconds=0.2)), txt],
                                check=_mel_check(_frames(0.2))))
    for channels in (2, 6, 64):
        out.append(must_deliver(f"c6-wav-{channels}-channels", [("wav", audio("wav", channels=channels, seconds=0.2)),
                                                                 txt], check=_mel_check(_frames(0.2))))
    for subtype in ("PCM_U8", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"):
        buf = io.BytesIO()
        soundfile.write(buf, 0.1 * rng.standard_normal(3200), 16000, format="WAV", subtype=subtype)
        out.append(must_deliver(f"c6-wav-{subtype}", [("wav", buf.getvalue()), txt],
                                check=_mel_check(_frames(0.2))))
    out.append(must_deliver("c6-json-says-an-hour", [("flac", audio("flac", seconds=0.2)), txt,
                                                     ("json", b'{"duration": 3600}')],
                            check=_mel_check(_frames(30.0))))  # padded to max_seconds
    # truncated files: refused, failed at decode, or decoded short and padded; never more than that
    for ext in AUDIO_FORMATS:
        clip = audio(ext, seconds=0.5, seed=12)
        offsets = sorted({4, 40, 100, len(clip) // 3, len(clip) // 2, len(clip) - 7} if ext == "flac"
                         else {30, len(clip) // 2, len(clip) - 5})
        for offset in offsets:
            out.append(either(f"c6-{ext}-cut-at-{offset}", [(ext, clip[:offset]), txt], unreadable | failed,
                              check=_one_mel))
            if ext == "flac":
                out.append(either(f"c6-{ext}-cut-at-{offset}-with-duration", [(ext, clip[:offset]), txt, with_duration],
                                  failed, check=_mel_check(_frames(0.3))))
    return out


def test_hostile_audio_in_the_decode_pool(server_for, root):
    """Audio variants through the default decode process pool: a decode failure in a worker skips
    its sample only (header checks at decode keep a worker from building a gigabyte kernel)."""
    rng = np.random.default_rng(808)
    variants = class6_variants(rng)
    assert len(variants) >= 68
    fates = run_variants(server_for, root, "class6", variants, config={"dp_size": 2},
                         server={"decode_workers": None})
    counts = Counter(fates.values())
    assert counts["unreadable_audio"] >= 13 and counts["decode_failed"] >= 13 and counts["delivered"] >= 19, counts


# --- class 7: error tolerance --------------------------------------------------------------------

def _garbage(key: str, rng, kind: int) -> list[tuple[str, bytes]]:
    """A bad sample of one of several kinds."""
    return [[("jpg", rng.bytes(100)), ("txt", b"x")], [("txt", b"\xff\xfe")], [("jpg", valid_member("jpg", rng)),
            ("json", b"[")], [("wav", b"RIFF"), ("txt", b"x")]][kind % 4]


def test_error_tolerance(server_for, root):
    """150 bad samples in a row fail the job with DATA_LOSS (max_consecutive_errors); so does a
    data set where 60 % of the samples are bad, spread out (max_error_fraction); 10 % bad
    completes, every good sample delivered once and every bad one reported. Good samples fill a
    sequence each, so steps are planned and sent before the job fails."""
    rng = np.random.default_rng(909)
    directory = root / "class7"
    directory.mkdir()
    address = server_for()

    def shard(name: str, pattern: list[bool]) -> tuple[Path, list[str], list[str]]:
        """good (True) and bad (False) samples in the order of ``pattern``."""
        path, parts, goods, bads = directory / f"{name}.tar", [], [], []
        for i, ok in enumerate(pattern):
            key = f"{name}-{i:04d}"
            (goods if ok else bads).append(key)
            members = [("txt", key.encode() * 200)] if ok else _garbage(key, rng, i)
            parts.append(sample_entries(key, members))
        path.write_bytes(b"".join(parts) + END_OF_ARCHIVE)
        return path, goods, bads

    def failing(path: Path, goods: list[str], **config) -> str:
        out = consume(address, job(path, **config))
        assert len(out.errors) == 1 and isinstance(out.errors[0], ServiceUnavailableError), out.errors
        assert "DATA_LOSS" in str(out.errors[0]), out.errors[0]
        assert len(out.keys) == len(set(out.keys)) and set(out.keys) <= set(goods)  # nothing bad, nothing twice
        assert len(out.keys) >= 10  # the steps before the failure were sent
        return out.report.failure

    in_a_row = [True] * 20 + [False] * 150 + [True] * 20
    path, goods, _ = shard("in-a-row", in_a_row)
    failure = failing(path, goods, max_consecutive_errors=100, max_error_fraction=1.0)
    assert "101 bad samples in a row" in failure and "max_consecutive_errors 100" in failure, failure

    spread = [True] * 10 + [bool(rng.random() >= 0.6) for _ in range(300)]
    assert max(len(run) for run in "".join("x" if ok else "b" for ok in spread).split("x")) < 50
    path, goods, _ = shard("mostly-bad", spread)
    failure = failing(path, goods, max_consecutive_errors=50, max_error_fraction=0.5)
    assert "max_error_fraction 0.5" in failure, failure

    some = [i % 10 != 3 for i in range(300)]
    path, goods, bads = shard("some-bad", some)
    out = consume(address, job(path, max_consecutive_errors=100, max_error_fraction=0.5))
    variants = [must_skip(key, []) for key in bads]
    for v in variants:
        v.shard = str(path)
    fates = exactly_once(out, set(goods), variants)
    assert not out.report.failure and len(fates) == 30
    assert len(in_a_row) + len(spread) + len(some) == 800


# --- product bugs this suite found (now fixed), as minimal reproductions --------------------------

def _read(data: bytes) -> tuple[list[dict], list[SampleError]]:
    problems: list[SampleError] = []
    samples = list(iter_samples(io.BytesIO(data), "shard.tar", TarLimits(), problems.append))
    return samples, problems


def test_a_shard_cut_inside_a_header_is_reported_and_no_sample_is_delivered_partial():
    data, keys, layout = _truncation_base("hdr", np.random.default_rng(0))
    for s in range(1, len(keys)):
        for m in range(3):
            header = layout[s][m][0] - 512
            samples, problems = _read(data[:header + 100])
            partial = [x["__key__"] for x in samples if not {"jpg", "txt", "json"} <= set(x)]
            assert not partial, f"cut in header {m} of {keys[s]}: delivered with members missing: {partial}"
            assert [p.kind for p in problems] == ["truncated_shard"], (keys[s], m, problems)


def test_a_corrupt_header_checksum_is_reported():
    data, keys, layout = _truncation_base("sum", np.random.default_rng(0))
    header = layout[3][1][0] - 512  # sample 3's second member
    corrupt = bytearray(data)
    corrupt[header + 148:header + 156] = b"0000000\0"
    samples, problems = _read(bytes(corrupt))
    assert [x["__key__"] for x in samples] == keys[:3], [x["__key__"] for x in samples]  # not sample 3 without its txt
    assert [(p.key, p.kind) for p in problems] == [(keys[3], "truncated_shard")], problems


def test_a_refused_header_between_samples_reports_the_sample_it_might_belong_to():
    """Documented policy, not a bug: a pax or long-name block names the member that follows it, which
    may belong to the sample being read, so that sample is reported truncated_shard (it may be
    incomplete); every sample before it is delivered and nothing after it is read."""
    data, keys, layout = _truncation_base("pax", np.random.default_rng(0))
    at = layout[3][0][0] - 512
    samples, problems = _read(data[:at] + _header_bomb(tarfile.XHDTYPE, 100 << 20) + data[at:])
    assert [x["__key__"] for x in samples] == keys[:2], [x["__key__"] for x in samples]
    assert [(p.key, p.kind) for p in problems] == [(keys[2], "truncated_shard")], problems


def _one_bad_sample_job(server_for, root, name: str, bad: bytes) -> Outcome:
    rng = np.random.default_rng(1)
    directory = root / name
    directory.mkdir()
    goods = [sample_entries(f"{name}-{i}", good_members(f"{name}-{i}", rng)) for i in range(6)]
    (directory / "0.tar").write_bytes(b"".join(goods[:3]) + bad + b"".join(goods[3:]) + END_OF_ARCHIVE)
    return consume(server_for(), job(directory / "0.tar"), timeout_s=30)


def test_a_member_name_that_is_not_utf8_is_an_invalid_key(server_for, root):
    name = "bad-name"
    out = _one_bad_sample_job(server_for, root, name, tar_entry("evil\udcff.txt", b"caption"))
    assert not out.errors, out.errors
    assert sorted(out.keys) == [f"{name}-{i}" for i in range(6)]
    assert [r.kind for r in out.report.skipped] == ["invalid_key"]


def test_a_member_named_dunder_key_does_not_override_the_key(server_for, root):
    name = "spoof-key"
    out = _one_bad_sample_job(server_for, root, name, tar_entry("evil.txt", b"evil")
                              + tar_entry("evil.__key__", f"{name}-4".encode()))
    assert not out.errors, out.errors
    assert len(out.keys) == len(set(out.keys)), Counter(out.keys).most_common(2)


def test_a_member_named_dunder_url_does_not_override_the_shard(server_for, root):
    name = "spoof-url"
    bad = tar_entry("evil.txt", b"evil") + tar_entry("evil.jpg", b"garbage") + tar_entry("evil.__url__", b"\xff")
    try:
        out = _one_bad_sample_job(server_for, root, name, bad)
    except grpc.RpcError as exc:
        pytest.fail(f"GetReport failed: {exc.code()}: {exc.details()}")
    assert [(r.key, r.shard.endswith("0.tar")) for r in out.report.skipped] == [("evil", True)]


def test_a_job_failing_on_its_first_step_is_data_loss(server_for, root):
    rng = np.random.default_rng(2)
    directory = root / "first-step"
    directory.mkdir()
    path = directory / "0.tar"
    path.write_bytes(b"".join(sample_entries(f"junk{i}", _garbage(f"junk{i}", rng, i)) for i in range(120))
                     + END_OF_ARCHIVE)
    address = server_for()
    config = job(path, max_consecutive_errors=100)
    with DataClient(address, config, 0, connect_timeout_s=10):
        pass  # opens the job
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PreprocessStub(channel)
        for _ in range(2):  # the stream that fails the job, and one started after
            with pytest.raises(grpc.RpcError) as info:
                for _ in stub.StreamMicrobatches(pb.StreamRequest(job_id=config.job_id(), dp_rank=0), timeout=20):
                    pass
            assert info.value.code() == grpc.StatusCode.DATA_LOSS, (info.value.code(), info.value.details())


def test_the_planning_read_of_a_png_decodes_no_pixels(monkeypatch):
    from PIL import PngImagePlugin

    loads = []
    original = PngImagePlugin.PngImageFile.load
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda self: loads.append(self.size) or original(self))
    assert imaging.read_header(zero_png(2000, 1500)).width == 2000
    assert not loads, f"pixels decoded while reading the header: {loads}"


def test_audio_with_non_finite_samples_is_not_delivered_as_nan():
    from disttrain_api.config import AudioConfig
    from preprocess_service.adapters.media.audio import decode_audio

    for value in (np.nan, np.inf, 1e30):
        wave = np.zeros(4800, np.float32)
        wave[100:110] = value
        buf = io.BytesIO()
        soundfile.write(buf, wave, 16000, format="WAV", subtype="FLOAT")
        try:
            mel = decode_audio(buf.getvalue(), AudioConfig(), _frames(0.3))
        except ValueError:
            continue  # refused: the sample is skipped as decode_failed
        assert np.isfinite(mel).all(), f"{value}: {np.isnan(mel).sum()} NaN values delivered"
def test_json_with_a_huge_integer_is_invalid_json():
    from preprocess_service.adapters.media.parse import parse_document
    from preprocess_service.core.tokenizer import ByteTokenizer

    with pytest.raises(SampleError) as info:
        parse_document({"__key__": "k", "txt": b"x", "json": b'{"w": 1' + b"0" * 5000 + b"}"},
                       image_config=IMAGE_CONFIG, tokenizer=ByteTokenizer(), seq_len=SEQ_LEN)
    assert info.value.kind == "invalid_json"
