"""Parquet files of the Hugging Face datasets layout: one sample per row.

A row becomes a webdataset-style sample by its columns' types and names, never by running
anything the file holds:

- an image or audio column (datasets' ``Image`` / ``Audio`` features: a struct with a ``bytes``
  field, or a list of them for several per row) gives one member per value, named by what its
  bytes are (``jpg``, ``png``, ``webp``; ``flac``, ``wav``, ``mp3``, ``ogg``), numbered from the
  second on (``1.jpg`` ...), in column order; a value with no bytes (only a ``path``) is a
  SampleError: this format reads what the file holds;
- ``conversations`` (LLaVA turns) or ``messages`` (OpenAI turns) go into the sample's JSON, as a
  LLaVA tar sample would hold them (media/conversations.py reads both);
- the first of ``text``, ``caption``, ``txt`` that is a string column is the sample's ``txt``.

A sample's key is the file's folder, its name without ``.parquet`` and its row number (nine
digits): ``en/train-00000-of-00004/000000017``. Rows are read one at a time, each checked
in Arrow's memory before Python copies it; a row group whose footer declares more than
max_sample_bytes a row (in all, or in one column) is not read (its rows reported), and a value
larger than max_member_bytes (or a row larger than max_sample_bytes) skips that row with a
reason. A resume starts at the row after the last one read (NEXT_OFFSET), skipping whole row
groups before it unread.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from disttrain_api.errors import SampleError
from preprocess_service.adapters.io.formats._base import Format, ProblemSink, register
from preprocess_service.adapters.io.tarstream import TarLimits
from preprocess_service.core.sample import NEXT_OFFSET

TEXT_COLUMNS = ("text", "caption", "txt")
TURN_COLUMNS = ("conversations", "messages")
_MEDIA = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"),
          (b"\xff\xfb", "mp3"), (b"\xff\xf3", "mp3"), (b"\xff\xf2", "mp3"))


def media_extension(data: bytes) -> str | None:
    """The member extension of an image or audio value by its first bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] in (b"WEBP", b"WAVE"):
        return "webp" if data[8:12] == b"WEBP" else "wav"
    return next((ext for magic, ext in _MEDIA if data.startswith(magic)), None)


@register
class HFParquet(Format):
    name = "parquet"
    suffixes = (".parquet",)
    magic = (b"PAR1",)
    in_folders = True

    def _file(self, f: BinaryIO):
        import pyarrow.parquet as pq  # the [service] extra; imported when a Parquet shard is read

        return pq.ParquetFile(f)

    def iter_samples(self, f: BinaryIO, path: str, url: str, limits: TarLimits, report: ProblemSink,
                     first: int = 0) -> Iterator[dict]:
        pf = self._file(f)
        columns = _columns(pf.schema_arrow)
        if not columns:
            report(SampleError("", "the Parquet file has no image, audio, text or conversation column this service "
                               f"reads (columns: {', '.join(pf.schema_arrow.names)[:300]})", url, "shard_error"))
            return
        row = 0
        for group in range(pf.num_row_groups):
            meta = pf.metadata.row_group(group)
            if row + meta.num_rows <= first:  # a resume: whole row groups before it are not read
                row += meta.num_rows
                continue
            chunk = max((meta.column(c).total_uncompressed_size for c in range(meta.num_columns)), default=0)
            if meta.total_byte_size > max(1, meta.num_rows) * limits.max_sample_bytes or \
                    chunk > max(1, meta.num_rows) * limits.max_sample_bytes:  # bounded before reading
                for skipped in range(max(row, first), row + meta.num_rows):
                    report(SampleError(_key(url, skipped), f"its row group {group} holds {meta.total_byte_size} bytes "
                                       f"for {meta.num_rows} rows, more than max_sample_bytes a row", url, "oversize"))
                row += meta.num_rows
                continue
            # one row at a time: a row is checked in Arrow's memory before Python copies it
            for batch in pf.iter_batches(batch_size=1, row_groups=[group], columns=list(columns)):
                if row >= first:
                    key = _key(url, row)
                    if batch.nbytes > limits.max_sample_bytes:
                        report(SampleError(key, f"the row holds {batch.nbytes} bytes, more than max_sample_bytes "
                                           f"({limits.max_sample_bytes})", url, "oversize"))
                    else:
                        values = batch.to_pydict()
                        sample = _sample(key, {name: values[name][0] for name in values}, columns, url, limits, report)
                        if sample is not None:
                            sample[NEXT_OFFSET] = row + 1
                            yield sample
                row += 1


