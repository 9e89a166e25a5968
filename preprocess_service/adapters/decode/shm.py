"""Same-host delivery: a microbatch handed to a client on this machine in a POSIX shared-memory
object instead of through gRPC (trainer/client.py is the other side).

Over loopback gRPC every microbatch crosses the socket as ~30 MB of HTTP/2 frames: the server's
send, the kernel's two copies, the client's receive and its copy into tensors cost more CPU than
the image decode of a small sample (bench/peers.py). A client on this host instead finds the
serialized Microbatch in ``/dev/shm/dtmb_<random>``: it maps it, unlinks it, and its tensors are
views of that mapping (no copy). The gRPC message carries only the object's name and size.

Who gets it: a client whose StreamRequest names a probe object it created in /dev/shm holding a
random token, when the call comes over loopback and this server reads the same token there (so
the two share /dev/shm and the client's user may read what this server's user writes: objects are
mode 0600). Anything else (another host, another container's /dev/shm, another user, an operator
who turned ``shm_delivery`` off) gets the bytes in the message as before.

Lent objects (Microbatch.shm_token; decode.Lent): the decode workers write a microbatch's media
straight into a shared-memory arena of the decode pool, named like these objects, and the stream
lends that arena to the client instead of copying it (the copy and the fresh pages cost about a
third of the server's CPU in bench/peers.py). The client holds a shared flock on it while its
arrays live and marks it taken; the pool reuses it once it is taken and unlocked, with a new
token in its first bytes (a message naming it then fails the client's check: lost, resumed), and
gives away (unlinks and forgets) the oldest beyond decode.MAX_LENT that a client keeps. Clients
that share the server's user could open any of these objects anyway (/dev/shm is listable): the
boundary is the user, as before.

Bounds: a stream has at most ``window`` objects the client has not unlinked (or taken) yet; the producer
waits for the client beyond that (the gRPC flow control that bounds large messages does not bound
tiny ones), each object is charged to the memory budget until the client unlinks it, and when the
stream ends every object it left is unlinked; a server that was killed leaves those in flight,
and ``sweep_orphans`` (run when a server starts) unlinks the objects of servers that are gone
(names carry the creating pid). Linux only (/dev/shm); elsewhere nothing changes.
"""

from __future__ import annotations

import collections
import hmac
import os
import re
import secrets
import stat
import threading
import time

from disttrain_api import lent
from disttrain_api.errors import ServiceUnavailableError
from preprocess_service.adapters.infra.budget import MemoryBudget

SHM_DIR = "/dev/shm"
PROBE_NAME = re.compile(r"dtprobe_[0-9a-f]{16,64}")
OBJECT_NAME = re.compile(r"dtmb_([0-9a-f]{8})_[0-9a-f]{24}")
"""A microbatch object: the creating server's pid, then random hex."""
MAX_PROBE_BYTES = 64
CONTROL_BYTES = 64
"""A lent object's first bytes (decode.Lent): TOKEN_BYTES of token, then the taken byte."""
TOKEN_BYTES, TAKEN_AT = lent.TOKEN_BYTES, lent.TAKEN_AT


def object_name() -> str:
    """A new object name (OBJECT_NAME): this process's pid, then 24 random hex digits."""
    return f"dtmb_{os.getpid():08x}_{secrets.token_hex(12)}"
_LOOPBACK = re.compile(r"(ipv4:127\.|ipv6:\[::1\]|ipv6:\[::ffff:127\.|unix:)")


def same_host(peer: str, probe_name: str, token: bytes) -> bool:
    """True if the caller (gRPC ``context.peer()``) is on this host and its probe object holds
    ``token``. Reads at most MAX_PROBE_BYTES of a regular file of that exact name pattern, never
    following a link or blocking on a FIFO."""
    if not probe_name or not os.path.isdir(SHM_DIR) or not _LOOPBACK.match(peer or ""):
        return False
    if not PROBE_NAME.fullmatch(probe_name) or not 16 <= len(token) <= MAX_PROBE_BYTES:
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, probe_name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != len(token):
            return False
        return hmac.compare_digest(os.read(fd, MAX_PROBE_BYTES), token)
    except OSError:
        return False
    finally:
        os.close(fd)


