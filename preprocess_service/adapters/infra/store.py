"""Redis adapter: the state that lets several service replicas serve one job.

Keys of a job (the ``{job_id}`` hash tag keeps a job on one Redis Cluster slot):

  disttrain:jobs                     set of job ids (the registry)
  disttrain:{J}:spec                 the normalised JobSpec, serialized (the job's identity)
  disttrain:{J}:owner                the client identity (a token digest with auth on) that opened it first
  disttrain:{J}:plan:K               committed plan of step K (plan_record bytes); written once, with SET NX,
                                     before any replica streams any of it
  disttrain:{J}:frontier             steps 0..frontier-1 are committed
  disttrain:{J}:done                 number of steps, once planning has reached the end
  disttrain:{J}:state                hash step -> planner state (JSON) before that step, every few steps: a
                                     planner that takes over loads the newest one at or before the frontier
  disttrain:{J}:wants                the highest step a stream waits for (sorted set, member "max")
  disttrain:{J}:wake                 list a waiting stream pushes to, the planner blocks on (BLPOP)
  disttrain:{J}:planner              planning lease: the token of the replica that plans ahead (PX expiry)
  disttrain:{J}:rank:R               step lease of rank R's stream: JSON {replica, stream, step} (PX expiry)
  disttrain:{J}:fence:R              incremented by every new stream of rank R; an older stream that sees a
                                     newer value stops (only one stream per rank is ever served)
  disttrain:{J}:acks                 hash rank -> next step every earlier step of which is checkpointed
  disttrain:{J}:skipped              hash sample key -> JSON SkippedRecord
  disttrain:{J}:counters             hash: planned_samples, sent_microbatches

Every public method is one round trip (a pipeline or a Lua script), so the round trips per step
are constant whatever the data set size; ``stats()`` counts commands and round trips.

Transient faults are retried with capped exponential backoff: Redis unreachable or timing out, and
the replies of a Redis that will serve again (OOM under maxmemory, READONLY from a replica not yet
promoted, LOADING, BUSY, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, NOREPLICAS, NOSCRIPT after a restart).
A call retries until it succeeds, its ``stop`` event is set or its deadline passes (``deadline_s``,
else the store's ``retry_deadline_s``, 30 s by default): then it raises ServiceUnavailableError
naming the address, the error and how long it retried. Streams pause through short faults and fail
with UNAVAILABLE (the client reconnects) through long ones. Any other error reply (WRONGTYPE, a
syntax error) is a bug: it is raised at once, not retried.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable
from urllib.parse import unquote, urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from disttrain_api.errors import ServiceUnavailableError
from preprocess_service.adapters.infra.metrics import REDIS_LATENCY

log = logging.getLogger(__name__)

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.exceptions.ReadOnlyError,
              redis.exceptions.OutOfMemoryError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
              redis.exceptions.NoScriptError)
"""Redis away, loading its AOF, a replica not yet promoted, full (maxmemory), a cluster failing over
(MasterDownError is a ClusterDownError), or a script cache emptied by a restart between a
pipeline's SCRIPT LOAD and its EVALSHA: wait, it comes back."""

_TRANSIENT_CODES = frozenset({"OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN",
                              "NOREPLICAS", "NOSCRIPT"})
"""Error replies of a Redis that will serve again; redis-py has no class for BUSY and NOREPLICAS."""

_REFUSING_WRITES = frozenset({"OOM", "READONLY", "NOREPLICAS"})

# An error code is the first word of a reply; redis-py's pipelines prefix the reply with
# "Command # N (...) of pipeline caused error: ", and a script's error before Redis 7 nests it
# as "...: -OOM ...". BUSYGROUP (a consumer group exists) is not BUSY: whole words only.
_CODE = re.compile(r"(?:^|caused error: |: -)([A-Z]+)\b")

