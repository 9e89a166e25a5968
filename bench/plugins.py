"""What operator plugins cost, in one run on the same shards: planning with and without sample
hooks, decoding with and without media hooks.

    python bench/plugins.py [--shards N] [--samples-per-shard N] [--rounds 3] [--quick] [--json FILE]

The example plugins of examples/plugins/ are pip-installed into a temporary folder, beside two
that do nothing (an identity sample hook, an identity media hook): their cost is the plumbing's
alone (a round trip to the sample-hook worker per sample; a call per decoded item).
1. planning: seconds to plan a whole epoch of synthetic LAION shards (Job.plan_all, one process),
   samples per second, the ratio to planning without plugins, and the CPU per sample of the whole
   tree (this process and the sample-hook worker) above planning without plugins, as a share of
   the floor's CPU per sample (every sample's image decoded by our decode path in one process,
   bench/peers_work.py: the cheapest way to the same pixels).
2. decoding: seconds to decode every planned microbatch in a DecodePool of 2 workers, images per
   second, and the ratio to decoding without plugins.
Arms run interleaved for --rounds rounds, best of each kept (a noisy host only slows a pass).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import benchjson  # noqa: E402

IDENTITY = '''
from disttrain_api.plugins import Plugin


class SampleIdentity(Plugin):
    def sample(self, members, ctx):
        return None


class MediaIdentity(Plugin):
    def media(self, kind, array, ctx):
        return None
'''


def install(root: Path) -> Path:
    """The example packages pip-installed into root/site, and the identity plugins beside them."""
    site = root / "site"
    sources = []
    for package in ("disttrain-clip-filter", "disttrain-random-crop"):
        shutil.copytree(REPO / "examples" / "plugins" / package, root / "src" / package)
        sources.append(str(root / "src" / package))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), *sources], check=True)
    (site / "bench_identity.py").write_text(IDENTITY)
    dist = site / "bench_identity-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-identity\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[disttrain.plugins]\nsample_identity = bench_identity:SampleIdentity\n"
                                           "media_identity = bench_identity:MediaIdentity\n")
    return site


def hook_worker_cpu_s(job) -> float:
    """CPU seconds the job's sample-hook worker has used (0 without one): read from /proc, since it
    is the fork server's child, not ours."""
    hooks = job.documents.hooks
    process = getattr(hooks, "_process", None)
    if process is None:
        return 0.0
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def floor_cpu_per_sample(tars: list[str], rounds: int) -> float:
    """CPU seconds per sample of the floor: each sample parsed and its images decoded into a reused
    buffer by our decode path, one process (bench/peers_work.py); best of ``rounds``."""
    import numpy as np
    import peers_systems
    import peers_work

    index = peers_systems.tar_index(tars)
    arena, files, best = np.empty(peers_systems.ARENA_BYTES, np.uint8), {}, float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for entry in index:
            peers_work.prepare(peers_systems.read_sample(entry, files), "ours", arena)
        best = min(best, (time.process_time() - started) / len(index))
    for fd in files.values():
        os.close(fd)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--samples-per-shard", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 shard of 40 samples, 1 round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.samples_per_shard, args.rounds = 1, 40, 1

    from disttrain_api.config import JobConfig, PluginConfig
    from disttrain_tools import synth
    from preprocess_service.adapters.decode import DecodePool, forkserver
    from preprocess_service.service.job import Job

    forkserver.start()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(install(root)))
        synth.write_dataset(root / "data", synth.SynthConfig(num_shards=args.shards,
                                                             samples_per_shard=args.samples_per_shard))

        def config(*plugins: PluginConfig) -> JobConfig:
            return JobConfig(shards=(str(root / "data"),), seq_len=4096, num_microbatches=2, plugins=plugins)

        keep_all = PluginConfig(name="clip_filter", params={"min_score": -1.0})
        planning = {"none": (), "identity sample hook": (PluginConfig(name="sample_identity"),),
                    "clip_filter (keeps all)": (keep_all,)}
        decoding = {"none": (), "identity media hook": (PluginConfig(name="media_identity"),),
                    "random_resized_crop": (PluginConfig(name="random_resized_crop"),)}
        plan_s: dict[str, float] = {}
        plan_cpu: dict[str, float] = {}
        samples = 0
        Job(config()).plan_all()  # warm: the planner's kernels and the decoders load once, outside the timings
        floor_cpu = floor_cpu_per_sample(sorted(str(p) for p in (root / "data").rglob("*.tar")), args.rounds)
        for _ in range(args.rounds):
            for name, plugins in planning.items():
                job = Job(config(*plugins))
                if job.documents.hooks is not None:  # its worker started outside the timing
                    job.documents.hooks._started()
                worker_cpu = hook_worker_cpu_s(job)
                started, cpu = time.perf_counter(), time.process_time()
                job.plan_all()
                wall = time.perf_counter() - started
                cpu = time.process_time() - cpu + hook_worker_cpu_s(job) - worker_cpu
                plan_s[name] = min(plan_s.get(name, float("inf")), wall)
                samples = sum(1 for s in range(job.plan_all()) for _ in job.step_plan(s).documents())
                plan_cpu[name] = min(plan_cpu.get(name, float("inf")), cpu / samples)
                job.close()
        decode_s: dict[str, float] = {}
        images = 0
        pool = DecodePool(2)
        try:
            pool.wait_ready(120)
            for _ in range(args.rounds):
                for name, plugins in decoding.items():
                    job = Job(config(*plugins), retain_steps=1 << 20)
                    steps = job.plan_all()
                    started = time.perf_counter()
                    images = 0
                    for step in range(steps):
                        plan = job.step_plan(step)
                        for index in range(plan.num_microbatches):
                            arrays = job.microbatch(plan, 0, index, pool).arrays
                            images += len(arrays.get("image_shapes", ()))
                    decode_s[name] = min(decode_s.get(name, float("inf")), time.perf_counter() - started)
                    job.close()
        finally:
            pool.close()

    result = {"samples": samples, "images": images, "rounds": args.rounds, "floor_cpu_ms_per_sample": 1e3 * floor_cpu,
              "planning": [{"plugins": name, "seconds": round(s, 3), "samples_per_s": round(samples / s, 1),
                            "vs_none": round(plan_s["none"] / s, 3),
                            "cpu_ms_per_sample": round(1e3 * plan_cpu[name], 4),
                            "extra_cpu_ms_per_sample": round(1e3 * (plan_cpu[name] - plan_cpu["none"]), 4),
                            "extra_of_floor": round((plan_cpu[name] - plan_cpu["none"]) / floor_cpu, 4)}
                           for name, s in plan_s.items()],
              "decoding": [{"plugins": name, "seconds": round(s, 3), "images_per_s": round(images / s, 1),
                            "vs_none": round(decode_s["none"] / s, 3)} for name, s in decode_s.items()]}
    print(f"planning an epoch of {samples} samples (one process, best of {args.rounds}):")
    for row in result["planning"]:
        print(f"  {row['plugins']:<26} {row['seconds']:7.2f} s  {row['samples_per_s']:8.1f} samples/s  "
              f"{row['vs_none']:.2f}x of none  {row['cpu_ms_per_sample']:.3f} CPU ms/sample  "
              f"+{row['extra_cpu_ms_per_sample']:.3f} ms = {100 * row['extra_of_floor']:.2f}% of the floor's "
              f"{1e3 * floor_cpu:.2f} ms")
    print(f"decoding its {images} images (DecodePool(2), best of {args.rounds}):")
    for row in result["decoding"]:
        print(f"  {row['plugins']:<26} {row['seconds']:7.2f} s  {row['images_per_s']:8.1f} images/s  "
              f"{row['vs_none']:.2f}x of none")
    doc = benchjson.document("plugins", quick=args.quick)
    doc["tables"].append(benchjson.table(
        f"planning an epoch of {samples} samples (one process, best of {args.rounds})",
        ["plugins", "seconds", "samples/s", "x of none", "CPU ms/sample", "extra CPU ms/sample", "extra / floor"],
        [[r["plugins"], r["seconds"], r["samples_per_s"], r["vs_none"], r["cpu_ms_per_sample"],
          r["extra_cpu_ms_per_sample"], f"{100 * r['extra_of_floor']:.2f}%"] for r in result["planning"]],
        notes=["sample hooks run in a worker process of the job's, one round trip per sample",
               "CPU: this process and the sample-hook worker, best of the rounds; extra: above no plugins",
               f"floor: {1e3 * floor_cpu:.2f} CPU ms per sample (each sample parsed and its images decoded by our "
               "decode path in one process, bench/peers_work.py); goal (issue 49): a sample hook that does "
               "nothing costs at most 2% of it"]))
    doc["tables"].append(benchjson.table(
        f"decoding its {images} images (DecodePool(2), best of {args.rounds})",
        ["plugins", "seconds", "images/s", "x of none"],
        [[r["plugins"], r["seconds"], r["images_per_s"], r["vs_none"]] for r in result["decoding"]],
        notes=["media hooks run in the decode workers after each item is decoded"]))
    doc.update(result)
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
