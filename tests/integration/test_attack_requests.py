"""Adversarial requests: every job-spec number at and past its bounds, hostile timing reports,
spoofed identities, abandoned and closed jobs; each answered with the right status code, the
server unharmed."""

from __future__ import annotations

import dataclasses
import math
import time

import grpc
import pytest

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import AudioConfig, CostConfig, GenerationConfig, ImageConfig, JobConfig
from disttrain_api.errors import ConfigError, ServiceUnavailableError
from disttrain_api.spec import spec_from_config
from helpers import write_tiny_shards
from preprocess_service.service.server import create_server
from preprocess_service.service.settings import ServiceSettings
from trainer import Credentials, DataClient


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack-requests")
    write_tiny_shards(root, num_shards=1, samples_per_shard=8)
    return root


def _config(root, **kw):
    fields = dict(shards=(str(root),), seq_len=2048, dp_size=1, num_microbatches=1, seqs_per_microbatch=1)
    fields.update(kw)
    return JobConfig(**fields)


def _bound_cases():
    """(where, field, value at a bound, value past it) for every bounded number of a job spec."""
    cases = []
    for name, (low, high) in JobConfig.BOUNDS.items():
        cases += [("job", name, low, low - 1), ("job", name, high, high + 1)]
    for name, (low, high) in ImageConfig.BOUNDS.items():
        cases += [("image", name, high, high + 1), ("image", name, None, low - 1)]
    for name, (low, high) in AudioConfig.BOUNDS.items():
        cases += [("audio", name, low, low - 1), ("audio", name, None, high + 1)]
    cases += [("audio", "max_seconds", 3600.0, 3600.5), ("audio", "max_seconds", None, -1.0),
              ("audio", "max_seconds", None, math.inf), ("audio", "max_seconds", None, math.nan),
              ("generation", "image_size", 2048, 2049), ("generation", "image_size", 8, 7),
              ("generation", "query_tokens", 4096, 4097), ("generation", "query_tokens", 1, 0),
              ("job", "max_error_fraction", 1.0, 1.5), ("job", "max_error_fraction", None, 0.0),
              ("job", "max_error_fraction", None, math.nan),
              ("job", "enc_shared_by", 1, 2), ("job", "gen_shared_by", 1, 2)]
    for f in dataclasses.fields(CostConfig):
        if f.type == "float":
            cases += [("cost", f.name, 1e6, 1e6 * 2), ("cost", f.name, 0.0, -1e-9), ("cost", f.name, None, math.inf),
                      ("cost", f.name, None, math.nan)]
    return cases


def _with(root, where, name, value):
    if where == "job":
        return _config(root, **{name: value})
    nested = {"image": ImageConfig, "audio": AudioConfig, "generation": GenerationConfig, "cost": CostConfig}[where]
    return _config(root, **{where: nested(**{name: value})})


@pytest.mark.parametrize("where,name,ok,bad", _bound_cases(), ids=lambda v: str(v))
def test_every_spec_number_has_a_documented_range(shards, where, name, ok, bad):
    if ok is not None:
        try:
            _with(shards, where, name, ok)
        except ConfigError as exc:  # at the bound: only another field's rule may object
            assert name not in str(exc).split(" ")[0], exc
    with pytest.raises(ConfigError) as info:
        _with(shards, where, name, bad)
    assert name in str(info.value)


@pytest.fixture(scope="module")
def server():
    limits = ServiceSettings(max_open_jobs=6, max_open_jobs_per_client=4, job_idle_ttl_s=2.0, max_seq_len=65536)
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0, settings=limits)
    yield f"127.0.0.1:{port}", servicer
    server.stop(0).wait()


def _stub(address):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return channel, pb_grpc.PreprocessStub(channel)


def _raw_spec(root, **fields) -> pb.JobSpec:
    spec = spec_from_config(_config(root))
    for name, value in fields.items():
        target = spec
        *path, leaf = name.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return spec


def test_out_of_range_specs_are_invalid_argument_naming_the_field(server, shards):
    address, _ = server
    channel, stub = _stub(address)
    cases = {"seq_len": 2**31, "dp_size": 10**6, "num_microbatches": 10**5, "seqs_per_microbatch": 4096,
             "num_epochs": 2**31, "shuffle_buffer": 2**30, "pack_window": 10**6, "enc_shared_by": 7,
             "max_consecutive_errors": 2**31, "max_error_fraction": 7.0, "image.patch_size": 10**6,
             "image.max_source_pixels": 2**62, "audio.sample_rate": 2**31, "audio.n_mels": 10**6,
             "audio.n_fft": 10**7, "generation.image_size": 8192, "generation.query_tokens": 10**6,
             "cost.bb_linear_s": math.inf, "cost.gen_per_image_s": math.nan, "cost.enc_linear_s": -5.0}
    try:
        for field, value in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards, **{field: value})), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field.split(".")[-1] in info.value.details(), (field, info.value.details())
        stage_map = _raw_spec(shards)
        stage_map.stage_map[:] = ["bb"] * 100_000
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenJob(pb.OpenJobRequest(spec=stage_map), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stage" in info.value.details()
        # within the spec's bounds but past this server's: its own limits, named
        for field, value, words in (("seq_len", 1 << 20, "max_seq_len"),
                                    ("seqs_per_microbatch", 1024, "max_microbatch_bytes")):
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards, **{field: value})), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
        assert stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards)), timeout=10).job_id  # still serving
    finally:
        channel.close()