# Commit step K if nobody has: plan, counters, skipped samples; renew the planning lease if the
# caller holds it. The frontier only moves over contiguous steps (K == frontier), so every step
# below it has a plan: a late commit landing in a Redis that lost its data (restarted without AOF)
# cannot make the steps before it look dropped. KEYS: plan, frontier, counters, skipped, planner.
# ARGV: plan bytes, step, num samples, token, ttl ms, then pairs of (skipped key, record JSON).
# Returns 1 if this call committed the step.
_COMMIT = """
if redis.call('GET', KEYS[5]) == ARGV[4] then redis.call('PEXPIRE', KEYS[5], ARGV[5]) end
local fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX')
for i = 6, #ARGV, 2 do redis.call('HSETNX', KEYS[4], ARGV[i], ARGV[i + 1]) end
local frontier = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[2]) == frontier then redis.call('SET', KEYS[2], frontier + 1) end
if not fresh then return 0 end
redis.call('HINCRBY', KEYS[3], 'planned_samples', ARGV[3])
return 1
"""

# Planning reached the end: KEYS done, frontier; ARGV number of steps. Only once all are committed.
_DONE = """
if tonumber(redis.call('GET', KEYS[2]) or '0') ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return 1
"""

# Take or keep a lease: KEYS[1] lease, ARGV token, ttl ms. Returns 1 if the caller holds it now.
_ACQUIRE = """
local owner = redis.call('GET', KEYS[1])
if owner == false or owner == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# Give a lease back only if held: KEYS[1] lease, ARGV token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Acknowledge: KEYS acks, ARGV rank, next_step, dp_size. Keeps the max per rank; returns the min over
# all dp_size ranks (0 while some rank has not acknowledged).
_ACK = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > old then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
local values = redis.call('HVALS', KEYS[1])
if #values < tonumber(ARGV[3]) then return 0 end
local low = nil
for _, v in ipairs(values) do local n = tonumber(v); if low == nil or n < low then low = n end end
return low
"""

# Want: KEYS wants, wake, ARGV step. Raises the furthest step read; only a new furthest step wakes
# the planner (ranks reading the same step wake it once).
_WANT = """
if redis.call('ZADD', KEYS[1], 'GT', 'CH', ARGV[1], 'max') == 1 then
  redis.call('LPUSH', KEYS[2], 1)
  redis.call('LTRIM', KEYS[2], 0, 0)
end
return 0
"""


def _codes(exc: redis.RedisError) -> set[str]:
    """The error codes of ``exc`` (redis-py moves the ones it knows out of the message)."""
    codes = set(_CODE.findall(str(exc)))
    if getattr(exc, "status_code", None):
        codes.add(exc.status_code)
    return codes


def _transient(exc: redis.RedisError) -> bool:
    return isinstance(exc, _RETRYABLE) or bool(_codes(exc) & _TRANSIENT_CODES)


def _error_text(exc: redis.RedisError) -> str:
    """``exc`` as Redis said it: redis-py strips the code (OOM, READONLY...) off a reply it knows;
    put it back where the reply starts (after a pipeline's "Command # N (...) caused error: ")."""
    text, code = str(exc) or type(exc).__name__, getattr(exc, "status_code", None)
    head, sep, reply = text.rpartition("caused error: ")
    return f"{head}{sep}{code} {reply}" if code and not reply.startswith(code) else text


def _failure(exc: redis.RedisError) -> str:
    """What Redis did, for messages."""
    if _codes(exc) & _REFUSING_WRITES:
        return "refused writes"
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and not isinstance(exc, redis.BusyLoadingError):
        return "was unreachable"
    return "was not serving"


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_WATCH_S = 0.2
"""How often a replica on Sentinels asks them where the primary is (RedisStore._watch_primary)."""
FAILOVER_WAIT_S = 10.0
"""How much longer than its deadline a call waits while the Sentinels say the primary is down or
being replaced (RedisStore._failing_over): a fault every replica sees, so a stream waits for the
new primary rather than fail and send its client to another replica, which would wait as well."""
_FAILOVER_FLAGS = frozenset({"s_down", "o_down", "failover_in_progress"})


