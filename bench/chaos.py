"""Bounded chaos: several replicas on one Redis, a random replica SIGKILLed and restarted every few
seconds while every rank streams; prints samples delivered, lost and duplicated.

    python bench/chaos.py [--replicas 3] [--ranks 4] [--duration 120] [--kill-every 3 6] [--quick] [--json FILE]

Replicas are separate processes (`serve --redis`), each with one decode worker; the ranks are
DataClients in this process, each given every replica's address. When the time is up every rank
finishes the step it is in and stops. Ground truth is a single-node planner over the same config:
for every step a rank finished, each planned sample must have arrived exactly once in the
microbatch the plan puts it in (or be reported there as skipped, if it fails to decode).
Exit status 1 if anything was lost or duplicated. ``--quick`` is a smoke run (2 replicas, 2 ranks,
a few seconds, a small synthetic data set), not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_tools.jobs import ensure_demo_dataset  # noqa: E402
from disttrain_tools.localcluster import LocalRedis, Replica  # noqa: E402
from preprocess_service.service.job import Job  # noqa: E402


def chaos(*, num_replicas: int = 3, num_ranks: int = 4, duration_s: float = 120.0,
          kill_every_s: tuple[float, float] = (3.0, 6.0), seed: int = 0, shards: list[str] | None = None,
          workdir: Path | None = None, log=print) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="disttrain-chaos-"))
    shards = shards or [str(p) for p in ensure_demo_dataset(REPO / "data" / "laion-demo")]
    config = JobConfig(shards=tuple(shards), seq_len=4096, dp_size=num_ranks, num_microbatches=2,
                       seqs_per_microbatch=1, seed=seed, num_epochs=100)
    rng = random.Random(seed)
    received: dict[int, list] = {rank: [] for rank in range(num_ranks)}
    reconnects, errors = {}, []
    with LocalRedis(workdir / "redis") as redis_server:
        replicas = [Replica(redis_server.url, log_path=workdir / f"replica{i}.log", extra_args=("--lease-ttl", "2"))
                    for i in range(num_replicas)]
        for replica in replicas:
            replica.start(wait=False)
        from trainer import DataClient  # torch loads while the replicas start

        for replica in replicas:
            replica.wait_ready()
        deadline = time.monotonic() + duration_s
        addresses = [r.address for r in replicas]

        def consume(rank: int) -> None:
            try:
                order = addresses[rank % num_replicas:] + addresses[:rank % num_replicas]
                with DataClient(order, config, rank, prefetch=2, reconnect_timeout_s=90) as client:
                    for mb in client:
                        received[rank].append((mb.step, mb.microbatch_index, list(mb.sample_keys),
                                               [key for key, *_ in mb.skipped]))
                        if time.monotonic() > deadline and mb.microbatch_index + 1 == mb.num_microbatches:
                            break
                    reconnects[rank] = client.num_reconnects
            except Exception as exc:  # reported below
                errors.append((rank, exc))

        threads = [threading.Thread(target=consume, args=(rank,), daemon=True) for rank in range(num_ranks)]
        for thread in threads:
            thread.start()
        kills = 0
        while time.monotonic() < deadline:
            # no sleeping past the deadline: the loop ends there (no kill comes after it)
            time.sleep(max(0.0, min(rng.uniform(*kill_every_s), deadline - time.monotonic())))
            alive = [r for r in replicas if r.alive()]
            if len(alive) < 2 or time.monotonic() >= deadline:
                continue  # keep one replica up: the clients must be able to go somewhere
            victim = rng.choice(alive)
            victim.kill()
            kills += 1
            log(f"  t={duration_s - (deadline - time.monotonic()):5.1f}s  killed replica :{victim.port}, restarting it")
            victim.start(wait=False)
        for thread in threads:
            thread.join(timeout=300)
        for replica in replicas:
            replica.kill()
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        raise RuntimeError(f"ranks {hung} did not finish within 300 s of the end of the chaos")
    if errors:
        raise RuntimeError(f"ranks failed: {errors}")
    return _verdict(config, received, kills, reconnects, duration_s)


def _verdict(config: JobConfig, received: dict[int, list], kills: int, reconnects: dict, duration_s: float) -> dict:
    """Compares what each rank got with a single-node plan of the steps it finished."""
    job = Job(config)
    planned = delivered = skipped = lost = duplicated = misplaced = 0
    for rank, got in received.items():
        last_step = max((step for step, *_ in got), default=-1)
        seen = collections.Counter()
        where = {}
        for step, index, keys, skips in got:
            for key in keys + skips:
                seen[(step, key)] += 1
                where[(step, key)] = index
            delivered += len(keys)
            skipped += len(skips)
        for step in range(last_step + 1):
            plan = job.step_plan(step)
            for index in range(plan.num_microbatches):
                for seq in plan.microbatch(rank, index):
                    for doc in seq.documents:
                        planned += 1
                        count = seen.pop((step, doc.key), 0)
                        lost += count == 0
                        duplicated += max(count - 1, 0)
                        misplaced += count > 0 and where[(step, doc.key)] != index
        duplicated += sum(seen.values())  # arrived but never planned for this rank and step
    return {"replicas_killed": kills, "duration_s": duration_s, "client_reconnects": sum(reconnects.values()),
            "steps_per_rank": {rank: max((s for s, *_ in got), default=-1) + 1 for rank, got in received.items()},
            "samples_planned": planned, "samples_delivered": delivered, "samples_skipped_reported": skipped,
            "samples_lost": lost, "samples_duplicated": duplicated, "samples_misplaced": misplaced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of chaos")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN", "MAX"),
                        help="seconds between kills, uniform in [MIN, MAX]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 replicas, 2 ranks, 2.5 s, a kill every 1-2 s, 2 shards of 40 samples")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    shards = None
    if args.quick:
        args.replicas, args.ranks, args.duration = min(args.replicas, 2), min(args.ranks, 2), min(args.duration, 2.5)
        args.kill_every = (1.0, 2.0)
        shards = benchjson.quick_shards(2, 40)
    print(f"chaos: {args.replicas} replicas, {args.ranks} ranks, {args.duration:g} s, a replica SIGKILLed "
          f"every {args.kill_every[0]:g}-{args.kill_every[1]:g} s")
    figures = chaos(num_replicas=args.replicas, num_ranks=args.ranks, duration_s=args.duration,
                    kill_every_s=tuple(args.kill_every), seed=args.seed, shards=shards)
    for name, value in figures.items():
        print(f"  {name:26s} {value}")
    doc = benchjson.document("chaos", quick=args.quick) | figures
    rows = [[name, value if not isinstance(value, dict) else ", ".join(f"rank {k}: {v}" for k, v in value.items())]
            for name, value in figures.items()]
    doc["tables"].append(benchjson.table(
        f"chaos: {args.replicas} replicas on one Redis, {args.ranks} ranks, {args.duration:g} s, a replica SIGKILLed "
        f"every {args.kill_every[0]:g}-{args.kill_every[1]:g} s", ["figure", "value"], rows,
        notes=["target: 0 samples lost, duplicated and misplaced (checked against a single-node plan of every step "
               "a rank finished)"]))
    benchjson.write(args.json, doc)
    return 0 if figures["samples_lost"] == 0 and figures["samples_duplicated"] == 0 \
        and figures["samples_misplaced"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
