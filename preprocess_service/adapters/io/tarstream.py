"""Bounded reading of webdataset tar shards: samples out of a byte stream, every size checked
from its header before anything is read.

``iter_samples(fileobj, url, limits, on_problem)`` yields raw samples (``__key__``, ``__url__``,
member suffix -> bytes) grouped as webdataset groups them (consecutive members whose names share
the part before the first dot of the base name; ``__*__`` meta members skipped; suffixes lower
case). What it never does, whatever the shard holds:

- read a member larger than ``max_member_bytes`` or a sample larger than ``max_sample_bytes``
  (the data is skipped through, the sample reported ``oversize``);
- read a pax or GNU long-name header block larger than ``MAX_HEADER_BLOCK_BYTES`` (the shard
  ends there, reported);
- keep more than ``max_members_per_sample`` members or a key longer than ``MAX_KEY_CHARS``.

Duplicates follow one policy, keep the first and report the others: a member name repeated
inside a sample keeps its first copy (the sample goes on, the copy is reported
``duplicate_member``); a key that appears again later in the same shard is reported
``duplicate_key`` (the job-wide check across shards is the planner's). A shard cut short reports
the sample it was reading, by key (``truncated_shard``), and every complete sample before it is
delivered.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from disttrain_api.errors import SampleError
from preprocess_service.adapters.io.config import READER_DEFAULTS
from preprocess_service.core.sample import NEXT_OFFSET

MAX_HEADER_BLOCK_BYTES = 1 << 20
"""Largest pax extended header or GNU long name this reader accepts (tarfile would read any size)."""
MAX_KEY_CHARS = 1024
_META = re.compile(r"__[^/]*__($|/)")
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""webdataset.tariterators.base_plus_ext's split (the part before the base name's first dot, the
rest). Matched here, not imported: importing any webdataset module imports torch (webdataset's
package imports its torch loaders), the largest import and memory item of a server that needs neither;
tests/unit/preprocess_service/adapters/io/test_shards.py checks the two agree."""

ProblemSink = Callable[[SampleError], None]