def sentinel_target(url: str) -> tuple[list[tuple[str, int]], str, int, str | None, str | None]:
    """(sentinels, master name, db, username, password) of
    ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]`` (port 26379 by
    default): the replicas ask the Sentinels where the primary is, and again after a failover."""
    parsed = urlparse(url)
    auth, at, netloc = parsed.netloc.rpartition("@")
    user, _, password = auth.partition(":") if at else ("", "", "")
    sentinels = []
    for host in netloc.split(","):
        name, colon, port = host.rpartition(":") if not host.endswith("]") else ("", "", "")
        if not colon:
            name, port = host, ""
        if not name.strip("[]") or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
            sentinels = []
            break
        sentinels.append((name.strip("[]"), int(port) if port else 26379))
    parts = [p for p in parsed.path.split("/") if p]
    if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()) or parsed.query:
        raise ValueError(f"a Sentinel URL is {SENTINEL_SCHEMES[0]}://HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB], "
                         f"got {describe(url)!r}")
    return (sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, unquote(user) or None,
            unquote(password) or None)


def describe(url: str) -> str:
    """The Redis address of ``url`` without a password, for messages."""
    parsed = urlparse(url)
    if parsed.scheme in SENTINEL_SCHEMES:
        return f"{parsed.scheme}://{parsed.netloc.rpartition('@')[2]}{parsed.path or ''}"
    return f"{parsed.scheme}://{parsed.hostname or 'localhost'}:{parsed.port or 6379}{parsed.path or ''}"


def _connect(url: str, **options) -> redis.Redis:
    """A client of ``url``: a plain Redis (redis://, rediss://, unix://) or the primary that
    Sentinels name (redis+sentinel://)."""
    if urlparse(url).scheme not in SENTINEL_SCHEMES:
        return redis.Redis.from_url(url, **options)
    from redis.connection import SSLConnection
    from redis.sentinel import Sentinel, SentinelManagedConnection

    class PrimaryConnection(SentinelManagedConnection):
        """redis-py's Sentinel connection asks where the primary is in connect(), but a connection
        dropped mid-call is connected again by send_command without asking, to the address it had:
        the old primary after a failover. Here every connect asks."""

        def _connect_retry(self):
            if self._sock:
                return
            self.connect_check_health(check_health=self.connection_pool.check_connection,
                                      retry_socket_connect=False)

        def connect_check_health(self, *args, **kwargs):
            if self._sock is None:
                self.host, self.port = self.connection_pool.get_master_address()
            return super().connect_check_health(*args, **kwargs)

    class PrimarySSLConnection(PrimaryConnection, SSLConnection):
        pass

    sentinels, master, db, username, password = sentinel_target(url)
    ssl = urlparse(url).scheme.startswith("rediss")
    lookup = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout")}
    # one try per Sentinel per lookup (redis-py's default retries would stretch the caller's deadline)
    sentinel_options = {**lookup, "retry": Retry(NoBackoff(), 0)}
    return Sentinel(sentinels, sentinel_kwargs=sentinel_options, ssl=ssl, **lookup).master_for(
        master, db=db, username=username, password=password,
        connection_class=PrimarySSLConnection if ssl else PrimaryConnection, **options)


def _watch_primary(ref: weakref.ref, closing: threading.Event) -> None:
    """Asks the Sentinels where the primary is every SENTINEL_WATCH_S and cuts the store's calls
    waiting on any other address (a failover, even one before the first look): each fails at once,
    and its retry connects to the new primary, rather than wait out its socket timeout on one that
    is gone (redis-py drops the idle connections itself). Ends with the store (``ref``) or
    ``closing``; an unexpected error is logged once and the watch goes on."""
    known, failing = None, False
    while not closing.wait(SENTINEL_WATCH_S):
        store = ref()
        if store is None:
            return
        try:
            pool = store._redis.connection_pool
            try:
                primary = pool.get_master_address()
            except (redis.RedisError, OSError):
                continue  # none named (a failover under way) or no Sentinel answered: asked again
            cut = _cut_connections(pool, primary)
            if cut or (known is not None and primary != known):
                store._primary_moved()  # calls pausing between tries go to it now
            if known is not None and primary != known:
                log.warning("Redis at %s: the Sentinels name a new primary, %s:%s (was %s:%s); %d call(s) waiting "
                            "on the old one cut short", store.address, *primary, *known, cut)
            known, failing = primary, False
        except Exception:
            if not failing:
                log.exception("Redis at %s: watching the Sentinels for a new primary failed; trying again",
                              store.address)
            failing = True
        finally:
            del store


