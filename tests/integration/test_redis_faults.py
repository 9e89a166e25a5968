"""RedisStore through Redis faults, against a real redis-server: a call rides out a transient fault
(out of memory, read-only replica, busy script, Redis killed) that clears within its deadline,
fails with ServiceUnavailableError naming the address and the error once the deadline passes,
and raises at once on an error that retrying cannot fix (WRONGTYPE: a bug)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from disttrain_api.errors import ServiceUnavailableError
from disttrain_tools.localcluster import LocalRedis, free_port
from preprocess_service.adapters.infra.store import RedisStore

CLEAR_AFTER_S = 1.0
"""A fault lasts this long in the tests where it clears: several retries, well inside the deadline."""

BOUND_S = 10.0
"""Loose upper bound on a call's duration: catches "retries forever", not timing detail."""


@pytest.fixture()
def server(tmp_path):
    with LocalRedis(tmp_path / "redis") as local:
        yield local


@pytest.fixture()
def admin(server):
    """A plain client that sets up and clears faults (redis-py reconnects it after a restart)."""
    client = redis.Redis(port=server.port, socket_timeout=5)
    yield client
    client.close()


# --- faults: each sets itself up, checks Redis really fails, returns how to clear it -------------
def _oom(server, admin):
    """Fills Redis, then caps its memory below what it holds: every write gets OOM until the filler goes."""
    with redis.Redis(port=server.port) as filler:  # closed: its query buffer is not counted below
        for _ in range(8):
            filler.append("filler", b"x" * 1_000_000)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", admin.info("memory")["used_memory"] - 2_000_000)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        admin.set("probe", 1)
    return lambda: admin.delete("filler")


def _readonly(server, admin):
    """Makes Redis a read-only replica of a master that is not there: it never syncs, so it keeps
    its data, and refuses writes with READONLY until promoted."""
    admin.config_set("replica-read-only", "yes")
    admin.replicaof("127.0.0.1", free_port())
    with pytest.raises(redis.exceptions.ReadOnlyError):
        admin.set("probe", 1)
    return lambda: admin.replicaof("NO", "ONE")


def _busy(server, admin):
    """Runs a script that never ends: past busy-reply-threshold Redis answers BUSY until SCRIPT KILL."""
    admin.config_set("busy-reply-threshold", 100)
    looping = threading.Thread(target=_loop_forever, args=(server.port,), daemon=True)
    looping.start()
    deadline = time.monotonic() + 5
    while not _answers_busy(admin):
        assert time.monotonic() < deadline, "the looping script did not make Redis busy"
        time.sleep(0.05)

    def clear():
        admin.script_kill()
        looping.join(timeout=5)
    return clear


def _loop_forever(port: int) -> None:
    try:
        with redis.Redis(port=port) as client:
            client.eval("while true do end", 0)
    except redis.RedisError:
        pass  # killed by SCRIPT KILL, or Redis stopped under it


def _answers_busy(admin) -> bool:
    try:
        admin.set("probe", 1)
    except redis.ResponseError as exc:
        assert str(exc).startswith("BUSY"), exc
        return True
    return False


def _down(server, admin):
    """Kills redis-server; clearing starts it again on the same port and data directory (AOF)."""
    server.stop(kill=True)
    return server.start


FAULTS = {"oom": _oom, "readonly": _readonly, "busy": _busy, "down": _down}
MESSAGES = {"oom": ("refused writes", "OOM command not allowed"), "readonly": ("refused writes", "READONLY"),
            "busy": ("was not serving", "BUSY"), "down": ("was unreachable", "")}


def _clear_later(clear) -> threading.Timer:
    timer = threading.Timer(CLEAR_AFTER_S, clear)
    timer.start()
    return timer


def _timed(fn):
    began = time.monotonic()
    result = fn()
    return result, time.monotonic() - began


# --- every kind of write round trip rides out OOM ---------------------------------------------------
WRITES = {
    "pipeline": (lambda s: s.register_job("j", b"spec"), lambda s, admin: s.job_spec("j") == b"spec"),
    "script": (lambda s: s.commit_plan("j", 0, b"plan", 3, {"k": "{}"}, "token", 5),
               lambda s, admin: s.read_plan("j", 0)[:2] == (b"plan", 1)),
    "pipeline-with-script": (lambda s: s.read_plan("j", 4, want=True),
                             lambda s, admin: admin.zscore("disttrain:{j}:wants", "max") == 4),
    "transaction": (lambda s: s.add_timings("j", ["{}"], window=10), lambda s, admin: s.timings("j") == [b"{}"]),
}


