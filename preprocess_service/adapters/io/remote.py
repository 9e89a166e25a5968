"""Remote shards: http(s) through urllib and object stores (s3://, gs://) through fsspec, read
through the shard cache (io/cache.py) and resumed after a dropped connection.

``open_remote`` gives a shard's cached copy (downloading it first when it is not cached: once,
whoever asks) or, when the cache has no room for it, a ``RemoteFile`` streaming it.

``RemoteFile`` reads one remote shard front to back. A transient failure (connection refused or
reset, a timeout, HTTP 408/425/429/5xx, a connection closed before the announced length) is
retried after an exponential backoff (``FetchPolicy``), asking only for the rest
(``Range: bytes=N-`` with ``If-Range``): a 206 must carry a ``Content-Range`` starting at N and
the same total; a server that ignores ranges answers 200 and the bytes already had are read
again and dropped. The shard fails (FetchError naming the URL, the attempts and the cause) after
``retries`` attempts in a row that brought no byte, or ``retry_window_s`` without a byte. Any
other failure is final at once: an HTTP 4xx such as 404, a redirect the shard policy refuses, a
shard that changed (size or ETag/Last-Modified) while it was read, a size above
``max_shard_bytes``. Every socket read has a timeout, and every byte received calls
``progress`` (the reader thread's watchdog in shards.py sees a slow download progressing).

A download into the cache holds room there (reserved from the announced size, evicting other
shards) until it ends, so it must also keep up a minimum throughput: once it has fallen more
than ``retry_window_s`` behind ``min_bytes_per_s`` (fewer than ``min_bytes_per_s * (seconds
since it began - retry_window_s)`` bytes), the shard fails and its room is freed; a server
that trickles a byte at a time cannot keep a reservation indefinitely. A stream (no cache room)
holds nothing shared and is bounded by the reader's watchdog alone. With the cache's per-owner
share (io/cache.py), one job can neither hold nor keep reserved more than its share.

Object stores use the server's own credentials (s3fs: AWS_* variables, ~/.aws; gcsfs: Google
application default credentials), so they are only read when the operator lists the scheme in
allowed_shard_schemes; fsspec runs no program for them (webdataset's gopen would run
``aws``/``gsutil``). Their filesystem is made for the scheme (``fsspec.filesystem``) and given the
plain ``bucket/key``: nothing in a name is read as fsspec URL syntax (``::`` chains, which
sources.parse refuses anyway), and every request has the read timeout (s3fs: botocore's
connect_timeout and read_timeout; gcsfs: aiohttp's sock_connect and sock_read).
"""

from __future__ import annotations

import http.client
import io
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from disttrain_api.errors import ConfigError, PermissionDenied
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.cache import Claim, ShardCache
from preprocess_service.adapters.io.config import READER_DEFAULTS
from preprocess_service.adapters.io.sources import ShardPolicy, Source

log = logging.getLogger(__name__)

"""Schemes read here (and cached); others go to webdataset's gopen when the operator allows them."""
MAX_BACKOFF_S = 8.0
CHUNK_BYTES = 1 << 20
FSSPEC_BLOCK_BYTES = 8 << 20
USER_AGENT = "disttrain-preprocess"
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class ShardReadError(OSError):
    """A shard cannot be opened or read (not a regular file, HTTP error, timeout)."""


