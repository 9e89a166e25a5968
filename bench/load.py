"""Load test: many concurrent client streams against 2 replicas on loopback, for a bounded time.

    python bench/load.py [--streams 32] [--duration 60] [--quick] [--json FILE]

One job with --streams data-parallel ranks (2048-token sequences, 1 per microbatch, 2
microbatches per step, the demo data set repeated) is served by 2 replica processes (one decode
worker each) on a real redis-server; rank r reads from replica r % 2 in one of 4 client
processes (threads per rank). Reported: microbatches and samples per second over all streams,
the time between consecutive microbatches of a stream (median, p99, max over all streams, the p99
over the median (target: under 2; the decode pool schedules the streams fairly), and each stream's
own median and p99; a microbatch with no media, at the end of an epoch, needs no decoding and comes
right after the one before, as it would from any scheduler), and the service's
memory: the resident set of each replica with its decode workers, sampled every second; the
peak in the first and the last third of the run show whether memory stays bounded (it should:
every queue is bounded). Machines here are noisy, and replicas, Redis and clients share its cores.
``--quick`` is a smoke run (4 streams in 2 client processes, 3 s but at least 4 microbatches per
stream, one synthetic shard of 40 samples), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
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
from soak import tree_pids  # noqa: E402  (bench/ is on sys.path when this runs as a script)

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_tools.jobs import ensure_demo_dataset  # noqa: E402
from disttrain_tools.localcluster import LocalRedis, Replica  # noqa: E402

CLIENT_PROCESSES = 4


def _tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total = 0
    for p in tree_pids(pid):
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank below, as figures here always were)."""
    return values[int(q * (len(values) - 1))]


def _gap_figures(results: dict) -> tuple[dict, list[str]]:
    """Figures of the time between a stream's microbatches, over all streams, and a line per stream."""
    gaps = sorted(g for r in results.values() for g in r["gaps"])
    if not gaps:
        return {"gap_median_ms": None, "gap_p99_ms": None, "gap_max_ms": None}, []
    lines, ratios = [], []
    for rank in sorted(results):
        own = sorted(results[rank]["gaps"])
        if own:
            median, p99 = statistics.median(own), _percentile(own, 0.99)
            ratios.append(p99 / median)
            lines.append(f"    rank {rank:3d}: {len(own):4d} gaps, median {1000 * median:6.0f} ms, "
                         f"p99 {1000 * p99:6.0f} ms ({p99 / median:.2f}x)")
    median, p99 = statistics.median(gaps), _percentile(gaps, 0.99)
    return {"gap_median_ms": round(1000 * median, 1), "gap_p99_ms": round(1000 * p99, 1),
            "gap_max_ms": round(1000 * gaps[-1], 1), "gap_p99_over_median": round(p99 / median, 2),
            "stream_p99_over_median_max": round(max(ratios), 2),
            "stream_p99_over_median_median": round(statistics.median(ratios), 2)}, lines


