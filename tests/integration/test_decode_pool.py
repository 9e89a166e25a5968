"""The decode worker pool under worker death: SIGKILL a real worker mid-decode and still get every
document exactly once (retried on a replacement), or reported when it kills workers twice."""

import io
import os
import signal
import threading
import time

import numpy as np
import pytest
from PIL import Image

from disttrain_api.config import AudioConfig, ImageConfig, JobConfig
from disttrain_tools.runner import RunResult, all_keys, consume_rank
from helpers import write_tiny_shards
from preprocess_service.adapters import decode
from preprocess_service.adapters.decode import WORKER_DIED, DecodePool, Decoder, InlineDecoder, forkserver
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.assemble import layout_microbatch
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
CFG = ImageConfig(max_pixels=4096 * 28 * 28)


def _big_png(seed: int) -> bytes:
    """A 2400x2400 noise PNG: ~100 ms to decode, so a worker is caught holding it."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (2400, 2400, 3), dtype=np.uint8)).save(out, "PNG", compress_level=0)
    return out.getvalue()


@pytest.fixture(scope="module")
def layout():
    docs = [parse_document({"__key__": f"doc{i}", "png": _big_png(i), "txt": b"caption"},
                           image_config=CFG, tokenizer=TOK, seq_len=8192) for i in range(8)]
    return layout_microbatch([PackedSequence(seq_len=8192, documents=[d]) for d in docs], seq_len=8192,
                             tokenizer=TOK, audio_config=AudioConfig())


@pytest.fixture(scope="module")
def expected(layout):
    return InlineDecoder().submit(layout).result().buffer.copy()


def _wait_for_holder(pool: DecodePool, key: str | None = None, timeout_s: float = 20.0, skip=()) -> int:
    """Pid of a worker (not in ``skip``) holding ``key`` (any document if None) in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid, keys in pool.in_flight().items():
            if keys and (key is None or key in keys) and pid not in skip:
                return pid
        time.sleep(0.002)
    raise AssertionError(f"no worker took {key or 'a document'} within {timeout_s} s")


@pytest.fixture(params=["a task per document", "tasks of four documents"])
def task_bytes(request, monkeypatch):
    """The documents of a microbatch go to the workers one per task (these are 17 MB each), or
    as two tasks of four: a worker that dies then loses four documents at once."""
    if request.param == "tasks of four documents":
        monkeypatch.setattr(decode.pool, "TASK_INPUT_BYTES", 1 << 40)  # one per worker
    return request.param


def test_killed_worker_is_replaced_and_its_documents_are_retried(layout, expected, task_bytes):
    pool = DecodePool(2)
    try:
        future = pool.submit(layout)
        victim = _wait_for_holder(pool)
        os.kill(victim, signal.SIGKILL)
        decoded = future.result(timeout=120)
        assert decoded.errors == {}
        np.testing.assert_array_equal(decoded.buffer, expected)  # every slot, byte for byte
        decoded.release()
        stats = pool.stats()
        assert stats["worker_restarts"] == 1
        assert stats["documents_retried"] >= (4 if task_bytes == "tasks of four documents" else 1)
        assert stats["documents_decoded"] == len(layout.documents)  # each once: none lost, none twice
        assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2
    finally:
        pool.close()


def test_a_document_that_kills_two_workers_is_reported_and_the_rest_delivered(layout, expected, task_bytes):
    """A task of several documents is retried one document per task: the poison fails alone."""
    pool = DecodePool(2, max_in_flight=1)
    try:
        future = pool.submit(layout)
        poison = "doc5"
        killed = []
        for _ in range(2):
            killed.append(_wait_for_holder(pool, poison, skip=killed))
            os.kill(killed[-1], signal.SIGKILL)
        decoded = future.result(timeout=120)
        assert list(decoded.errors) == [poison] and decoded.errors[poison].startswith(WORKER_DIED)
        for doc, items in layout.documents:
            if doc.key != poison:
                for item in items:
                    window = slice(item.offset, item.offset + item.nbytes)
                    np.testing.assert_array_equal(decoded.buffer[window], expected[window])
        decoded.release()
        stats = pool.stats()
        assert stats["worker_restarts"] == 2
        assert stats["documents_decoded"] == len(layout.documents) - 1 and stats["documents_failed"] == 1
    finally:
        pool.close()


