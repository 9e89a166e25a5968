"""Streaming throughput of real microbatches vs the bare gRPC ceiling, in one run on the same machine.

    python bench/stream.py [--shards SPEC ...] [--dp-size 2] [--seq-len 8192] [--seqs-per-microbatch 2]
                           [--repeats 3] [--no-end-to-end] [--quick] [--json FILE]

Three measurements, each timed inside the client processes (connect to last message, slowest
stream; process start-up and imports left out everywhere):

1. end to end: the service runs in its own process (``python -m preprocess_service serve``);
   ``dp_size`` client processes (trainer.DataClient, via runner.run_job) consume one epoch of the
   dataset (default: the synthetic LAION-style demo set). This includes reading the tars, planning
   and decoding, so on a small machine it is decode-bound; decoding alone is measured by
   bench/decode.py. Reported: samples/s, sequences/s, MB/s of tensor payload.
2. wire path (what ">= 0.8 of the bare gRPC ceiling" is judged on): a service process started by
   this script (``--prepared-server``) runs the real create_server() (default decode workers, and
   same-host shared-memory delivery off, so the microbatches cross gRPC as they do to another host)
   with two changes: its decoder is wrapped in a replay decoder (the first request for a microbatch
   layout, keyed by its sample keys and buffer size, is decoded by the real decoder and a copy of
   the buffer is kept; later requests for that layout get the kept buffer at once, with no copy),
   and every job it opens keeps its encoded bytes (``retain_steps`` = 2**30, and nothing dropped
   after sending), so no tar is read again. The same job is run twice against it with
   runner.run_job: pass 1 plans the job and fills the replay cache (not timed), pass 2 is timed
   exactly like the end-to-end figure. Pass 2 therefore contains the service's streaming path for
   real microbatches: plan lookup, layout of the token arrays, serialization from the decode buffer
   (wire.encode_microbatch), the producer/consumer hand-off, gRPC, and on the client the parse
   (wire.decode_microbatch) and the copy into torch tensors; decoding is replaced by the replay of
   the microbatches decoded in pass 1. Both passes must pass the exactly-once check.
3. ceiling: a bare gRPC server process streams the same number of messages of the same mean size
   (one preallocated bytes payload, nothing built, decoded or copied per message) to the same number
   of client processes, which only count bytes. Measured right after the timed wire-path pass.

Printed: end-to-end / ceiling and wire-path / ceiling. The timed wire-path pass and the ceiling are
measured ``--repeats`` times (default 3) back to back, alternating; each pair gives a ratio, and the
headline figures are medians (the ceiling's median is also the end-to-end ratio's denominator).
Machines here are noisy: compare figures from one run only. ``--quick`` is a smoke run (40 samples,
one repeat, the wire path only), not a measurement.

Set DISTTRAIN_STREAM_PROFILE=PREFIX to run cProfile in the wire-path server's stream threads during
the last timed pass; it writes PREFIX.producer.prof (the per-stream producer threads: plan lookup,
layout, serialization) and PREFIX.stream.prof (the gRPC threads that hand the messages to gRPC). The
profiler slows the server down: do not report figures from a profiled run.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402

from disttrain_api.channel import CHANNEL_OPTIONS  # noqa: E402

if TYPE_CHECKING:
    from disttrain_tools.runner import RunResult

# The runner, the job config and the demo data are imported in main(), not here: every client
# process (spawned, so it imports this file again as __mp_main__) would otherwise import the
# service's server module too, ~0.8 s of CPU each, which neither a rank nor a bare client uses.

BARE_METHOD = "/bench.Bare/Stream"
PROFILE_ENV = "DISTTRAIN_STREAM_PROFILE"
STATS_PREFIX = "prepared-server stats "


def start_process(args: list[str]) -> tuple[subprocess.Popen, int]:
    """Starts a server process that prints '... listening on HOST:PORT' first; returns it and the port."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """SIGTERM, then what the process printed after its first line."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


# --- the ceiling ----------------------------------------------------------------------------------

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


# --- the wire path's server -----------------------------------------------------------------------

