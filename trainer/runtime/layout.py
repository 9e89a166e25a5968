"""Which rank runs what in the disaggregated pipeline, and in which order (1F1B).

Ranks, in order: ``enc_dp`` encoder replicas, then the backbone grid stage-major
(``bb_pp`` stages x ``bb_dp`` DP ranks), then ``gen_dp`` generator replicas. ``enc_dp = 0`` runs
the encoder inside the backbone's first stage and ``gen_dp = 0`` the generator inside its last:
both 0 is the monolithic (Megatron-like) layout. Backbone DP rank d
is one chain encoder -> stage 0 .. stage P-1 -> generator; the encoder and generator replicas are
shared by the chains: microbatch m of chain d goes to replica (m * bb_dp + d) % replicas.
Every chain runs a non-interleaved 1F1B schedule over its P + 2 stages; a shared replica runs the
ops of its stage for all the (chain, microbatch) pairs it serves, slot by slot, so its receives
come in an order no chain can deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from preprocess_service.schedule import stage_order


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The op order of ``stage``: the service simulator's (schedule.stage_order), so the plans it
    judges are run in the order it judged them."""
    return stage_order(num_stages, num_microbatches, stage)


@dataclass(frozen=True, slots=True)
class RuntimeLayout:
    enc_dp: int
    bb_dp: int
    bb_pp: int
    gen_dp: int

    def __post_init__(self) -> None:
        for name in ("bb_dp", "bb_pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("enc_dp", "gen_dp"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: run it inside the backbone's first/last stage)")

    @property
    def world_size(self) -> int:
        return self.enc_dp + self.bb_dp * self.bb_pp + self.gen_dp

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

    def enc_rank(self, replica: int) -> int:
        return replica

    def bb_rank(self, dp: int, stage: int) -> int:
        return self.enc_dp + stage * self.bb_dp + dp

    def gen_rank(self, replica: int) -> int:
        return self.enc_dp + self.bb_dp * self.bb_pp + replica

    def role(self, rank: int) -> tuple:
        """("enc", replica) | ("bb", dp, stage) | ("gen", replica)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a layout of {self.world_size} ranks")
        if rank < self.enc_dp:
            return ("enc", rank)
        rank -= self.enc_dp
        if rank < self.bb_dp * self.bb_pp:
            return ("bb", rank % self.bb_dp, rank // self.bb_dp)
        return ("gen", rank - self.bb_dp * self.bb_pp)

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
        """The ranks that hold the same parameters and reduce gradients together (a module run inside
        a backbone stage reduces with that stage)."""
        out = {}
        if self.enc_dp:
            out["enc"] = [self.enc_rank(e) for e in range(self.enc_dp)]
        if self.gen_dp:
            out["gen"] = [self.gen_rank(g) for g in range(self.gen_dp)]
        for s in range(self.bb_pp):
            out[f"bb{s}"] = [self.bb_rank(d, s) for d in range(self.bb_dp)]
        return out