def _key(url: str, row: int) -> str:
    """``folder/file-stem/row``: the file's folder keeps ``en/train-00000`` and ``de/train-00000``
    apart."""
    parts = url.rstrip("/").rsplit("/", 2)[-2:]
    name = parts[-1][:-len(".parquet")] if parts[-1].lower().endswith(".parquet") else parts[-1]
    return "/".join([*parts[:-1], name, f"{row:09d}"])


def _columns(schema) -> dict[str, str]:
    """Column -> role ("media", "media_list", "turns", "text") of the columns read."""
    import pyarrow as pa

    def media(t) -> bool:
        return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0

    out: dict[str, str] = {}
    for field in schema:
        t = field.type
        if media(t):
            out[field.name] = "media"
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and media(t.value_type):
            out[field.name] = "media_list"
        elif field.name in TURN_COLUMNS and (pa.types.is_list(t) or pa.types.is_large_list(t)):
            out[field.name] = "turns"
    text = next((f.name for name in TEXT_COLUMNS for f in schema
                 if f.name == name and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))), None)
    if text is not None:
        out[text] = "text"
    return out


def _sample(key: str, values: dict, columns: dict[str, str], url: str, limits: TarLimits,
            report: ProblemSink) -> dict | None:
    sample: dict = {"__key__": key, "__url__": url}
    media: list[bytes] = []
    meta: dict = {}
    try:
        for name, role in columns.items():
            value = values.get(name)
            if value is None:
                continue
            if role in ("media", "media_list"):
                for item in ([value] if role == "media" else value):
                    data = (item or {}).get("bytes")
                    if not data:
                        raise SampleError(key, f"column {name!r} holds no bytes (a path only: "
                                          f"{str((item or {}).get('path'))[:80]!r}); this format reads what the file "
                                          "holds", url, "empty")
                    media.append(data)
            elif role == "turns":
                meta[name] = value
            elif isinstance(value, str):
                sample["txt"] = value.encode("utf-8")
        for i, data in enumerate(media):  # jpg, 1.png, 2.jpg ...: the member index keeps their order
            ext = media_extension(data)
            if ext is None:
                raise SampleError(key, "a media value is neither an image nor an audio file this service reads",
                                  url, "unreadable_image")
            sample[ext if i == 0 else f"{i}.{ext}"] = data
        if meta:
            sample["json"] = json.dumps(meta, ensure_ascii=False).encode("utf-8")
        sizes = [len(v) for k, v in sample.items() if not k.startswith("__")]
        if any(size > limits.max_member_bytes for size in sizes):
            raise SampleError(key, f"a value is more than max_member_bytes ({limits.max_member_bytes})", url,
                              "oversize")
        if sum(sizes) > limits.max_sample_bytes:
            raise SampleError(key, f"the row is more than max_sample_bytes ({limits.max_sample_bytes})", url,
                              "oversize")
        if len(sizes) > limits.max_members_per_sample:
            raise SampleError(key, f"the row has more than {limits.max_members_per_sample} members", url, "oversize")
        if len(sizes) == 0:
            raise SampleError(key, "the row holds nothing this service reads", url, "empty")
    except SampleError as exc:
        report(exc)
        return None
    except (TypeError, ValueError, AttributeError) as exc:
        report(SampleError(key, f"the row cannot be read ({type(exc).__name__}: {exc})", url, "parse_failed"))
        return None
    return sample