@pytest.mark.parametrize("write", WRITES, ids=list(WRITES))
def test_a_write_refused_for_lack_of_memory_is_retried_until_memory_is_freed(server, admin, write):
    store = RedisStore(server.url, retry_deadline_s=20)
    call, landed = WRITES[write]
    timer = _clear_later(_oom(server, admin))
    try:
        _, elapsed = _timed(lambda: call(store))
    finally:
        timer.join()
    assert elapsed < BOUND_S
    assert store.stats()["retries"] > 0, "the write was refused at first"
    assert landed(store, admin), "the retried round trip did all it does"


# --- any transient fault that clears within the deadline ---------------------------------------------
@pytest.mark.parametrize("fault", ["readonly", "busy", "down"])
def test_a_write_rides_out_a_fault_that_clears(server, admin, fault):
    store = RedisStore(server.url, retry_deadline_s=20)
    store.register_job("before", b"old spec")
    timer = _clear_later(FAULTS[fault](server, admin))
    try:
        _, elapsed = _timed(lambda: store.register_job("j", b"spec"))
    finally:
        timer.join()
    assert elapsed < BOUND_S
    assert store.stats()["retries"] > 0
    assert store.job_spec("j") == b"spec"
    assert store.job_spec("before") == b"old spec", "the fault lost no data"


def test_redis_killed_while_a_call_waits_for_its_reply_and_restarted(server, admin):
    store = RedisStore(server.url, retry_deadline_s=20)

    def bounce():
        server.stop(kill=True)
        time.sleep(CLEAR_AFTER_S)
        server.start()
        admin.lpush("disttrain:{j}:wake", 1)  # ends the BLPOP sent again after the restart
    bouncer = threading.Timer(0.3, bounce)
    bouncer.start()
    try:
        _, elapsed = _timed(lambda: store.wait_for_want("j", timeout_s=8))
    finally:
        bouncer.join()
    assert elapsed < BOUND_S, "the BLPOP sent after the restart returns at the wake-up, not at its timeout"
    assert store.stats()["retries"] > 0


# --- a fault that does not clear: bounded ---------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_that_never_clears_fails_after_the_deadline_naming_address_and_error(server, admin, fault):
    store = RedisStore(server.url, retry_deadline_s=1.5)
    FAULTS[fault](server, admin)
    began = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as info:
        store.register_job("j", b"spec")
    elapsed = time.monotonic() - began
    assert 1.0 < elapsed < BOUND_S, "retried until the deadline, then gave up"
    message = str(info.value)
    what, error = MESSAGES[fault]
    assert f"Redis at {server.url} {what} for" in message and "(deadline 1.5 s)" in message, message
    assert error in message, message


def test_a_call_whose_stop_is_set_gives_up_at_the_first_fault(server, admin):
    store = RedisStore(server.url, retry_deadline_s=20)
    _oom(server, admin)
    stop = threading.Event()
    stop.set()
    began = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="refused writes when the call was stopped .*OOM"):
        store.commit_plan("j", 0, b"plan", 1, {}, "token", 5, stop=stop)
    assert time.monotonic() - began < 10, "gave up at the first fault, not after the 20 s deadline"


@pytest.mark.parametrize("ended_by", ["new primary", "stop"])
def test_a_pause_between_tries_ends_when_the_sentinels_name_a_new_primary_or_the_call_stops(server, ended_by):
    """The backoff between tries grows to 2 s: a failover that ends just after a try must not leave
    the next one that late. The Sentinel watch (_watch_primary) calls _primary_moved; a pause of a
    minute started before it (or the call's stop) ends at once, and one without either goes on."""
    store = RedisStore(server.url)
    stop = threading.Event()
    seen = store._primaries_seen  # as _call reads it before a try
    pause = threading.Thread(target=store._pause, args=(60.0, stop, seen), daemon=True)
    pause.start()
    pause.join(0.3)
    assert pause.is_alive(), "the pause ended with nothing to end it"
    store._primary_moved() if ended_by == "new primary" else stop.set()
    pause.join(BOUND_S)
    assert not pause.is_alive(), f"the pause went on after the {ended_by}"
    if ended_by == "new primary":  # a primary named during the try (before the pause) ends it too
        began = time.monotonic()
        store._pause(60.0, None, seen)
        assert time.monotonic() - began < BOUND_S
    store.close()


