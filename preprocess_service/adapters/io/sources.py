"""Shard sources: a client's shard specs parsed, expanded within bounds, normalised and checked
against the operator's policy before anything is opened.

Order of work for every spec (``resolve``), so no check can be bypassed by syntax:
1. bound the raw text (length, printable characters, brace count);
2. split webdataset's ``::`` lists and brace-expand each part, counting the names *before*
   generating them (``{0..999999999}`` is refused, not materialised);
3. parse every expanded name into a ``Source`` (scheme, normalised location): local paths (plain
   or ``file:``) must not contain a ``..`` component and are resolved with realpath (symlinks
   followed); URLs get a lower-case scheme and host and may not contain ``..`` segments, raw or
   percent-encoded; no name of another scheme may contain ``::`` (webdataset's list separator,
   and fsspec's chain of filesystems: ``s3://bucket/key::file:///etc/passwd`` would pass an
   ``s3://bucket/`` prefix and read a local file; only an http(s) URL's bracketed IPv6 host may
   hold it), and an object store's name is ``s3://bucket/key`` (no user, port or query);
4. check the scheme against ``ShardPolicy.allowed_schemes`` (default: local files and
   http(s); object stores (``s3://``, ``gs://``, normalised like URLs with the bucket as the host),
   ``pipe:`` and every other scheme that runs a program only when the operator lists it) and the
   normalised location against ``allowed_prefixes`` (empty: any).

Refusals raise ConfigError (malformed: INVALID_ARGUMENT) or PermissionDenied (well-formed but not
allowed: PERMISSION_DENIED), naming the shard and the rule.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np

from disttrain_api.errors import ConfigError, PermissionDenied
from preprocess_service.adapters.io import formats
from preprocess_service.adapters.io.config import DEFAULT_SCHEMES, READER_DEFAULTS
from preprocess_service.core.shardnames import Concat, ListNames, ShardNames, hash_index

LOCAL_SCHEMES = ("file",)
PROGRAM_SCHEMES = ("pipe", "gsutil", "ais", "sftp", "scp", "hf", "htgs")
"""Schemes webdataset's gopen serves by running a program; refused unless the operator lists them."""
OBJECT_STORE_SCHEMES = ("s3", "gs")
"""Object stores, read through fsspec with the server's own credentials (remote.py; the [remote]
extra); refused unless the operator lists them."""
NAMING: dict[str, str] = {"file": "path", "http": "url", "https": "url", "s3": "url", "gs": "url"}
"""Each scheme's naming rule: "path" (a local path, realpath'd), "url" (lower-case scheme and host,
the bucket of an object store as the host) or "opaque" (any other: no '..', no '::' chains). A
scheme file (schemes/) declares its own when it registers."""
MAX_SPEC_CHARS = 4096
MAX_SPECS = 4096
MAX_BRACE_GROUPS = 16
_RANGE = re.compile(r"^(-?\d+|[A-Za-z])\.\.(-?\d+|[A-Za-z])(?:\.\.(-?\d+))?$")