def test_hostile_timing_reports_are_refused(shards, server):
    address, _ = server
    config = _config(shards, cost_feedback=True, seed=11)
    with DataClient(address, config, 0) as client:
        next(client)
        for bad in (math.inf, -math.inf, math.nan, -1.0, 1e12):
            with pytest.raises(grpc.RpcError) as info:
                client.report_timings([(0, 0, bad, 0.1, 0.1)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "encoder_s" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                client.report_timings([(0, 0, 0.1, 0.1, 0.1)], bubble=(0, bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bubble" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                client.report_totals([(0, 0, 1e-310)])  # would weigh the fit without bound
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "below" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                client.report_totals([(0, 0, bad)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_s" in info.value.details()
        channel, stub = _stub(address)
        try:
            flood = pb.TimingReport(job_id=client.job_id, timings=[pb.MicrobatchTiming(step=0)] * 70_000)
            with pytest.raises(grpc.RpcError) as info:
                stub.ReportTimings(flood, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            both = pb.TimingReport(job_id=client.job_id, timings=[pb.MicrobatchTiming(step=0, encoder_s=1, total_s=2)])
            with pytest.raises(grpc.RpcError) as info:
                stub.ReportTimings(both, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_s alone" in info.value.details()
            wrong_rank = pb.TimingReport(job_id=client.job_id, timings=[pb.MicrobatchTiming(step=0, dp_rank=5)])
            with pytest.raises(grpc.RpcError) as info:
                stub.ReportTimings(wrong_rank, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in info.value.details()
        finally:
            channel.close()
        assert client.report_timings([(0, 0, 0.1, 0.2, 0.3)]).num_observations >= 1  # a sane report still works


def test_with_tokens_a_job_belongs_to_its_token_and_headers_without_auth_prove_nothing(shards):
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, auth_tokens=("alice", "mallory"),
                                    settings=ServiceSettings(max_streams_per_client=1))
    address = f"127.0.0.1:{port}"
    try:
        config = _config(shards, cost_feedback=True, seed=12)
        with DataClient(address, config, 0, credentials=Credentials(token="alice")) as alice:
            next(alice)
            channel, stub = _stub(address)
            mallory = (("authorization", "Bearer mallory"),)
            try:
                calls = {"DescribeJob": lambda: stub.DescribeJob(pb.DescribeJobRequest(job_id=alice.job_id),
                                                                 metadata=mallory, timeout=10),
                         "ReportTimings": lambda: stub.ReportTimings(pb.TimingReport(
                             job_id=alice.job_id, timings=[pb.MicrobatchTiming(step=0, encoder_s=1e3)]),
                             metadata=mallory, timeout=10),
                         "CloseJob": lambda: stub.CloseJob(pb.CloseJobRequest(job_id=alice.job_id), metadata=mallory,
                                                           timeout=10),
                         "GetReport": lambda: stub.GetReport(pb.ReportRequest(job_id=alice.job_id), metadata=mallory,
                                                             timeout=10),
                         "OpenJob": lambda: stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)),
                                                         metadata=mallory, timeout=10)}
                for name, call in calls.items():
                    with pytest.raises(grpc.RpcError) as info:
                        call()
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            finally:
                channel.close()
            assert next(alice).tokens.numel() > 0  # alice's job is untouched
            assert alice.report().job_id == alice.job_id
    finally:
        server.stop(0).wait()
    # auth off: a made-up authorization header does not buy a new identity's stream quota
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, settings=ServiceSettings(max_streams_per_client=1))
    address = f"127.0.0.1:{port}"
    try:
        first = DataClient(address, _config(shards, num_epochs=1000, seed=13), 0, prefetch=1)
        next(first)
        for fake in ("Bearer a", "Bearer b", "x"):
            spoofed = DataClient(address, first.job_id, 0, prefetch=1, reconnect_timeout_s=1,
                                 credentials=Credentials(token=fake))
            with pytest.raises(ServiceUnavailableError, match="RESOURCE_EXHAUSTED.*max_streams_per_client"):
                next(spoofed)
            spoofed.close()
        first.close()
    finally:
        server.stop(0).wait()


def test_close_job_ends_its_streams_and_frees_it(shards, server):
    address, servicer = server
    client = DataClient(address, _config(shards, num_epochs=1000, seed=14), 0, prefetch=1)
    next(client)
    assert servicer.jobs.is_open(client.job_id)
    other = DataClient(address, client.job_id, 0)
    assert other.close_job() == 1
    with pytest.raises(ServiceUnavailableError, match="CANCELLED.*closed"):
        for _ in range(100):
            next(client)
    assert not servicer.jobs.is_open(client.job_id)
    with pytest.raises(grpc.RpcError) as info:
        other.report()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "closed" in info.value.details()
    # a rank made with the job's config, which opens a job a restarted node forgot, does not
    # open a closed one again
    with pytest.raises(grpc.RpcError) as info:
        client.acknowledge(1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not servicer.jobs.is_open(client.job_id)
    client.close()
    other.close()
    with DataClient(address, _config(shards, num_epochs=1000, seed=14), 0, prefetch=1) as again:
        next(again)  # opening its config again starts it anew
        assert servicer.jobs.is_open(again.job_id) and again.acknowledge(1) == 1
        again.close_job()


def test_abandoned_jobs_expire_and_limits_name_the_way_out(shards, server):
    address, servicer = server
    channel, stub = _stub(address)
    try:
        ids = [stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards, seed=100 + i)), timeout=10).job_id
               for i in range(4)]
        with pytest.raises(grpc.RpcError) as info:  # a fifth job from the same client
            stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards, seed=200)), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_open_jobs_per_client" in info.value.details() and "retry in" in info.value.details()
        pushback = dict(info.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        assert pushback is not None and int(pushback) > 0
        deadline = time.monotonic() + 15
        while any(servicer.jobs.is_open(i) for i in ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(servicer.jobs.is_open(i) for i in ids)  # expired after job_idle_ttl_s, freed
        assert stub.OpenJob(pb.OpenJobRequest(spec=_raw_spec(shards, seed=200)), timeout=10).job_id
    finally:
        channel.close()


def test_a_job_with_an_open_stream_does_not_expire(shards, server):
    address, servicer = server
    with DataClient(address, _config(shards, num_epochs=1000, seed=15), 0, prefetch=1) as client:
        next(client)
        time.sleep(4)  # twice the idle TTL, the client reading nothing
        assert servicer.jobs.is_open(client.job_id)
        assert next(client).tokens.numel() > 0


def test_with_replicas_a_job_belongs_to_the_token_that_opened_it_on_any_replica(shards, tmp_path):
    from disttrain_tools.localcluster import LocalRedis

    with LocalRedis(tmp_path / "redis") as redis:
        servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=redis.url, auth_tokens=("alice", "mallory"))
                   for _ in range(2)]
        a, b = (f"127.0.0.1:{port}" for _, port, _ in servers)
        try:
            with DataClient(a, _config(shards, seed=21), 0, credentials=Credentials(token="alice")) as alice:
                next(alice)
                channel, stub = _stub(b)  # the other replica learns the job from Redis
                try:
                    with pytest.raises(grpc.RpcError) as info:
                        stub.DescribeJob(pb.DescribeJobRequest(job_id=alice.job_id),
                                         metadata=(("authorization", "Bearer mallory"),), timeout=10)
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert stub.DescribeJob(pb.DescribeJobRequest(job_id=alice.job_id),
                                            metadata=(("authorization", "Bearer alice"),), timeout=10).job_id
                finally:
                    channel.close()
        finally:
            for server, _, _ in servers:
                server.stop(0).wait()


def test_with_replicas_decode_failures_are_in_every_replicas_report(tmp_path):
    import json

    import webdataset as wds

    from disttrain_tools.localcluster import LocalRedis

    root = tmp_path / "data"
    write_tiny_shards(root, num_shards=1, samples_per_shard=6)
    with wds.TarWriter(str(root / "00001.tar")) as writer:  # planned from its JSON duration, fails to decode
        writer.write({"__key__": "bad-audio", "flac": b"not audio at all" * 64, "txt": b"a clip",
                      "json": json.dumps({"duration": 2.0}).encode()})
    with LocalRedis(tmp_path / "redis") as redis:
        servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=redis.url) for _ in range(2)]
        a, b = (f"127.0.0.1:{port}" for _, port, _ in servers)
        try:
            config = _config(root, seed=22)
            with DataClient(a, config, 0) as client:
                keys = [k for mb in client for k in mb.sample_keys]
            assert "bad-audio" not in keys and len(keys) == 6
            with DataClient(b, client.job_id, 0) as other:  # a replica that streamed nothing
                skipped = {s.key: s.kind for s in other.report().skipped}
            assert skipped.get("bad-audio") == "decode_failed", skipped
        finally:
            for server, _, _ in servers:
                server.stop(0).wait()