class FetchError(ShardReadError):
    """A remote read failed; ``transient`` ones are retried."""

    def __init__(self, message: str, *, transient: bool):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchPolicy:
    """How remote shards are fetched (server settings shard_fetch_*, max_shard_bytes)."""

    retries: int = READER_DEFAULTS.shard_fetch_retries
    """Failed attempts in a row without a byte received before the shard fails."""
    backoff_s: float = READER_DEFAULTS.shard_fetch_backoff_s
    """Wait before the first retry, doubled for each next one (at most MAX_BACKOFF_S)."""
    retry_window_s: float = READER_DEFAULTS.shard_fetch_retry_window_s
    """Seconds without a byte after which no more retries are made."""
    max_shard_bytes: int = READER_DEFAULTS.max_shard_bytes
    """Largest remote shard read (Content-Length or object size; counted when none is given)."""
    min_bytes_per_s: int = READER_DEFAULTS.shard_fetch_min_bytes_per_s
    """Least average throughput of a download into the cache, after a grace of retry_window_s
    (256 KiB/s: a 400 MB shard within about 27 minutes); 0: none."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.retry_window_s <= 0 or self.max_shard_bytes < 1 or \
                self.min_bytes_per_s < 0:
            raise ValueError(f"invalid fetch policy {self}")


@dataclass(slots=True)
class Response:
    """One connection's answer: its body starts at byte ``start`` of the shard."""

    body: Any
    """readinto(buffer) and close()."""
    start: int
    size: int | None
    """The whole shard's bytes, when the server says."""
    validator: str | None = None
    """A strong ETag or Last-Modified: a changed one means the shard changed."""


Connector = Callable[[int, "str | None"], Response]
"""connect(first byte wanted, validator of the first answer) -> Response."""


def _nothing() -> None:
    pass


class RemoteFile(io.RawIOBase):
    """A remote shard from byte ``start`` on, as a read-only stream that survives dropped
    connections (module docstring); bytes received are counted in ``counters``."""

    def __init__(self, url: str, connect: Connector, policy: FetchPolicy, counters: ShardCache, *, start: int = 0,
                 progress: Callable[[], None] = _nothing):
        super().__init__()
        self.url, self._connect_to, self.policy, self.counters = url, connect, policy, counters
        self.position = start
        self.size: int | None = None
        self.validator: str | None = None
        self._progress = progress
        self._body: Any = None
        self._skip = 0
        self._connections = 0
        self._failures = 0
        self._last_byte = time.monotonic()
        self._uncounted = 0
        self._retry(self._connect)  # the first answer tells the size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self.size is not None:
            view = view[:max(0, self.size - self.position)]
        if not len(view):
            return 0
        return self._retry(lambda: self._read(view))

    def _retry(self, attempt: Callable[[], Any]) -> Any:
        while True:
            try:
                return attempt()
            except Exception as exc:
                if not _transient(exc):
                    self._close_body()
                    raise
                self._failed(exc)

    def _read(self, view: memoryview) -> int:
        if self._body is None:
            self._connect()
        while self._skip:  # a server that ignored the range: drop what we had
            got = self._body.readinto(view[:self._skip])
            if not got:
                raise EOFError(f"the connection closed at byte {self.position - self._skip}")
            self._skip -= got
            self._count(got)
        got = self._body.readinto(view)
        if got:
            self.position += got
            self._failures = 0
            self._count(got)
            if self.size is None and self.position > self.policy.max_shard_bytes:
                raise FetchError(f"{self.url} sent more than max_shard_bytes ({self.policy.max_shard_bytes})",
                                 transient=False)
        elif self.size is not None and self.position < self.size:
            raise EOFError(f"the connection closed at byte {self.position} of {self.size}")
        return got

    def _connect(self) -> None:
        answer = self._connect_to(self.position, self.validator)
        self._body = answer.body
        if self._connections == 0:
            self.size, self.validator = answer.size, answer.validator
            if answer.size is not None and answer.size > self.policy.max_shard_bytes:
                raise FetchError(f"{self.url} is {answer.size} bytes, more than max_shard_bytes "
                                 f"({self.policy.max_shard_bytes})", transient=False)
        else:
            changed = (answer.size is not None and self.size is not None and answer.size != self.size) or \
                (answer.validator is not None and self.validator is not None and answer.validator != self.validator)
            if changed:
                raise FetchError(f"{self.url} changed while it was read (size {self.size} -> {answer.size}, "
                                 f"validator {self.validator} -> {answer.validator})", transient=False)
            self.counters.count("resume" if answer.start == self.position else "restart")
        if answer.start > self.position:
            raise FetchError(f"{self.url} answered a request for byte {self.position} with bytes from "
                             f"{answer.start}", transient=False)
        self._skip = self.position - answer.start
        self._connections += 1

    def _failed(self, exc: Exception) -> None:
        self._close_body()
        self._failures += 1
        quiet = time.monotonic() - self._last_byte
        wait = min(self.policy.backoff_s * 2 ** (self._failures - 1), MAX_BACKOFF_S)
        if self._failures > self.policy.retries or quiet + wait > self.policy.retry_window_s:
            self.counters.count("failure")
            raise FetchError(f"cannot fetch {self.url}: {_describe(exc)} (gave up after {self._failures} attempts in a "
                             f"row without a byte, {quiet:.1f} s; shard_fetch_retries {self.policy.retries}, "
                             f"shard_fetch_retry_window_s {self.policy.retry_window_s:g})", transient=False) from None
        self.counters.count("retry")
        log.info("retrying %s in %.2f s at byte %d: %s", self.url, wait, self.position, _describe(exc))
        time.sleep(wait)

    def _count(self, nbytes: int) -> None:
        self._last_byte = time.monotonic()
        self._uncounted += nbytes
        if self._uncounted >= CHUNK_BYTES:
            self._flush_count()
        self._progress()

    def _flush_count(self) -> None:
        if self._uncounted:
            self.counters.count_fetched(self.url, self._uncounted)
            self._uncounted = 0

    def _close_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # closing a broken connection: nothing left to lose
                pass

    def close(self) -> None:
        if not self.closed:
            self._flush_count()
            self._close_body()
        super().close()


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, FetchError):
        return exc.transient
    if isinstance(exc, ShardReadError):
        return False
    return isinstance(exc, (OSError, http.client.HTTPException, EOFError))


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, FetchError) else f"{type(exc).__name__}: {text}"