@dataclass(frozen=True, slots=True)
class ShardPolicy:
    """What the operator allows a job's shards to be (server settings, never a client's spec)."""

    allowed_schemes: tuple[str, ...] = DEFAULT_SCHEMES
    """Schemes a shard may use; "file" covers plain paths. Add "pipe" to let jobs run shell
    commands on the server (off by default)."""
    allowed_prefixes: tuple[str, ...] = ()
    """Normalised path or URL prefixes every expanded shard must start with; empty: any."""
    max_shards: int = READER_DEFAULTS.max_shards
    """Most shard names one job may expand to."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_schemes", tuple(s.lower().rstrip(":") for s in self.allowed_schemes))
        if self.max_shards < 1:
            raise ConfigError(f"max_shards must be at least 1, got {self.max_shards}")


@dataclass(frozen=True, slots=True)
class Source:
    """One shard: its scheme and normalised location (an absolute real path for local files)."""

    scheme: str
    location: str

    @property
    def is_local(self) -> bool:
        return self.scheme in LOCAL_SCHEMES

    @property
    def url(self) -> str:
        """How the rest of the service names it: the path for local files, else the URL."""
        return self.location


def resolve_names(specs: Sequence[str], policy: ShardPolicy = ShardPolicy()) -> ShardNames:
    """Every shard the specs name, checked, as a sequence that holds no more than it must: a
    pattern part of more than EAGER_NAMES names is kept as its pattern (PatternNames) and a
    directory as its sorted *.tar names in one string (FolderNames); a local directory stands
    for its sorted *.tar files."""
    if len(specs) > MAX_SPECS:
        raise ConfigError(f"a job may give at most {MAX_SPECS} shard specs, got {len(specs)}")
    pieces: list[PatternNames | list[tuple[Source, str]]] = []
    dirs: dict[str, str] = {}  # realpath of each folder, once per call: a million names share a few
    allowed = _allowed(policy)
    total = 0
    for spec in specs:  # every name is parsed and checked before any is looked up on disk
        _check_text(spec)
        for part in _parts(spec):
            tree = _parse_braces(part, spec)
            count = _count(tree, policy.max_shards + 1)
            total += count
            if total > policy.max_shards:
                raise ConfigError(f"shard spec {spec!r} expands to more than {policy.max_shards} shards, the most "
                                  "this service allows one job (max_shards)")
            if count > EAGER_NAMES:
                pattern = PatternNames(tree, count, spec, policy, allowed)
                if not pattern.spot_check():  # a pattern of folders is expanded at once, as before
                    pieces.append(pattern)
                    continue
            named = [(parse(name, spec, dirs), spec) for name in _generate(tree)]
            for source, _ in named:
                check(source, policy, spec, allowed)
            pieces.append(named)
    out: list[ShardNames] = []
    held: list[str] = []
    room = policy.max_shards
    for piece in pieces:
        if isinstance(piece, PatternNames):
            out.extend([ListNames(held), piece])
            held, room = [], room - len(piece)
            continue
        for source, spec in piece:
            found = _directory_tars(source, spec, policy, room, dirs, allowed)
            room -= len(found)
            if isinstance(found, FolderNames):
                out.extend([ListNames(held), found])
                held = []
            else:
                held.extend(found)
    out.append(ListNames(held))
    names = Concat(out)
    if len(names) > policy.max_shards:
        raise ConfigError(f"the shard specs expand to more than {policy.max_shards} shards, the most this service "
                          "allows one job (max_shards)")
    if not len(names):
        raise ConfigError(f"the shard specs {list(specs)!r} expand to no shard")
    return names.parts[0] if len(names.parts) == 1 else names


def resolve(specs: Sequence[str], policy: ShardPolicy = ShardPolicy()) -> list[Source]:
    """resolve_names, every name parsed (for a few names: tests and tools)."""
    return [parse(url) for url in resolve_names(specs, policy)]


def _check_text(spec: str) -> None:
    if not isinstance(spec, str) or not spec:
        raise ConfigError("a shard spec is empty")
    if len(spec) > MAX_SPEC_CHARS:
        raise ConfigError(f"shard spec {spec[:60]!r}... is {len(spec)} characters, more than {MAX_SPEC_CHARS}")
    if any(ord(c) < 32 or ord(c) == 127 for c in spec):
        raise ConfigError(f"shard spec {spec!r} contains control characters")


# --- brace expansion --------------------------------------------------------------------------

def expand(spec: str, limit: int) -> list[str]:
    """webdataset's shard syntax (``::`` separates lists; ``{a,b}``, ``{000..099}``, ``{0..98..2}``),
    counted before it is generated: more than ``limit`` names raise ConfigError."""
    names: list[str] = []
    for part in _parts(spec):
        tree = _parse_braces(part, spec)
        count = _count(tree, limit + 1)
        if len(names) + count > limit:
            raise ConfigError(f"shard spec {spec!r} expands to more than {limit} shards, the most this service "
                              "allows one job (max_shards)")
        names.extend(_generate(tree))
    return names


def _parts(spec: str) -> list[str]:
    parts = spec.split("::")
    if not all(parts):
        raise ConfigError(f"shard spec {spec!r} has an empty item between '::' separators")
    return parts


def _parse_braces(text: str, spec: str):
    """A sequence of str / ("alt", [sequences]) / ("range", values)."""
    if text.count("{") > MAX_BRACE_GROUPS:
        raise ConfigError(f"shard spec {spec!r} has more than {MAX_BRACE_GROUPS} brace groups")
    return _parse_seq(text, 0, spec, top=True)[0]


def _parse_seq(text: str, pos: int, spec: str, top: bool):
    seq: list = []
    literal = []
    while pos < len(text):
        c = text[pos]
        if c == "{":
            if literal:
                seq.append("".join(literal))
                literal = []
            group, pos = _parse_group(text, pos + 1, spec)
            seq.append(group)
            continue
        if c == "}" or (c == "," and not top):
            if top:
                raise ConfigError(f"shard spec {spec!r} has an unmatched '}}'")
            break
        literal.append(c)
        pos += 1
    if literal:
        seq.append("".join(literal))
    return seq, pos


def _parse_group(text: str, pos: int, spec: str):
    end = text.find("}", pos)
    body = text[pos:end] if end >= 0 else ""
    match = _RANGE.match(body) if "{" not in body else None
    if match:
        return ("range", _range_values(*match.groups(), spec)), end + 1
    options = []
    while True:
        seq, pos = _parse_seq(text, pos, spec, top=False)
        options.append(seq)
        if pos >= len(text):
            raise ConfigError(f"shard spec {spec!r} has an unmatched '{{'")
        if text[pos] == "}":
            return ("alt", options), pos + 1
        pos += 1  # a comma


def _range_values(first: str, last: str, step: str | None, spec: str):
    """A lazy description of a range: (start, stop, step, width, letters)."""
    step_n = abs(int(step)) if step else 1
    if step_n == 0:
        raise ConfigError(f"shard spec {spec!r} has a range with step 0")
    if first.isalpha() != last.isalpha():
        raise ConfigError(f"shard spec {spec!r} mixes letters and numbers in a range")
    if first.isalpha():
        a, b = ord(first), ord(last)
        return (a, b, step_n, 0, True)
    width = max(len(first), len(last)) if (first.lstrip("-").startswith("0") and len(first.lstrip("-")) > 1) or \
        (last.lstrip("-").startswith("0") and len(last.lstrip("-")) > 1) else 0
    return (int(first), int(last), step_n, width, False)


def _range_len(values) -> int:
    a, b, step, _, _ = values
    return abs(b - a) // step + 1


def _count(seq, cap: int) -> int:
    """Names a sequence expands to, stopping at ``cap`` (no big number is ever built)."""
    total = 1
    for item in seq:
        if isinstance(item, str):
            continue
        kind, body = item
        n = _range_len(body) if kind == "range" else min(cap, sum(_count(o, cap) for o in body))
        total = min(cap, total * n)
    return total


def _generate(seq) -> Iterator[str]:
    if not seq:
        yield ""
        return
    head, rest = seq[0], seq[1:]
    for prefix in _items(head):
        for suffix in _generate(rest):
            yield prefix + suffix


def _items(item) -> Iterator[str]:
    if isinstance(item, str):
        yield item
        return
    kind, body = item
    if kind == "alt":
        for option in body:
            yield from _generate(option)
        return
    a, b, step, width, letters = body
    direction = 1 if b >= a else -1
    for value in range(a, b + direction, step * direction):
        yield chr(value) if letters else (f"{value:0{width}d}" if width else str(value))


# --- parsing and checking ---------------------------------------------------------------------

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def parse(name: str, spec: str = "", dirs: dict[str, str] | None = None) -> Source:
    """One expanded shard name -> Source. Local paths lose nothing but ``.``/duplicate slashes and
    symlinks (realpath); a ``..`` component is refused outright rather than resolved. ``dirs``
    caches the realpath of folders across the names of one expansion."""
    spec = spec or name
    match = _SCHEME.match(name)
    scheme = match.group(1).lower() if match else ""
    naming = "path" if scheme == "" or len(scheme) == 1 else NAMING.get(scheme, "opaque")
    if naming == "path":  # "C:" is not a scheme here, but refuse it as a path
        path = name[len("file:"):] if scheme == "file" else name
        if scheme == "file" and path.startswith("//"):
            parts = urlsplit(name)
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(f"shard {name!r} (from {spec!r}): file URLs must name this host")
            path = unquote(parts.path)
        return Source("file", _local(path, name, spec, dirs))
    if naming == "url":  # s3://bucket/key: the bucket is the host
        return Source(scheme, _url(name, scheme, spec))
    _refuse_chain(name, spec, name)
    rest = name[len(scheme) + 1:]
    if _has_dotdot(unquote(rest)):
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains a '..' component")
    return Source(scheme, scheme + ":" + rest)


def _refuse_chain(name: str, spec: str, text: str) -> None:
    if "::" in text:
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains '::', which would be read as a chain of "
                          "filesystems (fsspec) or a list of shards (webdataset); give each shard its own name")


def _has_dotdot(path: str) -> bool:
    return ".." in path and any(part == ".." for part in re.split(r"[/\\]", path))


def _local(path: str, name: str, spec: str, dirs: dict[str, str] | None = None) -> str:
    if not path:
        raise ConfigError(f"shard {name!r} (from {spec!r}) names no path")
    if "\x00" in path:
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains a NUL byte")
    if _has_dotdot(path):
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains a '..' component; give the path without it")
    if dirs is None:
        return os.path.realpath(path)
    folder, base = os.path.split(os.path.abspath(path))
    if not base:
        return os.path.realpath(path)
    real = dirs.get(folder)
    if real is None:
        real = dirs[folder] = os.path.realpath(folder)
    full = os.path.join(real, base)
    return os.path.realpath(full) if os.path.islink(full) else full  # the file itself may be a link


def _url(name: str, scheme: str, spec: str) -> str:
    try:
        parts = urlsplit(name)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"shard {name!r} (from {spec!r}) is not a valid URL: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"shard {name!r} (from {spec!r}) is a URL without a host")
    if _has_dotdot(unquote(parts.path)):
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains a '..' path segment")
    if any(c in name for c in " \"'`<>\\"):
        raise ConfigError(f"shard {name!r} (from {spec!r}) contains characters a URL may not hold unquoted")
    if scheme in OBJECT_STORE_SCHEMES:
        _refuse_chain(name, spec, name)
        if parts.username is not None or parts.password is not None or port is not None or parts.query:
            raise ConfigError(f"shard {name!r} (from {spec!r}): an object store's shard is named "
                              f"{scheme}://bucket/key, without a user, a port or a query")
    else:  # an IPv6 host ([::1]) may hold '::'; nothing else may
        _refuse_chain(name, spec, name[:len(scheme) + 3] + re.sub(r"\[[^\]]*\]", "", parts.netloc, count=1)
                      + name[len(scheme) + 3 + len(parts.netloc):])
    host = parts.hostname.lower()
    netloc = (f"{parts.username}@" if parts.username else "") + (f"[{host}]" if ":" in host else host)
    netloc += f":{port}" if port is not None else ""
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def _allowed(policy: ShardPolicy) -> list[Source]:
    """The policy's allowed prefixes, parsed (a prefix that cannot be parsed allows nothing)."""
    out = []
    for prefix in policy.allowed_prefixes:
        try:
            out.append(parse(prefix))
        except ConfigError:
            continue
    return out


