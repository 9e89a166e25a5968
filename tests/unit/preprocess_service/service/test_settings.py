"""ServiceSettings composes its components' own configs (the shard reader's, the memory budget's):
their fields are settings by the same names, their defaults are the components' defaults, and
what an operator sets reaches the component."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain_api.errors import ConfigError
from preprocess_service.adapters.infra.budget import MemoryBudget
from preprocess_service.adapters.infra.config import BudgetConfig
from preprocess_service.adapters.io.config import ReaderConfig
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.service import settings


@pytest.mark.parametrize("component", [ReaderConfig, BudgetConfig])
def test_every_component_setting_is_a_service_setting_with_the_components_default(component):
    composed = settings.ServiceSettings()
    for f in dataclasses.fields(component):
        assert f.name in settings.FIELDS and f"DISTTRAIN_{f.name.upper()}" in settings.ENV_NAMES
        assert getattr(composed, f.name) == f.default, f.name


def test_default_settings_build_the_default_reader_and_set_ones_reach_it():
    assert ShardReader.configured(settings.ServiceSettings()) == ShardReader()
    cfg = settings.load(environ={"DISTTRAIN_MAX_MEMBER_BYTES": "1000", "DISTTRAIN_MAX_SAMPLE_BYTES": "2000",
                                 "DISTTRAIN_SHARD_FETCH_RETRIES": "2", "DISTTRAIN_ALLOWED_SHARD_SCHEMES": "file,s3",
                                 "DISTTRAIN_MEMORY_WAIT_S": "7"})
    reader = ShardReader.configured(cfg)
    assert (reader.limits.max_member_bytes, reader.limits.max_sample_bytes, reader.fetch.retries,
            reader.policy.allowed_schemes) == (1000, 2000, 2, ("file", "s3"))
    assert MemoryBudget.configured(dataclasses.replace(cfg, memory_budget_bytes=1 << 20)).wait_s == 7


def test_a_component_checks_its_own_settings():
    with pytest.raises(ConfigError, match="max_sample_bytes"):
        settings.load(environ={"DISTTRAIN_MAX_SAMPLE_BYTES": "10", "DISTTRAIN_MAX_MEMBER_BYTES": "20"})
    with pytest.raises(ConfigError, match="memory_wait_s"):
        settings.load(environ={"DISTTRAIN_MEMORY_WAIT_S": "0"})
