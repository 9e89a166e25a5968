"""LLaVA-style instruction data: one JSON file (an array of records) or JSON Lines file (a record
per line), each record a sample:

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is in the picture?"},
                       {"from": "gpt", "value": "A bus."}]}

``image`` is one relative path or a list of them (OpenAI-style ``messages`` work too, as in a
tar sample's JSON). Images are files under the folder that holds the JSON file: a path that is
absolute, holds ``..``, or resolves (through links) out of that folder is refused for that sample,
as is one that is not a regular file or is larger than max_member_bytes. ``video`` (or
``videos``) names video files the same way (.mp4, .webm, .mkv, .mov), placed by ``<video>``
markers. The media of a JSON file read over the network are not read (its copy sits in the shard
cache): such a record is skipped with that reason. A sample's key is the record's ``id`` when it is
a short printable string or a number, else the file's name and its place (``x.jsonl#000000017``);
a repeated id is a duplicate key (the planner keeps the first). A resume starts at the record
after the last one read (NEXT_OFFSET).

A JSON array is parsed whole, so it may be at most MAX_ARRAY_BYTES (64 MiB: parsed, it takes
several times that); a larger one (LLaVA-665k's file is 1 GB) is given as JSON Lines:
``jq -c '.[]' in.json > out.jsonl``. JSON Lines are read a line at a time, each at most
max_sample_bytes.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

from disttrain_api.errors import SampleError
from preprocess_service.adapters.io.formats._base import Format, ProblemSink, register
from preprocess_service.adapters.io.formats.parquet import media_extension
from preprocess_service.adapters.io.tarstream import TarLimits
from preprocess_service.adapters.media.video import VIDEO_EXTENSIONS
from preprocess_service.core.sample import NEXT_OFFSET

MAX_ARRAY_BYTES = 64 << 20
MAX_IMAGES = 32
"""Most images one record may name."""
MAX_ID_CHARS = 128


@register
class LlavaJson(Format):
    name = "llava"
    suffixes = (".json", ".jsonl")
    magic = (b"[", b"{")

    def iter_samples(self, f: BinaryIO, path: str, url: str, limits: TarLimits, report: ProblemSink,
                     first: int = 0) -> Iterator[dict]:
        # images sit beside the JSON file: a remote one's copy sits in the shard cache, among others'
        folder = os.path.realpath(os.path.dirname(path)) if url.startswith("/") else None
        for index, record in _records(f, path, url, limits, report, first):
            sample = _sample(index, record, folder, url, limits, report)
            if sample is not None:
                sample[NEXT_OFFSET] = index + 1
                yield sample


def _records(f: BinaryIO, path: str, url: str, limits: TarLimits, report: ProblemSink,
             first: int = 0) -> Iterator[tuple[int, object]]:
    """(index, record) from record ``first`` on; a record before it is not parsed (a JSON Lines
    line) or not looked at (an array)."""
    head = f.read(1 << 16)
    f.seek(0)
    if head.lstrip()[:1] == b"[":  # a JSON array: parsed whole, within MAX_ARRAY_BYTES
        size = os.fstat(f.fileno()).st_size
        if size > MAX_ARRAY_BYTES:
            report(SampleError("", f"a JSON array of {size} bytes, more than {MAX_ARRAY_BYTES}: give it as JSON Lines "
                               "(one record per line), which is read a line at a time", url, "shard_error"))
            return
        try:
            records = json.loads(f.read(size + 1))
        except (ValueError, RecursionError) as exc:
            report(SampleError("", f"the JSON file cannot be parsed ({type(exc).__name__}: {str(exc)[:200]})", url,
                               "invalid_json"))
            return
        records = records if isinstance(records, list) else []
        yield from ((i, records[i]) for i in range(first, len(records)))
        return
    index = 0
    reader = io.BufferedReader(f, 1 << 16) if not isinstance(f, io.BufferedReader) else f
    while True:
        line = reader.readline(limits.max_sample_bytes + 1)
        if not line:
            return
        if len(line) > limits.max_sample_bytes and not line.endswith(b"\n"):
            report(SampleError(_key(url, index), f"a line longer than max_sample_bytes ({limits.max_sample_bytes})",
                               url, "oversize"))
            while line and not line.endswith(b"\n"):  # the rest of that line
                line = reader.readline(1 << 20)
            index += 1
            continue
        if not line.strip():
            continue
        if index >= first:
            try:
                yield index, json.loads(line)
            except (ValueError, RecursionError) as exc:
                report(SampleError(_key(url, index), f"line {index + 1} is not JSON ({type(exc).__name__})", url,
                                   "invalid_json"))
        index += 1


def _key(url: str, index: int) -> str:
    """A record without a usable id: its file's name and place (``llava.jsonl#000000017``), so two
    files' records never share a key."""
    return f"{url.rsplit('/', 1)[-1]}#{index:09d}"


