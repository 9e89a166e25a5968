"""End-to-end streaming throughput vs the bare gRPC ceiling, in one run on the same machine.

    python bench/stream.py [--shards SPEC ...] [--dp-size 2] [--seq-len 8192] [--seqs-per-microbatch 2]

1. end to end: the service runs in its own process (``python -m preprocess_service serve``);
   ``dp_size`` client processes (trainer.DataClient) consume one epoch of the dataset (default: the
   synthetic LAION-style demo set). Reported: samples/s, sequences/s, MB/s of tensor payload.
2. ceiling: a bare gRPC server process streams the same number of messages of the same mean size
   (one preallocated bytes payload, nothing decoded or copied per message) to the same number of
   client processes, which only count bytes.
The ratio end-to-end / ceiling says how much of the transport's capacity the service delivers.
Machines here are noisy: compare figures from one run only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from preprocess_service.__main__ import ensure_demo_dataset  # noqa: E402
from preprocess_service.config import JobConfig  # noqa: E402
from preprocess_service.runner import run_job  # noqa: E402
from preprocess_service.server import CHANNEL_OPTIONS  # noqa: E402

BARE_METHOD = "/bench.Bare/Stream"


def start_process(args: list[str]) -> tuple[subprocess.Popen, int]:
    """Starts a server process that prints '... listening on HOST:PORT' first; returns it and the port."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def bare_serve() -> None:
    """The ceiling's server: streams ``count`` copies of one ``size``-byte payload per request."""

    def stream(request: bytes, context):
        count, size = json.loads(request)
        payload = os.urandom(size)
        for _ in range(count):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"bare server listening on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def bare_client(address: str, count: int, size: int, results) -> None:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream(BARE_METHOD)(json.dumps([count, size]).encode())
        start = time.perf_counter()
        received = sum(len(message) for message in call)
        results.put((received, time.perf_counter() - start))


def measure_ceiling(num_streams: int, count_per_stream: int, size: int) -> tuple[int, float]:
    proc, port = start_process([__file__, "--bare-server"])
    try:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        clients = [ctx.Process(target=bare_client, args=(f"127.0.0.1:{port}", count_per_stream, size, results))
                   for _ in range(num_streams)]
        for c in clients:
            c.start()
        outcomes = [results.get(timeout=600) for _ in clients]
        for c in clients:
            c.join()
        # like the end-to-end figure: from the first request to the last byte, slowest stream
        return sum(n for n, _ in outcomes), max(s for _, s in outcomes)
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", nargs="+", help="shard specs (default: the synthetic demo set)")
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--seqs-per-microbatch", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        bare_serve()
        return 0
    shard_specs = args.shards or [str(p) for p in ensure_demo_dataset(REPO / "data" / "laion-demo")]
    config = JobConfig(shards=tuple(shard_specs), dp_size=args.dp_size, seq_len=args.seq_len,
                       num_microbatches=args.num_microbatches, seqs_per_microbatch=args.seqs_per_microbatch)

    proc, port = start_process(["-m", "preprocess_service", "serve", "--host", "127.0.0.1", "--port", "0"])
    try:
        result = run_job(config, address=f"127.0.0.1:{port}", progress=False)
    finally:
        proc.terminate()
        proc.wait()
    # Timed inside each client process (connect to last microbatch), slowest rank: process start-up
    # and imports are left out, as they are for the ceiling.
    seconds = max(r.seconds for r in result.ranks)
    e2e_bytes = sum(r.num_bytes for r in result.ranks)
    num_messages = sum(len(r.microbatches) for r in result.ranks)
    num_samples = sum(len(r.keys) for r in result.ranks)
    num_sequences = sum(r.num_sequences for r in result.ranks)
    if not result.exactly_once()["ok"] or num_messages == 0:
        print(f"end-to-end run failed its exactly-once check: {result.exactly_once()}", file=sys.stderr)
        return 1
    per_stream = num_messages // args.dp_size
    mean_size = e2e_bytes // num_messages
    bare_bytes, bare_seconds = measure_ceiling(args.dp_size, per_stream, mean_size)

    figures = {
        "e2e_seconds": seconds, "e2e_bytes": e2e_bytes, "e2e_samples": num_samples,
        "e2e_sequences": num_sequences, "e2e_messages": num_messages,
        "e2e_samples_per_s": num_samples / seconds, "e2e_sequences_per_s": num_sequences / seconds,
        "e2e_mb_per_s": e2e_bytes / 1e6 / seconds,
        "bare_bytes": bare_bytes, "bare_seconds": bare_seconds, "bare_mb_per_s": bare_bytes / 1e6 / bare_seconds,
    }
    figures["ratio"] = figures["e2e_mb_per_s"] / figures["bare_mb_per_s"]
    print(f"end to end, service -> {args.dp_size} client processes: {num_samples} samples, {num_sequences} "
          f"sequences, {num_messages} microbatches, {e2e_bytes / 1e6:.1f} MB in {seconds:.2f} s")
    print(f"  {figures['e2e_samples_per_s']:.1f} samples/s   {figures['e2e_sequences_per_s']:.2f} sequences/s   "
          f"{figures['e2e_mb_per_s']:.1f} MB/s")
    print(f"bare gRPC ceiling, {args.dp_size} streams x {per_stream} messages x {mean_size / 1e6:.1f} MB: "
          f"{bare_bytes / 1e6:.1f} MB in {bare_seconds:.2f} s = {figures['bare_mb_per_s']:.1f} MB/s")
    print(f"ratio end-to-end / ceiling: {figures['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