# --- connectors -------------------------------------------------------------------------------

class CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the shard policy allows."""

    def __init__(self, policy: ShardPolicy):
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            sources.check(sources.parse(newurl), self.policy)
        except (ConfigError, PermissionDenied) as exc:
            raise urllib.error.URLError(f"redirect refused: {exc}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def http_connector(url: str, policy: ShardPolicy, timeout_s: float) -> Connector:
    """Connects to an http(s) shard (redirects checked against ``policy``; ``timeout_s`` per
    socket operation)."""
    opener = urllib.request.build_opener(CheckedRedirects(policy))

    def connect(start: int, validator: str | None) -> Response:
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
            if validator:
                headers["If-Range"] = validator
        try:
            answer = opener.open(urllib.request.Request(url, headers=headers), timeout=timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()
            transient = exc.code in (408, 425, 429) or exc.code >= 500
            raise FetchError(f"cannot fetch {url}: HTTP {exc.code} {exc.reason}", transient=transient) from None
        except urllib.error.URLError as exc:
            transient = isinstance(exc.reason, OSError)
            raise FetchError(f"cannot fetch {url}: {exc.reason}", transient=transient) from None
        except ValueError as exc:
            raise FetchError(f"cannot fetch {url}: {exc}", transient=False) from None
        try:
            return _http_response(url, answer, start)
        except BaseException:
            answer.close()
            raise

    return connect


def _http_response(url: str, answer, start: int) -> Response:
    length = _length(url, answer.headers.get("Content-Length"))
    etag = answer.headers.get("ETag")
    validator = etag if etag and not etag.startswith("W/") else answer.headers.get("Last-Modified")
    if answer.status == 200:
        return Response(_HttpBody(answer), 0, length, validator)
    if answer.status == 206 and start:
        match = _CONTENT_RANGE.match(answer.headers.get("Content-Range", "").strip())
        if not match or int(match.group(1)) != start:
            raise FetchError(f"{url} answered a range request from byte {start} with Content-Range "
                             f"{answer.headers.get('Content-Range')!r}", transient=False)
        total = None if match.group(3) == "*" else int(match.group(3))
        if length is not None and length != int(match.group(2)) - start + 1:
            raise FetchError(f"{url}: Content-Length {length} does not match Content-Range "
                             f"{answer.headers.get('Content-Range')!r}", transient=False)
        return Response(_HttpBody(answer), start, total, validator)
    raise FetchError(f"cannot fetch {url}: unexpected HTTP {answer.status}", transient=False)


class _HttpBody:
    """An HTTP response body read as it arrives: one read never waits for more than one socket
    receive (``read1``), so a timeout loses nothing already received and progress is seen often."""

    def __init__(self, answer):
        self.answer = answer

    def readinto(self, view) -> int:
        data = self.answer.read1(len(view))
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.answer.close()


def _length(url: str, value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit():
        raise FetchError(f"{url} sent Content-Length {value!r}, not a number of bytes", transient=False)
    return int(value)


def store_options(scheme: str, timeout_s: float) -> dict[str, Any]:
    """The fsspec filesystem options of an object store: ``timeout_s`` for connecting and for
    each read (options the operator set in fsspec's config for the scheme win)."""
    import fsspec.config

    aliases = ("gcs", "gs") if scheme == "gs" else (scheme,)  # gcsfs answers to both
    configured = {key: value for alias in aliases for key, value in fsspec.config.conf.get(alias, {}).items()}
    if scheme == "s3":  # s3fs -> botocore.config.Config
        return {"config_kwargs": {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                                  **configured.get("config_kwargs", {})}}
    if scheme == "gs" and "requests_timeout" not in configured:  # gcsfs: for every aiohttp request; none by default
        import aiohttp  # gcsfs's own dependency

        return {"requests_timeout": aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)}
    return {}