class SegmentLedger:
    """The shared-memory objects one stream has handed out and its client has not unlinked yet."""

    def __init__(self, budget: MemoryBudget, window: int, stall_timeout_s: float):
        self.budget, self.window, self.stall_timeout_s = budget, max(1, window), stall_timeout_s
        self._open: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._lent: collections.OrderedDict[str, object] = collections.OrderedDict()
        """Name -> decode.Lent of the lent objects the client has not taken yet."""
        self._lock = threading.Lock()
        self._closed = False
        self.num_created = 0

    def write(self, parts: list, stop: threading.Event) -> tuple[str, int]:
        """A new object holding ``parts`` (bytes-like, concatenated): (its name, its size). Waits
        while ``window`` objects are still unread (ServiceUnavailableError after the stall
        timeout: the client is alive but not reading) and for room in the budget."""
        nbytes = sum(memoryview(p).nbytes for p in parts)
        self.wait_for_room(stop)
        self.budget.reserve(nbytes, what="a microbatch in shared memory", stop=stop)
        name = object_name()
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except BaseException:
            self.budget.release(nbytes)
            raise
        try:  # write(2), not a mapping: the kernel fills fresh pages without a page fault each
            views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
            written = 0
            while views:
                done = os.writev(fd, views[:1024])
                if done <= 0:
                    raise OSError(f"could not write to {path} (tmpfs full?)")
                written += done
                while views and done >= views[0].nbytes:
                    done -= views[0].nbytes
                    views.pop(0)
                if views and done:
                    views[0] = views[0][done:]
            if written != nbytes:
                raise OSError(f"wrote {written} of {nbytes} bytes to {path}")
        except BaseException:
            os.unlink(path)
            self.budget.release(nbytes)
            raise
        finally:
            os.close(fd)
        with self._lock:
            closed = self._closed
            if not closed:
                self._open[name] = nbytes
                self.num_created += 1
        if closed:  # the stream ended while this was written: nobody will take it
            os.unlink(path)
            self.budget.release(nbytes)
            raise ServiceUnavailableError("the stream ended")
        return name, nbytes

    def lend(self, lent, stop: threading.Event) -> None:
        """Counts ``lent`` (a decode.Lent, already in its arena) as handed out until the client
        marks it taken; abandoned at once if the stream has ended (ServiceUnavailableError). The
        caller has waited for room (wait_for_room)."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._lent[lent.name] = lent
                self.num_created += 1
        if closed:
            lent.abandon()
            raise ServiceUnavailableError("the stream ended")

    def wait_for_room(self, stop: threading.Event) -> None:
        """Waits while ``window`` objects are unread (ServiceUnavailableError after the stall
        timeout, or once ``stop`` is set)."""
        if not self._wait(self.window - 1, stop.is_set):
            if stop.is_set():
                raise ServiceUnavailableError("the stream was stopped")
            raise ServiceUnavailableError(f"the client opened none of its {self.window} microbatches in shared "
                                          f"memory for {self.stall_timeout_s:g} s (stream_stall_timeout_s)")

    def wait_taken(self, cancelled) -> bool:
        """At the end of a stream: waits until the client has taken every object (the last ones
        are still on their way when the producer is done), at most the stall timeout or until
        ``cancelled()``; then close() frees what is left."""
        return self._wait(0, cancelled)

    def _wait(self, most: int, cancelled) -> bool:
        """Waits until at most ``most`` objects are untaken: False on cancelled() or the stall timeout."""
        deadline, pause = time.monotonic() + self.stall_timeout_s, 0.001
        while self._prune() > most:
            if cancelled() or time.monotonic() > deadline:
                return False
            time.sleep(pause)  # the client unlinks as it receives: a short wait, only when it is behind
            pause = min(0.02, pause * 2)
        return True

    def _prune(self) -> int:
        """Forgets (and uncharges) the objects the client has unlinked, and the lent ones it has
        taken; returns how many remain."""
        with self._lock:
            gone = [n for n in self._open if not os.path.exists(os.path.join(SHM_DIR, n))]
            for name in gone:
                self.budget.release(self._open.pop(name))
            for name in [n for n, lent in self._lent.items() if lent.taken()]:
                del self._lent[name]
            return len(self._open) + len(self._lent)

    def close(self) -> None:
        """Unlinks every object the client did not take (the stream ended or broke)."""
        with self._lock:
            self._closed = True
            left, self._open = self._open, collections.OrderedDict()
            lent, self._lent = self._lent, collections.OrderedDict()
        for item in lent.values():  # untaken: the pool reuses them (their token changes first)
            item.abandon()
        for name, nbytes in left.items():
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
            self.budget.release(nbytes)


def sweep_orphans(min_age_s: float = 60.0) -> int:
    """Unlinks microbatch objects whose server is gone (no process has their pid) and that are at
    least ``min_age_s`` old: what a killed server left in /dev/shm. Returns how many."""
    if not os.path.isdir(SHM_DIR):
        return 0
    removed, now = 0, time.time()
    for name in os.listdir(SHM_DIR):
        match = OBJECT_NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if info.st_uid != os.getuid() or now - info.st_mtime < min_age_s or _alive(int(match.group(1), 16)):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