def _record_key(index: int, record: dict, url: str) -> str:
    ident = record.get("id")
    if isinstance(ident, int) and not isinstance(ident, bool):
        return str(ident)
    if isinstance(ident, str) and 0 < len(ident) <= MAX_ID_CHARS and ident.isprintable() and "#" not in ident:
        return ident
    return _key(url, index)


def _sample(index: int, record: object, folder: str | None, url: str, limits: TarLimits,
            report: ProblemSink) -> dict | None:
    if not isinstance(record, dict):
        report(SampleError(_key(url, index), "a record is not a JSON object", url, "invalid_json"))
        return None
    key = _record_key(index, record, url)
    try:
        images, videos = _paths(record, "image", key, url), _paths(record, "video", key, url)
        if (images or videos) and folder is None:
            raise SampleError(key, "the media of a remote JSON file are not read (only those beside a local one)",
                              url, "unreadable_image")
        sample: dict = {"__key__": key, "__url__": url}
        total = 0
        for i, relative in enumerate(images):
            data = _image(relative, folder, key, url, limits, limits.max_sample_bytes - total)
            ext = media_extension(data) or "jpg"
            sample[ext if i == 0 else f"{i}.{ext}"] = data
            total += len(data)
        for i, relative in enumerate(videos):
            ext = relative.rsplit(".", 1)[-1].lower()
            if ext not in VIDEO_EXTENSIONS:
                raise SampleError(key, f"video {relative[:120]!r}: a video file ends in one of {VIDEO_EXTENSIONS}",
                                  url, "unreadable_video")
            data = _image(relative, folder, key, url, limits, limits.max_sample_bytes - total, "video")
            sample[ext if i == 0 else f"{i}.{ext}"] = data
            total += len(data)
        meta = {name: record[name] for name in ("conversations", "messages") if name in record}
        if not meta:
            raise SampleError(key, "the record has no 'conversations' or 'messages'", url, "invalid_conversation")
        sample["json"] = json.dumps(meta, ensure_ascii=False).encode("utf-8")
        if total + len(sample["json"]) > limits.max_sample_bytes:
            raise SampleError(key, f"the record's images and text add up to more than max_sample_bytes "
                              f"({limits.max_sample_bytes})", url, "oversize")
    except SampleError as exc:
        report(exc)
        return None
    return sample


def _paths(record: dict, field: str, key: str, url: str) -> list[str]:
    """The record's ``field`` (or its plural): one path or a list of them."""
    paths = record.get(field, record.get(field + "s"))
    paths = [] if paths is None else [paths] if isinstance(paths, str) else paths
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths) or len(paths) > MAX_IMAGES:
        raise SampleError(key, f"{field!r} must be a path or a list of at most {MAX_IMAGES} paths", url, "invalid_json")
    return paths


def _image(relative: str, folder: str | None, key: str, url: str, limits: TarLimits, room: int,
           what: str = "image") -> bytes:
    """A media file under ``folder``, read within the limits, or SampleError naming why not."""
    kind = f"unreadable_{what}"
    from preprocess_service.adapters.io.schemes.local import open_regular  # not at import: schemes import sources

    if not relative or os.path.isabs(relative) or "\x00" in relative or ".." in relative.replace("\\", "/").split("/"):
        raise SampleError(key, f"{what} path {relative[:120]!r} must be relative, inside the JSON file's folder", url,
                          kind)
    real = os.path.realpath(os.path.join(folder, relative))
    if not real.startswith(folder.rstrip("/") + "/"):
        raise SampleError(key, f"{what} path {relative[:120]!r} leads out of the JSON file's folder", url,
                          kind)
    try:
        with open_regular(real) as image:
            size = os.fstat(image.fileno()).st_size
            if not stat.S_ISREG(os.fstat(image.fileno()).st_mode) or size > min(limits.max_member_bytes, room):
                raise SampleError(key, f"{what} {relative[:120]!r} is {size} bytes, more than max_member_bytes "
                                  f"({limits.max_member_bytes}) or what max_sample_bytes leaves the record", url,
                                  "oversize")
            data = image.read(size + 1)
            if len(data) > size:  # grew while read
                raise SampleError(key, f"{what} {relative[:120]!r} changed while it was read", url, kind)
            return data
    except SampleError:
        raise
    except Exception as exc:  # missing, a FIFO, unreadable: this sample's problem
        raise SampleError(key, f"{what} {relative[:120]!r}: {exc}", url, kind) from None