# --- errors that retrying cannot fix --------------------------------------------------------------
@pytest.mark.parametrize("key, call", [
    ("disttrain:jobs", lambda s: s.register_job("j", b"spec")),  # SADD in a pipeline
    ("disttrain:{j}:counters",  # HINCRBY in a script
     lambda s: s.commit_plan("j", 0, b"plan", 1, {}, "token", 5)),
    ("disttrain:{j}:wants", lambda s: s.read_plan("j", 0, want=True)),  # ZADD in a script in a pipeline
], ids=["pipeline", "script", "pipeline-with-script"])
def test_a_wrong_type_is_a_bug_raised_at_once(server, admin, key, call):
    store = RedisStore(server.url, retry_deadline_s=20)
    admin.set(key, "not the type the store writes")
    began = time.monotonic()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        call(store)
    assert time.monotonic() - began < 10, "raised at once, not after the 20 s deadline"
    assert store.stats()["retries"] == 0


def test_scripts_still_run_after_redis_forgets_them(server, admin):
    """SCRIPT FLUSH (as a restart does) empties the script cache: redis-py loads the scripts again."""
    store = RedisStore(server.url, retry_deadline_s=20)
    admin.script_flush()
    assert store.commit_plan("j", 0, b"plan", 1, {}, "token", 5)
    admin.script_flush()
    assert store.read_plan("j", 0, want=True)[:2] == (b"plan", 1)
    assert store.stats()["retries"] == 0


def _wait_replicated(port: int, key: str, value: bytes) -> None:
    with redis.Redis(port=port) as direct:
        deadline = time.monotonic() + BOUND_S
        while direct.get(key) != value:
            assert time.monotonic() < deadline, "the replica never received the write"
            time.sleep(0.05)