def fsspec_connector(source: Source, timeout_s: float) -> Connector:
    """Connects to an object (s3://bucket/key, gs://bucket/key; sources.parse normalised it)
    through fsspec, ``timeout_s`` per request."""
    location = source.location
    path = location[len(source.scheme) + len("://"):]  # bucket/key
    try:
        import fsspec

        fs = fsspec.filesystem(source.scheme, **store_options(source.scheme, timeout_s))
    except ImportError as exc:
        raise FetchError(f"cannot read {location}: {exc} (pip install 'disttrain[remote]' installs fsspec, s3fs "
                         "and gcsfs)", transient=False) from None
    except (ValueError, TypeError) as exc:
        raise FetchError(f"cannot read {location}: {exc}", transient=False) from None

    def connect(start: int, validator: str | None) -> Response:
        try:
            info = fs.info(path)
            f = fs.open(path, "rb", block_size=FSSPEC_BLOCK_BYTES, cache_type="readahead")
            f.seek(start)
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            raise FetchError(f"cannot read {location}: {type(exc).__name__}: {exc}", transient=False) from None
        except Exception as exc:  # the store's client raises its own types (botocore, aiohttp): retried, bounded
            if isinstance(exc, MemoryError):
                raise
            raise FetchError(f"cannot read {location}: {type(exc).__name__}: {exc}", transient=True) from None
        size = info.get("size")
        tag = info.get("ETag") or info.get("etag")
        return Response(_ObjectBody(f, location), start, int(size) if size is not None else None,
                        str(tag) if tag else None)

    return connect


class _ObjectBody:
    """An fsspec file whose read errors (of whatever client type) become transient FetchErrors."""

    def __init__(self, f, location: str):
        self.f, self.location = f, location

    def readinto(self, view) -> int:
        try:
            return self.f.readinto(view)
        except (MemoryError, FetchError):
            raise
        except Exception as exc:
            raise FetchError(f"reading {self.location}: {type(exc).__name__}: {exc}", transient=True) from None

    def close(self) -> None:
        self.f.close()


# --- through the cache ------------------------------------------------------------------------

@dataclass(slots=True)
class Opened:
    """An open shard positioned at the byte asked for."""

    file: Any
    path: str | None
    """A local file (the shard itself or its cached copy, pinned while open); None: streamed."""
    positioned: bool = True
    """False for streams that cannot start mid-shard (webdataset's gopen): the caller skips samples."""