class ReplayDecoder:
    """Wraps the service's decoder: the first request for a layout (its sample keys and buffer size)
    is decoded by the real decoder and a copy of the result is kept; later requests for the same
    layout get a completed future with a Decoded over the kept buffer (no copy; release is a no-op,
    and nothing writes to it: a microbatch with failed documents is compacted into a new buffer)."""

    def __init__(self, inner):
        self._inner = inner
        self._lock = threading.Lock()
        self._kept: dict[tuple, tuple] = {}
        self.hits = 0
        self.misses = 0

    def submit(self, layout, stop=None, hooks=None) -> futures.Future:
        from preprocess_service.adapters.decode import Decoded

        key = (tuple(layout.sample_keys), layout.nbytes)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self.hits += 1
            else:
                self.misses += 1
        if kept is not None:
            buffer, errors = kept
            done: futures.Future = futures.Future()
            done.set_result(Decoded(buffer, dict(errors)))
            return done
        # A future of our own, completed only after the copy: the caller may release the real
        # buffer as soon as its future is done.
        out: futures.Future = futures.Future()

        def keep(inner_future: futures.Future) -> None:
            try:
                decoded = inner_future.result()
                copy = decoded.buffer.copy()
            except BaseException as exc:  # handed to the caller
                out.set_exception(exc)
                return
            with self._lock:
                self._kept[key] = (copy, dict(decoded.errors))
            out.set_result(decoded)

        self._inner.submit(layout, stop, hooks).add_done_callback(keep)
        return out

    def __getattr__(self, name):  # stats(), close(), worker_pids(), ...
        return getattr(self._inner, name)


class SectionTimers:
    """Seconds spent in the stream path's sections, per pass (SIGUSR1 starts the next pass)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.totals: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            totals = self.totals[self.current]
            totals[name] += seconds
            totals[name + "#n"] += count

    def timed(self, name: str, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapped


class ThreadProfiles:
    """cProfile of whole threads (stream producers and gRPC stream handlers), kept per pass."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.profiles: dict[tuple[int, str], list] = collections.defaultdict(list)

    def start(self, role: str):
        import cProfile

        profile = cProfile.Profile()
        with self._lock:
            self.profiles[(self.current, role)].append(profile)
        profile.enable()
        return profile

    def dump(self, prefix: str, which_pass: int) -> list[str]:
        import pstats

        written = []
        for role in ("producer", "stream"):
            profiles = self.profiles.get((which_pass, role), [])
            if not profiles:
                continue
            stats = pstats.Stats(profiles[0])
            for profile in profiles[1:]:
                stats.add(profile)
            path = f"{prefix}.{role}.prof"
            stats.dump_stats(path)
            written.append(path)
        return written


