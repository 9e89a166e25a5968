"""The pipeline layout, one definition for the trainer's runtime, the service's simulator and
the orchestration planner.

``PipelineLayout`` says which process runs what: ``enc_dp`` encoder replicas of ``enc_tp``
ranks, the backbone grid stage-major (``bb_pp`` stages x ``bb_dp`` DP ranks x ``bb_tp`` TP
ranks), then ``gen_dp`` generator replicas of ``gen_tp`` ranks. ``enc_dp = 0`` runs the encoder
inside the backbone's first stage and ``gen_dp = 0`` the generator inside its last, at the
backbone's TP; both 0 is the monolithic (Megatron-like) layout. Backbone DP rank d is one chain:
encoder -> backbone stage 0 .. bb_pp-1 -> generator. With fewer encoder (generator) replicas
than chains, one replica serves ``bb_dp / enc_dp`` *consecutive* chains (replica ``d // g``); with
more, each chain has ``enc_dp / bb_dp`` replicas of its own and sends its microbatch m to the
``m % k``-th (replica ``d * k + m % k``). One of the two counts must divide the other.

``StageModel`` is what the service simulates and plans for: the stage map (``"enc"``,
``"bb/2"``: half the backbone, ``"enc+bb/2"``: the encoder and half the backbone in one stage),
backward factors, and ``shared_by``. ``PipelineLayout.stage_model()`` derives it, so the trainer
sends exactly the pipeline it runs.

``stage_ops`` is the op order of every stage replica, the non-interleaved 1F1B order
(``stage_order``) over microbatch slots, and within a slot the chains the replica serves in rank
order: the runtime executes it and the simulator times it (a shared replica runs slot m of its
chains back to back, once all their inputs are there).

Pure (numpy only): the trainer imports it without the service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODULES = ("enc", "bb", "gen")
MAX_SPLIT = 64
"""At most this many encoder (generator) replicas serve one backbone DP rank."""


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
    those g consecutive ranks at every stage of that module (module docstring)."""
    split_by: tuple[int, int, int] = (1, 1, 1)
    """Replicas of enc, bb, gen that serve one backbone DP rank (bb: always 1): k > 1 sends the
    rank's microbatch m to its replica m % k. A module is shared or split, not both."""

    def __post_init__(self) -> None:
        for entry in self.stage_map:
            parts = [_parse_part(entry, part) for part in entry.split("+")]
            if len({m for m, _ in parts}) != len(parts):
                raise ValueError(f"stage {entry!r} names a module twice")
        if len(self.shared_by) != 3 or any(int(g) != g or g < 1 for g in self.shared_by):
            raise ValueError(f"shared_by must be 3 positive integers (enc, bb, gen), got {self.shared_by}")
        object.__setattr__(self, "shared_by", tuple(int(g) for g in self.shared_by))
        if self.shared_by[1] != 1:
            raise ValueError("the backbone is never shared: every backbone DP rank is its own replica "
                             f"(shared_by['bb'] must be 1, got {self.shared_by[1]})")
        if len(self.split_by) != 3 or any(int(k) != k or not 1 <= k <= MAX_SPLIT for k in self.split_by):
            raise ValueError(f"split_by must be 3 integers in [1, {MAX_SPLIT}] (enc, bb, gen), got {self.split_by}")
        object.__setattr__(self, "split_by", tuple(int(k) for k in self.split_by))
        if self.split_by[1] != 1:
            raise ValueError(f"the backbone is never split: split_by['bb'] must be 1, got {self.split_by[1]}")
        for i in (0, 2):
            if self.shared_by[i] > 1 and self.split_by[i] > 1:
                raise ValueError(f"{MODULES[i]} is both shared (by {self.shared_by[i]} ranks) and split (over "
                                 f"{self.split_by[i]} replicas per rank): one of them must be 1")
        for entry in self.stage_map:
            shared = {(self.shared_by[MODULES.index(m)], self.split_by[MODULES.index(m)]) for m, _ in _parts(entry)}
            if len(shared) > 1:
                raise ValueError(f"stage {entry!r} runs modules shared by different numbers of ranks "
                                 f"(shared_by {dict(zip(MODULES, self.shared_by))}); one stage is one replica")

    @property
    def num_stages(self) -> int:
        return len(self.stage_map)

    def stage_groups(self) -> np.ndarray:
        """int[P]: ranks that share one replica of each stage."""
        return np.array([self.shared_by[MODULES.index(_parts(e)[0][0])] for e in self.stage_map], dtype=np.int64)

    def stage_splits(self) -> np.ndarray:
        """int[P]: replicas of each stage per rank."""
        return np.array([self.split_by[MODULES.index(_parts(e)[0][0])] for e in self.stage_map], dtype=np.int64)

    def kernel_groups(self) -> np.ndarray:
        """int[P] as the compiled simulator takes it: g >= 1 ranks per replica, or -k for k replicas per rank."""
        groups, splits = self.stage_groups(), self.stage_splits()
        return np.where(splits > 1, -splits, groups)

    def replicas(self, stage: int, D: int) -> int:
        """Replicas of ``stage`` for D backbone DP ranks."""
        return D // int(self.stage_groups()[stage]) * int(self.stage_splits()[stage])

    def members(self, stage: int, replica: int) -> range:
        """The backbone DP ranks (chains) that replica ``replica`` of ``stage`` serves: g consecutive
        ranks for a shared stage, else the one rank replica // k (k replicas per rank)."""
        g, k = int(self.stage_groups()[stage]), int(self.stage_splits()[stage])
        return range(replica * g, (replica + 1) * g) if k == 1 else range(replica // k, replica // k + 1)

    def replica_of(self, stage: int, rank: int, microbatch: int) -> int:
        """The replica of ``stage`` that runs ``rank``'s microbatch ``microbatch``."""
        g, k = int(self.stage_groups()[stage]), int(self.stage_splits()[stage])
        return rank // g if k == 1 else rank * k + microbatch % k

    def stage_ops(self, stage: int, replica: int, num_microbatches: int) -> list[tuple[str, int, int]]:
        """(op 'F' | 'B', chain, microbatch) in the order replica ``replica`` of ``stage`` runs them:
        the stage's 1F1B slot order (only slots m with m % k == replica % k on one of k replicas
        per rank), and within a slot its chains in rank order."""
        chains, k = self.members(stage, replica), int(self.stage_splits()[stage])
        return [(op, d, m) for op, m in stage_order(self.num_stages, num_microbatches, stage)
                if k == 1 or m % k == replica % k for d in chains]

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
            for module, share in _parts(entry):
                out[s, MODULES.index(module)] = 1.0 / share
        return out

    def stage_times(self, module_fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """module_fwd float[M, 3] (enc, bb, gen forward seconds per microbatch) -> (fwd, bwd) float[P, M]."""
        weights = self.weights()
        fwd = weights @ module_fwd.T
        bwd = weights @ (module_fwd * np.asarray(self.bwd_factor)).T
        return fwd, bwd


def _parse_part(entry: str, part: str) -> tuple[str, int]:
    module, _, share = part.partition("/")
    if module not in MODULES or (share and (not share.isdigit() or int(share) < 1 or len(share) > 6)):
        raise ValueError(f"stage {entry!r} is not 'MODULE', 'MODULE/K' or such parts joined by '+', with MODULE in "
                         f"{MODULES} and K a positive integer")
    return module, int(share or 1)


def _parts(entry: str) -> list[tuple[str, int]]:
    """"enc+bb/2" -> [("enc", 1), ("bb", 2)]."""
    return [_parse_part(entry, part) for part in entry.split("+")]


def stage_order(P: int, M: int, stage: int) -> list[tuple[str, int]]:
    """The op sequence of one stage: ('F' | 'B', microbatch). Warm-up forwards, then one forward
    one backward, then the cool-down backwards."""
    warmup = min(P - stage - 1, M)
    ops = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", m) for m in range(M - warmup, M)]
    return ops


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Which rank runs what (module docstring): module groups, their DP and TP, the backbone's
    pipeline stages, and which encoder/generator replica serves which backbone DP rank."""

    enc_dp: int
    bb_dp: int
    bb_pp: int
    gen_dp: int
    enc_tp: int = 1
    bb_tp: int = 1
    gen_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("enc_dp", "bb_dp", "bb_pp", "gen_dp", "enc_tp", "bb_tp", "gen_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or not 0 <= value <= 1 << 16:
                raise ValueError(f"{name} must be an integer in [0, 65536], got {value!r}")
        for name in ("bb_dp", "bb_pp", "enc_tp", "bb_tp", "gen_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for module in ("enc", "gen"):
            replicas = getattr(self, f"{module}_dp")
            if replicas and self.bb_dp % replicas and replicas % self.bb_dp:
                raise ValueError(f"{module}_dp {replicas} must divide bb_dp {self.bb_dp} or be a multiple of it: a "
                                 f"{module} replica serves whole backbone DP ranks, or each rank has k replicas "
                                 f"(0 runs it inside a backbone stage)")
            if replicas > self.bb_dp * MAX_SPLIT:
                raise ValueError(f"{module}_dp {replicas}: at most {MAX_SPLIT} replicas per backbone DP rank")
            if not replicas and getattr(self, f"{module}_tp") != 1:
                raise ValueError(f"{module}_dp 0 runs the {module} inside a backbone stage at the backbone's TP: "
                                 f"{module}_tp must be 1")

    # -- what the service plans for -------------------------------------------------------------

    @property
    def enc_shared_by(self) -> int:
        """Backbone DP ranks that one encoder replica serves (1 inside the backbone's stage)."""
        return max(1, self.bb_dp // self.enc_dp) if self.enc_dp else 1

    @property
    def gen_shared_by(self) -> int:
        return max(1, self.bb_dp // self.gen_dp) if self.gen_dp else 1

    @property
    def enc_split_by(self) -> int:
        """Encoder replicas per backbone DP rank (1 when they are shared or inside the backbone)."""
        return max(1, self.enc_dp // self.bb_dp)

    @property
    def gen_split_by(self) -> int:
        return max(1, self.gen_dp // self.bb_dp)

    @property
    def stage_map(self) -> tuple[str, ...]:
        """The chain's stages: the encoder's (unless inside stage 0), the backbone's, the generator's."""
        bb = "bb" if self.bb_pp == 1 else f"bb/{self.bb_pp}"
        stages = [bb] * self.bb_pp
        stages[0] = stages[0] if self.enc_dp else f"enc+{stages[0]}"
        stages[-1] = stages[-1] if self.gen_dp else f"{stages[-1]}+gen"
        return (("enc",) if self.enc_dp else ()) + tuple(stages) + (("gen",) if self.gen_dp else ())

    def stage_model(self, bwd_factor: tuple[float, float, float] = (2.0, 2.0, 2.0),
                    p2p_latency: float = 0.0) -> StageModel:
        return StageModel(stage_map=self.stage_map, bwd_factor=bwd_factor, p2p_latency=p2p_latency,
                          shared_by=(self.enc_shared_by, 1, self.gen_shared_by),
                          split_by=(self.enc_split_by, 1, self.gen_split_by))

    # -- ranks ----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._gen_start + self.gen_dp * self.gen_tp

    @property
    def _bb_start(self) -> int:
        return self.enc_dp * self.enc_tp

    @property
    def _gen_start(self) -> int:
        return self._bb_start + self.bb_dp * self.bb_pp * self.bb_tp

    @property
    def monolithic(self) -> bool:
        return self.enc_dp == 0 and self.gen_dp == 0

    @property
    def num_stages(self) -> int:
        return len(self.stage_map)

    def chain_stage(self, bb_stage: int) -> int:
        """Position of backbone stage ``bb_stage`` in its chain."""
        return bb_stage + (self.enc_dp > 0)

    def enc_rank(self, replica: int, tp: int = 0) -> int:
        """Global rank of TP rank ``tp`` of an encoder replica (0: the one that communicates)."""
        return replica * self.enc_tp + tp

    def bb_rank(self, dp: int, stage: int, tp: int = 0) -> int:
        return self._bb_start + (stage * self.bb_dp + dp) * self.bb_tp + tp

    def gen_rank(self, replica: int, tp: int = 0) -> int:
        return self._gen_start + replica * self.gen_tp + tp

    def enc_of(self, dp: int, microbatch: int) -> int:
        """The encoder replica that runs microbatch ``microbatch`` of backbone DP rank ``dp``."""
        return self.stage_model().replica_of(0, dp, microbatch)

    def gen_of(self, dp: int, microbatch: int) -> int:
        return self.stage_model().replica_of(self.num_stages - 1, dp, microbatch)

    def role(self, rank: int) -> tuple:
        """("enc", replica) | ("bb", dp, stage) | ("gen", replica); the TP rank is ``tp_rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a layout of {self.world_size} ranks")
        if rank < self._bb_start:
            return ("enc", rank // self.enc_tp)
        if rank < self._gen_start:
            cell = (rank - self._bb_start) // self.bb_tp
            return ("bb", cell % self.bb_dp, cell // self.bb_dp)
        return ("gen", (rank - self._gen_start) // self.gen_tp)

    def tp_rank(self, rank: int) -> int:
        if rank < self._bb_start:
            return rank % self.enc_tp
        if rank < self._gen_start:
            return (rank - self._bb_start) % self.bb_tp
        return (rank - self._gen_start) % self.gen_tp

    def tp_ranks(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s TP group, its leader first."""
        first = rank - self.tp_rank(rank)
        size = self.enc_tp if rank < self._bb_start else self.bb_tp if rank < self._gen_start else self.gen_tp
        return list(range(first, first + size))

    def ops(self, rank: int, num_microbatches: int) -> list[tuple[str, int, int]]:
        """(op, chain, microbatch) that ``rank`` runs in one step, in order: its stage replica's
        ``StageModel.stage_ops`` (a module inside a backbone stage runs in that stage's ops)."""
        role = self.role(rank)
        if role[0] == "enc":
            stage, replica = 0, role[1]
        elif role[0] == "gen":
            stage, replica = self.num_stages - 1, role[1]
        else:
            stage, replica = self.chain_stage(role[2]), role[1]
        return self.stage_model().stage_ops(stage, replica, num_microbatches)

    def groups(self) -> dict[str, list[int]]:
        """The ranks that hold the same parameters and reduce gradients together, one group per
        module (or backbone stage) and TP rank, named ``"{module}.tp{t}"``; a module run inside a
        backbone stage reduces with that stage."""
        out = {}
        for t in range(self.enc_tp if self.enc_dp else 0):
            out[f"enc.tp{t}"] = [self.enc_rank(e, t) for e in range(self.enc_dp)]
        for t in range(self.gen_tp if self.gen_dp else 0):
            out[f"gen.tp{t}"] = [self.gen_rank(g, t) for g in range(self.gen_dp)]
        for s in range(self.bb_pp):
            for t in range(self.bb_tp):
                out[f"bb{s}.tp{t}"] = [self.bb_rank(d, s, t) for d in range(self.bb_dp)]
        return out

    def tp_groups(self) -> list[list[int]]:
        """Every TP group of more than one rank."""
        starts = [self.enc_rank(e) for e in range(self.enc_dp)] if self.enc_tp > 1 else []
        starts += [self.bb_rank(d, s) for s in range(self.bb_pp) for d in range(self.bb_dp)] if self.bb_tp > 1 else []
        starts += [self.gen_rank(g) for g in range(self.gen_dp)] if self.gen_tp > 1 else []
        return [self.tp_ranks(r) for r in starts]

    def group_of(self, rank: int) -> str:
        """The name of ``rank``'s gradient-reduction group in ``groups()``."""
        role = self.role(rank)
        module = role[0] if role[0] != "bb" else f"bb{role[2]}"
        return f"{module}.tp{self.tp_rank(rank)}"