@contextmanager
def open_remote(source: Source, connect: Connector, *, cache: ShardCache, fetch: FetchPolicy, timeout_s: float,
                progress: Callable[[], None] = _nothing, start: int = 0, owner: str | None = None) -> Iterator[Opened]:
    """``source`` from byte ``start`` through ``connect`` (its scheme's: schemes/http.py,
    object_store.py): its cached copy (downloaded first if needed), or a stream when the cache has
    no room for it, or none within ``owner``'s share (counted ``bypass``)."""
    url = source.url
    got = cache.acquire(url, progress, timeout_s, owner=owner)
    if isinstance(got, str):
        yield from _cached(cache, url, got, start, owner)
        return
    try:
        remote = RemoteFile(url, connect, fetch, cache, progress=progress)
    except Exception as exc:
        got.abandon(exc)
        raise
    try:
        path = _download(got, remote, cache) if remote.size is not None and got.reserve(remote.size) else None
    except BaseException as exc:  # the claim ends whatever happened (abandoning it twice does nothing)
        got.abandon(exc)
        raise
    if path is not None:
        yield from _cached(cache, url, path, start, owner)
        return
    got.abandon(None)
    cache.count("bypass")
    if remote.size is not None and remote.size > cache.max_bytes > 0:
        log.warning("shard %s (%d bytes) is larger than the shard cache (%d bytes, shard_cache_bytes): streamed "
                    "uncached, and fetched again by every read", url, remote.size, cache.max_bytes)
    if start or remote.position:
        remote.close()
        remote = RemoteFile(url, connect, fetch, cache, start=start, progress=progress)
    with remote:
        yield Opened(remote, None)


def _cached(cache: ShardCache, url: str, path: str, start: int, owner: str | None) -> Iterator[Opened]:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            yield Opened(f, path)
    finally:
        cache.release(url, owner)


def _download(claim: Claim, remote: RemoteFile, cache: ShardCache) -> str | None:
    """Copies ``remote`` into the claimed cache file; the cached path (pinned), or None when the
    local disk refused it (the caller streams instead). A fetch error abandons the claim and is raised."""
    cache.count("miss")
    assert claim.temp_path is not None
    began = time.monotonic()
    try:
        with remote, open(claim.temp_path, "wb") as out:
            while chunk := _read_chunk(remote, claim):
                out.write(chunk)
                claim.touch()
                _keep_up(remote, began, cache)
        path = claim.commit()
    except FetchError as exc:
        claim.abandon(exc)
        raise
    except OSError as exc:  # the local disk: full, read-only, removed (also by the cache's close)
        if cache.disk_outage(True) == 0:  # said once per outage, not once per download
            log.warning("cannot cache %s in %s (%s); it is streamed uncached, as is every later download the disk "
                        "refuses (counted as bypass, not logged) until one is cached again", claim.url,
                        claim.temp_path, exc)
        claim.abandon(None)
        return None
    except BaseException as exc:
        claim.abandon(exc)
        raise
    failed = cache.disk_outage(False)
    if failed:
        log.warning("the shard cache's disk takes downloads again, after %d it could not", failed)
    return path


def _keep_up(remote: RemoteFile, began: float, cache: ShardCache) -> None:
    """Fails a download into the cache that fell more than retry_window_s behind min_bytes_per_s."""
    policy = remote.policy
    elapsed = time.monotonic() - began
    if policy.min_bytes_per_s and elapsed > policy.retry_window_s + remote.position / policy.min_bytes_per_s:
        cache.count("failure")
        raise FetchError(f"{remote.url} came at {remote.position / elapsed:.0f} bytes/s ({remote.position} of "
                         f"{remote.size} bytes in {elapsed:.1f} s), below shard_fetch_min_bytes_per_s "
                         f"({policy.min_bytes_per_s}) for more than shard_fetch_retry_window_s "
                         f"({policy.retry_window_s:g} s): given up", transient=False)


def _read_chunk(remote: RemoteFile, claim: Claim) -> bytes:
    try:
        return remote.read(CHUNK_BYTES)
    except OSError as exc:
        if isinstance(exc, FetchError):
            raise
        raise FetchError(f"cannot fetch {claim.url}: {_describe(exc)}", transient=False) from None