def test_a_sentinel_failover_is_followed_to_the_promoted_replica(tmp_path):
    """redis+sentinel:// URLs: the store asks the Sentinel where the primary is, and asks again
    when the primary dies and the Sentinel promotes its replica."""
    from disttrain_tools.localcluster import LocalSentinel

    with LocalRedis(tmp_path / "primary") as primary, \
            LocalRedis(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", str(primary.port))) as replica:
        sentinel = LocalSentinel(tmp_path / "sentinel", primary.port).start()
        try:
            store = RedisStore(sentinel.url, retry_deadline_s=60)
            assert store.address == f"redis+sentinel://127.0.0.1:{sentinel.port}/disttrain/0"
            store.register_job("job-a", b"spec-a")
            _wait_replicated(replica.port, "disttrain:{job-a}:spec", b"spec-a")
            primary.stop(kill=True)
            assert store.job_spec("job-a") == b"spec-a"  # retried until the Sentinel named the replica
            assert sentinel.primary() == ("127.0.0.1", replica.port)
            store.register_job("job-b", b"spec-b")  # and it takes writes there
            assert store.stats()["retries"] > 0
        finally:
            sentinel.stop()


def test_a_call_waiting_on_a_primary_that_went_silent_moves_to_the_promoted_replica(tmp_path):
    """The primary stops answering (SIGSTOP: its connections stay open, a call on one would wait
    out the socket timeout) and the Sentinel promotes its replica: the store sees the new primary
    and cuts the call short, which is made again there, long before the socket timeout."""
    import signal

    from disttrain_tools.localcluster import LocalSentinel

    socket_timeout_s = 60.0
    with LocalRedis(tmp_path / "primary") as primary, \
            LocalRedis(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", str(primary.port))) as replica:
        sentinel = LocalSentinel(tmp_path / "sentinel", primary.port).start()
        store = RedisStore(sentinel.url, socket_timeout_s=socket_timeout_s, retry_deadline_s=120)
        try:
            store.register_job("job-a", b"spec-a")
            _wait_replicated(replica.port, "disttrain:{job-a}:spec", b"spec-a")
            primary.process.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            assert store.job_spec("job-a") == b"spec-a"  # sent to the silent primary, then cut and sent again
            waited = time.monotonic() - began
            assert sentinel.primary() == ("127.0.0.1", replica.port)
            assert waited < socket_timeout_s / 2, f"the call waited {waited:.1f} s on the silent primary"
        finally:
            store.close()
            sentinel.stop()
            primary.process.send_signal(signal.SIGCONT)


def _sentinel_flags(sentinel) -> set[str]:
    with redis.Redis(port=sentinel.port, socket_timeout=5) as client:
        flags = client.sentinel_master(sentinel.name)["flags"]
    return set(flags) if isinstance(flags, set) else set(flags.split(","))


def test_a_stream_s_call_waits_past_its_deadline_while_the_sentinels_replace_the_primary(tmp_path):
    """A stream's calls give up after ~2 s so that its client moves to another replica; but when
    the Sentinels say the primary is down (a failover every replica waits on), moving only costs
    a second decode elsewhere: the call waits on. Here no promotion can end it (the replica may
    not be promoted), so the call is still waiting well past its deadline, until it is stopped."""
    import signal

    from disttrain_tools.localcluster import LocalSentinel

    with LocalRedis(tmp_path / "primary") as primary, \
            LocalRedis(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", str(primary.port),
                                                         "--replica-priority", "0")) as replica:
        sentinel = LocalSentinel(tmp_path / "sentinel", primary.port, down_after_ms=200).start()
        stream = RedisStore(sentinel.url).impatient(0.4)
        try:
            stream.register_job("job-a", b"spec-a")
            _wait_replicated(replica.port, "disttrain:{job-a}:spec", b"spec-a")
            assert not stream._failing_over()
            primary.process.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + BOUND_S
            while not _sentinel_flags(sentinel) & {"s_down", "o_down"}:
                assert time.monotonic() < deadline, "the Sentinel never saw the primary down"
                time.sleep(0.05)
            assert stream._failing_over()
            stop, outcome = threading.Event(), []

            def call():
                try:
                    outcome.append(stream.read_plan("job-a", 0, stop=stop))
                except ServiceUnavailableError as exc:
                    outcome.append(exc)

            waiting = threading.Thread(target=call, daemon=True)
            waiting.start()
            waiting.join(2.0)  # five times its 0.4 s deadline
            assert waiting.is_alive(), f"the call gave up during the failover: {outcome}"
            stop.set()
            waiting.join(BOUND_S)
            assert not waiting.is_alive() and "stopped" in str(outcome[0])
        finally:
            stream.close()
            sentinel.stop()
            primary.process.send_signal(signal.SIGCONT)


def test_a_stream_s_call_gives_up_at_its_deadline_when_the_sentinels_see_the_primary_well(tmp_path):
    """The other side: a primary this replica cannot reach while the Sentinels still see it well
    (down-after not reached: a fault of this replica's link, as far as anyone knows) fails the
    stream's call at its deadline, so that its client moves to another replica."""
    import signal

    from disttrain_tools.localcluster import LocalSentinel

    with LocalRedis(tmp_path / "primary") as primary:
        sentinel = LocalSentinel(tmp_path / "sentinel", primary.port, down_after_ms=600_000).start()
        stream = RedisStore(sentinel.url).impatient(0.4)
        try:
            stream.register_job("job-a", b"spec-a")
            primary.process.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            with pytest.raises(ServiceUnavailableError, match="deadline"):
                stream.read_plan("job-a", 0)
            assert time.monotonic() - began < BOUND_S
            assert not stream._failing_over()
        finally:
            primary.process.send_signal(signal.SIGCONT)
            stream.close()
            sentinel.stop()


def test_the_planner_s_wait_for_a_want_holds_under_a_short_socket_timeout(server):
    """The planner's store bounds each try like the streams' (impatient, with the long retry
    deadline): its blocking wait for a stream's want is held below that socket timeout, so a
    quiet job is a wait that ends, not a timeout retried until the deadline."""
    base = RedisStore(server.url, retry_deadline_s=4.0)
    planner = base.impatient(1.0, retry_deadline_s=base.retry_deadline_s)
    try:
        assert (planner.socket_timeout_s, planner.retry_deadline_s) == (0.5, 4.0)
        _, took = _timed(lambda: planner.wait_for_want("job-q", timeout_s=5.0))
        assert took < BOUND_S
        assert planner.stats()["retries"] == 0  # the wait ended, no try timed out
    finally:
        planner.close()
        base.close()
