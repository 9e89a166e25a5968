"""The time each trainer rank waits for data: a property, a metric, and a warning when data is the
bottleneck (a consumer that does nothing waits on the service nearly all the time)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from disttrain_api.config import JobConfig
from helpers import write_tiny_shards
from preprocess_service.service.server import create_server
from trainer import DataClient
from trainer import client as client_module


def test_a_rank_that_waits_on_the_service_is_told_and_measured(tmp_path, caplog, monkeypatch):
    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=20)
    monkeypatch.setattr(client_module, "WAIT_WINDOW", 4)
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    config = JobConfig(shards=(str(tmp_path),), seq_len=512, num_microbatches=2, shuffle_buffer=8)
    before = REGISTRY.get_sample_value("disttrain_client_data_wait_seconds_total", {"rank": "0"}) or 0.0
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.client"), \
                DataClient(f"127.0.0.1:{port}", config, 0, prefetch=1) as client:
            count = sum(1 for _ in client)
    finally:
        server.stop(0).wait()
    assert count > 4
    assert client.data_wait_s > 0 and 0 < client.data_wait_fraction <= 1
    after = REGISTRY.get_sample_value("disttrain_client_data_wait_seconds_total", {"rank": "0"})
    assert after - before == pytest.approx(client.data_wait_s, rel=1e-6)
    assert any("data is the bottleneck" in r.getMessage() for r in caplog.records), caplog.text
