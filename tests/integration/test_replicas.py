"""Several replicas on one real redis-server: exactly-once delivery through replica crashes,
trainer restarts and Redis restarts, with the content a single node would have sent."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
import redis

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.channel import CHANNEL_OPTIONS, SERVICE_NAME
from disttrain_api.config import JobConfig
from disttrain_api.errors import ServiceUnavailableError
from disttrain_tools import synth
from disttrain_tools.localcluster import LocalRedis, Replica, free_port
from helpers import write_tiny_shards
from preprocess_service.adapters.infra.store import RedisStore
from preprocess_service.service.cli import main as cli_main
from preprocess_service.service.job import Job
from preprocess_service.service.server import create_server
from trainer import DataClient


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_tiny_shards(root, num_shards=3, samples_per_shard=24)
    synth.write_corrupt_shard(root / "corrupt.tar", seed=2)
    return root


@pytest.fixture()
def redis_server(tmp_path):
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def _config(dataset, **overrides) -> JobConfig:
    fields = dict(shards=(str(dataset),), seq_len=2048, dp_size=2, num_microbatches=2, seqs_per_microbatch=1,
                  seed=7, num_epochs=2)
    fields.update(overrides)
    return JobConfig(**fields)


def _reference(config: JobConfig) -> dict[int, list[tuple[int, int, list[str]]]]:
    """What a single node plans for each rank: (step, microbatch, planned keys), in stream order."""
    job, out = Job(config), {rank: [] for rank in range(config.dp_size)}
    for step in range(job.plan_all()):
        plan = job.step_plan(step)
        for rank in out:
            for index in range(plan.num_microbatches):
                out[rank].append((step, index, [d.key for s in plan.microbatch(rank, index) for d in s.documents]))
    return out


def _received(mb) -> tuple[int, int, list[str]]:
    """What a microbatch delivered: its keys plus the planned samples it reports as skipped, in plan order."""
    return mb.step, mb.microbatch_index, sorted(mb.sample_keys + [key for key, *_ in mb.skipped])


def _digest(mb) -> str:
    return hashlib.sha256(mb.tokens.numpy().tobytes() + b"".join(i.numpy().tobytes() for i in mb.images)).hexdigest()


def _consume(addresses, config, rank, out, *, delay_s=0.0, after=None, state=None, stop_after=None):
    with DataClient(addresses, config, rank, prefetch=1, reconnect_timeout_s=60) as client:
        if state is not None:
            client.load_state_dict(state)
        for mb in client:
            out.append((_received(mb), _digest(mb)))
            if after is not None:
                after(len(out))
            if stop_after is not None and len(out) == stop_after:
                return client.state_dict(), client.num_reconnects
            time.sleep(delay_s)
        return client.state_dict(), client.num_reconnects


def _in_threads(bodies):
    errors, threads = [], []
    for body in bodies:
        def run(body=body):
            try:
                body()
            except Exception as exc:  # surfaced below
                errors.append(exc)
        threads.append(threading.Thread(target=run))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors


def _planned(reference, rank):
    return [(step, index, sorted(keys)) for step, index, keys in reference[rank]]


def _single_node_digests(config):
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    try:
        out = {}
        _in_threads([lambda r=r: out.__setitem__(r, []) or _consume(f"127.0.0.1:{port}", config, r, out[r])
                     for r in range(config.dp_size)])
        return {r: [d for _, d in out[r]] for r in out}
    finally:
        server.stop(0).wait()


# --- the store --------------------------------------------------------------------------------------
def test_leases_commits_and_acks_against_real_redis(redis_server):
    store = RedisStore(redis_server.url)
    assert store.acquire("j", "planner", "a", ttl_s=0.3)
    assert not store.acquire("j", "planner", "b", ttl_s=0.3)
    assert store.acquire("j", "planner", "a", ttl_s=0.3)  # renewal by the holder
    time.sleep(0.45)
    assert store.acquire("j", "planner", "b", ttl_s=5), "an expired lease must pass to another replica"
    store.release("j", "planner", "a")  # not the holder: no effect
    assert not store.acquire("j", "planner", "a", ttl_s=5)
    assert store.commit_plan("j", 0, b"plan0", 3, {"k": "{}"}, "b", 5)
    assert not store.commit_plan("j", 0, b"other", 3, {}, "b", 5), "a step is committed once"
    assert store.read_plan("j", 0) == (b"plan0", 1, None)
    assert store.resume_state("j") is None, "no planner state stored: a new planner starts at step 0"
    store.save_state("j", 0, '{"step": 0}')
    store.save_state("j", 0, '{"step": "again"}')
    store.save_state("j", 16, '{"step": 16}')
    assert store.resume_state("j") == b'{"step": 0}', "the newest state at or before the frontier, stored once"
    assert store.acknowledge("j", 0, 4, dp_size=2) == 0  # rank 1 has not acknowledged
    assert store.acknowledge("j", 1, 3, dp_size=2) == 3
    assert store.acknowledge("j", 1, 2, dp_size=2) == 3, "acknowledgements never go back"
    # a late commit after Redis lost its data leaves a gap: the frontier waits until it is filled
    assert store.commit_plan("g", 2, b"p2", 1, {}, "b", 5)
    assert store.read_plan("g", 2) == (b"p2", 0, None)
    for step in (0, 1):
        store.commit_plan("g", step, b"p", 1, {}, "b", 5)
    assert store.read_plan("g", 0)[1] == 2
    assert not store.commit_plan("g", 2, b"p2", 1, {}, "b", 5)
    assert store.read_plan("g", 0)[1] == 3
    before = store.stats()["round_trips"]
    store.read_plan("j", 5, want=True)
    assert store.stats()["round_trips"] == before + 1, "one pipelined round trip"


def test_unreachable_redis_is_a_clear_error_naming_the_address(capsys):
    port = free_port()
    with pytest.raises(ServiceUnavailableError, match=f"cannot reach Redis at redis://127.0.0.1:{port}/0"):
        create_server("127.0.0.1:0", decode_workers=0, redis_url=f"redis://127.0.0.1:{port}/0")
    assert cli_main(["serve", "--port", "0", "--redis", f"redis://127.0.0.1:{port}/0"]) == 2
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in capsys.readouterr().err


# --- replicas in this process -------------------------------------------------------------------
@pytest.fixture()
def two_replicas(redis_server):
    servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=redis_server.url,
                             job_options={"lease_ttl_s": 1.0}) for _ in range(2)]
    yield [f"127.0.0.1:{port}" for _, port, _ in servers], [s for _, _, s in servers]
    for server, _, _ in servers:
        server.stop(0).wait()


def test_ranks_on_different_replicas_get_what_one_node_sends(dataset, two_replicas):
    addresses, _ = two_replicas
    config = _config(dataset)
    reference, digests = _reference(config), _single_node_digests(config)
    out = {0: [], 1: []}
    _in_threads([lambda: _consume(addresses[0], config, 0, out[0]), lambda: _consume(addresses[1], config, 1, out[1])])
    for rank in (0, 1):
        assert [r for r, _ in out[rank]] == _planned(reference, rank)
        assert [d for _, d in out[rank]] == digests[rank], "same tensors as a single node"


def test_a_restored_trainer_continues_on_another_replica_with_the_same_data(dataset, two_replicas):
    addresses, _ = two_replicas
    config = _config(dataset)
    reference = _reference(config)
    head, tail = [], []
    state, _ = _consume(addresses[0], config, 1, head, stop_after=5)
    _consume(addresses[1], config, 1, tail, state=state)
    assert [r for r, _ in head + tail] == _planned(reference, 1)


@pytest.mark.parametrize("durable", [True, False], ids=["sigkill-with-aof", "restart-empty-without-aof"])
def test_redis_killed_and_restarted_mid_stream_loses_nothing(dataset, tmp_path, durable):
    """With AOF (as deployed) Redis comes back with every plan; without it, it comes back empty and
    the planner re-plans from step 0, which gives the same plans (planning is deterministic)."""
    redis_server = LocalRedis(tmp_path / "redis-bounce", appendonly=durable).start()
    servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=redis_server.url,
                             job_options={"lease_ttl_s": 1.0}) for _ in range(2)]
    addresses, servicers = [f"127.0.0.1:{port}" for _, port, _ in servers], [s for _, _, s in servers]
    config = _config(dataset, num_epochs=3)
    reference, out, restarted = _reference(config), {0: [], 1: []}, threading.Event()

    def bounce(count):
        if count == 6 and not restarted.is_set():
            restarted.set()
            redis_server.stop(kill=True)
            time.sleep(1.5)
            redis_server.start()

    _in_threads([lambda: _consume(addresses[0], config, 0, out[0], delay_s=0.05, after=bounce),
                 lambda: _consume(addresses[1], config, 1, out[1], delay_s=0.05)])
    assert restarted.is_set()
    for rank in (0, 1):
        assert [r for r, _ in out[rank]] == _planned(reference, rank)
    try:
        assert sum(s.jobs.factory.store.stats()["retries"] for s in servicers) > 0, "the replicas saw Redis go away"
        lost = sum(s.jobs.get(config.job_id()).plans.lost_writes for s in servicers)
        assert (lost > 0) == (not durable), "an empty Redis is lost writes, said; one with its AOF is not"
        warnings = [w for s in servicers for w in pb.JobSummary(**s.jobs.get(config.job_id()).summary()).warnings]
        assert any("lost acknowledged writes" in w for w in warnings) == (not durable), warnings  # in status
    finally:
        for server, _, _ in servers:
            server.stop(0).wait()
        redis_server.stop(kill=True)


def test_a_newer_stream_of_a_rank_stops_the_older_one(dataset, two_replicas):
    addresses, _ = two_replicas
    config = _config(dataset)
    with DataClient(addresses[0], config, 0) as client:
        job_id = client.job_id
    channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
    streams = [c.unary_stream(f"/{SERVICE_NAME}/StreamMicrobatches",
                              request_serializer=pb.StreamRequest.SerializeToString,
                              response_deserializer=pb.Microbatch.FromString) for c in channels]
    older = streams[0](pb.StreamRequest(job_id=job_id, dp_rank=0))
    assert next(older).step == 0
    newer = streams[1](pb.StreamRequest(job_id=job_id, dp_rank=0))
    assert next(newer).step == 0
    with pytest.raises(grpc.RpcError) as info:
        for _ in range(20):
            next(older)
    assert info.value.code() == grpc.StatusCode.ABORTED and "newer stream" in info.value.details()
    newer.cancel()
    for channel in channels:
        channel.close()


def test_acknowledged_steps_are_dropped_and_cannot_be_resumed(dataset, two_replicas):
    addresses, _ = two_replicas
    config = _config(dataset)
    out = []
    with DataClient(addresses[0], config, 0) as client:
        for _ in range(6):
            out.append(next(client))
        assert client.acknowledge(2) == 0
    with DataClient(addresses[1], config, 1) as client:
        assert client.acknowledge(2) == 2
        channel = grpc.insecure_channel(addresses[1], options=CHANNEL_OPTIONS)
        stream = channel.unary_stream(f"/{SERVICE_NAME}/StreamMicrobatches",
                                      request_serializer=pb.StreamRequest.SerializeToString,
                                      response_deserializer=pb.Microbatch.FromString)
        with pytest.raises(grpc.RpcError) as info:
            next(stream(pb.StreamRequest(job_id=client.job_id, dp_rank=1, start_step=1)))
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE and "dropped" in info.value.details()
        assert next(stream(pb.StreamRequest(job_id=client.job_id, dp_rank=1, start_step=2))).step == 2
        channel.close()


# --- replicas as processes ----------------------------------------------------------------------
def test_sigkill_of_the_planning_replica_mid_epoch_loses_and_repeats_nothing(dataset, redis_server, tmp_path):
    replicas = [Replica(redis_server.url, log_path=tmp_path / f"replica{i}.log",
                        extra_args=("--lease-ttl", "1.5")).start() for i in range(2)]
    try:
        config = _config(dataset, num_epochs=8)  # planning goes on long after the kill
        reference, out, killed, reconnects = _reference(config), {0: [], 1: []}, [], {}
        client = redis.Redis.from_url(redis_server.url)

        def kill_planner(count):
            if count == 5 and not killed:
                holder = client.get(f"disttrain:{{{config.job_id()}}}:planner").decode()
                victim = next(r for r in replicas if holder.startswith(f"replica-{r.address}/"))
                victim.kill()
                killed.append(victim)

        def rank(r, addresses, after=None):
            reconnects[r] = _consume(addresses, config, r, out[r], delay_s=0.05, after=after)[1]

        _in_threads([lambda: rank(0, [replicas[0].address, replicas[1].address], kill_planner),
                     lambda: rank(1, [replicas[1].address, replicas[0].address])])
        assert killed, "the planning replica was killed"
        assert sum(reconnects.values()) >= 1, "the rank on the killed replica moved to the other one"
        for r in (0, 1):
            assert [x for x, _ in out[r]] == _planned(reference, r)
        survivor = next(r for r in replicas if r is not killed[0])
        assert b"planning from step" in survivor.log_path.read_bytes(), "the survivor took the planning over"
    finally:
        for replica in replicas:
            replica.kill()


def test_chaos_random_replica_kills_lose_and_repeat_nothing(tmp_path):
    """bench/chaos.py, shortened: 3 replica processes, 4 ranks, a random replica SIGKILLed and
    restarted every 2-4 s for 30 s."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_chaos",
                                                  Path(__file__).resolve().parents[2] / "bench/chaos.py")
    bench_chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_chaos)
    chaos = bench_chaos.chaos

    figures = chaos(num_replicas=3, num_ranks=4, duration_s=30, kill_every_s=(2.0, 4.0), seed=1,
                    workdir=tmp_path, log=lambda _line: None)
    assert figures["replicas_killed"] >= 5
    assert figures["client_reconnects"] >= 1
    assert figures["samples_planned"] > 100  # enough to check (a loaded machine plans fewer in 30 s)
    assert figures["samples_lost"] == 0
    assert figures["samples_duplicated"] == 0
    assert figures["samples_misplaced"] == 0


def test_stream_and_acknowledgements_move_together_to_another_replica(dataset, redis_server):
    servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=redis_server.url) for _ in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port, _ in servers]
    config = _config(dataset)
    reference = _reference(config)
    try:
        with DataClient(addresses, config, 0, prefetch=1) as client:
            got = [_received(next(client)) for _ in range(3)]
            servers[0][0].stop(0).wait()  # replica A goes away under an open stream
            assert client.acknowledge(1) == 0, "the acknowledgement goes to replica B"
            got += [_received(mb) for mb in client]
            assert client.num_reconnects >= 1 and client.address == addresses[1]
        assert got == _planned(reference, 0)
    finally:
        for server, _, _ in servers:
            server.stop(0).wait()
