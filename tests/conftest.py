"""Markers: every test is ``unit`` (in-process, seconds) or ``integration`` (real gRPC servers,
redis-server, subprocesses, torchrun: minutes). ``./dev.sh test -m unit`` runs the fast half."""

import pytest

INTEGRATION_MODULES = {
    "test_attack_blocking", "test_attack_requests", "test_attack_samples", "test_attack_sources", "test_cli",
    "test_decode_pool", "test_deploy", "test_feedback", "test_memory_budget", "test_metrics_endpoint", "test_ops",
    "test_redis_faults", "test_remote_shards", "test_replicas", "test_service", "test_tensor_parallel", "test_train",
    "test_models", "test_mixture_service", "test_bench_train", "test_benches", "test_memory_e2e",
}
"""Modules whose tests start real servers or processes; the rest are unit tests."""


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        item.add_marker(pytest.mark.integration if module in INTEGRATION_MODULES else pytest.mark.unit)
