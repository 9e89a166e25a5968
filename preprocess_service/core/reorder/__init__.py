"""Batch planners, by name: which rank trains on which sequences, in which microbatch and order.

One file per planner in this package, each registering itself; adding a planner is adding a file
(every module here whose name does not start with an underscore is imported below):

* ``arrival.py``, ``random_order.py`` ("random"): baselines; ``paper.py``: DistTrain's heuristics;
  ``lpt.py``: the ranks' totals balanced by LPT; ``ours.py`` ("ours", the service default, and
  "ours-deep"): vector balancing and a local search with the exact 1F1B simulator in the loop.
* ``instance.py``: instances and plans in their JSON forms, and evaluation (not a planner).

Registries (a planner file fills them with the decorators below):

* ``PLANNERS``: whole-batch planners, ``fn(instance: Instance, rng) -> int[D, M, S]``: sequence ids
  per rank, microbatches in execution order. The job's ``reorder_algorithm`` names one; the
  service refuses a name not registered here.
* ``INTRA_ALGORITHMS``: scalar intra-microbatch heuristics, ``fn(costs: float[B], D, M, S, rng) ->
  int[D, M, S]``: which sequences each rank gets in each microbatch slot (slot m of the arrival
  order is sequences [m*D*S, (m+1)*D*S)).
* ``INTER_ALGORITHMS``: scalar inter-microbatch heuristics, ``fn(microbatch_costs: float[D, M],
  rng) -> int[D, M]``: each rank's microbatches in execution order.
  ``scalar_planner(name, intra, inter)`` registers their composition on the scalar fwd+bwd cost
  (cost.SequenceCost.total_s). Only ``random`` draws from ``rng``; the others take None as well.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TypeVar

import numpy as np

IntraAlgorithm = Callable[[np.ndarray, int, int, int, np.random.Generator], np.ndarray]
InterAlgorithm = Callable[[np.ndarray, np.random.Generator], np.ndarray]
BatchPlanner = Callable[..., np.ndarray]
"""fn(instance: instance.Instance, rng: np.random.Generator) -> int[D, M, S]."""

PLANNERS: dict[str, BatchPlanner] = {}
INTRA_ALGORITHMS: dict[str, IntraAlgorithm] = {}
INTER_ALGORITHMS: dict[str, InterAlgorithm] = {}
F = TypeVar("F", bound=Callable)


def _registrar(registry: dict, kind: str, name: str) -> Callable[[F], F]:
    def register(fn: F) -> F:
        if name in registry:
            raise ValueError(f"two {kind} named {name!r}")
        registry[name] = fn
        return fn
    return register


def planner(name: str) -> Callable[[F], F]:
    """Registers a whole-batch planner under ``name`` (a job's reorder_algorithm)."""
    return _registrar(PLANNERS, "planners", name)


def intra(name: str) -> Callable[[F], F]:
    """Registers a scalar intra-microbatch heuristic under ``name``."""
    return _registrar(INTRA_ALGORITHMS, "intra-microbatch heuristics", name)


def inter(name: str) -> Callable[[F], F]:
    """Registers a scalar inter-microbatch heuristic under ``name``."""
    return _registrar(INTER_ALGORITHMS, "inter-microbatch heuristics", name)


def scalar_planner(name: str, *, intra: str, inter: str) -> None:
    """Registers the planner ``name``: heuristics ``intra`` then ``inter`` on the scalar cost."""
    def plan(instance, rng: np.random.Generator) -> np.ndarray:
        return plan_batch(instance.totals, D=instance.D, M=instance.M, S=instance.S, intra=intra, inter=inter,
                          rng=rng)
    plan.__doc__ = f"intra {intra!r} + inter {inter!r} on the scalar fwd+bwd cost"
    planner(name)(plan)


def plan_batch(costs: np.ndarray, *, D: int, M: int, S: int, intra: str, inter: str,
               rng: np.random.Generator) -> np.ndarray:
    """Both reorderings: int[D, M, S] sequence ids, microbatches in each rank's execution order."""
    assignment = INTRA_ALGORITHMS[intra](costs, D, M, S, rng)
    order = INTER_ALGORITHMS[inter](costs[assignment].sum(axis=2), rng)
    return np.take_along_axis(assignment, order[:, :, None], axis=1)


def imbalance(costs: np.ndarray, plan: np.ndarray) -> float:
    """max / mean of the per-rank total load (1.0 = perfectly balanced)."""
    loads = costs[plan].sum(axis=(1, 2))
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def warm_up() -> None:
    """Compiles the planners' numba kernels, or loads them from numba's on-disk cache (compiled once
    per installation, loaded after; bench/reorder.py times both), by planning two tiny batches with every
    signature the planners use, so that a process plans its first real batch at full speed. Call it
    when a service or CLI starts, not on a job's first step."""
    from preprocess_service.core.reorder import ours

    ours.warm_up()


for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

# the scalar heuristics by their function names too (tests, benches)
from preprocess_service.core.reorder.arrival import inter_arrival, intra_arrival  # noqa: E402
from preprocess_service.core.reorder.lpt import intra_lpt  # noqa: E402
from preprocess_service.core.reorder.paper import inter_paper, intra_paper  # noqa: E402
from preprocess_service.core.reorder.random_order import intra_random  # noqa: E402

__all__ = ["INTER_ALGORITHMS", "INTRA_ALGORITHMS", "PLANNERS", "imbalance", "inter", "inter_arrival", "inter_paper",
           "intra", "intra_arrival", "intra_lpt", "intra_paper", "intra_random", "plan_batch", "planner",
           "scalar_planner", "warm_up"]