@dataclass(frozen=True, slots=True)
class TarLimits:
    """Operator bounds on what one shard may make the service read (server settings)."""

    max_member_bytes: int = READER_DEFAULTS.max_member_bytes
    """Largest tar member read into memory; a larger one skips its sample (checked from the header)."""
    max_sample_bytes: int = READER_DEFAULTS.max_sample_bytes
    """Largest sum of a sample's member sizes."""
    max_members_per_sample: int = 64
    """Most members one sample may have."""


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses oversized pax / GNU long-name blocks before tarfile reads them, and
    makes a cut or corrupt header an error: tarfile would take it for the end of the archive and
    lose the rest of the shard unreported."""

    @classmethod
    def fromtarfile(cls, tarfile_):  # tarfile's own, with the error mapping
        buf = tarfile_.fileobj.read(tarfile.BLOCKSIZE)
        if 0 < len(buf) < tarfile.BLOCKSIZE and not buf.strip(b"\0"):
            raise tarfile.EmptyHeaderError("end of file inside the end-of-archive blocks")  # a clean end
        try:
            obj = cls.frombuf(buf, tarfile_.encoding, tarfile_.errors)
        except (tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError) as exc:
            raise tarfile.ReadError(f"corrupt or cut tar header at byte {tarfile_.offset}: {exc}") from None
        obj.offset = tarfile_.fileobj.tell() - tarfile.BLOCKSIZE
        return obj._proc_member(tarfile_)

    def _proc_member(self, tarfile_):
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                         tarfile.SOLARIS_XHDTYPE) and self.size > MAX_HEADER_BLOCK_BYTES:
            raise tarfile.HeaderError(f"a {self.type!r} header block of {self.size} bytes (at most "
                                      f"{MAX_HEADER_BLOCK_BYTES} accepted)")
        return super()._proc_member(tarfile_)


@dataclass(slots=True)
class _Sample:
    key: str
    members: dict
    nbytes: int = 0
    problem: SampleError | None = None


def iter_members(fileobj) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """(header, tar) of every regular member of a tar stream, headers bounded."""
    tar = tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_BoundedTarInfo)
    for info in tar:
        tar.members = []  # stream mode keeps every header otherwise
        if info.isreg():
            yield info, tar


def split_name(name: str) -> tuple[str | None, str | None]:
    """(key, lower-case suffix) as webdataset groups members; (None, None) for names it skips:
    meta members (``__*__``), and suffixes that would name a sample's own fields (``KEY.__key__``
    must not overwrite its key or shard)."""
    if _META.match(name):
        return None, None
    match = _BASE_PLUS_EXT.match(name)
    if match is None or match.group(2).startswith("__"):
        return None, None
    return match.group(1), match.group(2).lower()


def _printable_key(key: str) -> str:
    """A key as valid UTF-8 (tarfile keeps undecodable name bytes as lone surrogates)."""
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def iter_samples(fileobj, url: str, limits: TarLimits, on_problem: ProblemSink,
                 base_offset: int | None = None, keys_only: bool = False) -> Iterator[dict]:
    """Raw samples of one tar stream; problems go to ``on_problem`` (SampleError, with key where
    known) and never end the stream early, except a broken or cut tar, which ends it after
    reporting the sample it was reading. With ``base_offset`` (where ``fileobj`` starts in the
    shard file), an uncompressed tar's samples carry NEXT_OFFSET: where the next sample starts.
    ``keys_only``: the same samples, decided by the same headers, without their members' bytes
    (skipped, not read into memory; a member cut short still ends the stream at that sample)."""
    current: _Sample | None = None
    seen: set[str] = set()
    try:
        for info, tar in iter_members(fileobj):
            key, suffix = split_name(info.name)
            if key is None:
                continue
            if current is None or key != current.key:
                if current is not None:
                    sample = _finish(current, url, on_problem)
                    if sample is not None:
                        if base_offset is not None and getattr(tar.fileobj, "comptype", "") == "tar":
                            sample[NEXT_OFFSET] = base_offset + info.offset
                        yield sample
                current = _Sample(key, {})
                if len(key) > MAX_KEY_CHARS:
                    current.problem = SampleError(_printable_key(key[:64]) + "...", f"key is {len(key)} characters, "
                                                  f"more than {MAX_KEY_CHARS}", url, "invalid_key")
                elif _printable_key(key) != key:
                    current.problem = SampleError(_printable_key(key), "key is not valid UTF-8", url, "invalid_key")
                elif key in seen:
                    current.problem = SampleError(key, "the key appears again later in the shard; the first "
                                                  "sample with this key is kept", url, "duplicate_key")
                seen.add(key)
            _add_member(current, info, tar, suffix, url, limits, on_problem, keys_only)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        lost = current.key if current is not None else ""
        where = f"while reading sample {lost!r}" if lost else "before its first sample"
        on_problem(SampleError(lost, f"the shard is cut short or corrupt {where} ({type(exc).__name__}: {exc}); "
                               "samples before it were read", url, "truncated_shard"))
        return
    if current is not None:
        sample = _finish(current, url, on_problem)
        if sample is not None:
            if base_offset is not None:
                sample[NEXT_OFFSET] = -1
            yield sample


def _add_member(current: _Sample, info, tar, suffix: str, url: str, limits: TarLimits, on_problem,
                keys_only: bool = False) -> None:
    if current.problem is not None:
        return  # the sample is lost anyway: its remaining members are skipped unread
    if suffix in current.members:
        on_problem(SampleError(current.key, f"member {suffix!r} appears twice; the first copy is kept", url,
                               "duplicate_member"))
        return
    if len(current.members) >= limits.max_members_per_sample:
        current.problem = SampleError(current.key, f"has more than {limits.max_members_per_sample} members "
                                      "(max_members_per_sample)", url, "oversize")
        return
    if info.size > limits.max_member_bytes:
        current.problem = SampleError(current.key, f"member {suffix!r} is {info.size} bytes, more than "
                                      f"max_member_bytes {limits.max_member_bytes}", url, "oversize")
        return
    if current.nbytes + info.size > limits.max_sample_bytes:
        current.problem = SampleError(current.key, f"members add up to more than max_sample_bytes "
                                      f"{limits.max_sample_bytes}", url, "oversize")
        return
    if keys_only:  # tarfile skips the data to the next header, and fails there if it is cut short
        current.members[suffix] = b""
        current.nbytes += info.size
        return
    data = tar.extractfile(info).read()
    if len(data) != info.size:
        raise EOFError(f"member {info.name!r} holds {len(data)} of its {info.size} bytes")
    current.members[suffix] = data
    current.nbytes += info.size


def _finish(current: _Sample, url: str, on_problem) -> dict | None:
    if current.problem is not None:
        on_problem(current.problem)
        return None
    return {"__key__": current.key, "__url__": url, **current.members}


def index_members(fileobj, limits: TarLimits) -> dict[str, dict[str, tuple[int, int]]]:
    """key -> {suffix: (data offset, size)} of a seekable local tar, grouped as iter_samples groups
    them, first occurrence kept; members over the limits are left out (the planner reported their
    samples). A broken tail leaves the samples before it indexed.

    Plain ustar headers (what webdataset's and img2dataset's writers make for ASCII names) are read
    by ``pread``, one per member; a tar with any other header (pax, GNU long names, sparse files,
    base-256 numbers, a checksum only tarfile accepts) is indexed by tarfile, which reads them all.
    The two give the same index (tests/unit/preprocess_service/adapters/io/test_tarstream.py)."""
    try:
        return _index(_plain_headers(fileobj.fileno()), limits)
    except _NotPlain:
        fileobj.seek(0)
        return _index(_tarfile_headers(fileobj), limits)


def _index(headers: Iterator[tuple[str, int, int]], limits: TarLimits) -> dict[str, dict[str, tuple[int, int]]]:
    index: dict[str, dict[str, tuple[int, int]]] = {}
    previous = None
    for name, offset_data, size in headers:
        key, suffix = split_name(name)
        if key is None:
            continue
        if key != previous and key in index:
            previous = key  # a later sample with a key already seen: not the one planned
            continue
        if previous != key:
            index[key] = {}
        previous = key
        if size <= limits.max_member_bytes:
            index[key].setdefault(suffix, (offset_data, size))
    return index


def _tarfile_headers(fileobj) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of every regular member, as tarfile reads them."""
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:", tarinfo=_BoundedTarInfo)
        while (info := tar.next()) is not None:
            tar.members = []
            if info.isreg():
                yield info.name, info.offset_data, info.size
    except (tarfile.TarError, EOFError):
        pass


