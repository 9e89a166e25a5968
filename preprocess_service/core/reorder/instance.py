"""Reordering instances and plans in their JSON forms, whole-plan algorithms, and plan evaluation.

Instance (``disttrain-reorder-instance/1``): D ranks x M microbatches x S sequences = B sequence ids,
per-sequence forward seconds of each module, the pipeline's stage map, backward factors and p2p
latency; optionally ``"shared_by": {"enc": g, "gen": g}``, backbone ranks served by one encoder or
generator replica (default 1: independent ranks; simulate.py says how shared stages couple ranks).
Plan (``disttrain-reorder-plan/1``): ``plan[rank][microbatch in execution order]`` = S ids,
every id exactly once. A plan is judged by the exact 1F1B simulator (iteration time = slowest rank,
or slowest coupled component) against the batch lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import numpy as np

from disttrain_api.layout import MODULES, StageModel
from preprocess_service.core import reorder
from preprocess_service.core.bounds import batch_lower_bound
from preprocess_service.core.simulate import component_makespans

INSTANCE_FORMAT = "disttrain-reorder-instance/1"
PLAN_FORMAT = "disttrain-reorder-plan/1"


@dataclass(frozen=True, slots=True)
class Instance:
    D: int
    M: int
    S: int
    model: StageModel
    costs: np.ndarray
    """float[B, 3]: forward seconds of enc, bb, gen per sequence."""

    def __post_init__(self) -> None:
        B = self.D * self.M * self.S
        if self.costs.shape != (B, 3):
            raise ValueError(f"costs must hold {B} = D*M*S sequences for enc, bb and gen; got shape "
                             f"{self.costs.shape}")
        if (self.costs < 0).any():
            raise ValueError("costs must be >= 0 seconds")
        self.model.check_ranks(self.D)

    @property
    def totals(self) -> np.ndarray:
        """float[B]: forward + backward seconds over all modules, the paper's scalar cost."""
        return (self.costs * (1.0 + np.asarray(self.model.bwd_factor))).sum(axis=1)

    def to_json(self) -> dict:
        return {"format": INSTANCE_FORMAT, "D": self.D, "M": self.M, "S": self.S, "P": self.model.num_stages,
                "stage_map": list(self.model.stage_map),
                "bwd_factor": dict(zip(MODULES, self.model.bwd_factor)), "p2p_latency": self.model.p2p_latency,
                "shared_by": {"enc": self.model.shared_by[0], "gen": self.model.shared_by[2]},
                "costs": {m: self.costs[:, i].tolist() for i, m in enumerate(MODULES)}}

    @classmethod
    def from_json(cls, data: dict) -> Instance:
        if data.get("format") != INSTANCE_FORMAT:
            raise ValueError(f"instance format is {data.get('format')!r}, expected {INSTANCE_FORMAT!r}")
        if len(data["stage_map"]) != data["P"]:
            raise ValueError(f"P is {data['P']} but stage_map has {len(data['stage_map'])} stages")
        shared = data.get("shared_by", {})
        if not isinstance(shared, dict) or set(shared) - {"enc", "gen"}:
            raise ValueError(f"shared_by must map 'enc' and/or 'gen' to ranks per replica, got {shared!r}")
        model = StageModel(stage_map=tuple(data["stage_map"]),
                           bwd_factor=cast(tuple[float, float, float],  # one per module: MODULES has 3
                                           tuple(float(data["bwd_factor"][m]) for m in MODULES)),
                           p2p_latency=float(data.get("p2p_latency", 0.0)),
                           shared_by=(shared.get("enc", 1), 1, shared.get("gen", 1)))
        costs = np.column_stack([np.asarray(data["costs"][m], dtype=float) for m in MODULES])
        return cls(D=int(data["D"]), M=int(data["M"]), S=int(data["S"]), model=model, costs=costs)


def check_plan(instance: Instance, plan: np.ndarray) -> np.ndarray:
    """Validates shape and that every sequence id appears exactly once; returns int[D, M, S]."""
    plan = np.asarray(plan)
    expected = (instance.D, instance.M, instance.S)
    if plan.shape != expected:
        raise ValueError(f"plan has shape {plan.shape}, expected [D][M][S] = {list(expected)}")
    ids = np.sort(plan.ravel())
    if not np.array_equal(ids, np.arange(plan.size)):
        counts = np.bincount(plan.ravel(), minlength=plan.size)
        raise ValueError(f"plan must use every sequence id exactly once; missing {np.flatnonzero(counts == 0)[:10]}"
                         f", repeated {np.flatnonzero(counts > 1)[:10]}")
    return plan.astype(np.int64)


def evaluate(instance: Instance, plan: np.ndarray) -> dict:
    """Iteration time by the exact simulator, the batch lower bound and their ratio."""
    plan = check_plan(instance, plan)
    fwd, bwd = instance.model.stage_times(instance.costs)  # float[P, B]
    per_rank_fwd = fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
    per_rank_bwd = bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
    iteration = float(component_makespans(per_rank_fwd, per_rank_bwd, instance.model).max())
    bound = batch_lower_bound(instance.costs, instance.model, D=instance.D, M=instance.M, S=instance.S)
    return {"iteration_s": iteration, "lower_bound_s": bound, "ratio_to_bound": iteration / bound if bound else 1.0}


PLANNERS = reorder.PLANNERS
"""The whole-batch planners by name (the registry lives in the package: reorder/__init__.py)."""


def plan_instance(instance: Instance, method: str, seed: int = 0) -> dict:
    """Runs a registered planner; returns the plan in its JSON form with method and planning time."""
    if method not in PLANNERS:
        raise ValueError(f"unknown algorithm {method!r}; known: {sorted(PLANNERS)}")
    start = time.perf_counter()
    plan = check_plan(instance, PLANNERS[method](instance, np.random.default_rng(seed)))
    return {"format": PLAN_FORMAT, "plan": plan.tolist(),
            "meta": {"method": method, "time_s": time.perf_counter() - start}}


def warm_kernels(configs=None) -> int:
    """Runs every registered planner and the simulator on small random batches of ``configs``
    (default: a plain 4-stage job and one whose encoder and generator replicas are shared), so
    numba compiles every kernel signature the planner uses into its cache (NUMBA_CACHE_DIR; the
    service image does this at build time, so a pod's first step costs no compilation). Returns
    the planner runs made."""
    from disttrain_api.config import JobConfig

    if configs is None:
        configs = [JobConfig(shards=("warm",), dp_size=2, num_microbatches=4, seqs_per_microbatch=2),
                   JobConfig(shards=("warm",), dp_size=4, num_microbatches=4, seqs_per_microbatch=1,
                             enc_shared_by=2, gen_shared_by=2)]
    rng = np.random.default_rng(0)
    runs = 0
    for config in configs:
        D, M, S = config.dp_size, config.num_microbatches, config.seqs_per_microbatch
        instance = Instance(D=D, M=M, S=S, model=config.stage_model(), costs=rng.random((D * M * S, 3)))
        for method in PLANNERS:
            evaluate(instance, PLANNERS[method](instance, np.random.default_rng(runs)))
            runs += 1
    return runs