def _cut_connections(pool, primary: tuple[str, int]) -> int:
    """Shuts down the sockets of ``pool``'s connections in use that are not to ``primary`` (the
    thread using each gets a connection error and its retry reconnects); how many. Uses redis-py's
    pool internals (tests/unit/preprocess_service/adapters/test_store_internals.py checks them)."""
    in_use = list(pool._get_in_use_connections())  # a copy, taken under the pool's lock
    cut = 0
    for connection in in_use:
        sock = getattr(connection, "_sock", None)
        if sock is not None and (connection.host, connection.port) != tuple(primary):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
    return cut


class RedisStore:
    """One replica's connection to the job state in Redis (thread-safe: redis-py pools connections)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, socket_timeout_s: float = 10.0,
                 retry_deadline_s: float = 30.0, quiet_retries: int = 1):
        self.url = url
        self.address = describe(url)
        self.retry_deadline_s, self.socket_timeout_s = retry_deadline_s, socket_timeout_s
        # redis-py's own retries (10 by default, up to seconds apart) would hide faults from _call
        # and stretch its deadline: one at once (``quiet_retries``) replaces a pooled connection
        # Redis closed while idle, anything longer is _call's to back off from, count and bound.
        # redis-py retries a failed connect and then the command, each that many times: a silent
        # partition costs (1 + 2 * quiet_retries) timeouts before _call sees it.
        self._redis = _connect(url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                               health_check_interval=30, retry=Retry(NoBackoff(), quiet_retries))
        try:
            self._redis.ping()
        except _RETRYABLE + (redis.ResponseError, OSError) as exc:
            raise ServiceUnavailableError(f"cannot reach Redis at {self.address}: {exc}") from None
        self._commit = self._redis.register_script(_COMMIT)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._ack = self._redis.register_script(_ACK)
        self._done = self._redis.register_script(_DONE)
        self._want = self._redis.register_script(_WANT)
        self._lock = threading.Lock()
        self._stats = {"commands": 0, "round_trips": 0, "retries": 0}
        self._down_since: float | None = None
        self._said_failover = False
        self._moved = threading.Condition()
        self._primaries_seen = 0  # bumped by _primary_moved: a pause between tries ends
        self._closing = threading.Event()
        if urlparse(url).scheme in SENTINEL_SCHEMES:  # holds no reference: it ends with the store
            threading.Thread(target=_watch_primary, args=(weakref.ref(self), self._closing),
                             name="redis-primary-watch", daemon=True).start()

    def impatient(self, timeout_s: float, *, retry_deadline_s: float | None = None) -> RedisStore:
        """The same Redis with every try bounded by about ``timeout_s`` (the connect, each reply and,
        unless ``retry_deadline_s`` says otherwise, the retries): a silent partition or a primary
        gone in a failover fails a try in that time, not the socket timeout's 10 s. For streams (a
        client moves to another replica rather than wait out a fault that may be this replica's
        alone) and, with a longer ``retry_deadline_s``, the planner (it tries again at once, on the
        primary the Sentinels name)."""
        # no quiet retries (each would add a timeout unseen): a try is one connect or one reply, so
        # a silent partition fails a read (half of ``timeout_s``) and then connects (a quarter each:
        # a connect to a primary gone in a failover gives way sooner to one the Sentinels name)
        clone = RedisStore(self.url, connect_timeout_s=timeout_s / 4, socket_timeout_s=timeout_s / 2,
                           retry_deadline_s=timeout_s if retry_deadline_s is None else retry_deadline_s,
                           quiet_retries=0)
        clone._stats, clone._lock = self._stats, self._lock  # one replica's counts, whichever pool
        return clone

    # --- plumbing -----------------------------------------------------------------------------
    def _call(self, fn: Callable, *, commands: int, stop: threading.Event | None = None,
              deadline_s: float | None = None):
        """Runs ``fn(redis)`` (one round trip of ``commands`` commands), retrying transient faults
        for up to ``deadline_s`` (default ``retry_deadline_s``). ``fn`` runs again as a whole: a
        pipeline one command of which got OOM or READONLY raises (redis-py raises a pipeline's first
        error reply) and is sent again with its other commands. That is safe: a refused command had
        no effect, a script that fails on its first write has none either, and every round trip
        here is idempotent or harmless to repeat (see each method)."""
        deadline_s = self.retry_deadline_s if deadline_s is None else deadline_s
        start, delay = time.monotonic(), 0.05
        while True:
            try:
                seen = self._primaries_seen  # before the try: a primary named during it ends the pause
                began = time.perf_counter()
                result = fn(self._redis)
                REDIS_LATENCY.observe(time.perf_counter() - began)
            except redis.RedisError as exc:
                if not _transient(exc):
                    raise  # WRONGTYPE, a syntax error...: a bug, retrying cannot help
                self._note_fault(exc, deadline_s)
                self._pause(self._pause_or_give_up(exc, start, delay, stop, deadline_s), stop, seen)
                delay = min(delay * 2, 2.0)
                continue
            self._note_success(commands)
            return result

    def _pause(self, seconds: float, stop: threading.Event | None, seen: int) -> None:
        """Waits ``seconds`` between tries, less once ``stop`` is set or the Sentinels name a new
        primary after ``seen`` (the backoff grows to 2 s: a failover that ends just after a try
        would otherwise leave the next one up to 2 s late)."""
        end = time.monotonic() + seconds
        with self._moved:
            while (left := end - time.monotonic()) > 0 and self._primaries_seen == seen:
                if stop is not None and stop.is_set():
                    return
                # ``stop`` is set elsewhere, without this condition: looked at every 50 ms
                self._moved.wait(left if stop is None else min(left, 0.05))

    def _failing_over(self) -> bool:
        """Whether a Sentinel this replica reaches says the primary is down or being replaced
        (its flags: s_down, o_down, failover_in_progress). Then the fault is Redis's own, not this
        replica's link to it (a replica cut off reaches no Sentinel, or one that sees the primary
        well). Never with a plain Redis URL. Logged once per outage."""
        pool = self._redis.connection_pool
        manager = getattr(pool, "sentinel_manager", None)
        if manager is None:
            return False
        for sentinel in manager.sentinels:
            try:
                flags = sentinel.sentinel_master(pool.service_name).get("flags", "")
            except (redis.RedisError, OSError, AttributeError):
                continue  # that Sentinel cannot say: the next one may
            flags = set(flags) if isinstance(flags, (set, frozenset)) else set(str(flags).split(","))
            under_way = bool(flags & _FAILOVER_FLAGS)
            with self._lock:
                first, self._said_failover = under_way and not self._said_failover, self._said_failover or under_way
            if first:
                log.warning("Redis at %s: the Sentinels say the primary is down (%s); calls wait up to %g s more "
                            "for the one they promote", self.address, ",".join(sorted(flags & _FAILOVER_FLAGS)),
                            FAILOVER_WAIT_S)
            return under_way
        return False

    def _primary_moved(self) -> None:
        """The Sentinels name a primary other than the one calls were on (_watch_primary)."""
        with self._moved:
            self._primaries_seen += 1
            self._moved.notify_all()

    def _note_fault(self, exc: redis.RedisError, deadline_s: float) -> None:
        with self._lock:
            self._stats["retries"] += 1
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:  # once per outage, not once per retry
            log.warning("Redis at %s %s (%s); pausing and retrying for up to %g s",
                        self.address, _failure(exc), _error_text(exc), deadline_s)

    def _pause_or_give_up(self, exc: redis.RedisError, start: float, delay: float,
                          stop: threading.Event | None, deadline_s: float) -> float:
        """How long to wait before the next try: ``delay``, cut short so that the last try falls on
        the deadline. Raises ServiceUnavailableError once the caller stopped or the deadline passed."""
        elapsed = time.monotonic() - start
        if stop is not None and stop.is_set():
            raise ServiceUnavailableError(f"Redis at {self.address} {_failure(exc)} when the call was stopped "
                                          f"after {elapsed:.1f} s: {_error_text(exc)}") from None
        # no try starts at the deadline: one failing there would overrun it by its own timeouts
        if elapsed + min(delay, 0.05) >= deadline_s:
            if elapsed < deadline_s + FAILOVER_WAIT_S and self._failing_over():
                return min(delay, 0.2)  # a new primary named ends the pause at once (_pause)
            raise ServiceUnavailableError(f"Redis at {self.address} {_failure(exc)} for {elapsed:.1f} s of retries "
                                          f"(deadline {deadline_s:g} s): {_error_text(exc)}") from None
        return min(delay, deadline_s - elapsed)

    def _note_success(self, commands: int) -> None:
        with self._lock:
            self._stats["commands"] += commands
            self._stats["round_trips"] += 1
            if self._down_since is not None:
                log.warning("Redis at %s is back after %.1f s", self.address, time.monotonic() - self._down_since)
                self._down_since = None
                self._said_failover = False

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        self._closing.set()
        self._redis.close()
        self._redis.connection_pool.disconnect()
        manager = getattr(self._redis.connection_pool, "sentinel_manager", None)
        for sentinel in manager.sentinels if manager is not None else ():
            sentinel.close()

    @staticmethod
    def _key(job_id: str, *parts) -> str:
        return ":".join(("disttrain", "{" + job_id + "}", *map(str, parts)))

    # --- registry -----------------------------------------------------------------------------
    def register_job(self, job_id: str, spec: bytes, *, deadline_s: float | None = None) -> None:
        def run(r):
            pipe = r.pipeline(transaction=False)
            pipe.set(self._key(job_id, "spec"), spec, nx=True)
            pipe.sadd("disttrain:jobs", job_id)
            pipe.execute()
        self._call(run, commands=2, deadline_s=deadline_s)

    def job_owner(self, job_id: str, claim: str = "", *, deadline_s: float | None = None) -> str:
        """The identity that opened the job first, on any replica; ``claim`` becomes it if none has."""
        def run(r):
            pipe = r.pipeline(transaction=False)
            if claim:
                pipe.set(self._key(job_id, "owner"), claim, nx=True)
            pipe.get(self._key(job_id, "owner"))
            return pipe.execute()[-1]
        owner = self._call(run, commands=2 if claim else 1, deadline_s=deadline_s)
        return owner.decode() if owner else ""

    def job_spec(self, job_id: str, *, deadline_s: float | None = None) -> bytes | None:
        return self._call(lambda r: r.get(self._key(job_id, "spec")), commands=1, deadline_s=deadline_s)

    # --- plans --------------------------------------------------------------------------------
    def read_plan(self, job_id: str, step: int, *, want: bool = False,
                  stop=None) -> tuple[bytes | None, int, int | None]:
        """(committed plan of ``step`` or None, frontier, number of steps or None while planning).
        ``want`` also tells the planner that a stream reads ``step`` (it keeps its lookahead beyond
        the furthest step read) and wakes it."""
        def run(r):
            pipe = r.pipeline(transaction=False)  # frontier first: a commit landing in between is harmless
            pipe.get(self._key(job_id, "frontier"))
            pipe.get(self._key(job_id, "plan", step))
            pipe.get(self._key(job_id, "done"))
            if want:
                self._want(keys=[self._key(job_id, "wants"), self._key(job_id, "wake")], args=[step], client=pipe)
            return pipe.execute()
        frontier, plan, done, *_ = self._call(run, commands=4 if want else 3, stop=stop)
        return plan, int(frontier or 0), None if done is None else int(done)

    def planner_view(self, job_id: str, token: str, ttl_s: float, *,
                     stop=None) -> tuple[bool, int, int, int | None]:
        """Takes or renews the planning lease for ``token``; returns (held, frontier, highest step a
        stream waits for or -1, number of steps or None while planning)."""
        def run(r):
            pipe = r.pipeline(transaction=False)
            self._acquire(keys=[self._key(job_id, "planner")], args=[token, int(ttl_s * 1000)], client=pipe)
            pipe.get(self._key(job_id, "frontier"))
            pipe.zscore(self._key(job_id, "wants"), "max")
            pipe.get(self._key(job_id, "done"))
            return pipe.execute()
        held, frontier, want, done = self._call(run, commands=4, stop=stop)
        return (bool(held), int(frontier or 0), -1 if want is None else int(want),
                None if done is None else int(done))

    def wait_for_want(self, job_id: str, timeout_s: float, *, stop=None) -> None:
        """Blocks until a stream wants a plan (read_plan with want) or ``timeout_s`` passes (held
        below the socket timeout, which would take a longer wait for a dead link)."""
        timeout_s = max(0.05, min(timeout_s, 0.6 * self.socket_timeout_s))
        self._call(lambda r: r.blpop([self._key(job_id, "wake")], timeout=timeout_s), commands=1, stop=stop)

    def resume_state(self, job_id: str, *, stop=None) -> bytes | None:
        """The planner state a new planner continues from: the newest stored at or before the
        frontier (None: start at step 0). Two round trips: the steps, then that one state."""
        def steps(r):
            pipe = r.pipeline(transaction=False)
            pipe.get(self._key(job_id, "frontier"))
            pipe.hkeys(self._key(job_id, "state"))
            return pipe.execute()
        frontier, stored = self._call(steps, commands=2, stop=stop)
        usable = [int(s) for s in stored if int(s) <= int(frontier or 0)]
        if not usable:
            return None
        return self._call(lambda r: r.hget(self._key(job_id, "state"), max(usable)), commands=1, stop=stop)

    def save_state(self, job_id: str, step: int, state: str, *, stop=None) -> None:
        """Stores the planner state before ``step`` (once: HSETNX; planning is deterministic)."""
        self._call(lambda r: r.hsetnx(self._key(job_id, "state"), step, state), commands=1, stop=stop)

    def commit_plan(self, job_id: str, step: int, plan: bytes, num_samples: int, skipped: dict[str, str],
                    token: str, ttl_s: float, *, stop=None) -> bool:
        """Commits ``step`` unless it already is (returns whether this call did), with the skipped
        samples found while planning it, and renews the planning lease ``token`` holds."""
        keys = [self._key(job_id, name)
                for name in ("plan", "frontier", "counters", "skipped", "planner")]
        keys[0] = self._key(job_id, "plan", step)
        args = [plan, step, num_samples, token, int(ttl_s * 1000)]
        for key, record in skipped.items():
            args += [key, record]
        return bool(self._call(lambda r: self._commit(keys=keys, args=args, client=r), commands=1, stop=stop))

    def commit_done(self, job_id: str, num_steps: int, *, stop=None) -> bool:
        """Records the number of steps, if every step is committed (a late write into a Redis that
        lost its data must not end the job); returns whether it did."""
        keys = [self._key(job_id, "done"), self._key(job_id, "frontier")]
        return bool(self._call(lambda r: self._done(keys=keys, args=[num_steps], client=r), commands=1, stop=stop))

    def committed_plan(self, job_id: str, step: int, *, stop=None) -> bytes | None:
        return self._call(lambda r: r.get(self._key(job_id, "plan", step)), commands=1, stop=stop)

    def drop_plans(self, job_id: str, steps: range, *, keep_state_from: int | None = None,
                   deadline_s: float = 10.0) -> None:
        """Deletes the plans of ``steps``, and the planner states older than the newest one at or
        before ``keep_state_from`` (no planner needs them: every rank acknowledged a later step)."""
        if not steps:
            return

        def run(r):
            pipe = r.pipeline(transaction=False)
            pipe.delete(*(self._key(job_id, "plan", k) for k in steps))
            if keep_state_from is not None:
                stored = sorted(int(s) for s in r.hkeys(self._key(job_id, "state")))
                base = max((s for s in stored if s <= keep_state_from), default=None)
                old = [s for s in stored if base is not None and s < base]
                if old:
                    pipe.hdel(self._key(job_id, "state"), *old)
            pipe.execute()
        self._call(run, commands=3, deadline_s=deadline_s)

    # --- leases -------------------------------------------------------------------------------
    def acquire(self, job_id: str, name: str, token: str, ttl_s: float, *, stop=None) -> bool:
        """Takes the lease ``name`` (e.g. "planner") for ``token``, or renews it; False if another holds it."""
        key = self._key(job_id, name)
        return bool(self._call(lambda r: self._acquire(keys=[key], args=[token, int(ttl_s * 1000)], client=r),
                               commands=1, stop=stop))

    def release(self, job_id: str, name: str, token: str) -> None:
        key = self._key(job_id, name)
        try:
            self._call(lambda r: self._release(keys=[key], args=[token], client=r), commands=1, deadline_s=2.0)
        except ServiceUnavailableError:
            pass  # it expires on its own
        except (OSError, ValueError, AttributeError):  # the store was closed under the call (shutdown;
            # redis-py drops a closed connection's reader: AttributeError): it expires too
            if not self._closing.is_set():
                raise

    def claim_rank(self, job_id: str, rank: int, lease: dict, ttl_s: float, spec: bytes, *, stop=None) -> int:
        """Starts a stream of ``rank``: returns its fence token (newer streams get larger ones). Also
        registers the job again, should Redis have lost it."""
        def run(r):
            pipe = r.pipeline(transaction=False)
            pipe.incr(self._key(job_id, "fence", rank))
            pipe.set(self._key(job_id, "rank", rank), json.dumps(lease), px=int(ttl_s * 1000))
            pipe.set(self._key(job_id, "spec"), spec, nx=True)
            pipe.sadd("disttrain:jobs", job_id)
            return pipe.execute()[0]
        return int(self._call(run, commands=4, stop=stop))

    def step_sent(self, job_id: str, rank: int, lease: dict, ttl_s: float, num_microbatches: int, *,
                  stop=None) -> int:
        """A stream finished sending a step: renews its lease, counts, returns the rank's fence."""
        def run(r):
            pipe = r.pipeline(transaction=False)
            pipe.get(self._key(job_id, "fence", rank))
            pipe.set(self._key(job_id, "rank", rank), json.dumps(lease), px=int(ttl_s * 1000))
            pipe.hincrby(self._key(job_id, "counters"), "sent_microbatches", num_microbatches)
            return pipe.execute()[0]
        return int(self._call(run, commands=3, stop=stop) or 0)

    # --- acknowledgements and report ------------------------------------------------------------
    def acknowledge(self, job_id: str, rank: int, next_step: int, dp_size: int, *,
                    deadline_s: float | None = None) -> int:
        key = self._key(job_id, "acks")
        return int(self._call(lambda r: self._ack(keys=[key], args=[rank, next_step, dp_size], client=r),
                              commands=1, deadline_s=deadline_s))

    def record_skipped(self, job_id: str, records: dict[str, str], *, stop=None) -> None:
        """Adds skipped samples (key -> SkippedRecord JSON); a key already recorded keeps its record."""
        def run(r):
            pipe = r.pipeline(transaction=False)
            for key, record in records.items():
                pipe.hsetnx(self._key(job_id, "skipped"), key, record)
            pipe.execute()
        if records:
            self._call(run, commands=len(records), stop=stop)

    def add_timings(self, job_id: str, rows: list[str], window: int, *, deadline_s: float = 10.0) -> tuple[int, int]:
        """Appends measured-timing observations (JSON), keeps the newest ``window``; returns (the
        number ever added, the frontier: the first step a refit can still price). A retry after a
        lost reply may add a batch twice: observations are samples of a fit, not data."""
        def run(r):
            pipe = r.pipeline(transaction=True)
            pipe.rpush(self._key(job_id, "timings"), *rows)
            pipe.ltrim(self._key(job_id, "timings"), -window, -1)
            pipe.hincrby(self._key(job_id, "counters"), "timing_observations", len(rows))
            pipe.get(self._key(job_id, "frontier"))
            return pipe.execute()
        if not rows:
            return self._call(lambda r: (int(r.hget(self._key(job_id, "counters"), "timing_observations") or 0),
                                         int(r.get(self._key(job_id, "frontier")) or 0)), commands=2,
                              deadline_s=deadline_s)
        *_, total, frontier = self._call(run, commands=4, deadline_s=deadline_s)
        return int(total), int(frontier or 0)

    def timings(self, job_id: str, *, stop=None) -> list[bytes]:
        """The newest observations add_timings kept, oldest first."""
        return self._call(lambda r: r.lrange(self._key(job_id, "timings"), 0, -1), commands=1, stop=stop)

    def report(self, job_id: str, *, deadline_s: float | None = None) -> dict:
        def run(r):
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(self._key(job_id, "skipped"))
            pipe.hgetall(self._key(job_id, "counters"))
            pipe.get(self._key(job_id, "frontier"))
            pipe.get(self._key(job_id, "done"))
            return pipe.execute()
        skipped, counters, frontier, done = self._call(run, commands=4, deadline_s=deadline_s)
        return {"skipped": [json.loads(v) for v in skipped.values()],
                "counters": {k.decode(): int(v) for k, v in counters.items()},
                "frontier": int(frontier or 0), "done": None if done is None else int(done)}
