"""A shard cache whose disk refuses downloads says so once per outage (ShardCache.disk_outage)."""

from __future__ import annotations

from preprocess_service.adapters.io.cache import ShardCache


def test_an_outage_is_said_at_its_first_failure_and_counted_at_its_end(tmp_path):
    cache = ShardCache(1 << 20, str(tmp_path))
    assert cache.disk_outage(False) is None  # no outage: nothing to say
    assert [cache.disk_outage(True) for _ in range(3)] == [0, None, None]  # said once
    assert cache.disk_outage(False) == 3  # back, after three refused downloads
    assert cache.disk_outage(False) is None
    assert cache.disk_outage(True) == 0  # a new outage is said again
