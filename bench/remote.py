"""Remote shards: bytes fetched per epoch over the shard bytes, cold and warm, and wall times.

    .venv/bin/python bench/remote.py [--no-cache-baseline] [--quick] [--json FILE]

The demo shards (``./dev.sh run``'s: 4 synthetic LAION-style shards and a corrupt one) are served
by nginx (tests/webservers.py: Debian's nginx in the foreground on a free
loopback port, its access log recording the bytes sent per request). ``./dev.sh run``'s job (2
client ranks, one epoch, run_job) runs over the http URLs against an embedded service
(create_server, decode workers one per core), in two modes:

- single node: the job keeps each step's encoded media from planning to decoding, so it reads
  each shard once anyway; cold cache, then warm (a second job, another seed, same service);
- one replica over Redis (redis-server on a free port): every microbatch re-reads its samples
  from the shards (``shared_job.py``), which is where a cache matters: cold, warm, a cache that
  holds only 2 of the 5 shards, and with --no-cache-baseline the behaviour before the cache
  (shard_cache_bytes = 0: every microbatch scans its shards again over HTTP: slow).
- local files, single node, for the wall time.

Printed per run: bytes the service received (its counters) and bytes nginx sent (body, and with
headers), each over the bytes of the shards, the shard GETs nginx served, the wall time, and
the exactly-once check. (run_job lists every shard's keys itself for that check: those reads are
made once, before the measured runs, and not counted.) Everything shares this machine's cores:
compare ratios, not seconds. ``--quick`` is a smoke run (3 synthetic shards of 20 samples instead
of the demo set, one client rank, one decode worker; single node cold and warm, and a replica with the
2-shard cache), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run
sys.path.insert(0, str(REPO / "tests"))

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from webservers import Nginx  # noqa: E402  (tests/ is on sys.path when this runs as a script)

if TYPE_CHECKING:
    from preprocess_service.service.settings import ServiceSettings

# The service's modules are imported in the functions that use them: run_job's client processes
# start by spawn, which runs this script's top level again, and a client needs none of them.


def _run(name: str, config: JobConfig, server_and_reader, nginx: Nginx, shard_bytes: int) -> dict:
    from disttrain_tools.runner import run_job

    server, reader = server_and_reader
    before = reader.cache.stats() if reader else None
    log_start = len(nginx.log())
    start = time.perf_counter()
    result = run_job(config, address=f"127.0.0.1:{server.port}", progress=False)
    seconds = time.perf_counter() - start
    time.sleep(0.2)  # nginx logs a request when its response is done
    served = nginx.log()[log_start:]
    row = {"run": name, "wall_s": round(seconds, 2), "exactly_once": result.exactly_once()["ok"],
           "shard_gets": sum(1 for line in served if line.path.endswith(".tar")),
           "nginx_body_ratio": sum(line.body_bytes_sent for line in served) / shard_bytes,
           "nginx_with_headers_ratio": sum(line.bytes_sent for line in served) / shard_bytes}
    if reader:
        after = reader.cache.stats()
        row["fetched_ratio"] = (after.fetched_total - before.fetched_total) / shard_bytes
        events = {k: after.events[k] - before.events[k] for k in after.events}
        row["events"] = {k: n for k, n in events.items() if n}
    return row


class _Service:
    def __init__(self, limits: ServiceSettings, redis_url: str | None = None, decode_workers: int | None = None):
        from preprocess_service.service.server import create_server

        self.server, self.port, self.servicer = create_server("127.0.0.1:0", settings=limits, redis_url=redis_url,
                                                              decode_workers=decode_workers)

    def __enter__(self):
        return self, self.servicer.reader

    def __exit__(self, *exc):
        self.server.stop(0).wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-cache-baseline", action="store_true", help="also run with shard_cache_bytes = 0")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 synthetic shards of 20 samples, one client rank")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    from disttrain_tools.jobs import ensure_demo_dataset
    from disttrain_tools.localcluster import LocalRedis
    from preprocess_service.adapters.io import shards
    from preprocess_service.service.settings import ServiceSettings

    paths = ([Path(p) for p in benchjson.quick_shards(3, 20)] if args.quick
             else ensure_demo_dataset(REPO / "data" / "laion-demo"))
    shard_bytes = sum(p.stat().st_size for p in paths)
    config = JobConfig(shards=tuple(map(str, paths)), dp_size=1 if args.quick else 2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp, \
            Nginx(paths[0].parent, Path(tmp) / "nginx") as nginx, LocalRedis(Path(tmp) / "redis") as redis:
        urls = tuple(f"{nginx.url}/{p.name}" for p in paths)
        for url in urls:  # run_job's own listing of the keys (this process's reader), not measured
            for _ in shards.iter_shard(url, lambda problem: None):
                pass
        http = dataclasses.replace(config, shards=urls)
        limits = ServiceSettings(shard_cache_dir=tmp)
        small = dataclasses.replace(limits, shard_cache_bytes=max(p.stat().st_size for p in paths) * 2 + 1)
        small_label = f"cache of 2 shards ({small.shard_cache_bytes / 1e6:.0f} MB)"
        runs = [("single node", None, [("cold cache", limits, 0), ("warm cache (a new job)", None, 1)]),
                ("replica on Redis", redis.url, [("cold cache", limits, 2), ("warm cache (a new job)", None, 3),
                                                 (small_label, small, 4)]
                 + ([("no cache (before)", dataclasses.replace(limits, shard_cache_bytes=0), 5)]
                    if args.no_cache_baseline else []))]
        if args.quick:  # a smoke run of each path (miss, hit, eviction; one node and a replica)
            runs = [runs[0], ("replica on Redis", redis.url, [(small_label, small, 4)])]
        decode_workers = 1 if args.quick else None
        for mode, redis_url, steps in runs:
            service = None
            for name, step_limits, seed in steps:
                if step_limits is not None:
                    if service:
                        service.__exit__()
                    service = _Service(step_limits, redis_url, decode_workers)
                job = dataclasses.replace(http, seed=config.seed + seed)
                rows.append(_run(f"{mode}: {name}", job, service.__enter__(), nginx, shard_bytes))
            service.__exit__()
        if not args.quick:
            with _Service(limits) as service:
                rows.append(_run("single node: local files", config, (service[0], None), nginx, shard_bytes))
    print(f"{len(paths)} shards, {shard_bytes / 1e6:.1f} MB, served by nginx on loopback; job: "
          f"dp_size {config.dp_size}, 1 epoch, {config.seq_len}-token sequences")
    print(f"{'run':44s} {'fetched/shards':>14s} {'nginx body':>10s} {'+headers':>9s} {'GETs':>5s} {'wall s':>7s}  ok")
    for row in rows:
        fetched = f"{row['fetched_ratio']:.4f}x" if "fetched_ratio" in row else "-"
        print(f"{row['run']:44s} {fetched:>14s} {row['nginx_body_ratio']:9.4f}x "
              f"{row['nginx_with_headers_ratio']:8.4f}x {row['shard_gets']:5d} {row['wall_s']:7.1f}  "
              f"{row['exactly_once']}  {row.get('events', '')}")
    doc = benchjson.document("remote", quick=args.quick) | {"rows": rows}
    doc["tables"].append(benchjson.table(
        f"remote shards: {len(paths)} shards, {shard_bytes / 1e6:.1f} MB, served by nginx on loopback; job: dp_size "
        f"{config.dp_size}, 1 epoch, {config.seq_len}-token sequences",
        ["run", "fetched/shards", "nginx body/shards", "nginx with headers/shards", "GETs", "wall s", "exactly once"],
        [[row["run"], round(row["fetched_ratio"], 4) if "fetched_ratio" in row else None,
          round(row["nginx_body_ratio"], 4), round(row["nginx_with_headers_ratio"], 4), row["shard_gets"],
          row["wall_s"], row["exactly_once"]] for row in rows],
        notes=["fetched: the bytes the service received (its shard cache's counters); nginx: the bytes it sent, from "
               "its access log", "everything shares this machine's cores: compare ratios, not seconds"]))
    benchjson.write(args.json, doc)
    return 0 if all(row["exactly_once"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