def test_stream_survives_a_killed_decode_worker_with_every_sample_once(tmp_path):
    """Service level: real server, real client processes; a decode worker is SIGKILLed mid-stream."""
    import multiprocessing as mp

    import grpc

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc
    from disttrain_api.channel import CHANNEL_OPTIONS
    from disttrain_api.spec import spec_from_config
    from preprocess_service.service.server import create_server

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=40)
    config = JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2, seed=3)
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=2)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            info = pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)))
        killer = threading.Thread(target=_kill_when_busy, args=(servicer,), daemon=True)
        killer.start()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=consume_rank, args=(address, info.job_id, r, 1, results)) for r in range(2)]
        for proc in procs:
            proc.start()
        ranks = [results.get(timeout=240) for _ in procs]
        for proc in procs:
            proc.join(timeout=10)
        killer.join(timeout=30)
        job = servicer.jobs.get(info.job_id)
        skipped = [{"key": r.key, "kind": r.kind} for r in job.report()["skipped"]]
        run = RunResult(job_id=info.job_id, ranks=ranks, skipped=skipped, step_balance=[],
                        shard_keys=all_keys(list(info.shard_urls)), seconds=1.0)
        check = run.exactly_once()
        assert check["ok"], check
        assert check["skipped"] == 0 and check["delivered"] == 80
        assert servicer.decoder.stats()["worker_restarts"] >= 1
    finally:
        server.stop(grace=0).wait()


def _kill_when_busy(servicer) -> None:
    pool = servicer.decoder
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [pid for pid, keys in pool.in_flight().items() if keys]
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            return
        time.sleep(0.001)


def test_streams_are_served_in_turn_and_decode_the_same_bytes(layout):
    """A stream (its stop event) that queued three microbatches gets one per round: the two
    streams that queued one each come before its second, not after its third. Content is the
    same whatever the order."""
    def single(i: int):
        doc = parse_document({"__key__": f"one{i}", "png": _big_png(100 + i), "txt": b"caption"},
                             image_config=CFG, tokenizer=TOK, seq_len=8192)
        return layout_microbatch([PackedSequence(seq_len=8192, documents=[doc])], seq_len=8192,
                                 tokenizer=TOK, audio_config=AudioConfig())

    singles = [single(i) for i in range(5)]
    expected = [InlineDecoder().submit(s).result().buffer.copy() for s in singles]
    deep, a, b = threading.Event(), threading.Event(), threading.Event()
    pool = DecodePool(1, max_in_flight=1)
    try:
        blocker = pool.submit(layout)  # 8 slow documents: the rest queue up behind it meanwhile
        finished: list[str] = []
        futures = {}
        for name, index, stop in (("deep0", 0, deep), ("deep1", 1, deep), ("deep2", 2, deep), ("a", 3, a),
                                  ("b", 4, b)):
            futures[name] = pool.submit(singles[index], stop)
            futures[name].add_done_callback(lambda _, name=name: finished.append(name))
        assert not blocker.done(), "the blocker finished before the others were queued: make it slower"
        blocker.result(timeout=120).release()
        for name, index in (("deep0", 0), ("deep1", 1), ("deep2", 2), ("a", 3), ("b", 4)):
            decoded = futures[name].result(timeout=120)
            np.testing.assert_array_equal(decoded.buffer, expected[index])
            decoded.release()
        assert finished == ["deep0", "a", "b", "deep1", "deep2"]  # first come, first served: deep0..2, a, b
    finally:
        pool.close()


