"""The non-interleaved 1F1B op order of a pipeline stage: what the simulator times and what the
trainer's runtime executes (kept free of heavy imports: trainer processes load it)."""

from __future__ import annotations


def stage_order(P: int, M: int, stage: int) -> list[tuple[str, int]]:
    """The op sequence of one stage: ('F' | 'B', microbatch). Warm-up forwards, then one forward
    one backward, then the cool-down backwards."""
    warmup = min(P - stage - 1, M)
    ops = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", m) for m in range(M - warmup, M)]
    return ops
