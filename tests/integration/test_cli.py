"""The entry point as a user runs it: `python -m disttrain_tools run|serve`, real processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disttrain_tools import synth
from helpers import jpeg_bytes, shard_keys, write_tiny_shards

REPO = Path(__file__).resolve().parents[2]


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "disttrain_tools", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_run_on_user_shards_prints_the_figures_and_writes_the_report(tmp_path):
    paths = write_tiny_shards(tmp_path / "data", num_shards=3, samples_per_shard=10)
    bad = synth.write_corrupt_shard(tmp_path / "data" / "corrupt.tar", seed=2)
    report = tmp_path / "report.json"
    spec = f"{tmp_path}/data/{{00000..00002}}.tar"
    proc = _run("run", "--shards", spec, str(tmp_path / "data" / "corrupt.tar"), "--seq-len", "2048",
                "--dp-size", "2", "--num-microbatches", "2", "--seqs-per-microbatch", "1", "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for figure in ("samples/s", "sequences/s", "MB/s", "DP imbalance", "no reordering", "exactly-once: OK"):
        assert figure in proc.stdout, f"{figure!r} missing from:\n{proc.stdout}"
    data = json.loads(report.read_text())
    received = [k for rank in data["ranks"].values() for mb in rank["microbatches"] for k in mb["keys"]]
    assert all({"step", "microbatch", "keys"} <= set(mb) for mb in data["ranks"]["0"]["microbatches"])
    assert len(received) == len(set(received))
    assert {s["key"] for s in data["skipped"]} == set(bad)
    assert set(received) | set(bad) == shard_keys([*paths, tmp_path / "data" / "corrupt.tar"])
    assert data["exactly_once"]["ok"] and set(data["ranks"]) == {"0", "1"}


def _append(path: Path, members: list[tuple[str, bytes]]) -> None:
    """Appends raw members to an uncompressed tar (any name, repeated ones too)."""
    with tarfile.open(path, "a") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_run_on_shards_with_duplicates_passes_its_exactly_once_check(tmp_path):
    """A duplicate member and duplicate keys (in the same shard, in another) lose nothing: the first
    copy is delivered once, the other reported; the check counts each such key once and passes."""
    paths = write_tiny_shards(tmp_path / "data", num_shards=3, samples_per_shard=10)
    image = jpeg_bytes(64, 48, seed=7)
    _append(paths[0], [("dupmember.jpg", image), ("dupmember.txt", b"first"), ("dupmember.txt", b"second"),
                       ("000000005.jpg", image), ("000000005.txt", b"again, same shard")])
    _append(paths[1], [("000000003.jpg", image), ("000000003.txt", b"again, another shard")])
    report = tmp_path / "report.json"
    proc = _run("run", "--shards", str(tmp_path / "data"), "--seq-len", "2048", "--dp-size", "2",
                "--num-microbatches", "2", "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("exactly-once: OK (28 delivered once, 0 skipped with reasons, 3 delivered + reported duplicate, "
            "0 missing, 0 duplicated, of 31 keys)") in proc.stdout, proc.stdout
    data = json.loads(report.read_text())
    received = [k for rank in data["ranks"].values() for mb in rank["microbatches"] for k in mb["keys"]]
    assert sorted(received) == sorted(shard_keys(paths))
    assert sorted((s["key"], s["kind"]) for s in data["skipped"]) == [
        ("000000003", "duplicate_key"), ("000000005", "duplicate_key"), ("dupmember", "duplicate_member")]
    assert data["exactly_once"]["kept_first_copy"] == ["000000003", "000000005", "dupmember"]


def test_bad_arguments_are_named(tmp_path):
    proc = _run("run", "--shards", str(tmp_path / "missing.tar"))
    assert proc.returncode == 2
    assert "missing.tar' does not exist" in proc.stderr


def test_unreachable_service_address_is_a_clear_error(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=2)
    proc = _run("run", "--shards", str(tmp_path), "--address", "127.0.0.1:1", "--connect-timeout", "1")
    assert proc.returncode == 2
    assert "cannot reach the preprocessing service at '127.0.0.1:1'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_alone_on_a_port_answers_health_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1",
                             "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