class _NotPlain(Exception):
    """A header only tarfile reads (the whole tar is indexed by tarfile instead)."""


_BLOCK = tarfile.BLOCKSIZE
_REGULAR = (b"0", b"\0", b"7")
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")
"""Links, devices, directories, FIFOs: not samples' members (no data, or data skipped)."""


def _plain_headers(fd: int) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of every regular member of a ustar file by ``pread`` (pax
    headers giving a path, a size or what an index ignores, like tarfile's own fractional mtime);
    raises _NotPlain at any header tarfile must read (checked before anything is yielded)."""
    members, offset, pax = [], 0, {}
    while True:
        buf = os.pread(fd, _BLOCK, offset)
        if len(buf) < _BLOCK or not buf.strip(b"\0"):
            break  # the end, or a cut header: tarfile stops there too
        kind, size = buf[156:157], _octal(buf[124:136])
        if kind not in _REGULAR + _SKIPPED + (b"x",) or _octal(buf[148:156]) != sum(buf) - sum(buf[148:156]) + 256:
            raise _NotPlain
        data_offset, offset = offset + _BLOCK, offset + _BLOCK + -(-size // _BLOCK) * _BLOCK
        if kind == b"x":
            if size > MAX_HEADER_BLOCK_BYTES:
                raise _NotPlain
            pax = _pax_records(os.pread(fd, size, data_offset))
            continue
        name = _text(buf[0:100])
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"  # an old-style directory
        if kind == b"5":
            name = name.rstrip("/")
        if prefix := _text(buf[345:500]):
            name = prefix + "/" + name
        if b"path" in pax:
            name = pax[b"path"].decode("utf-8", "surrogateescape")
        if b"size" in pax:
            size = _octal_or_decimal(pax[b"size"])
            offset = data_offset + -(-size // _BLOCK) * _BLOCK
        pax = {}
        if kind in _REGULAR:
            members.append((name, data_offset, size))
    yield from members


_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax extended header (``LENGTH KEY=VALUE\\n``), as tarfile parses them."""
    records, pos = {}, 0
    while match := _PAX_RECORD.match(data, pos):
        length, key = int(match.group(1)), match.group(2)
        if length < len(match.group(0)) + 1 or pos + length > len(data) or data[pos + length - 1:pos + length] != b"\n":
            raise _NotPlain
        if key.startswith(b"GNU.sparse") or key == b"hdrcharset":
            raise _NotPlain  # sparse members and names in another charset: tarfile's to read
        records[key] = data[match.end(0):pos + length - 1]
        pos += length
    if data[pos:].strip(b"\0"):
        raise _NotPlain
    return records


def _octal_or_decimal(value: bytes) -> int:
    try:
        return int(value)
    except ValueError:
        raise _NotPlain from None


def _octal(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):
        raise _NotPlain  # a base-256 number
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise _NotPlain from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
