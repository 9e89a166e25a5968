"""Nothing blocks the server: clients that stop reading, replicas that are stopped (SIGSTOP, not
killed), and SIGTERM with stuck calls all end within a bound, and no microbatch is lost or sent
twice."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import JobConfig
from disttrain_api.spec import spec_from_config
from helpers import shard_keys, write_tiny_shards
from preprocess_service.service.server import create_server
from trainer import DataClient


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack-blocking")
    paths = write_tiny_shards(root, num_shards=2, samples_per_shard=16)
    return root, paths


def _config(root, **kw):
    fields = dict(shards=(str(root),), seq_len=2048, dp_size=1, num_microbatches=2, seqs_per_microbatch=1)
    fields.update(kw)
    return JobConfig(**fields)


def _stalled_streams(address, config, count):
    """Opens ``count`` streams that are never read (a peer alive but not reading)."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.PreprocessStub(channel)
    info = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=30)
    calls = [stub.StreamMicrobatches(pb.StreamRequest(job_id=info.job_id, dp_rank=0)) for _ in range(count)]
    return channel, calls


def test_a_client_that_stops_reading_is_cut_off_and_its_memory_freed(shards):
    root, _ = shards
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0,
                                           stream_stall_timeout_s=2.0, max_streams_per_client=0)
    try:
        channel, calls = _stalled_streams(f"127.0.0.1:{port}", _config(root, num_epochs=1000), 3)
        deadline = time.monotonic() + 60
        while servicer.watchdog.num_cancelled < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert servicer.watchdog.num_cancelled >= 3
        while servicer.counters.active_streams and time.monotonic() < deadline:
            time.sleep(0.2)
        assert servicer.counters.active_streams == 0
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.CANCELLED
        channel.close()
    finally:
        server.stop(0).wait()


def _serve(*flags):
    proc = subprocess.Popen([sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "0", "--decode-workers", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if match:
            return proc, f"127.0.0.1:{match.group(1)}"
    raise AssertionError(f"serve exited with {proc.wait()}")


def test_sigterm_drains_and_exits_within_its_grace_with_stuck_calls(shards, tmp_path):
    root, paths = shards
    fifo = tmp_path / "stuck.tar"
    os.mkfifo(fifo)
    proc, address = _serve("--shutdown-grace-s", "2", "--shard-read-timeout-s", "600")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # its log, read as an operator's
    try:
        channel, calls = _stalled_streams(address, _config(root, num_epochs=1000), 4)
        time.sleep(2)  # the streams are open and blocked on clients that do not read
        deadline = time.monotonic() + 180  # and the server is warm: a first start may still compile its kernels
        while not any("warm in" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # keep what it was doing: every thread's stack (faulthandler)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError("the server did not exit within 30 s of SIGTERM; its log and stacks:\n"
                                 + "".join(lines[-200:])) from None
        assert time.monotonic() - started < 15 and code == 0
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stopped_replica_fails_over_with_nothing_lost_or_repeated(shards):
    root, paths = shards
    first, a = _serve()
    second, b = _serve()
    stopped = False
    try:
        config = _config(root, num_epochs=3)
        keys = Counter()
        with DataClient([a, b], config, 0, prefetch=1, keepalive_s=1.0, reconnect_timeout_s=60) as client:
            positions = []
            for mb in client:
                positions.append((mb.step, mb.microbatch_index))
                keys.update(mb.sample_keys)
                if len(positions) == 3:
                    assert client.address == a
                    first.send_signal(signal.SIGSTOP)  # alive, holding its connections, answering nothing
                    stopped, started = True, time.monotonic()
            assert client.address == b and client.num_reconnects >= 1
            assert client.resumed_at and client.resumed_at[0] - started < 30
            report = client.report()
        lost = {s.key for s in report.skipped if s.key}
        assert set(keys) == shard_keys(paths) - lost and set(keys.values()) == {3}  # each key once per epoch
        assert positions == sorted(set(positions))  # every microbatch once, in order
    finally:
        if stopped:
            first.send_signal(signal.SIGCONT)
        for proc in (first, second):
            proc.kill()
            proc.wait()
