"""Which rank runs what in the disaggregated pipeline, and in which order (1F1B).

Ranks, in order: ``enc_dp`` encoder replicas of ``enc_tp`` ranks each, then the backbone grid
stage-major (``bb_pp`` stages x ``bb_dp`` DP ranks x ``bb_tp`` TP ranks), then ``gen_dp``
generator replicas of ``gen_tp`` ranks. ``enc_dp = 0`` runs the encoder inside the backbone's
first stage and ``gen_dp = 0`` the generator inside its last, at the backbone's TP: both 0 is the
monolithic (Megatron-like) layout. Backbone DP rank d
is one chain encoder -> stage 0 .. stage P-1 -> generator; the encoder and generator replicas are
shared by the chains: microbatch m of chain d goes to replica (m * bb_dp + d) % replicas.
Every chain runs a non-interleaved 1F1B schedule over its P + 2 stages; a shared replica runs the
ops of its stage for all the (chain, microbatch) pairs it serves, slot by slot, so its receives
come in an order no chain can deadlock. Between modules and stages only TP rank 0 of each group
(its leader) sends and receives; it forwards what it receives to the other TP ranks of its group
(tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain_api.layout import stage_order


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The op order of ``stage``: the service simulator's (disttrain_api.layout.stage_order), so the plans it
    judges are run in the order it judged them."""
    return stage_order(num_stages, num_microbatches, stage)


@dataclass(frozen=True, slots=True)
class RuntimeLayout:
    enc_dp: int
    bb_dp: int
    bb_pp: int
    gen_dp: int
    enc_tp: int = 1
    bb_tp: int = 1
    gen_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("bb_dp", "bb_pp", "enc_tp", "bb_tp", "gen_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("enc_dp", "gen_dp"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: run it inside the backbone's first/last stage)")

    @property
    def world_size(self) -> int:
        return self._bb_start + self.bb_dp * self.bb_pp * self.bb_tp + self.gen_dp * self.gen_tp

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
        """Stages of one chain: encoder (unless inside stage 0), the backbone's, generator (unless
        inside the last stage)."""
        return self.bb_pp + (self.enc_dp > 0) + (self.gen_dp > 0)

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

    def enc_of(self, dp: int, m: int) -> int:
        return (m * self.bb_dp + dp) % self.enc_dp

    def gen_of(self, dp: int, m: int) -> int:
        return (m * self.bb_dp + dp) % self.gen_dp

    def shared_ops(self, module: str, replica: int, num_microbatches: int) -> list[tuple[str, int, int]]:
        """(op, chain dp, microbatch) of an encoder or generator replica, in execution order."""
        stage, owner = (0, self.enc_of) if module == "enc" else (self.num_stages - 1, self.gen_of)
        return [(op, d, m) for op, m in one_f_one_b(self.num_stages, stage, num_microbatches)
                for d in range(self.bb_dp) if owner(d, m) == replica]

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