def check(source: Source, policy: ShardPolicy, spec: str = "", allowed: list[Source] | None = None) -> None:
    """Raises PermissionDenied unless the operator's policy allows ``source`` (``allowed``: the
    policy's prefixes already parsed, _allowed)."""
    spec = spec or source.location
    if source.scheme not in policy.allowed_schemes:
        hint = (" it runs a program on the server; the operator can allow it with allowed_shard_schemes"
                if source.scheme in PROGRAM_SCHEMES else
                " it reads an object store with the server's credentials; the operator can allow it with "
                "allowed_shard_schemes" if source.scheme in OBJECT_STORE_SCHEMES else
                " allowed_shard_schemes does not list it")
        raise PermissionDenied(f"shard {source.location!r} (from {spec!r}) uses scheme {source.scheme!r}, which this "
                               f"service does not read ({', '.join(policy.allowed_schemes)}):{hint}")
    if not policy.allowed_prefixes:
        return
    if not any(_under(source, prefix) for prefix in (_allowed(policy) if allowed is None else allowed)):
        raise PermissionDenied(f"shard {source.location!r} (from {spec!r}) is outside the prefixes this service may "
                               f"read ({', '.join(policy.allowed_prefixes)}; allowed_shard_prefixes)")


def _under(source: Source, allowed: Source) -> bool:
    if allowed.scheme != source.scheme:
        return False
    base = allowed.location.rstrip("/")
    return source.location == base or source.location.startswith(base + "/")


