"""The pipeline layout of one backbone DP rank, shared by the trainer's runtime, the service's
simulator and the planner: which module (and what share of it) each pipeline stage runs, the
backward factors, how many backbone ranks one encoder or generator replica serves, and the
non-interleaved 1F1B op order of a stage (what the simulator times and the runtime executes).

Pure (numpy only): the trainer imports it without the service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODULES = ("enc", "bb", "gen")


@dataclass(frozen=True, slots=True)
class StageModel:
    """Which module (and what share of it) each pipeline stage runs, and backward factors."""

    stage_map: tuple[str, ...]
    bwd_factor: tuple[float, float, float] = (2.0, 2.0, 2.0)
    """Backward / forward time of enc, bb, gen (0 for a frozen module)."""
    p2p_latency: float = 0.0
    """Seconds between an op's end on one stage and the dependent op's start on the next."""
    shared_by: tuple[int, int, int] = (1, 1, 1)
    """Backbone DP ranks that one replica of enc, bb, gen serves (bb: always 1). g > 1 couples
    those g ranks at every stage of that module (module docstring)."""

    def __post_init__(self) -> None:
        for entry in self.stage_map:
            module, _, share = entry.partition("/")
            if module not in MODULES or (share and (not share.isdigit() or int(share) < 1)):
                raise ValueError(f"stage {entry!r} is not 'MODULE' or 'MODULE/K' with MODULE in {MODULES} "
                                 "and K a positive integer")
        if len(self.shared_by) != 3 or any(int(g) != g or g < 1 for g in self.shared_by):
            raise ValueError(f"shared_by must be 3 positive integers (enc, bb, gen), got {self.shared_by}")
        object.__setattr__(self, "shared_by", tuple(int(g) for g in self.shared_by))
        if self.shared_by[1] != 1:
            raise ValueError("the backbone is never shared: every backbone DP rank is its own replica "
                             f"(shared_by['bb'] must be 1, got {self.shared_by[1]})")

    @property
    def num_stages(self) -> int:
        return len(self.stage_map)

    def stage_groups(self) -> np.ndarray:
        """int[P]: ranks that share one replica of each stage."""
        return np.array([self.shared_by[MODULES.index(e.partition("/")[0])] for e in self.stage_map],
                        dtype=np.int64)

    @property
    def component(self) -> int:
        """Ranks coupled into one simulated component: lcm of the group sizes (1 = independent)."""
        return math.lcm(*(int(g) for g in self.stage_groups()))

    def check_ranks(self, D: int) -> None:
        """Raises ValueError unless D ranks split into whole groups of every shared module."""
        if D % self.component:
            raise ValueError(f"{D} DP ranks do not split into groups of {self.component} "
                             f"(shared_by {dict(zip(MODULES, self.shared_by))})")

    def weights(self) -> np.ndarray:
        """float[P, 3]: share of each module's time that each stage runs."""
        out = np.zeros((self.num_stages, len(MODULES)))
        for s, entry in enumerate(self.stage_map):
            module, _, share = entry.partition("/")
            out[s, MODULES.index(module)] = 1.0 / int(share or 1)
        return out

    def stage_times(self, module_fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """module_fwd float[M, 3] (enc, bb, gen forward seconds per microbatch) -> (fwd, bwd) float[P, M]."""
        weights = self.weights()
        fwd = weights @ module_fwd.T
        bwd = weights @ (module_fwd * np.asarray(self.bwd_factor)).T
        return fwd, bwd


def stage_order(P: int, M: int, stage: int) -> list[tuple[str, int]]:
    """The op sequence of one stage: ('F' | 'B', microbatch). Warm-up forwards, then one forward
    one backward, then the cool-down backwards."""
    warmup = min(P - stage - 1, M)
    ops = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", m) for m in range(M - warmup, M)]
    return ops
