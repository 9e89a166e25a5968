"""How the service's own CPU per sample and memory grow with the job's shape (bench/peers.py
--scale, issue 20 item 5): planning (EpochPlanner: shuffle, pack, price, reorder, simulate) and
microbatch layout (assemble.layout_microbatch) for 2..128 DP ranks, in one process, on synthetic
documents of a caption plus K images of the planned 448x448 size (256 tokens each), packed
S documents per sequence. Decoding is left out (it is per image, not per job shape: the decode
figure printed beside is the floor's, ms per image, measured here on the demo's JPEGs).

Columns: planning + layout CPU ms per sample; peak Python heap of planning one step (tracemalloc,
MiB), the bytes of one step's token arrays (tokens, positions, modality, loss mask, spans) and of
its decoded media (the output buffers the decode workers fill). A CPU node's cores are roughly
samples/s x (planning + K x decode ms) / 1000, with the plumbing's overhead measured by peers.py.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator

import numpy as np
import peers_work  # also puts the repository on sys.path

from disttrain_api.config import JobConfig
from preprocess_service.core.assemble import layout_microbatch
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.core.sample import Document, ImageRef, TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer

IMAGE_TOKENS, CAPTION_TOKENS = 256, 60
SHARD_SAMPLES = 100_000


class FakeSource:
    """A shard of SHARD_SAMPLES samples that only carry their own index (no bytes to read)."""

    def iter_shard(self, url: str, on_problem, start: dict | None = None) -> Iterator[dict]:
        for i in range((start or {}).get("samples", 0), SHARD_SAMPLES):
            yield {"__key__": f"{i:07d}", "__url__": url}

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        return {key: {"__key__": key, "__url__": url} for key in keys}


def _parser(num_images: int, rng: np.random.Generator):
    def parse(sample: dict) -> Document:
        text = int(rng.integers(CAPTION_TOKENS // 2, CAPTION_TOKENS * 2))
        images = tuple(ImageRef(f"{j}.jpg", 448, 448, IMAGE_TOKENS) for j in range(num_images))
        return Document(sample["__key__"], sample["__url__"], (*images, TextSegment("txt", np.zeros(text, np.int32))))
    return parse


def measure_shape(dp_size: int, samples_per_seq: int, num_images: int, steps: int = 3) -> dict:
    """Planning + layout CPU per sample and memory of ``steps`` steps of one job shape."""
    doc_tokens = num_images * IMAGE_TOKENS + CAPTION_TOKENS * 1.25 + 2
    longest = num_images * IMAGE_TOKENS + CAPTION_TOKENS * 2 + 2  # the parser's longest document
    seq_len = int(max(longest, samples_per_seq * doc_tokens * 1.1))
    config = JobConfig(shards=("fake.tar",), dp_size=dp_size, num_microbatches=4, seqs_per_microbatch=1,
                       seq_len=seq_len)
    tokenizer = ByteTokenizer()

    def planner():
        parse = _parser(num_images, np.random.default_rng(0))
        return EpochPlanner(config, ["fake.tar"], Documents(FakeSource(), parse))

    tracemalloc.start()
    plan = planner().next_plan()
    heap_mib = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    step_bytes = step_media = 0
    for rank in range(dp_size):
        for index in range(plan.num_microbatches):
            layout = layout_microbatch(plan.microbatch(rank, index), seq_len=seq_len, tokenizer=tokenizer,
                                       audio_config=config.audio)
            step_bytes += sum(a.nbytes for a in layout.arrays.values())
            step_media += layout.nbytes
    source = planner()
    samples, start = 0, time.process_time()
    for _ in range(steps):
        plan = source.next_plan()
        samples += sum(len(seq.documents) for seq in plan.sequences)
        for rank in range(dp_size):
            for index in range(plan.num_microbatches):
                layout_microbatch(plan.microbatch(rank, index), seq_len=seq_len, tokenizer=tokenizer,
                                  audio_config=config.audio)
    cpu = time.process_time() - start
    return {"dp_size": dp_size, "samples_per_seq": samples_per_seq, "images_per_sample": num_images,
            "seq_len": seq_len, "samples_per_step": samples // steps, "cpu_ms_per_sample": 1000 * cpu / samples,
            "plan_heap_mib": heap_mib, "step_arrays_mib": step_bytes / 2**20,
            "step_media_mib": step_media / 2**20}


def decode_ms_per_image(urls: list[str], limit: int = 60) -> float:
    """The floor's decode cost: our decode path on the demo's images, CPU ms per image."""
    from preprocess_service.adapters.io import shards

    images, cpu = 0, 0.0
    for url in urls:
        for sample in shards.iter_shard(url, lambda problem: None):
            start = time.process_time()
            prepared = peers_work.prepare(sample, "ours")
            cpu += time.process_time() - start
            images += len(prepared.images) if prepared else 0
            if images >= limit:
                return 1000 * cpu / images
    return 1000 * cpu / max(images, 1)


SHAPES = ([(dp, 4, 1) for dp in (2, 8, 32, 128)] + [(8, s, 1) for s in (1, 16, 64)]
          + [(8, 4, k) for k in (4, 16)])


def run(urls: list[str], quick: bool = False) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    shapes = SHAPES[:3] if quick else SHAPES
    decode_ms = decode_ms_per_image(urls)
    measure_shape(*shapes[0], steps=1)  # warm: the planner's compiled kernels, imports
    rows = [measure_shape(*shape, steps=1 if quick else 3) for shape in shapes]
    print(f"\nscale: planning + layout (one process), synthetic captions + K 448x448 images; decode "
          f"(the floor, ours) {decode_ms:.2f} CPU ms per image on the demo set")
    print(f"{'DP ranks':>8s} {'samples/seq':>11s} {'images/sample':>13s} {'seq_len':>8s} {'samples/step':>12s} "
          f"{'plan+layout ms/sample':>22s} {'+decode ms/sample':>18s} {'plan heap MiB':>13s} {'step arrays MiB':>15s} "
          f"{'step pixels MiB':>15s}")
    for row in rows:
        row["with_decode_ms_per_sample"] = row["cpu_ms_per_sample"] + row["images_per_sample"] * decode_ms
        print(f"{row['dp_size']:8d} {row['samples_per_seq']:11d} {row['images_per_sample']:13d} {row['seq_len']:8d} "
              f"{row['samples_per_step']:12d} {row['cpu_ms_per_sample']:22.3f} "
              f"{row['with_decode_ms_per_sample']:18.2f} {row['plan_heap_mib']:13.1f} {row['step_arrays_mib']:15.1f} "
              f"{row['step_media_mib']:15.1f}")
    return rows


if __name__ == "__main__":
    import json
    import sys

    out, quick, *shard_urls = sys.argv[1:]
    with open(out, "w") as f:
        json.dump(run(shard_urls, quick=quick == "quick"), f)
