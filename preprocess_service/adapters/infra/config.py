"""The memory budget's own settings (BudgetConfig), composed by the service's settings
(service/settings.py) like the reader's (io/config.py). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain_api.errors import ConfigError
from preprocess_service.adapters.io.config import setting


@dataclass(kw_only=True, frozen=True)
class BudgetConfig:
    memory_budget_bytes: int = setting("bytes all streams and jobs may hold for data: decode buffers and shared "
                                       "memory, prepared microbatches, kept media; 0: half the machine's or "
                                       "container's memory", 0)
    memory_wait_s: float = setting("seconds a running stream waits for room in the memory budget before it fails "
                                   "RESOURCE_EXHAUSTED (its client resumes it later)", 30.0)
    memory_sample_s: float = setting("seconds between samples of the service's resident memory (the server's whole "
                                     "process tree: decode workers, fork server), which the memory budget counts "
                                     "beyond its charges; 0: charges only", 0.5)

    def check_budget(self) -> None:
        if not 0 <= self.memory_sample_s <= 60:
            raise ConfigError(f"memory_sample_s must be in [0, 60], got {self.memory_sample_s}")
        if self.memory_budget_bytes < 0 or not 0 < self.memory_wait_s <= 3600:
            raise ConfigError(f"memory_budget_bytes must be >= 0 and memory_wait_s in (0, 3600], got "
                              f"{self.memory_budget_bytes} and {self.memory_wait_s}")


BUDGET_DEFAULTS = BudgetConfig()
