"""Replicas on Redis: throughput with 1 and 2 replicas, Redis traffic per step, and failover time.

    python bench/replicas.py [--epochs 1] [--failovers 3] [--quick] [--json FILE]

1. throughput: the demo data set streamed to 2 ranks by 1 replica, then by 2 replicas (rank r on
   replica r), in one run. Every replica is its own process with one decode worker, so the ratio
   shows what a second replica (node) adds, not how one node's cores are shared; a fresh Redis
   per arm.
2. Redis per step: two replicas in this process serve the same job for 1 and for 3 epochs; the
   commands and round trips (pipelines and scripts) they sent, per step. Constant per step means
   it does not grow with the data set.
3. failover: a rank streams from replica A (with B's address too); A is SIGKILLed; the time from
   the kill to the first microbatch the rank receives from B. Measured killing a replica that only
   streams, and killing the one that holds the planning lease (B must first take the lease over,
   after --lease-ttl seconds, when the next step is not committed yet).
Machines here are noisy: compare figures from one run only. ``--quick`` is a smoke run (one
synthetic shard of 40 samples instead of the demo set, one failover per kind), not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run

import benchjson  # noqa: E402
import redis  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_tools.jobs import ensure_demo_dataset  # noqa: E402
from disttrain_tools.localcluster import LocalRedis, Replica  # noqa: E402
from preprocess_service.service.server import create_server  # noqa: E402

LEASE_TTL_S = 2.0


def _config(shards, **overrides) -> JobConfig:
    fields = dict(shards=tuple(shards), seq_len=8192, dp_size=2, num_microbatches=4, seqs_per_microbatch=2)
    fields.update(overrides)
    return JobConfig(**fields)


def _stream(addresses_per_rank, config) -> tuple[int, float]:
    """Every rank in its own thread; (samples, seconds from the first microbatch to the last)."""
    from trainer import DataClient

    counts, firsts, lasts = [0] * config.dp_size, [], []

    def body(rank):
        with DataClient(addresses_per_rank[rank], config, rank, prefetch=4) as client:
            for mb in client:
                if counts[rank] == 0:
                    firsts.append(time.perf_counter())
                counts[rank] += len(mb.sample_keys)
            lasts.append(time.perf_counter())

    threads = [threading.Thread(target=body, args=(r,)) for r in range(config.dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), max(lasts) - min(firsts)


def throughput(shards, workdir: Path, epochs: int) -> dict:
    out = {}
    for num_replicas in (1, 2):
        with LocalRedis(workdir / f"redis-tp{num_replicas}") as server:
            replicas = [Replica(server.url, log_path=workdir / f"tp{num_replicas}-{i}.log").start(wait=False)
                        for i in range(num_replicas)]
            try:
                for replica in replicas:
                    replica.wait_ready()
                config = _config(shards, num_epochs=epochs)
                samples, seconds = _stream([replicas[r % num_replicas].address for r in range(2)], config)
            finally:
                for replica in replicas:
                    replica.kill()
        out[num_replicas] = {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds}
    out["ratio"] = out[2]["samples_per_s"] / out[1]["samples_per_s"]
    return out


def redis_per_step(shards, workdir: Path) -> dict:
    out = {}
    for epochs in (1, 3):
        with LocalRedis(workdir / f"redis-rt{epochs}") as server:
            servers = [create_server("127.0.0.1:0", decode_workers=0, redis_url=server.url) for _ in range(2)]
            try:
                config = _config(shards, num_epochs=epochs, seq_len=4096, num_microbatches=2, seqs_per_microbatch=1)
                _stream([f"127.0.0.1:{servers[r][1]}" for r in range(2)], config)
                stats = [s.jobs.factory.store.stats() for _, _, s in servers]
                steps = servers[0][2].jobs.get(config.job_id()).num_steps()
            finally:
                for srv, _, _ in servers:
                    srv.stop(0).wait()
        out[epochs] = {"steps": steps, "commands_per_step": sum(s["commands"] for s in stats) / steps,
                       "round_trips_per_step": sum(s["round_trips"] for s in stats) / steps}
    return out


def failover(shards, workdir: Path, repeats: int) -> dict:
    from trainer import DataClient

    out = {"streaming replica": [], "planning replica": []}
    for kind in out:
        for attempt in range(repeats):
            with LocalRedis(workdir / f"redis-fo-{kind[0]}{attempt}") as server:
                replicas = [Replica(server.url, log_path=workdir / f"fo-{i}.log",
                                    extra_args=("--lease-ttl", str(LEASE_TTL_S))).start(wait=False) for i in range(2)]
                try:
                    for replica in replicas:
                        replica.wait_ready()
                    config = _config(shards, seq_len=4096, num_microbatches=2, seqs_per_microbatch=1, dp_size=1,
                                     seed=attempt, num_epochs=20)
                    planner = replicas[0] if kind == "planning replica" else replicas[1]
                    # the planner is whoever plans first: let `planner` plan step 0 through a short stream
                    with DataClient(planner.address, config, 0, prefetch=1) as warm:
                        next(warm)
                    lease = f"disttrain:{{{config.job_id()}}}:planner"
                    with DataClient([replicas[0].address, replicas[1].address], config, 0, prefetch=1) as client:
                        received = 0
                        for _ in client:
                            received += 1
                            if received == 6:
                                holder = redis.Redis.from_url(server.url).get(lease) or b""
                                if holder.startswith(f"replica-{planner.address}/".encode()) is False:
                                    raise RuntimeError(f"the planning lease is held by {holder!r}, "
                                                       f"not by {planner.port}")
                                killed_at = time.monotonic()
                                replicas[0].kill()
                            if client.resumed_at:
                                out[kind].append(client.resumed_at[0] - killed_at)
                                break
                            time.sleep(0.02)
                finally:
                    for replica in replicas:
                        replica.kill()
    return {kind: {"median_s": statistics.median(v), "all_s": v} for kind, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=1, help="epochs of the demo set in part 1")
    parser.add_argument("--failovers", type=int, default=3, help="kills per kind in part 3")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one synthetic shard of 40 samples, one epoch, one failover per kind")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.failovers = 1, 1
    shards = (benchjson.quick_shards() if args.quick
              else [str(p) for p in ensure_demo_dataset(REPO / "data" / "laion-demo")])
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-bench-replicas-"))
    figures = {}

    tp = figures["throughput"] = throughput(shards, workdir, args.epochs)
    print(f"1. throughput, 2 ranks, {'a synthetic shard' if args.quick else 'demo set'}, one decode worker per "
          "replica")
    for n in (1, 2):
        print(f"   {n} replica{'s' if n > 1 else ' '}  {tp[n]['samples']:6d} samples in {tp[n]['seconds']:6.2f} s = "
              f"{tp[n]['samples_per_s']:7.1f} samples/s")
    print(f"   ratio 2 / 1 replicas: {tp['ratio']:.2f}")

    rt = figures["redis_per_step"] = redis_per_step(shards, workdir)
    print("\n2. Redis traffic of 2 replicas serving 2 ranks, per step")
    for epochs, row in rt.items():
        print(f"   {epochs} epoch{'s' if epochs > 1 else ' '} ({row['steps']:4d} steps)  "
              f"{row['commands_per_step']:5.1f} commands/step  {row['round_trips_per_step']:5.1f} round trips/step")

    fo = figures["failover"] = failover(shards, workdir, args.failovers)
    print(f"\n3. failover: SIGKILL of a rank's replica -> first microbatch from another (lease TTL {LEASE_TTL_S:g} s)")
    for kind, row in fo.items():
        print(f"   {kind:18s} median {row['median_s']:5.2f} s  (" + ", ".join(f"{v:.2f}" for v in row["all_s"]) + ")")
    doc = benchjson.document("replicas", quick=args.quick) | figures
    doc["tables"] += [
        benchjson.table("throughput, 2 ranks, one decode worker per replica (a process each)",
                        ["replicas", "samples", "seconds", "samples/s"],
                        [[n, tp[n]["samples"], round(tp[n]["seconds"], 2), round(tp[n]["samples_per_s"], 1)]
                         for n in (1, 2)], notes=[f"ratio 2 / 1 replicas: {tp['ratio']:.2f}"]),
        benchjson.table("Redis traffic of 2 replicas serving 2 ranks, per step",
                        ["epochs", "steps", "commands/step", "round trips/step"],
                        [[epochs, row["steps"], round(row["commands_per_step"], 1),
                          round(row["round_trips_per_step"], 1)] for epochs, row in rt.items()],
                        notes=["constant per step: the traffic does not grow with the data set"]),
        benchjson.table(f"failover: SIGKILL of a rank's replica -> first microbatch from another (lease TTL "
                        f"{LEASE_TTL_S:g} s)", ["replica killed", "median s", "all s"],
                        [[kind, round(row["median_s"], 2), ", ".join(f"{v:.2f}" for v in row["all_s"])]
                         for kind, row in fo.items()])]
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
