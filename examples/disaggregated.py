"""Our disaggregated trainer at small size: encoder, backbone and generator as separate
torch.distributed groups (here 4 processes: encoder, two backbone data-parallel ranks,
generator), each microbatch's media sent to the encoder, its activations through the backbone,
its queries to the generator, in the order the service planned.

    torchrun --nproc-per-node 4 examples/disaggregated.py --address HOST:PORT --shards DATA [--steps 4]

It is ``python -m trainer.train`` with a small model and this layout; every flag of trainer/train.py
may follow (``--help``). On GPUs give ``--device cuda --bf16`` (docs/gpu.md).
"""

from __future__ import annotations

import sys

from trainer import train

SMALL = ["--enc-dp", "1", "--bb-dp", "2", "--bb-pp", "1", "--gen-dp", "1", "--model-layers", "2",
         "--num-microbatches", "3", "--seq-len", "2048", "--profile-microbatches", "0"]
"""The layout (1 encoder, 2 backbone DP ranks, 1 generator: 4 processes) and a small model."""

if __name__ == "__main__":
    raise SystemExit(train.main([*SMALL, *sys.argv[1:]]))