def prepared_serve() -> None:
    """The wire path's server: the real service, its decoder wrapped in a ReplayDecoder and its jobs
    keeping their encoded bytes. Section timers (and, with DISTTRAIN_STREAM_PROFILE, cProfile) are
    kept per pass; SIGUSR1 starts the next pass; on SIGTERM it prints one stats line and exits."""
    from preprocess_service.adapters.io import shards
    from preprocess_service.service.job import Job
    from preprocess_service.service.server import PreprocessServicer, create_server
    from preprocess_service.service.settings import ServiceSettings
    from preprocess_service.service.streams import MicrobatchStream

    timers = SectionTimers()
    profile_prefix = os.environ.get(PROFILE_ENV)
    profiles = ThreadProfiles() if profile_prefix else None
    refetched = collections.Counter()

    # Instrumentation, installed before create_server() binds the handlers.
    Job.start_microbatch = timers.timed("start_microbatch", Job.start_microbatch)  # plan, bytes, layout, submit
    Job.finish_microbatch = timers.timed("finish_microbatch", Job.finish_microbatch)  # wait, media views
    MicrobatchStream._message = timers.timed("serialize", MicrobatchStream._message)  # header + encode
    MicrobatchStream._put = timers.timed("queue_put", MicrobatchStream._put)  # waits while the queue is full
    scan = shards._scan_file  # re-reads a streamed shard front to back to find a microbatch's samples

    def counted_scan(f, url, keys, limits):
        refetched[url] += len(keys)
        return scan(f, url, keys, limits)

    shards._scan_file = counted_scan
    produce = MicrobatchStream._produce

    def profiled_produce(self, *args):
        profile = profiles.start("producer") if profiles else None
        try:
            return produce(self, *args)
        finally:
            if profile:
                profile.disable()

    MicrobatchStream._produce = profiled_produce
    stream_microbatches = PreprocessServicer.StreamMicrobatches

    def timed_stream(self, request, context):
        """Splits the gRPC thread's time: waiting for the producer's next message vs handing the
        previous one to gRPC (serialization into gRPC's buffers, flow control)."""
        profile = profiles.start("stream") if profiles else None
        try:
            inner = stream_microbatches(self, request, context)
            while True:
                start = time.perf_counter()
                try:
                    item = next(inner)
                except StopIteration:
                    timers.add("stream_wait_for_producer", time.perf_counter() - start)
                    return
                got = time.perf_counter()
                timers.add("stream_wait_for_producer", got - start)
                yield item
                timers.add("stream_send", time.perf_counter() - got)
        finally:
            if profile:
                profile.disable()

    PreprocessServicer.StreamMicrobatches = timed_stream

    # Over gRPC, as a client on another host gets it: same-host clients would be lent the decode
    # arenas in shared memory (shm_delivery), which carries no payload through gRPC at all, and the
    # ratio to the bare gRPC ceiling would say nothing about the wire path.
    server, port, servicer = create_server("127.0.0.1:0", settings=ServiceSettings(shm_delivery=False))
    replay = ReplayDecoder(servicer.decoder)
    servicer.decoder = replay
    open_job = servicer.jobs.open

    def open_retaining(config, **kwargs):
        job = open_job(config, **kwargs)
        job.plans.retain_steps = 1 << 30
        # retain_steps alone does not keep the bytes: mark_sent drops a step's encoded bytes once
        # every rank has been sent it, and pass 2 would re-read the tars. Keep everything.
        job.plans._release_through = lambda step: None
        return job

    servicer.jobs.open = open_retaining

    def next_pass(*_):
        timers.current += 1
        if profiles:
            profiles.current += 1

    stopped = threading.Event()
    signal.signal(signal.SIGUSR1, next_pass)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    print(f"prepared server listening on 127.0.0.1:{port}", flush=True)
    stopped.wait()
    written = profiles.dump(profile_prefix, timers.current) if profiles else []
    server.stop(grace=1).wait(timeout=30)
    stats = {"replay_hits": replay.hits, "replay_misses": replay.misses, "refetched_samples": sum(refetched.values()),
             "sections": {str(p): dict(t) for p, t in timers.totals.items()}, "profiles": written}
    print(STATS_PREFIX + json.dumps(stats), flush=True)


# --- measuring ------------------------------------------------------------------------------------

def check_pass(name: str, result: RunResult) -> str | None:
    check = result.exactly_once()
    if not check["ok"] or not any(r.microbatches for r in result.ranks):
        errors = [r.error for r in result.ranks if r.error]
        return (f"{name} failed its exactly-once check: {len(check['missing'])} missing, "
                f"{len(check['duplicated'])} duplicated, {len(check['unexpected'])} unexpected, "
                f"{len(check['delivered_and_skipped'])} delivered and skipped; errors: {errors}")
    return None


