"""How fast ``serve`` comes up, as a container orchestrator and a trainer see it, in one run.

    python bench/startup.py [--rounds 5] [--decode-workers 2] [--quick] [--json FILE]

Each round launches ``python -m preprocess_service serve`` on a free port (warm: the page cache
and the planner's compiled kernels as a second launch finds them) and, from the moment of launch,
asks grpc.health.v1 every 10 ms on a channel of its own: the first answer (NOT_SERVING while the
service starts behind its bound port), the first SERVING (the service's calls attached), and the
first SERVING of the warm entry (the planner's kernels loaded and the decode workers up). A client
(this process, its imports done before the launch) opens a small job and takes its first
microbatch as soon as the port answers: launch to first microbatch. Medians and ranges over the
rounds. Goals (issue 49): health answered within 0.5 s of launch, "warming" until warm.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402

POLL_S = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_health(address: str, launched: float, out: dict, stop: threading.Event) -> None:
    """Fills out["answer"], out["serving"], out["warm"]: seconds from launch to each."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from preprocess_service.service.front import WARM_SERVICE

    serving = health_pb2.HealthCheckResponse.SERVING
    options = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
               ("grpc.max_reconnect_backoff_ms", 20)]  # a refused port is tried again at once
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set() and "warm" not in out:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == serving:
                    out.setdefault("serving", time.monotonic() - launched)
                out.setdefault("answer", time.monotonic() - launched)
                if "serving" in out and stub.Check(health_pb2.HealthCheckRequest(service=WARM_SERVICE),
                                                   timeout=1).status == serving:
                    out.setdefault("warm", time.monotonic() - launched)
            except grpc.RpcError:
                pass
            time.sleep(POLL_S)


def one_round(shards: Path, decode_workers: int) -> dict:
    from disttrain_api.config import JobConfig
    from trainer import DataClient

    port = _free_port()
    address = f"127.0.0.1:{port}"
    out: dict = {}
    stop = threading.Event()
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--decode-workers", str(decode_workers)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watcher = threading.Thread(target=_watch_health, args=(address, launched, out, stop), daemon=True)
    watcher.start()
    try:
        config = JobConfig(shards=(str(shards),), dp_size=1, seq_len=2048, num_microbatches=2)
        with DataClient(address, config, 0, prefetch=1, connect_timeout_s=60, shared_memory=False) as client:
            next(client)
            out["first_microbatch"] = time.monotonic() - launched
        watcher.join(timeout=120)
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 2

    from disttrain_tools import synth

    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "data"
        synth.write_dataset(shards, synth.SynthConfig(num_shards=1, samples_per_shard=32))
        one_round(shards, args.decode_workers)  # warm: the page cache and the kernel cache, not counted
        rounds = [one_round(shards, args.decode_workers) for _ in range(args.rounds)]

    names = [("answer", "first health answer"), ("serving", "health SERVING (service attached)"),
             ("warm", "warm (kernels loaded, decode workers up)"), ("first_microbatch", "client's first microbatch")]
    rows = []
    for key, label in names:
        values = [r[key] for r in rounds if key in r]
        if values:
            rows.append([label, f"{statistics.median(values):.3f}", f"{min(values):.3f}-{max(values):.3f}",
                         len(values)])
    print(f"serve start-up, seconds from launch ({args.rounds} rounds, {args.decode_workers} decode workers):")
    for row in rows:
        print(f"  {row[0]:<42} {row[1]:>7} s  ({row[2]})  {row[3]} rounds")
    answers = [r["answer"] for r in rounds if "answer" in r]
    if not answers:
        raise SystemExit("serve never answered health: see its log (run it by hand)")
    answer = statistics.median(answers)
    print(f"goal: health answered within 0.5 s of launch: {'met' if answer <= 0.5 else 'NOT met'} ({answer:.3f} s)")
    doc = benchjson.document("startup", quick=args.quick)
    doc["tables"].append(benchjson.table(
        f"serve start-up: seconds from launch ({args.rounds} rounds, {args.decode_workers} decode workers)",
        ["event", "median s", "range s", "rounds"], rows,
        notes=["warm launches (a first, uncounted launch filled the page cache and the kernel cache)",
               "health polled every 10 ms on its own channel; the client (imports done before the launch) opens a "
               "1-shard job and takes its first microbatch",
               f"goal (issue 49): health answered within 0.5 s of launch: "
               f"{'met' if answer <= 0.5 else 'NOT met'} ({answer:.3f} s median)"]))
    doc["rounds"] = rounds
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
