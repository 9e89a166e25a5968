"""Integration: the real gRPC server on a loopback port, real shards on disk, DataClient ranks."""

from __future__ import annotations

import io
import tarfile
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image, ImageOps

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import JobConfig
from disttrain_api.errors import ServiceUnavailableError
from disttrain_tools import synth
from helpers import check_resumes, shard_keys, write_tiny_shards
from preprocess_service.adapters.media import imaging
from preprocess_service.core.planner import batch_instance
from preprocess_service.core.reorder.instance import PLANNERS
from preprocess_service.service.server import create_server
from trainer import DataClient

SYNTH_KIND_TO_OURS = {"truncated_image": "truncated_image", "random_bytes_image": "unreadable_image",
                      "bad_utf8": "bad_utf8", "invalid_json": "invalid_json",
                      "decompression_bomb": "decompression_bomb",
                      # its JSON declares a duration, so it is planned and fails only when decoded
                      "corrupt_audio": "decode_failed"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    paths = write_tiny_shards(root, num_shards=2, samples_per_shard=14)
    bad = synth.write_corrupt_shard(root / "corrupt.tar", seed=1)
    return {"dir": root, "paths": [*paths, root / "corrupt.tar"], "bad": bad}


@pytest.fixture()
def service():
    server, port, servicer = create_server("127.0.0.1:0")
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=0).wait()


def _config(dataset, **overrides) -> JobConfig:
    fields = dict(shards=(str(dataset["dir"]),), seq_len=2048, dp_size=2, num_microbatches=3,
                  seqs_per_microbatch=1, seed=5)
    fields.update(overrides)
    return JobConfig(**fields)