def _directory_tars(source: Source, spec: str, policy: ShardPolicy, room: int, dirs: dict[str, str] | None = None,
                    allowed: list[Source] | None = None) -> list[str] | FolderNames:
    """A local directory -> its *.tar files (FolderNames, each checked: a symlink inside is
    resolved, since it may point elsewhere); a local file must exist."""
    if not source.is_local:
        return [source.url]
    path = source.location
    if os.path.isdir(path):
        return FolderNames(path, spec, policy, room, dirs, allowed)
    if not os.path.exists(path):
        origin = f" (from {spec!r})" if spec != path else ""
        raise ConfigError(f"shard {path!r} does not exist{origin}")
    refuse_foreign_format(path, spec)
    return [source.url]


READ_FORMATS = ("WebDataset tar shards (.tar, or a .tar compressed with gzip, bzip2 or xz), Hugging Face Parquet "
                "files (.parquet), LLaVA-style JSON or JSON Lines (.json, .jsonl), or a folder of tars or Parquet "
                "files")
"""What a shard spec may name, for error messages."""
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")
_LOOKS_LIKE = ((b"PAR1", "a Parquet file"), (b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"),
               (b"PK\x03\x04", "a zip archive"), (b"\x28\xb5\x2f\xfd", "zstd-compressed"), (b"fLaC", "a FLAC file"),
               (b"RIFF", "a RIFF (WAV/WebP) file"))


def refuse_foreign_format(path: str, spec: str = "") -> None:
    """ConfigError for a local file that is plainly another format (by its first 512 bytes: not a
    tar header with a valid checksum or a compressor's magic, but JSON, text, Parquet, an image,
    a zip ...), naming what it looks like and what is read. An empty, unreadable or unrecognised
    file (a damaged shard) is left to the reader to report."""
    try:  # never blocks: a FIFO or a device is not read here (the reader fails that shard)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        head = os.pread(fd, 512, 0)
    except OSError:
        return
    finally:
        os.close(fd)
    fmt = formats.format_of(path)
    if fmt is not None:  # named as a format we read: it must look like one
        if not head or not fmt.magic or head.lstrip().startswith(fmt.magic):
            return
        raise ConfigError(f"shard {path!r} is named as a {fmt.name} file but does not start like one "
                          f"({head[:16]!r})")
    if not head or head.startswith(_COMPRESSED):
        return
    if len(head) == 512:
        try:
            tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
            return
        except tarfile.HeaderError:
            pass
    text = head.lstrip()
    kind = next((name for magic, name in _LOOKS_LIKE if head.startswith(magic)), None) or (
        "JSON (LLaVA-style instruction data?)" if text[:1] in (b"{", b"[") else
        "text" if all(32 <= c < 127 or c in (9, 10, 13) for c in head) else None)
    if kind is None:  # unknown bytes: a damaged shard, reported by the reader with the rest
        return
    origin = f" (from {spec!r})" if spec and spec != path else ""
    raise ConfigError(f"shard {path!r}{origin} is {kind}, not a format this service reads: {READ_FORMATS}")


# --- names held lazily ------------------------------------------------------------------------

EAGER_NAMES = 4096
"""A pattern part of at most this many names is expanded at once, every name parsed and checked
and every local file looked up. A larger part is kept as its pattern (PatternNames): its names
are made, parsed and checked when asked for (a shard is opened), after a spot check of
SPOT_CHECKS names spread over it; a local name that does not exist is then reported when its
shard is opened (shard_error), not refused with the job."""
SPOT_CHECKS = 64
MAX_FOLDER_CACHE = 1 << 16
"""Most folders whose realpath a PatternNames keeps (a pattern may vary in a folder's name)."""


class PatternNames(ShardNames):
    """The names of one brace pattern (no ``::``), name ``i`` made from the pattern when asked
    for, in the order ``expand`` gives them: O(pattern) memory for any number of names."""

    def __init__(self, tree, count: int, spec: str, policy: ShardPolicy, allowed: list[Source]):
        self._node = _compile(tree)
        if self._node.count != count:
            raise AssertionError(f"pattern {spec!r}: {self._node.count} names counted as {count}")
        self.spec, self.policy, self._allowed = spec, policy, allowed
        self._dirs: dict[str, str] = {}
        self._raw_index: tuple[np.ndarray, np.ndarray] | None = None
        self._spelled_as_made = False
        """Every spot-checked name normalised to its own spelling (spot_check)."""

    def __len__(self) -> int:
        return self._node.count

    def raw(self, i: int) -> str:
        """Name ``i`` as the pattern spells it (before normalising)."""
        return self._node.nth(i)

    def name(self, i: int) -> str:
        if len(self._dirs) > MAX_FOLDER_CACHE:
            self._dirs.clear()
        source = parse(self.raw(i), self.spec, self._dirs)
        check(source, self.policy, self.spec, self._allowed)
        return source.url

    def position(self, url: str) -> int | None:
        """Looked up among the names as the pattern spells them (an index made without parsing a
        name: about 1.5 us per name, once), each hit confirmed by making the name. A pattern whose
        spot-checked names all normalise to themselves is taken to do so everywhere; another one
        falls back to the index of made names (ShardNames.position)."""
        if not self._spelled_as_made:
            return super().position(url)
        if self._raw_index is None:
            self._raw_index = hash_index((self.raw(i) for i in range(len(self))), len(self))
        return self._find(self._raw_index, url)

    def quick_names(self) -> Iterator[str]:
        if not self._spelled_as_made:
            return iter(self)
        simple = self._node.single_range()
        if simple is None:
            return (self.raw(i) for i in range(len(self)))
        before, (a, b, step, width, letters), after = simple
        values = range(a, b + 1, step) if b >= a else range(a, b - 1, -step)
        return (before + (chr(v) if letters else f"{v:0{width}d}" if width else str(v)) + after for v in values)

    def spot_check(self) -> bool:
        """Names spread over the pattern (its first and last among them) made and checked now, so
        a pattern that names what it may not, or local files that are not there, is refused when
        the job opens. True when they are folders: the pattern is then expanded at once. Only a
        pattern of URLs whose checked names are spelled as made is looked up by its spelling (a
        local name may pass through a link anywhere in the pattern)."""
        n = len(self)
        picks = sorted({round(k * (n - 1) / max(1, SPOT_CHECKS - 1)) for k in range(SPOT_CHECKS)})
        urls = [self.name(i) for i in picks]
        local = any(parse(url).is_local for url in urls)
        self._spelled_as_made = not local and all(url == self.raw(i) for url, i in zip(urls, picks))
        for url in urls:  # every one allowed first, then there (and a shard)
            if parse(url).is_local:
                if os.path.isdir(url):
                    return True
                if not os.path.exists(url):
                    raise ConfigError(f"shard {url!r} (from {self.spec!r}) does not exist")
                refuse_foreign_format(url, self.spec)
        return False


class FolderNames(ShardNames):
    """A local folder's *.tar files, sorted, held as one string of their names (not one object
    per file): about 20 bytes per shard of a million. Each is checked when listed (a symlink is
    resolved and its target checked)."""

    def __init__(self, path: str, spec: str, policy: ShardPolicy, room: int, dirs: dict[str, str] | None,
                 allowed: list[Source] | None):
        self.path = path
        names: list[str] = []
        links: list[str] = []
        for suffix in (".tar", *(s for s, fmt in formats.FORMATS.items() if fmt.in_folders)):  # tars, else ...
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.name.endswith(suffix):
                        names.append(entry.name)
                        if entry.is_symlink():
                            links.append(entry.name)
                        if len(names) > room:
                            raise ConfigError(f"shard directory {path!r} holds more than {room} *{suffix} files "
                                              "(max_shards)")
            if names:
                break
        if not names:
            raise ConfigError(f"shard directory {path!r} holds no *.tar or *.parquet file; this service reads "
                              f"{READ_FORMATS}")
        names.sort()
        self._links: dict[int, str] = {}
        for link in links:  # a link may point anywhere: resolved and checked like a named file
            target = parse(os.path.join(path, link), spec, dirs)
            check(target, policy, spec, allowed)
            self._links[bisect.bisect_left(names, link)] = target.url
        for name in names:  # a plain file is checked by its name in the (real) folder
            check(Source("file", os.path.join(path, name)), policy, spec, allowed)
        self._blob = "\0".join(names) + "\0"
        ends = np.cumsum(np.fromiter((len(name) + 1 for name in names), dtype=np.int64, count=len(names)))
        self._starts = np.concatenate(([0], ends)).astype(np.int64)

    def __len__(self) -> int:
        return len(self._starts) - 1

    def name(self, i: int) -> str:
        link = self._links.get(i)
        if link is not None:
            return link
        return os.path.join(self.path, self._blob[int(self._starts[i]):int(self._starts[i + 1]) - 1])


class _Node:
    """A compiled brace pattern: ``count`` names, the ``i``-th by ``nth`` (mixed radix, the last
    group varying fastest, as ``_generate`` orders them)."""

    __slots__ = ("count", "kind", "body", "starts")

    def __init__(self, kind: str, body, count: int, starts=None):
        self.kind, self.body, self.count, self.starts = kind, body, count, starts

    def nth(self, i: int) -> str:
        if self.kind == "lit":
            return self.body
        if self.kind == "range":
            a, b, step, width, letters = self.body
            value = a + (step if b >= a else -step) * i
            return chr(value) if letters else (f"{value:0{width}d}" if width else str(value))
        if self.kind == "alt":
            k = bisect.bisect_right(self.starts, i) - 1
            return self.body[k].nth(i - self.starts[k])
        out = list(self.starts)  # "seq": its literals, a variable item's place empty
        for k, item in self.body:
            i, r = divmod(i, item.count)
            out[k] = item.nth(r)
        return "".join(out)

    def single_range(self) -> tuple[str, tuple, str] | None:
        """(text before, range, text after) of a sequence whose one varying item is a range."""
        if self.kind != "seq" or len(self.body) != 1 or self.body[0][1].kind != "range":
            return None
        k, item = self.body[0]
        return "".join(self.starts[:k]), item.body, "".join(self.starts[k + 1:])


def _compile(seq) -> _Node:
    items = []
    for item in seq:
        if isinstance(item, str):
            items.append(_Node("lit", item, 1))
            continue
        kind, body = item
        if kind == "range":
            items.append(_Node("range", body, _range_len(body)))
            continue
        options = [_compile(option) for option in body]
        starts = [0]
        for option in options:
            starts.append(starts[-1] + option.count)
        items.append(_Node("alt", options, starts[-1], starts[:-1]))
    count = 1
    for node in items:
        count *= node.count
    # a sequence keeps its varying items (last first: the last varies fastest) and its literals in place
    varying = [(k, node) for k, node in enumerate(items) if node.kind != "lit"][::-1]
    literals = [node.body if node.kind == "lit" else "" for node in items]
    return _Node("seq", varying, count, literals)
