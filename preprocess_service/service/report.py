"""The job's report: samples it skipped (one record per lost sample, per shard problem, per dropped
duplicate copy) and each held step's balance."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from disttrain_api.errors import SampleError
from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.plugins.hooks import HookCosts, add_costs
from preprocess_service.core.planner import StepPlan


@dataclass(frozen=True, slots=True)
class SkippedRecord:
    key: str
    shard: str
    reason: str
    kind: str

    @classmethod
    def of(cls, problem: SampleError) -> SkippedRecord:
        return cls(problem.key, problem.shard, problem.reason, problem.kind)

    @property
    def record_id(self) -> str:
        """One record per lost sample (its key), per shard problem, and per dropped duplicate copy."""
        if not self.key:
            return f"<shard {self.shard}>"
        if self.kind in SampleError.NOT_LOST:
            return f"{self.key}\x00{self.kind}\x00{self.shard}"
        return self.key

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "shard": self.shard, "reason": self.reason, "kind": self.kind},
                          sort_keys=True)


class PluginCosts:
    """What a job's plugin hooks have spent in this process's workers (thread-safe): fed by the
    sample-hook worker after each sample and by each decoded microbatch; read by JobReport.plugins
    and counted in the disttrain_plugin_* metrics."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self._lock = threading.Lock()
        self._costs: HookCosts = {}

    def add(self, costs: HookCosts) -> None:
        if not costs:
            return
        with self._lock:
            add_costs(self._costs, costs)
        for (plugin, hook), cost in costs.items():
            metrics.plugin_spent(self.job_id, plugin, hook, cost.cpu_s, cost.calls)

    def rows(self) -> list[dict]:
        """One dict per (plugin, hook): plugin, hook, cpu_s, calls (JobReport.plugins), sorted."""
        with self._lock:
            return [{"plugin": plugin, "hook": hook, "cpu_s": cost.cpu_s, "calls": cost.calls}
                    for (plugin, hook), cost in sorted(self._costs.items())]


class SkipLog:
    """This process's skipped samples, each counted once in the metrics (stage "plan" or "decode")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, SkippedRecord] = {}

    def planning_skip(self, problem: SampleError) -> None:
        """A sample the planner skipped (its sink)."""
        record = SkippedRecord.of(problem)
        with self._lock:
            if record.record_id not in self._records:
                metrics.DECODE_ERRORS.labels(problem.kind, "plan").inc()
            self._records.setdefault(record.record_id, record)

    def add(self, records: list[SkippedRecord]) -> None:
        """Documents lost while serving (re-read or decoding failed), counted as they are lost
        (whether or not their microbatch is ever sent: a cancelled stream's is not)."""
        with self._lock:
            for record in records:
                if record.record_id not in self._records:
                    metrics.DECODE_ERRORS.labels(record.kind, "decode").inc()
                self._records.setdefault(record.record_id, record)

    def records(self) -> list[SkippedRecord]:
        with self._lock:
            return list(self._records.values())


def plan_balance(plan: StepPlan) -> dict:
    imbalance, arrival = plan.imbalance()
    return {"step": plan.step, "imbalance": imbalance, "arrival_imbalance": arrival,
            "rank_load_s": plan.rank_loads().tolist(), **plan.simulation,
            "num_sequences": sum(1 for seq in plan.sequences if seq.documents),
            "num_samples": sum(1 for _ in plan.documents())}
