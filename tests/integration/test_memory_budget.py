"""The global memory budget: every buffer, queued message and kept media byte is charged before
it exists; new streams and jobs beyond it are refused with a retry hint; streams already running
wait, and the charge never passes the budget, whatever clients do. On top, the service's measured
resident memory counts: what nobody charged (the idle service, heap, copies) holds new charges back."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, ResourceExhausted
from disttrain_api.spec import spec_from_config
from helpers import shard_keys, write_tiny_shards
from preprocess_service.adapters.infra.budget import STREAM_SHARE, MemoryBudget
from preprocess_service.adapters.infra.procmem import Calibrated, descendants, pss_bytes, resident_bytes
from preprocess_service.service.server import create_server
from preprocess_service.service.settings import ServiceSettings
from trainer import DataClient


def test_reserve_waits_for_room_and_gives_up_with_a_retry_hint():
    budget = MemoryBudget(100, wait_s=0.3)
    budget.reserve(80, what="a")
    assert not budget.try_reserve(30)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as info:
        budget.reserve(30, what="the second buffer")
    assert 0.25 < time.monotonic() - started < 5 and info.value.retry_after_s and "second buffer" in str(info.value)
    threading.Timer(0.1, budget.release, args=(80,)).start()
    budget.reserve(30, what="c")  # room appears while it waits
    assert budget.used == 30 and budget.peak == 80
    stop = threading.Event()
    stop.set()
    with pytest.raises(ResourceExhausted):
        budget.reserve(90, what="d", stop=stop)  # a cancelled stream does not wait
    with pytest.raises(ResourceExhausted, match="whole memory budget"):
        budget.reserve(101, what="e")
    with pytest.raises(ResourceExhausted, match="needs"):
        budget.admit(80, "a stream")  # more than the streams' share (75 of 100)
    end = budget.commit(50, "a stream")
    with pytest.raises(ResourceExhausted, match="committed"):
        budget.commit(30, "another")
    end()
    end()  # ending twice ends once
    assert budget.committed == 0
    assert budget.try_cache(20) and not budget.try_cache(10)  # the cache share is 25 of 100


def test_measured_memory_beyond_the_charges_counts_as_used():
    budget = MemoryBudget(1000, wait_s=0.5)
    with pytest.raises(ConfigError, match="leaves too little for data.*already holds 900"):
        budget.set_baseline(900)
    budget.set_baseline(400)  # the idle service: streams and cache share the other 600
    assert budget.data_total == 600 and budget.resident == 400 and budget.uncharged == 400
    with pytest.raises(ResourceExhausted, match=r"admits for any stream \(450"):
        budget.commit(451, "a stream")  # 75% of 600
    end = budget.commit(450, "a stream")
    end()
    assert budget.try_reserve(500) and not budget.try_reserve(100)  # 400 + 500 + 100 > 940
    budget.observe(950)  # the 500 were allocated: 450 resident beyond them
    assert budget.uncharged == 450 and not budget.try_reserve(60)
    budget.release(500)
    budget.observe(700)  # freed, but glibc kept 300 of it
    assert budget.uncharged == 700 and not budget.try_reserve(241)  # charges stop 10% of 600 short of 1000
    assert budget.try_reserve(240)
    budget.release(240)
    pressed = []
    budget.on_pressure = lambda: (pressed.append(1), budget.observe(400))  # a trim gives the heap back
    budget.reserve(500, what="a microbatch")  # waits, asks for a trim, fits
    assert pressed and budget.used == 500 and budget.resident_peak == 950
    budget.release(500)
    budget.on_pressure = lambda: None
    budget.observe(900)
    with pytest.raises(ResourceExhausted, match="900 more resident: the idle service's 400"):
        budget.reserve(200, what="a microbatch")
    threading.Timer(0.1, budget.observe, args=(400,)).start()
    budget.wait_s = 5
    budget.reserve(200, what="a microbatch")  # the next sample makes room
    assert budget.used == 200


def _touch_mib(mib: int) -> np.ndarray:
    return np.ones(mib << 17)  # float64: 8 bytes each, every page written


def test_resident_bytes_counts_private_memory_per_process_and_shared_memory_once():
    import multiprocessing as mp
    import os
    from multiprocessing import shared_memory

    from disttrain_api.heap import trim_malloc

    me = os.getpid()
    trim_malloc()  # free heap earlier tests left resident would be reused without a page fault
    before = resident_bytes([me])
    ballast = _touch_mib(200)
    assert resident_bytes([me]) - before > 180 << 20  # kept to the end: freed heap may be reused without a fault
    shm = shared_memory.SharedMemory(create=True, size=150 << 20)
    try:
        shm.buf[:] = b"\1" * len(shm.buf)
        ctx = mp.get_context("spawn")
        ready, done = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_map_and_touch, args=(shm.name, ready, done))
        child.start()
        try:
            assert ready.wait(60)
            mine, both = resident_bytes([me]), resident_bytes([me, child.pid])
            assert both - mine < (60 << 20) + 150 << 20  # the child's own memory, the arena not twice
            assert both - mine > 60 << 20  # its 60 MiB of private memory counts
        finally:
            done.set()
            child.join(30)
    finally:
        shm.close()
        shm.unlink()
    assert resident_bytes([2**22 + 12345]) is None and pss_bytes([2**22 + 12345]) is None  # no such process
    measure = Calibrated(lambda: [me], every_s=3600)
    trim_malloc()
    first = measure()  # calibrated: the exact PSS
    assert abs(first - pss_bytes([me])) < 16 << 20
    more = _touch_mib(100)
    assert 90 << 20 < measure() - first < 120 << 20  # the cheap estimate, corrected
    del ballast, more


def test_descendants_are_found_at_any_depth_and_from_any_thread():
    """The server counts its whole process tree: the fork server it starts, the decode workers the
    fork server forks, and children started by any of its threads."""
    import os
    import subprocess
    import sys

    grandchild_code = "import time; time.sleep(60)"
    child_code = ("import subprocess, sys, time; "
                  f"p = subprocess.Popen([sys.executable, '-c', {grandchild_code!r}]); print(p.pid, flush=True); "
                  "time.sleep(60)")
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(
        subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)))
    thread.start()
    thread.join()
    child = started[0]
    grandchild = int(child.stdout.readline())
    try:
        found = descendants(os.getpid())
        assert {child.pid, grandchild} <= set(found), (child.pid, grandchild, found)
        assert os.getpid() not in found and descendants(2**22 + 12345) == []
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait(10)


def _map_and_touch(name, ready, done):
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    _ = bytes(shm.buf)  # every page of the arena read in this process too
    ballast = _touch_mib(60)
    ready.set()
    done.wait(60)
    del ballast, _
    shm.close()


def test_a_budget_below_the_idle_service_is_refused_at_start():
    with pytest.raises(ConfigError, match="leaves too little for data"):
        create_server("127.0.0.1:0", decode_workers=0, settings=ServiceSettings(memory_budget_bytes=64 << 20))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    paths = write_tiny_shards(root, num_shards=2, samples_per_shard=16)
    return root, paths


def _config(root, **kw):
    fields = dict(shards=(str(root),), seq_len=4096, dp_size=4, num_microbatches=2, seqs_per_microbatch=1)
    fields.update(kw)
    return JobConfig(**fields)


@pytest.mark.parametrize("decode_workers", [0, 1])
def test_under_pressure_the_charge_stays_within_the_budget_and_every_sample_arrives_once(shards, decode_workers):
    root, paths = shards
    budget_bytes = 160 << 20
    server, port, servicer = create_server(
        "127.0.0.1:0", decode_workers=decode_workers,
        # charges only: pytest's memory is not the server's
        settings=ServiceSettings(memory_budget_bytes=budget_bytes, memory_wait_s=2.0, max_streams_per_client=0,
                      stream_stall_timeout_s=3.0, memory_sample_s=0))
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.PreprocessStub(channel)
    try:
        config = _config(root, num_epochs=2)
        job_id = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=30).job_id
        # clients that open streams and never read them, on a second job
        hog = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(_config(root, num_epochs=1000, seed=9))),
                           timeout=30).job_id
        stalled = [stub.StreamMicrobatches(pb.StreamRequest(job_id=hog, dp_rank=r % 4)) for r in range(12)]
        results: dict[int, Counter] = {}

        def rank(r):
            keys = Counter()
            with DataClient(address, job_id, r, prefetch=2, reconnect_timeout_s=120) as client:
                for mb in client:
                    keys.update(mb.sample_keys)
                    time.sleep(0.05)
            results[r] = keys

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        peak_seen = 0
        while any(t.is_alive() for t in threads):
            peak_seen = max(peak_seen, servicer.budget.used)
            assert servicer.budget.used <= budget_bytes
            time.sleep(0.02)
        for t in threads:
            t.join()
        report = stub.GetReport(pb.ReportRequest(job_id=job_id), timeout=30)
        received = sum(results.values(), Counter())
        lost = {s.key for s in report.skipped if s.key}
        assert set(received) == shard_keys(paths) - lost and set(received.values()) == {2}
        assert 0 < servicer.budget.peak <= budget_bytes
        for call in stalled:
            call.cancel()
        for job in (job_id, hog):  # their kept media goes with them
            stub.CloseJob(pb.CloseJobRequest(job_id=job), timeout=30)
        deadline = time.monotonic() + 30
        while servicer.budget.used and time.monotonic() < deadline:
            time.sleep(0.1)
        if decode_workers == 0:
            assert servicer.budget.used == 0  # every charge came back
        else:  # the pool keeps a few idle arenas (charged) for reuse
            assert servicer.budget.used == servicer.decoder.arenas.idle_bytes()
    finally:
        channel.close()
        server.stop(0).wait()


def test_new_streams_beyond_the_budget_are_refused_with_a_retry_hint(shards):
    root, _ = shards
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0,
                                           memory_budget_bytes=512 << 20, max_streams_per_client=0,
                                           memory_sample_s=0)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.PreprocessStub(channel)
    try:
        big = _config(root, seq_len=65536, seqs_per_microbatch=2, dp_size=1)  # up to ~400 MB a microbatch
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(big)), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in info.value.details()
        job_id = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(_config(root, dp_size=1))), timeout=30).job_id
        budget = servicer.budget  # the streams' share all committed but 1 MiB: no stream fits
        ballast = budget.commit(int(budget.data_total * STREAM_SHARE) - budget.committed - (1 << 20), "ballast")
        with pytest.raises(grpc.RpcError) as info:
            next(stub.StreamMicrobatches(pb.StreamRequest(job_id=job_id, dp_rank=0), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry in" in info.value.details()
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "5000"
        ballast()
        assert next(stub.StreamMicrobatches(pb.StreamRequest(job_id=job_id, dp_rank=0), timeout=30))
    finally:
        channel.close()
        server.stop(0).wait()


def test_kept_media_is_charged_and_dropped_when_it_does_not_fit(tmp_path):
    from preprocess_service.adapters.decode import InlineDecoder
    from preprocess_service.service.job import Job

    root = tmp_path  # compressed shards: the job holds their encoded bytes while the budget has room
    paths = write_tiny_shards(root, num_shards=2, samples_per_shard=16, compress=True)
    tight = MemoryBudget(200_000)  # room for a few encoded images only
    job = Job(_config(root, dp_size=1), budget=tight)
    decoder = InlineDecoder()
    keys = Counter()
    step = 0
    while (plan := job.step_plan(step)) is not None:
        assert tight.used <= tight.total
        for index in range(plan.num_microbatches):
            keys.update(job.microbatch(plan, 0, index, decoder).sample_keys)
        job.plans.mark_sent(0, step, plan.num_microbatches)
        step += 1
    assert set(keys) == shard_keys(paths) and set(keys.values()) == {1}  # dropped bytes were re-read
    assert 0 < tight.peak <= tight.total
    job.close()
    assert tight.used == 0


def test_the_decode_workers_join_the_baseline_once_up_and_a_budget_they_overfill_stops_serving():
    """The server serves at once and its decode workers start in the background; once they are up,
    their idle memory joins the budget's baseline. A budget with room for the server alone but not
    for its workers too is reported (health NOT_SERVING), not silently overcommitted."""
    import os

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, port, servicer = create_server("127.0.0.1:0", decode_workers=2)
    try:
        assert server.wait_warm(180)
        workers = servicer.decoder.idle_memory()
        assert workers > 0
        assert servicer.decoder.budget.baseline >= workers
    finally:
        server.stop(grace=0).wait()
    own = pss_bytes([os.getpid()])
    too_small = int((own + workers // 3) * 4 / 3)  # the server fits, the server with its workers does not
    server, port, _ = create_server("127.0.0.1:0", decode_workers=2, memory_budget_bytes=too_small)
    try:
        assert server.wait_warm(180)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(grace=0).wait()


def test_free_heap_is_measured_so_the_server_trims_only_when_it_pays():
    """The server's memory sampler gives the heap back (malloc_trim) only when glibc holds more than
    TRIM_ABOVE_BYTES free: mallinfo2 must see memory freed in pieces, as the shard readers free it."""
    from disttrain_api import heap

    if heap.free_heap_bytes() is None:
        pytest.skip("not glibc")
    heap.tune_malloc()  # as the server: pieces below 32 MiB come from the heap
    pieces = [bytes(200_000) for _ in range(400)]  # may reuse what earlier tests freed
    allocated = heap.free_heap_bytes()
    del pieces[::2]  # every other one freed: fragments the heap cannot shrink over
    assert heap.free_heap_bytes() - allocated >= 30 << 20
    del pieces


def test_stream_admission_reads_a_plan_held_as_references(tmp_path):
    """A replica's plans come from Redis as DocRefs (the chaos run of stop 44 died on one): the
    admission estimate treats them as not known yet, the bound before video."""
    from preprocess_service.core import plan_record
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=8)
    config = _config(tmp_path, dp_size=1)
    job = Job(config)
    try:
        assert job.step_plan(0) is not None
        from_redis = plan_record.decode(plan_record.encode(job.plans.held(0)))
        assert all(isinstance(doc, plan_record.DocRef) for doc in from_redis.documents())
        job.plans.held = lambda step: from_redis  # type: ignore[method-assign]
        per = config.max_microbatch_bytes(video=False)
        assert job.stream_estimate(prefetch=2, start_step=0) >= 4 * per
    finally:
        job.close()
