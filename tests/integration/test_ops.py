"""What operators use: settings from file, environment and flags; the Prometheus endpoint;
JSON logs with job, step and rank; the status command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError
from disttrain_tools import synth
from disttrain_tools.localcluster import LocalRedis, free_port
from helpers import write_tiny_shards
from preprocess_service.adapters.infra.metrics import REDIS_LATENCY
from preprocess_service.adapters.infra.store import RedisStore
from preprocess_service.service.settings import ENV_NAMES, load
from trainer import Credentials, DataClient

REPO = Path(__file__).resolve().parents[2]


def test_settings_file_then_environment_then_flags(tmp_path):
    config = tmp_path / "disttrain.toml"
    config.write_text('port = 6000\nmax_open_jobs = 3\nallowed_shard_prefixes = ["/data", "s3://b/"]\n'
                      'redis_url = "redis://file:6379/0"\n')
    env = {"DISTTRAIN_CONFIG": str(config), "DISTTRAIN_PORT": "7000", "DISTTRAIN_AUTH_TOKENS": "a, b",
           "DISTTRAIN_LEASE_TTL_S": "2.5"}
    s = load(environ=env, overrides={"port": "8000", "metrics_port": None})
    assert s.port == 8000 and s.max_open_jobs == 3 and s.redis_url == "redis://file:6379/0"
    assert s.allowed_shard_prefixes == ("/data", "s3://b/") and s.auth_tokens == ("a", "b") and s.lease_ttl_s == 2.5
    assert s.metrics_port == 9400  # an unset flag leaves the default
    assert load(environ={"DISTTRAIN_PORT": "7000"}).port == 7000
    assert all(name.startswith("DISTTRAIN_") for name in ENV_NAMES)


@pytest.mark.parametrize("env, message", [
    ({"DISTTRAIN_PORT": "http"}, "setting port = 'http' is not a valid int"),
    ({"DISTTRAIN_TLS_CERT": "c.pem"}, "tls_cert and tls_key go together"),
    ({"DISTTRAIN_LOG_FORMAT": "xml"}, "log_format must be text or json"),
    ({"DISTTRAIN_CONFIG": "/nonexistent/disttrain.toml"}, "cannot read the settings file"),
])
def test_bad_settings_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load(environ=env)


def test_unknown_setting_in_a_file_is_named(tmp_path):
    (tmp_path / "s.toml").write_text("prot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown settings \['prot'\]"):
        load(tmp_path / "s.toml", environ={})


def test_redis_round_trips_are_timed(tmp_path):
    with LocalRedis(tmp_path / "redis") as server:
        before = _histogram_count(REDIS_LATENCY)
        store = RedisStore(server.url)
        store.register_job("job-x", b"spec")
        store.job_spec("job-x")
        store.close()
        assert _histogram_count(REDIS_LATENCY) >= before + 2


def _histogram_count(histogram) -> float:
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops-shards")
    write_tiny_shards(root, num_shards=2, samples_per_shard=16)
    synth.write_corrupt_shard(root / "corrupt.tar", seed=3)
    return root


def test_served_metrics_json_logs_and_status(shards, tmp_path):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DISTTRAIN_LOG_FORMAT": "json", "DISTTRAIN_AUTH_TOKENS": "tok,other"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--metrics-port", str(metrics_port), "--decode-workers", "0"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + log_path.read_text()
        assert "token auth" in proc.stdout.readline()
        config = JobConfig(shards=(str(shards),), seq_len=2048, dp_size=2, num_microbatches=2, seqs_per_microbatch=1)
        creds = Credentials(token="tok")
        clients = [DataClient(f"127.0.0.1:{port}", config, rank, prefetch=1, credentials=creds) for rank in (0, 1)]
        received = [mb for mb in clients[0]]  # rank 0 reads the whole epoch, rank 1 its first step
        next(clients[1]), next(clients[1])
        lag = f'disttrain_stream_lag_steps{{job="{clients[0].job_id}",rank="1"}}'
        deadline = time.monotonic() + 60  # generous: a loaded machine sends slower
        while lag not in (metrics := _scrape(metrics_port)) and time.monotonic() < deadline:
            time.sleep(0.1)  # the server counts a step once its last microbatch is handed to gRPC
        samples = sum(len(mb.sample_keys) for mb in received)
        assert metrics['disttrain_items_sent_total{modality="sample"}'] >= samples > 0
        assert metrics['disttrain_items_sent_total{modality="image"}'] > 0
        assert metrics["disttrain_microbatches_sent_total"] >= len(received)
        # the report first: a sample is counted as it is skipped, before the report holds it, and rank 1's
        # stream still decodes ahead (its skips may land between a scrape and a later report)
        report = clients[0].report()
        decode_errors = {k: v for k, v in _scrape(metrics_port).items()
                         if k.startswith("disttrain_decode_errors_total{")}
        assert sum(decode_errors.values()) >= len(report.skipped) > 0
        for kind in {s.kind for s in report.skipped}:
            assert any(f'reason="{kind}"' in k for k in decode_errors), kind
        job = clients[0].job_id
        assert metrics[f'disttrain_step_dp_imbalance{{job="{job}"}}'] >= 1.0
        assert 0 <= metrics[f'disttrain_step_bubble_fraction{{job="{job}",source="predicted"}}'] < 1
        assert metrics[f'disttrain_stream_lag_steps{{job="{job}",rank="1"}}'] >= 1, "rank 1 is behind rank 0"
        assert metrics["disttrain_active_streams"] >= 1
        assert metrics['disttrain_queue_depth{queue="send"}'] >= 0

        status = subprocess.run([sys.executable, "-m", "preprocess_service", "status", "--address",
                                 f"127.0.0.1:{port}", "--job-id", job], cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "DISTTRAIN_AUTH_TOKEN": "tok"}, timeout=60)
        assert status.returncode == 0, status.stderr
        assert f"job {job}: 2 ranks" in status.stdout and "planned" in status.stdout and "imbalance" in status.stdout
        listed = subprocess.run([sys.executable, "-m", "preprocess_service", "status", "--address",
                                 f"127.0.0.1:{port}"], cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "DISTTRAIN_AUTH_TOKEN": "tok"}, timeout=60)
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if job in line)
        assert "1 open job(s)" in listed.stdout and "default / token:" in row, listed.stdout
        assert row.split()[1] == "2" and int(row.split()[3]) >= len(received), row  # ranks, microbatches sent
        print(listed.stdout)
        other = subprocess.run([sys.executable, "-m", "preprocess_service", "status", "--address",
                                f"127.0.0.1:{port}"], cwd=REPO, capture_output=True, text=True,
                               env={**os.environ, "DISTTRAIN_AUTH_TOKEN": "other"}, timeout=60)
        assert other.stdout.strip() == "no open jobs", "another token sees none of this token's jobs"
        denied = subprocess.run([sys.executable, "-m", "preprocess_service", "status", "--address",
                                 f"127.0.0.1:{port}", "--job-id", job], cwd=REPO, capture_output=True, text=True,
                                env={k: v for k, v in os.environ.items() if k != "DISTTRAIN_AUTH_TOKEN"}, timeout=60)
        assert denied.returncode == 2 and "bearer token" in denied.stderr
        for client in clients:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    opened = [r for r in records if r["message"].startswith("stream opened")]
    assert {(r["job"], r["rank"]) for r in opened} == {(job, 0), (job, 1)}
    assert all({"time", "level", "logger"} <= set(r) for r in records)
    skipped = [r for r in records if r["message"].startswith("skipped sample")]
    assert len([r for r in skipped if r["rank"] == 0]) == sum(len(mb.skipped) for mb in received)
    assert all(r["job"] == job and "step" in r for r in skipped)