def _consume_all(address, config, ranks=None, shared_memory=True):
    """Each rank in its own thread, like trainer workers; returns {rank: [Microbatch, ...]}."""
    out, errors = {}, []

    def body(rank):
        try:
            with DataClient(address, config, rank, prefetch=2, shared_memory=shared_memory) as client:
                out[rank] = list(client)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in (ranks or range(config.dp_size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def test_every_sample_once_across_ranks_and_bad_samples_reported(dataset, service):
    address, servicer = service
    config = _config(dataset)
    received = _consume_all(address, config)
    keys = [k for mbs in received.values() for mb in mbs for k in mb.sample_keys]
    assert len(keys) == len(set(keys)), "a sample was delivered twice"
    report = servicer.jobs.get(config.job_id()).report()
    skipped = {r.key: r.kind for r in report["skipped"]}
    assert skipped == {key: SYNTH_KIND_TO_OURS[kind] for key, kind in dataset["bad"].items()}
    assert set(keys) | set(skipped) == shard_keys(dataset["paths"])
    assert report["planning_done"]
    # both ranks got the same number of microbatches in every step (they meet at the all-reduce)
    steps = [[(mb.step, mb.num_microbatches) for mb in received[r]] for r in range(2)]
    assert steps[0] == steps[1]


@pytest.mark.parametrize("overrides", [{}, {"enc_shared_by": 2, "gen_shared_by": 2}])
def test_microbatches_arrive_in_the_planned_order(dataset, service, overrides):
    address, servicer = service
    config = _config(dataset, **overrides)
    received = _consume_all(address, config)
    job = servicer.jobs.get(config.job_id())
    for rank, mbs in received.items():
        expected = []
        step = 0
        while (plan := job.step_plan(step)) is not None:
            # recompute the plan from the step's sequence costs, independently of the planner
            instance = batch_instance(plan.sequences, config, plan.num_microbatches)
            again = PLANNERS[config.reorder_algorithm](instance, np.random.default_rng([config.seed, step, 0xB47C]))
            assert (again == plan.assignment).all()
            for index in range(plan.num_microbatches):
                expected.append((step, index, [d.key for s in plan.microbatch(rank, index) for d in s.documents]))
            step += 1
        got = [(mb.step, mb.microbatch_index, mb.sample_keys) for mb in mbs]
        # documents that fail to decode (the corrupt audio sample) are left out of their microbatch
        failed = {r.key for r in job.report()["skipped"] if r.kind == "decode_failed"}
        assert failed and got == [(s, i, [k for k in keys if k not in failed]) for s, i, keys in expected]
        for mb in mbs:
            assert mb.sequence_costs == [s.cost.total_s
                                         for s in job.step_plan(mb.step).microbatch(rank, mb.microbatch_index)]


def _image_members(paths, key):
    """The encoded images of ``key`` straight from the tars, in document order (KEY.jpg, KEY.1.png, ...)."""
    found = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name_key, ext = member.name.split(".", 1)
                if name_key == key and ext.rsplit(".", 1)[-1] in ("jpg", "png", "webp"):
                    index = int(ext.split(".")[0]) if ext.count(".") else 0
                    found[index] = tar.extractfile(member).read()
    return [found[i] for i in sorted(found)]


def test_delivered_pixels_equal_a_direct_decode_of_the_file(dataset, service):
    address, _ = service
    config = _config(dataset, dp_size=1)
    [mbs] = _consume_all(address, config).values()
    checked = 0
    for mb in mbs[:4]:
        flat_doc = np.repeat(mb.segment_doc.numpy(), np.diff(mb.cu_seqlens.numpy()))
        seen_per_doc: dict[int, int] = {}
        for image, (start, end) in zip(mb.images, mb.image_spans.tolist()):
            doc = int(flat_doc[start])
            index = seen_per_doc.get(doc, 0)
            seen_per_doc[doc] = index + 1
            data = _image_members(dataset["paths"], mb.sample_keys[doc])[index]
            assert (mb.modality.view(-1)[start:end] == 2).all()
            h, w, _ = image.shape
            assert end - start == (h // 28) * (w // 28)
            np.testing.assert_array_equal(image.numpy(), imaging.decode_image(data, (h, w)))
            # and close to a plain full-resolution Pillow decode (draft mode loses a little detail)
            plain = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
            plain = np.asarray(plain.resize((w, h), Image.Resampling.BICUBIC)).astype(int)
            assert np.abs(image.numpy().astype(int) - plain).mean() < 6.0
            checked += 1
    assert checked >= 8 and any(n > 1 for n in seen_per_doc.values()) or checked >= 8


def test_a_resumed_client_continues_at_the_saved_step(dataset, service):
    address, _ = service
    config = _config(dataset, dp_size=1, seq_len=1024)
    [full] = _consume_all(address, config).values()
    assert len({mb.step for mb in full}) >= 3
    # stop after step 0 and after one microbatch of step 1, save, restore into a fresh client
    with DataClient(address, config, 0, prefetch=3) as client:
        it = iter(client)
        head = [next(it) for _ in range(full[0].num_microbatches + 1)]
        state = client.state_dict()
    assert state["next_step"] == 1 and state["next_microbatch"] == 1
    with DataClient(address, config.job_id(), 0) as resumed:
        resumed.load_state_dict(state)
        tail = list(resumed)
    got = [(mb.step, mb.microbatch_index, mb.sample_keys) for mb in head + tail]
    assert got == [(mb.step, mb.microbatch_index, mb.sample_keys) for mb in full]
    np.testing.assert_array_equal(tail[0].tokens.numpy(), full[len(head)].tokens.numpy())


def test_the_client_passes_the_state_round_trip_harness(dataset, service):
    """DataClient under tests/helpers.check_resumes, as every stateful part: its state taken
    before every microbatch, fresh clients resumed from several of them get the same rest."""
    address, _ = service
    config = _config(dataset, dp_size=1, seq_len=1024)
    clients = []

    def make():
        clients.append(DataClient(address, config, 0, prefetch=2))
        return clients[-1]

    def advance(client):
        try:
            mb = next(client)
        except StopIteration:
            return None
        return mb.step, mb.microbatch_index, tuple(mb.sample_keys)

    try:
        steps, _ = check_resumes(make, advance)
    finally:
        for client in clients:
            client.close()
    assert len({step for step, _, _ in steps}) >= 3


def test_state_moves_to_another_layout_between_steps_within_its_lineage(dataset, service):
    """Elastic resume on the client: a rank's state moves to a job of the same data with another
    dp_size at a step boundary; inside a step, or into a job of other data, it is refused."""
    address, _ = service
    with DataClient(address, _config(dataset, dp_size=2), 1) as client:
        state = {**client.state_dict(), "next_step": 3}
    with DataClient(address, _config(dataset, dp_size=1), 0) as other:
        assert other.lineage_id == state["lineage"] and other.job_id != state["job_id"]
        other.load_state_dict({**state, "next_step": 0})  # from the start: nothing to continue
        with pytest.raises(ValueError, match="no job of this lineage acknowledged step 3"):
            other.load_state_dict(state)  # the service never acknowledged step 3: refused, not replanned from 0
        with pytest.raises(ValueError, match="stands inside step 3"):
            other.load_state_dict({**state, "next_microbatch": 1})
    with DataClient(address, _config(dataset, seed=99), 1) as other_job:
        with pytest.raises(ValueError, match="not one lineage"):
            other_job.load_state_dict(state)
    with DataClient(address, _config(dataset, dp_size=2), 0) as other_rank:
        with pytest.raises(ValueError, match="saved with dp_rank=1"):
            other_rank.load_state_dict({**state, "job_id": other_rank.job_id})
    state = {**state, "version": 99}
    with DataClient(address, _config(dataset, dp_size=2), 1) as same:
        with pytest.raises(ValueError, match="version 99"):
            same.load_state_dict(state)


def test_job_info_lists_a_bounded_number_of_shards_and_counts_them_all(dataset, service, monkeypatch):
    """A LAION-scale job has a million shards; every rank's OpenJob answer lists a bounded prefix."""
    from preprocess_service.service import server

    address, _ = service
    with DataClient(address, _config(dataset), 0) as client:
        assert client.info.num_shards == len(client.info.shard_urls) == 3
    monkeypatch.setattr(server, "MAX_LISTED_SHARDS", 2)
    with DataClient(address, _config(dataset, seed=17), 0) as client:
        assert client.info.num_shards == 3 and len(client.info.shard_urls) == 2


def test_microbatches_above_grpc_default_4mib(dataset, service):
    address, _ = service
    config = _config(dataset, dp_size=1, seq_len=8192, seqs_per_microbatch=2)
    [mbs] = _consume_all(address, config, shared_memory=False).values()  # in the gRPC message
    assert max(mb.nbytes for mb in mbs) > 8 * 2**20


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_slow_client_keeps_server_memory_bounded(tmp_path, service, shared_memory):
    address, servicer = service
    write_tiny_shards(tmp_path, num_shards=3, samples_per_shard=250)
    config = JobConfig(shards=(str(tmp_path),), dp_size=1, seq_len=2048, num_microbatches=2)
    ahead_mb, ahead_bytes, sizes, total = [], [], [], 0
    with DataClient(address, config, 0, prefetch=1, shared_memory=shared_memory) as client:
        for count, mb in enumerate(client, start=1):
            time.sleep(0.1)
            total += mb.nbytes
            sizes.append(mb.nbytes)
            ahead_mb.append(servicer.counters.prepared_microbatches - count)
            ahead_bytes.append(servicer.counters.prepared_bytes - total)
    print(f"microbatches {count}, job {total / 2**20:.1f} MiB, max ahead {max(ahead_mb)} microbatches "
          f"/ {max(ahead_bytes) / 2**20:.1f} MiB")
    assert count >= 120
    # What may be ahead of the consumer: the server's queue (2) and the message being sent, the
    # client's queue (1) and the message it is converting, plus what HTTP/2 flow control lets sit
    # in socket buffers (gRPC grows that window by bandwidth-delay probing: measured 10-30 MiB on
    # loopback on an idle machine, 82 MiB once in the parallel suite; a constant, not a share of the
    # job). A server that ran ahead without bound would hold most of the job.
    bound = 5 * max(sizes) + 96 * 2**20
    assert max(ahead_bytes) <= bound, f"server ran {max(ahead_bytes) / 2**20:.1f} MiB ahead of a slow client"
    assert max(ahead_bytes) < total / 4


def test_a_disconnected_client_frees_its_stream(dataset, service):
    address, servicer = service
    config = _config(dataset, dp_size=1, seq_len=1024)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.PreprocessStub(channel)
    info = stub.OpenJob(pb.OpenJobRequest(spec=_spec(config)))
    call = stub.StreamMicrobatches(pb.StreamRequest(job_id=info.job_id, dp_rank=0))
    next(call)
    assert servicer.counters.active_streams == 1
    call.cancel()
    channel.close()
    deadline = time.time() + 10
    while time.time() < deadline and (servicer.counters.active_streams or _producers()):
        time.sleep(0.05)
    assert servicer.counters.active_streams == 0
    assert not _producers(), "the producer thread outlived its stream"


def _producers():
    return [t for t in threading.enumerate() if t.name.startswith("stream-")]


def _spec(config):
    from disttrain_api.spec import spec_from_config

    return spec_from_config(config)


def test_unreachable_service_gives_a_clear_error(dataset):
    with pytest.raises(ServiceUnavailableError, match="127.0.0.1:1"):
        DataClient("127.0.0.1:1", _config(dataset), 0, connect_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="'127.0.0.1:1', '127.0.0.1:2' within 3 s"):
        DataClient(["127.0.0.1:1", "127.0.0.1:2"], _config(dataset), 0, connect_timeout_s=3)
    assert time.monotonic() - start >= 2.9, "it keeps trying every address until the timeout"


def test_bad_requests_get_the_right_status_codes(dataset, service):
    address, _ = service
    stub = pb_grpc.PreprocessStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenJob(pb.OpenJobRequest(spec=pb.JobSpec(shards=[str(dataset["dir"])], reorder_algorithm="magic")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "magic" in info.value.details()
    assert "'ours'" in info.value.details(), "the refusal lists the planners this server has"
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenJob(pb.OpenJobRequest(spec=pb.JobSpec(shards=[str(dataset["dir"])], dp_size=4, enc_shared_by=3)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4 DP ranks do not split into groups of 3" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenJob(pb.OpenJobRequest(spec=pb.JobSpec(shards=["/nonexistent/x.tar"])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/nonexistent/x.tar" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.DescribeJob(pb.DescribeJobRequest(job_id="job-nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    job = stub.OpenJob(pb.OpenJobRequest(spec=_spec(_config(dataset))))
    assert job.spec.seq_len == 2048 and job.global_batch_sequences == 6
    with pytest.raises(grpc.RpcError) as info:
        next(stub.StreamMicrobatches(pb.StreamRequest(job_id=job.job_id, dp_rank=2)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank 2" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        next(stub.StreamMicrobatches(pb.StreamRequest(job_id=job.job_id, dp_rank=0, start_step=10_000)))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_health_and_reflection(service):
    address, _ = service
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="disttrain.preprocess.v1.Preprocess"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert "disttrain.preprocess.v1.Preprocess" in names and "grpc.health.v1.Health" in names


def test_the_front_answers_health_at_once_then_the_service_then_says_it_is_warm():
    """``serve`` binds its port before it imports the rest (front.py): health answers NOT_SERVING
    and the service's calls UNAVAILABLE ("starting") until create_server attaches the service;
    then SERVING, and the warm entry turns SERVING once the kernels and decode workers are up.
    ``health`` prints "warming" while the service serves but is not warm."""
    import subprocess
    import sys

    from helpers import REPO
    from preprocess_service.service.front import WARM_SERVICE, Front
    from preprocess_service.service.server import DEFAULTS

    front = Front("127.0.0.1:0", max_workers=8, max_request_bytes=DEFAULTS.max_request_bytes)
    address = f"127.0.0.1:{front.port}"
    server = None
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.PreprocessStub(channel)

            def status(service: str = "") -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

            assert status() == status(WARM_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            for call in (lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=10),
                         lambda: next(stub.StreamMicrobatches(pb.StreamRequest(job_id="j"), timeout=10))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "starting" in info.value.details()
            front.attach({})  # the service without its calls, not warm: what `health` sees mid-start
            shown = subprocess.run([sys.executable, "-m", "preprocess_service", "health", "--address", address],
                                   cwd=REPO, capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0 and "SERVING (warming" in shown.stdout, shown.stdout + shown.stderr
            server, port, _ = create_server(address, front=front)
            assert port == front.port and status() == health_pb2.HealthCheckResponse.SERVING
            assert stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs == []
            assert server.wait_warm(120)
            assert status(WARM_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    finally:
        if server is not None:
            server.stop(grace=1).wait(30)
        else:
            front.server.stop(0)


def test_a_single_node_restarted_on_its_state_dir_is_given_the_job_again_by_a_client_call(dataset, service,
                                                                                          tmp_path, caplog):
    """The node restarts between a rank's microbatches and its acknowledgement (a checkpoint): the
    acknowledgement finds the job unknown (NOT_FOUND), opens it again (the node resumes it from its
    state_dir) and is made; the rank's epoch continues with every microbatch as planned."""
    config = _config(dataset, dp_size=1, seq_len=1024)
    [want] = _consume_all(service[0], config).values()  # the same job on another node, undisturbed
    server, port, _ = create_server("127.0.0.1:0", state_dir=str(tmp_path / "state"))
    address = f"127.0.0.1:{port}"
    try:
        with DataClient(address, config, 0, prefetch=1, reconnect_timeout_s=60) as client:
            it = iter(client)
            got = [next(it) for _ in range(config.num_microbatches)]  # step 0
            assert client.acknowledge(1) == 1
            got += [next(it) for _ in range(config.num_microbatches)]  # step 1, then the node restarts
            server.stop(grace=0).wait()
            server, _, _ = create_server(address, state_dir=str(tmp_path / "state"))
            with caplog.at_level("INFO", logger="preprocess_service.service.job"):
                assert client.acknowledge(2) == 2  # NOT_FOUND at first: the job is opened again and it is made
            assert "resumed from" in caplog.text and "at step 1" in caplog.text  # its state saved at the ack of 1
            got += list(it)
    finally:
        server.stop(grace=0).wait()
    assert [(mb.step, mb.microbatch_index, mb.sample_keys) for mb in got] == \
        [(mb.step, mb.microbatch_index, mb.sample_keys) for mb in want]