def _clients(ranks: list[int], addresses: list[str], config: JobConfig, deadline: float, out,
             min_microbatches: int = 0) -> None:
    """One client process: a thread per rank, each iterating its stream until the deadline (and
    at least ``min_microbatches``)."""
    from trainer import DataClient

    results = {}

    def rank_loop(rank: int) -> None:
        gaps, arrivals, samples, count, errors = [], [], 0, 0, []
        try:
            with DataClient(addresses[rank % 2], config, rank, prefetch=2) as client:
                last = time.monotonic()
                for mb in client:
                    now = time.monotonic()
                    gaps.append(now - last)
                    arrivals.append((now, mb.step, mb.microbatch_index, len(mb.sample_keys), len(mb.images)))
                    last = now
                    count += 1
                    samples += len(mb.sample_keys)
                    if now >= deadline and count >= min_microbatches:
                        break
        except Exception as exc:  # reported, not hidden
            errors.append(repr(exc))
        results[rank] = {"gaps": gaps[1:], "arrivals": arrivals, "microbatches": count, "samples": samples,
                         "errors": errors}

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 streams in 2 client processes, 3 s (at least 4 microbatches per stream), "
                             "one synthetic shard of 40 samples")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--raw", type=Path, help="write every stream's arrival times (s, step, index) here")
    args = parser.parse_args(argv)
    client_processes = CLIENT_PROCESSES
    if args.quick:
        args.streams, args.duration, client_processes = min(args.streams, 4), min(args.duration, 3.0), 2
        shards = str(Path(benchjson.quick_shards()[0]).parent)
    else:
        shards = str(ensure_demo_dataset(REPO / "data" / "laion-demo")[0].parent)
    config = JobConfig(shards=(shards,), seq_len=2048, dp_size=args.streams, num_microbatches=2,
                       seqs_per_microbatch=1, num_epochs=1000)
    work = Path(tempfile.mkdtemp(prefix="disttrain-load-"))
    with LocalRedis(work / "redis") as redis_server:
        replicas = [Replica(redis_server.url, log_path=work / f"replica{i}.log").start(wait=False) for i in range(2)]
        for replica in replicas:  # both start at once
            replica.wait_ready()
        addresses = [r.address for r in replicas]
        samples_rss: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample_memory() -> None:
            while not stop.is_set():
                samples_rss.append((time.monotonic(), sum(_tree_rss_bytes(r.process.pid) for r in replicas)))
                stop.wait(1.0)

        idle_rss = sum(_tree_rss_bytes(r.process.pid) for r in replicas)
        sampler = threading.Thread(target=sample_memory, daemon=True)
        start = time.monotonic()
        sampler.start()
        out = mp.Queue()
        groups = [list(range(i, args.streams, client_processes)) for i in range(client_processes)]
        deadline = time.monotonic() + args.duration
        procs = [mp.Process(target=_clients, args=(g, addresses, config, deadline, out, 4 if args.quick else 0))
                 for g in groups]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            results.update(out.get(timeout=args.duration + 300))
        for p in procs:
            p.join()
        elapsed = time.monotonic() - start
        stop.set()
        sampler.join()
        for r in replicas:
            r.kill()
    if args.raw:
        args.raw.write_text(json.dumps({r: v["arrivals"] for r, v in results.items()}))
    gap_figures, stream_lines = _gap_figures(results)
    microbatches = sum(r["microbatches"] for r in results.values())
    samples = sum(r["samples"] for r in results.values())
    errors = [e for r in results.values() for e in r["errors"]]
    third = elapsed / 3  # of the run as it went (the last microbatches may come after --duration)
    first = max((m for t, m in samples_rss if t - start <= third), default=0)
    last = max((m for t, m in samples_rss if t - start >= 2 * third), default=0)
    figures = {
        "streams": args.streams, "duration_s": round(elapsed, 1), "microbatches": microbatches, "samples": samples,
        "microbatches_per_s": round(microbatches / elapsed, 1), "samples_per_s": round(samples / elapsed, 1),
        **gap_figures,
        "streams_served": sum(1 for r in results.values() if r["microbatches"]),
        "errors": errors,
        "rss_idle_mib": round(idle_rss / 2**20), "rss_peak_mib": round(max(m for _, m in samples_rss) / 2**20),
        "rss_peak_first_third_mib": round(first / 2**20), "rss_peak_last_third_mib": round(last / 2**20),
        "memory_bounded": last <= 1.1 * first,
    }
    print(f"{args.streams} streams on 2 replicas for {elapsed:.0f} s ({len(os.sched_getaffinity(0))} cores shared by "
          "replicas, Redis and clients)")
    for key, value in figures.items():
        print(f"  {key:31s} {value}")
    print("  time between microbatches, per stream:")
    print("\n".join(stream_lines))
    per_stream = {rank: {"median_ms": round(1000 * statistics.median(r["gaps"]), 1),
                         "p99_ms": round(1000 * _percentile(sorted(r["gaps"]), 0.99), 1)}
                  for rank, r in sorted(results.items()) if r["gaps"]}
    doc = benchjson.document("load", quick=args.quick) | figures | {"per_stream": per_stream}
    doc["tables"].append(benchjson.table(
        f"load: {args.streams} streams on 2 replicas for {elapsed:.0f} s", ["figure", "value"],
        [[key, value if not isinstance(value, list) else len(value)] for key, value in figures.items()],
        notes=["gap: time between consecutive microbatches of a stream; target: p99 / median under 2",
               "rss: the replicas with their decode workers, sampled every second; memory_bounded: the peak of "
               "the last third within 1.1x the first third's", "errors: the number of streams' errors",
               "replicas, Redis and the clients share this machine's cores"]))
    doc["tables"].append(benchjson.table(
        "time between microbatches, per stream", ["rank", "median ms", "p99 ms", "p99 / median"],
        [[rank, row["median_ms"], row["p99_ms"],
          round(row["p99_ms"] / row["median_ms"], 2) if row["median_ms"] else None]
         for rank, row in per_stream.items()]))
    benchjson.write(args.json, doc)
    return 0 if not errors and figures["streams_served"] == args.streams else 1


if __name__ == "__main__":
    sys.exit(main())