def _eventually(condition, timeout_s: float = 30.0) -> bool:
    """``condition()`` turns true within the timeout (a future's callbacks run after its waiters wake)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_pool_tells_a_stream_whether_other_streams_have_work_in_it(layout):
    """A stream decodes one microbatch ahead only when no other stream's work keeps the workers busy
    (streams.py): the pool counts each stream's microbatches from submit until they are decoded,
    failed or the pool closed."""
    a, b = threading.Event(), threading.Event()
    pool = DecodePool(1, max_in_flight=1)
    try:
        assert not pool.others_decoding(a) and not pool.others_decoding(b)
        first, second = pool.submit(layout, a), pool.submit(layout, a)
        assert pool.others_decoding(b) and pool.others_decoding(None)
        assert not pool.others_decoding(a), "a stream's own work does not count"
        first.result(timeout=120).release()
        assert pool.others_decoding(b), "a's second microbatch is still in the pool"
        second.result(timeout=120).release()
        assert _eventually(lambda: not pool.others_decoding(b))
        third = pool.submit(layout, b)
        assert pool.others_decoding(a) and not pool.others_decoding(b)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        third.result(timeout=30)
    assert _eventually(lambda: not pool.others_decoding(a)), "failed work left the pool too"
    assert not InlineDecoder().others_decoding(a)
    assert isinstance(pool, Decoder) and isinstance(InlineDecoder(), Decoder), "both offer what streams call"


def test_work_submitted_while_workers_start_waits_for_them(layout, expected):
    """wait=False returns while the workers start (the server sets itself up meanwhile); work
    submitted at once is decoded when they are ready, byte for byte."""
    pool = DecodePool(2, wait=False)
    try:
        future = pool.submit(layout)
        decoded = future.result(timeout=120)
        np.testing.assert_array_equal(decoded.buffer, expected)
        decoded.release()
        pool.wait_ready(60)
        assert len(pool.worker_pids()) == 2
    finally:
        pool.close()


def test_workers_that_cannot_start_fail_the_pool_instead_of_hanging(layout):
    """Every worker is killed for not being ready within start_timeout_s (a microsecond: none can
    be; one whose ready message is read later is too slow all the same): after three in a row
    the pool reports it cannot start, and waiting work fails with that error, not a hang."""
    with pytest.raises(RuntimeError, match="cannot start"):
        DecodePool(1, start_timeout_s=1e-6)
    pool = DecodePool(1, start_timeout_s=1e-6, wait=False)
    try:
        with pytest.raises(RuntimeError, match="cannot start"):  # refused, or failed once it is known
            pool.submit(layout).result(timeout=60)
        with pytest.raises(RuntimeError, match="cannot start"):
            pool.submit(layout)
    finally:
        pool.close()


def test_constructing_the_pool_never_waits_for_the_fork_server(layout, expected, monkeypatch):
    """The first worker's start waits while the fork server imports torch and the decoders (about a
    CPU-second): that happens on the pool's thread, so a server sets itself up meanwhile. Here the
    starts are held until released: the constructor returns anyway, and work submitted then is
    decoded once they are let go."""
    release = threading.Event()
    original = DecodePool._start_worker

    def held(self, slot):
        assert release.wait(60)
        return original(self, slot)

    monkeypatch.setattr(DecodePool, "_start_worker", held)
    made = []
    constructor = threading.Thread(target=lambda: made.append(DecodePool(2, wait=False)), daemon=True)
    constructor.start()
    constructor.join(30)
    assert made, "DecodePool(wait=False) waited for its workers to start"
    pool = made[0]
    try:
        assert pool.worker_pids() == [] and pool.idle_memory() is None
        future = pool.submit(layout)
        release.set()
        decoded = future.result(timeout=120)
        np.testing.assert_array_equal(decoded.buffer, expected)
        decoded.release()
        pool.wait_ready(60)
        assert len(pool.worker_pids()) == 2
        assert pool.idle_memory() > 0  # measured as each reported ready, for the memory budget
    finally:
        release.set()
        pool.close()


def _report_gc(queue) -> None:
    import gc

    queue.put((os.getppid(), gc.isenabled(), gc.get_freeze_count()))


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_fork_server_started_early_serves_the_pool_and_its_children_collect_garbage(layout, expected):
    """``forkserver.start()`` (what `serve` and `run` call first thing) launches the fork server
    the pool then forks its workers from: one fork server, not two. It imports with the garbage
    collector off (decode/preload.py); its children must have it back on, with the preloaded objects frozen."""
    forkserver.start()
    ctx = forkserver.context()
    queue = ctx.SimpleQueue()
    probe = ctx.Process(target=_report_gc, args=(queue,))
    probe.start()
    fork_server, enabled, frozen = queue.get()
    probe.join(30)
    assert enabled and frozen > 10_000  # torch's objects and the decoders'
    pool = DecodePool(1)
    try:
        decoded = pool.submit(layout).result(timeout=120)
        np.testing.assert_array_equal(decoded.buffer, expected)
        decoded.release()
        assert [_parent_of(pid) for pid in pool.worker_pids()] == [fork_server]
    finally:
        pool.close()


def test_a_pool_closed_while_its_workers_start_leaves_no_process(monkeypatch):
    release = threading.Event()
    original = DecodePool._start_worker
    started = []

    def held(self, slot):
        assert release.wait(60)
        worker = original(self, slot)
        started.append(worker.process)
        return worker

    monkeypatch.setattr(DecodePool, "_start_worker", held)
    pool = DecodePool(2, wait=False)
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    time.sleep(0.1)  # close() is waiting for the dispatch thread, which is starting a worker
    release.set()
    closer.join(60)
    pool._starter.join(60)
    assert started and all(not p.is_alive() for p in started)


def test_a_failing_dispatcher_fails_the_work_instead_of_hanging_it(layout, monkeypatch):
    def broken(self, worker):
        raise ValueError("a bug in the dispatcher")

    monkeypatch.setattr(DecodePool, "_receive", broken)  # the first message (a worker's "ready") raises
    pool = DecodePool(1, wait=False)
    try:
        with pytest.raises(RuntimeError, match="dispatcher failed: ValueError: a bug in the dispatcher"):
            pool.submit(layout).result(timeout=120)  # failed once known, or refused if known already
        with pytest.raises(RuntimeError, match="dispatcher failed"):
            pool.submit(layout)
        with pytest.raises(RuntimeError, match="dispatcher failed"):
            pool.wait_ready(10)
    finally:
        pool.close()


def test_a_fork_server_that_never_starts_a_worker_fails_the_work_after_start_timeout(layout, monkeypatch):
    """Forking a worker waits for the fork server; one that hangs (a broken installation) must not
    leave the work waiting forever: after start_timeout_s the pool reports it cannot start."""
    release = threading.Event()
    original = DecodePool._start_worker

    def hung(self, slot):
        release.wait(120)
        return original(self, slot)

    monkeypatch.setattr(DecodePool, "_start_worker", hung)
    pool = DecodePool(1, start_timeout_s=0.5, wait=False)
    try:
        with pytest.raises(RuntimeError, match="cannot start: 0 of 1 were started within start_timeout_s 0.5 s"):
            pool.submit(layout).result(timeout=60)
        with pytest.raises(RuntimeError, match="cannot start"):
            pool.wait_ready(10)
    finally:
        release.set()
        pool.close()


def _small_layout(n: int = 3):
    from helpers import jpeg_bytes

    docs = [parse_document({"__key__": f"small{i}", "jpg": jpeg_bytes(160 + 8 * i, 120, seed=i), "txt": b"caption"},
                           image_config=CFG, tokenizer=TOK, seq_len=1024) for i in range(n)]
    return layout_microbatch([PackedSequence(seq_len=1024, documents=[d]) for d in docs], seq_len=1024,
                             tokenizer=TOK, audio_config=AudioConfig())


def test_a_lent_arena_is_reused_only_after_its_client_lets_go_and_is_uncharged_meanwhile():
    """Decoded.lend: the arena holds every array (media where they were decoded, token arrays
    copied into its spare room) at the offsets it names; the pool reuses it only once the client
    has marked it taken and dropped its flock, with a new token; a taken arena leaves the budget."""
    import fcntl

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import wire
    from preprocess_service.adapters.decode.shm import SHM_DIR
    from preprocess_service.adapters.infra.budget import MemoryBudget
    from preprocess_service.core.assemble import finish

    small = _small_layout()
    want = finish(small, InlineDecoder().submit(small).result().buffer).arrays
    budget = MemoryBudget(1 << 30)
    pool = DecodePool(1, budget=budget)
    try:
        decoded = pool.submit(small).result(timeout=120)
        lent = decoded.lend(finish(small, decoded.buffer).arrays)
        decoded.release()  # a no-op now: the arena is lent
        assert lent is not None and pool.stats()["lent"] == 1
        path = os.path.join(SHM_DIR, lent.name)
        header = pb.Microbatch(tensors=[pb.Tensor(name=n, dtype=wire.proto_dtype(d), shape=s, shm_offset=o)
                                        for n, d, s, o in lent.tensors])
        with open(path, "rb") as f:
            raw = np.frombuffer(f.read(lent.nbytes), dtype=np.uint8)
        assert raw[:16].tobytes() == lent.token
        got = wire.lent_views(header, raw)
        assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)
        charged = budget.used
        fd = os.open(path, os.O_RDWR)  # take it as a client does
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.pwrite(fd, b"\x01", 16)
        assert lent.taken()
        again = pool.submit(small).result(timeout=120)  # the lent arena is held: another one serves
        other = again.lend(finish(small, again.buffer).arrays)
        assert other.name != lent.name and pool.stats()["lent"] == 2
        assert budget.used == charged, "the new arena is charged, the taken one (same size) is the client's memory"
        other.abandon()  # its stream ended before its client took it: back at once, token changed
        assert pool.stats()["lent"] == 1
        with open(os.path.join(SHM_DIR, other.name), "rb") as f:
            assert f.read(16) != other.token
        with open(path, "rb") as f:
            assert f.read(16) == lent.token, "reused while its client held it"
        os.close(fd)  # let go
        pool.submit(small).result(timeout=120).release()  # any acquire takes it back
        assert pool.stats()["lent"] == 0
        with open(path, "rb") as f:
            assert f.read(16) != lent.token
    finally:
        pool.close()
    assert budget.used == 0


def test_a_client_that_keeps_every_microbatch_gets_them_given_away_past_max_lent(monkeypatch):
    """Lent arenas a client keeps (taken, locked) beyond MAX_LENT are unlinked and forgotten by the
    pool, oldest first: the server holds no descriptor or mapping for them, the client's stay valid."""
    import fcntl

    from preprocess_service.adapters import decode
    from preprocess_service.adapters.decode.shm import SHM_DIR
    from preprocess_service.core.assemble import finish

    monkeypatch.setattr(decode.arenas, "MAX_LENT", 1)
    small = _small_layout(1)
    pool = DecodePool(1)
    held = []
    try:
        for _ in range(3):
            decoded = pool.submit(small).result(timeout=120)
            lent = decoded.lend(finish(small, decoded.buffer).arrays)
            fd = os.open(os.path.join(SHM_DIR, lent.name), os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.pwrite(fd, b"\x01", 16)
            held.append((lent, fd))
        pool.submit(small).result(timeout=120).release()  # the acquire looks at the lent ones
        stats = pool.stats()
        assert stats["arenas_given_away"] == 2 and stats["lent"] == 1
        assert [os.path.exists(os.path.join(SHM_DIR, lent.name)) for lent, _ in held] == [False, False, True]
        for lent, fd in held:  # each client's copy is intact, given away or not
            assert os.pread(fd, 16, 0) == lent.token
    finally:
        for _, fd in held:
            os.close(fd)
        pool.close()


def test_closing_the_pool_fails_the_microbatches_still_in_decode(layout):
    """Whoever waits for a microbatch of a pool that closes gets an error, not a wait forever."""
    pool = DecodePool(1, max_in_flight=1)
    future = pool.submit(layout)  # eight large PNGs: most still wait when it closes
    _wait_for_holder(pool)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        future.result(timeout=30)


@pytest.mark.parametrize("sizes, workers, target, expected", [
    ([100] * 22, 2, 1000, [7, 8, 7]),               # 2.2 targets: three tasks of about equal bytes
    ([100] * 22, 2, 1 << 20, [11, 11]),              # small documents: still one task per worker
    ([100] * 3, 8, 1 << 20, [1, 1, 1]),              # never more tasks than documents
    ([10 << 20, 10, 10], 2, 1 << 20, [1, 2]),        # a huge document is a task of its own
    ([0, 0, 0], 2, 1 << 20, [2, 1]),                 # no media bytes at all: by count
    ([], 2, 1 << 20, []),
])
def test_a_microbatch_is_cut_into_consecutive_tasks_of_about_equal_bytes(sizes, workers, target, expected):
    documents = [(f"k{i}", [i], n) for i, n in enumerate(sizes)]
    chunks = decode.pool._chunks(documents, workers, target)
    assert [len(c) for c in chunks] == expected
    assert [key for chunk in chunks for key, _ in chunk] == [key for key, _, _ in documents]  # once each, in order
    assert all(items == [int(key[1:])] for chunk in chunks for key, items in chunk)