def pass_figures(prefix: str, result: RunResult) -> dict:
    """Client-side seconds (slowest rank) and volumes of one pass."""
    seconds = max(r.seconds for r in result.ranks)
    num_bytes = sum(r.num_bytes for r in result.ranks)
    num_samples = sum(len(r.keys) for r in result.ranks)
    num_sequences = sum(r.num_sequences for r in result.ranks)
    return {f"{prefix}_seconds": seconds, f"{prefix}_bytes": num_bytes, f"{prefix}_samples": num_samples,
            f"{prefix}_sequences": num_sequences,
            f"{prefix}_messages": sum(len(r.microbatches) for r in result.ranks),
            f"{prefix}_samples_per_s": num_samples / seconds, f"{prefix}_sequences_per_s": num_sequences / seconds,
            f"{prefix}_mb_per_s": num_bytes / 1e6 / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", nargs="+", help="shard specs (default: the synthetic demo set)")
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--seqs-per-microbatch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed wire-path passes, each followed by a ceiling measurement (medians reported; "
                             "default 3)")
    parser.add_argument("--no-end-to-end", action="store_true",
                        help="skip the end-to-end (decode-bound) measurement")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 40 samples, one repeat, 2048 tokens, no end-to-end run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepared-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        bare_serve()
        return 0
    if args.prepared_server:
        prepared_serve()
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from disttrain_api.config import JobConfig
    from disttrain_tools.jobs import ensure_demo_dataset
    from disttrain_tools.runner import run_job

    if args.quick:
        args.repeats, args.seq_len, args.no_end_to_end = 1, min(args.seq_len, 2048), True
    shard_specs = args.shards or (benchjson.quick_shards() if args.quick else
                                  [str(p) for p in ensure_demo_dataset(REPO / "data" / "laion-demo")])
    config = JobConfig(shards=tuple(shard_specs), dp_size=args.dp_size, seq_len=args.seq_len,
                       num_microbatches=args.num_microbatches, seqs_per_microbatch=args.seqs_per_microbatch)
    figures: dict = {}

    # 1. end to end: the service as deployed, decoding included.
    if not args.no_end_to_end:
        proc, port = start_process(["-m", "preprocess_service", "serve", "--host", "127.0.0.1", "--port", "0",
                                      "--metrics-port", "0"])
        try:
            result = run_job(config, address=f"127.0.0.1:{port}", progress=False)
        finally:
            proc.terminate()
            proc.wait()
        problem = check_pass("end-to-end run", result)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        figures.update(pass_figures("e2e", result))

    # 2. + 3. the wire path (pass 1 warms, then timed passes), each timed pass followed by the ceiling.
    proc, port = start_process([__file__, "--prepared-server"])
    address, wire_runs, stats_text, warm_messages = f"127.0.0.1:{port}", [], "", 0
    try:
        warm = run_job(config, address=address, progress=False)
        problem = check_pass("wire path, pass 1 (warming)", warm)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        figures["wire_warm_seconds"] = max(r.seconds for r in warm.ranks)
        warm_messages = sum(len(r.microbatches) for r in warm.ranks)
        for _ in range(args.repeats):
            proc.send_signal(signal.SIGUSR1)  # the server's section timers start a new pass
            time.sleep(0.2)
            timed = run_job(config, address=address, progress=False)
            problem = check_pass("wire path, timed pass", timed)
            if problem:
                print(problem, file=sys.stderr)
                return 1
            run = pass_figures("wire", timed)
            num_messages = run["wire_messages"]
            per_stream, mean_size = num_messages // args.dp_size, run["wire_bytes"] // num_messages
            bare_bytes, bare_seconds = measure_ceiling(args.dp_size, per_stream, mean_size)
            run.update({"bare_bytes": bare_bytes, "bare_seconds": bare_seconds,
                        "bare_mb_per_s": bare_bytes / 1e6 / bare_seconds, "bare_streams": args.dp_size,
                        "bare_messages_per_stream": per_stream, "bare_message_bytes": mean_size})
            run["wire_ratio"] = run["wire_mb_per_s"] / run["bare_mb_per_s"]
            wire_runs.append(run)
    finally:
        stats_text = stop_process(proc)
    stats = next((json.loads(line[len(STATS_PREFIX):]) for line in stats_text.splitlines()
                  if line.startswith(STATS_PREFIX)), {})

    # Volumes are the same in every timed pass; rates and seconds are medians over the repeats.
    last = wire_runs[-1]
    figures.update({k: v for k, v in last.items() if k.startswith(("wire_", "bare_"))})
    for name in ("wire_seconds", "wire_samples_per_s", "wire_sequences_per_s", "wire_mb_per_s", "wire_ratio",
                 "bare_seconds", "bare_mb_per_s"):
        figures[name] = statistics.median(r[name] for r in wire_runs)
    figures["wire_runs"] = wire_runs
    if "e2e_mb_per_s" in figures:
        figures["ratio"] = figures["e2e_ratio"] = figures["e2e_mb_per_s"] / figures["bare_mb_per_s"]
        if (figures["e2e_messages"], figures["e2e_bytes"]) != (figures["wire_messages"], figures["wire_bytes"]):
            print("warning: the end-to-end and wire-path runs delivered different microbatches", file=sys.stderr)
    sections = stats.get("sections", {}).get(str(args.repeats), {})
    figures["replay"] = {k: stats.get(k) for k in ("replay_hits", "replay_misses", "refetched_samples")}
    figures["wire_server_sections_s"] = {k: v for k, v in sections.items() if not k.endswith("#n")}

    ceiling_line = (f"bare gRPC ceiling, {args.dp_size} streams x {last['bare_messages_per_stream']} messages x "
                    f"{last['bare_message_bytes'] / 1e6:.1f} MB (one preallocated payload, nothing built per message)")
    if "e2e_seconds" in figures:
        print(f"end to end (tars, planning, decoding, streaming), service -> {args.dp_size} client processes: "
              f"{figures['e2e_samples']} samples, {figures['e2e_sequences']} sequences, {figures['e2e_messages']} "
              f"microbatches, {figures['e2e_bytes'] / 1e6:.1f} MB in {figures['e2e_seconds']:.2f} s")
        print(f"  {figures['e2e_samples_per_s']:.1f} samples/s   {figures['e2e_sequences_per_s']:.2f} sequences/s   "
              f"{figures['e2e_mb_per_s']:.1f} MB/s   (decode-bound; decoding alone: bench/decode.py)")
    print(f"wire path (plan lookup, token layout, serialization from the decode buffer, gRPC, client parse and "
          f"copy into torch; decoding replaced by replaying pass 1's microbatches), {args.dp_size} client "
          f"processes: {last['wire_messages']} microbatches, {last['wire_bytes'] / 1e6:.1f} MB "
          f"(warming pass {figures['wire_warm_seconds']:.2f} s, not timed)")
    for i, run in enumerate(wire_runs):
        tag = f"  [{i + 1}/{len(wire_runs)}] " if len(wire_runs) > 1 else "  "
        print(f"{tag}wire path {run['wire_seconds']:.2f} s = {run['wire_mb_per_s']:.1f} MB/s   "
              f"ceiling {run['bare_seconds']:.2f} s = {run['bare_mb_per_s']:.1f} MB/s   "
              f"ratio {run['wire_ratio']:.3f}")
    print(f"{ceiling_line}: {figures['bare_mb_per_s']:.1f} MB/s" + (" (median)" if len(wire_runs) > 1 else ""))
    replay = figures["replay"]
    if replay["replay_hits"] is not None:
        print(f"  replay decoder: {replay['replay_misses']} microbatches decoded, {replay['replay_hits']} replayed; "
              f"{replay['refetched_samples']} samples re-read from the tars")
        if replay["replay_misses"] != warm_messages or replay["refetched_samples"]:
            print("warning: the timed passes were not pure replays (microbatches decoded or samples re-read "
                  "after pass 1); the wire-path figure includes that work", file=sys.stderr)
    else:
        print("warning: the wire-path server reported no stats", file=sys.stderr)
    if sections:
        n = max(sections.get("serialize#n", 1), 1)
        print("  wire-path server, last timed pass (seconds summed over streams, per microbatch in ms): " + ", ".join(
            f"{name} {sections.get(name, 0.0):.2f} s ({1e3 * sections.get(name, 0.0) / n:.1f})"
            for name in ("start_microbatch", "finish_microbatch", "serialize", "queue_put",
                         "stream_wait_for_producer", "stream_send")))
    if stats.get("profiles"):
        print(f"  profiles: {', '.join(stats['profiles'])}")
    if "ratio" in figures:
        print(f"ratio end-to-end / ceiling: {figures['ratio']:.3f}")
    print(f"ratio wire path / ceiling:  {figures['wire_ratio']:.3f}" + (" (median)" if len(wire_runs) > 1 else "")
          + "   (target >= 0.8)")
    doc = benchjson.document("stream", quick=args.quick) | {"figures": figures}
    rows = [["wire path / bare gRPC ceiling (median)", round(figures["wire_ratio"], 3)],
            ["wire path MB/s (median)", round(figures["wire_mb_per_s"], 1)],
            ["bare gRPC ceiling MB/s (median)", round(figures["bare_mb_per_s"], 1)]]
    if "ratio" in figures:
        rows[:0] = [["end to end samples/s", round(figures["e2e_samples_per_s"], 1)],
                    ["end to end / bare gRPC ceiling", round(figures["ratio"], 3)]]
    doc["tables"].append(benchjson.table(
        f"streaming, {args.dp_size} client processes, {last['wire_messages']} microbatches of "
        f"{last['bare_message_bytes'] / 1e6:.1f} MB", ["figure", "value"], rows,
        notes=["wire path: the service's streaming path with decoding replaced by a replay of pass 1 (target >= 0.8 "
               "of the ceiling)", "end to end includes reading, planning and decoding: decode-bound here"]))
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
