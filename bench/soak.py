"""Soak test: hold many streams (some stalled) against one service for minutes and print its
memory (resident set and shared memory) over time against its memory budget.

    python bench/soak.py [--minutes 3] [--streams 32] [--stalled 8] [--budget-mib 1536] [--quick] [--json FILE]

One ``python -m preprocess_service serve`` process on loopback, with an explicit memory budget
(--budget-mib), no per-client stream limit (every stream comes from this host), a short stall
timeout (--stall-timeout-s) and its /metrics endpoint on a free loopback port. One job (dp_size =
--streams, --seq-len tokens, 1 sequence per microbatch, 2 microbatches per step, the demo shards
repeated for many epochs) is streamed by:

- reading ranks: DataClient threads spread over --client-processes processes; each consumes its
  microbatches and drops them, sleeping --train-ms per microbatch to stand for training. A
  DataClient retries RESOURCE_EXHAUSTED itself (after the server's retry hint); its log lines
  are counted here.
- stalled ranks (--stalled): raw StreamMicrobatches calls, one channel each, whose messages are
  never read. The server's stall watchdog cuts them after stream_stall_timeout_s; each is then
  opened again (from step 0), so the pressure stays on. gRPC Python shows the end of a stream only
  to a client that reads it, so a stalled call still open 10 s past the stall timeout is cancelled
  here and opened again (the server's own cuts are counted from its log). A refusal
  (RESOURCE_EXHAUSTED, seen at once: no message is pending) is counted and retried after the
  server's hint.

Every --interval-s the service's memory is sampled: the resident set (VmRSS) summed over the
server process and all its descendants (decode workers, the resource tracker), the same as PSS
(smaps_rollup: a shared page counted once, split among the processes mapping it; VmRSS counts
a /dev/shm page once per process that touched it), its private anonymous part, the /dev/shm
files the service maps (decode arenas, by mapped size), the whole /dev/shm usage (statvfs: this
machine, other users included), the budget gauges scraped from /metrics
(disttrain_memory_budget_bytes: kind=used,peak for the charges, kind=resident for the server's own
cheap estimate of its memory, which its budget counts), open streams, microbatches per second
delivered to the reading ranks, refusals and stall cuts so far. The budget covers the whole
service, its idle footprint included: the summary compares the peak PSS (the fair measure of a
process tree: VmRSS counts shared libraries and arenas once per process) with the budget.

Exit status 0 whatever the memory figures (the printed output is the evidence); 1 only when the
run itself fails (the server does not start or dies, no reading rank gets any microbatch).
DISTTRAIN_* variables are not passed to the server, so only the flags here configure it.
``--quick`` is a smoke run (4 streams, one stalled, 4 s from the first microbatch delivered, a 3 s
stall timeout, one synthetic shard of 40 samples), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_tools.jobs import ensure_demo_dataset  # noqa: E402
from disttrain_tools.localcluster import free_port  # noqa: E402

MIB = 1 << 20
STALL_LINE = "the client took no message"

# Slots of the counters shared with the client processes.
C_MICROBATCHES, C_SAMPLES, C_READER_REFUSED, C_READER_FAILED_OTHER, C_READER_ERRORS = 0, 1, 2, 3, 4
C_STALL_OPENS, C_STALL_REFUSED, C_STALL_CUT, C_STALL_OTHER, C_STALL_GAVE_UP = 5, 6, 7, 8, 9
C_REFUSED_AT_OPEN, C_REFUSED_WAITING = 10, 11  # RESOURCE_EXHAUSTED: admission, or a running stream's budget wait
NUM_COUNTERS = 12


class Deadline:
    """The end of the run, a monotonic time shared with the client processes (``--quick`` sets it
    once the first microbatch has arrived, so that a slow start leaves the run its seconds)."""

    def __init__(self, ctx, at: float):
        self._at = ctx.Value("d", at, lock=False)

    def get(self) -> float:
        return self._at.value

    def set(self, at: float) -> None:
        self._at.value = at

    def passed(self) -> bool:
        return time.monotonic() >= self._at.value

    def left(self) -> float:
        return max(0.0, self._at.value - time.monotonic())


def _refusal_kind(details: str) -> int:
    return C_REFUSED_AT_OPEN if "to start" in (details or "") else C_REFUSED_WAITING


def _add(counters, slot: int, n: int = 1) -> None:
    with counters.get_lock():
        counters[slot] += n


# --- memory of a process tree ----------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children, out, stack = _children_map(), [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack += children.get(p, [])
    return out


def _start_time(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        for line in open(path):
            key, _, rest = line.partition(":")
            if key in names:
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def tree_memory(pid: int) -> dict:
    """Memory of ``pid`` and its descendants: summed VmRSS, Pss, RssAnon, RssShmem, and the
    /dev/shm files they map (path -> mapped bytes, each file once)."""
    pids = tree_pids(pid)
    rss = pss = anon = shmem = 0
    shm_files: dict[str, int] = {}
    for p in pids:
        status = _kib_fields(f"/proc/{p}/status", ("VmRSS", "RssAnon", "RssShmem"))
        rss += status.get("VmRSS", 0)
        anon += status.get("RssAnon", 0)
        shmem += status.get("RssShmem", 0)
        pss += _kib_fields(f"/proc/{p}/smaps_rollup", ("Pss",)).get("Pss", status.get("VmRSS", 0))
        try:
            for line in open(f"/proc/{p}/maps"):
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    path = parts[5].strip().removesuffix(" (deleted)")
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    shm_files[path] = max(shm_files.get(path, 0), end - start)
        except OSError:
            pass
    return {"pids": pids, "rss": rss, "pss": pss, "anon": anon, "shmem": shmem, "shm_files": shm_files}


def dev_shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# --- metrics -----------------------------------------------------------------------------------
_METRIC = re.compile(r'^(disttrain_memory_budget_bytes\{kind="(\w+)"\}|disttrain_active_streams|'
                     r'disttrain_queue_depth\{queue="(\w+)"\})\s+(\S+)$')


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            text = reply.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            name = (f"budget_{m.group(2)}" if m.group(2) else f"queue_{m.group(3)}" if m.group(3)
                    else "active_streams")
            out[name] = float(m.group(4))
    return out


# --- clients -----------------------------------------------------------------------------------
class _StreamFailures(logging.Handler):
    """Counts DataClient's "stream from %s failed: CODE details" lines (it retries them itself)."""

    def __init__(self, counters, deadline: Deadline):
        super().__init__(logging.INFO)
        self.counters, self.deadline = counters, deadline

    def emit(self, record: logging.LogRecord) -> None:
        if self.deadline.passed():  # streams cancelled by close() at the end are not failures
            return
        if isinstance(record.msg, str) and record.msg.startswith("stream from") and len(record.args or ()) >= 2:
            if record.args[1] == "RESOURCE_EXHAUSTED":
                _add(self.counters, C_READER_REFUSED)
                _add(self.counters, _refusal_kind(str(record.args[2]) if len(record.args) > 2 else ""))
            else:
                _add(self.counters, C_READER_FAILED_OTHER)


def reader_process(ranks: list[int], address: str, config: JobConfig, deadline: Deadline, train_s: float,
                   counters, out) -> None:
    """A thread per reading rank, each iterating its stream until the deadline."""
    from trainer import DataClient

    log = logging.getLogger("trainer.client")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(_StreamFailures(counters, deadline))
    results: dict[int, dict] = {r: {"microbatches": 0, "errors": [], "reconnects": 0} for r in ranks}
    clients: dict[int, object] = {}

    def rank_loop(rank: int) -> None:
        result = results[rank]
        try:
            client = clients[rank] = DataClient(address, config, rank, prefetch=2, reconnect_timeout_s=3600)
            for mb in client:
                result["microbatches"] += 1
                with counters.get_lock():
                    counters[C_MICROBATCHES] += 1
                    counters[C_SAMPLES] += len(mb.sample_keys)
                del mb
                if deadline.passed():
                    break
                if train_s:
                    time.sleep(train_s)
        except Exception as exc:  # reported, not hidden
            if not deadline.passed():
                result["errors"].append(repr(exc)[:300])
                _add(counters, C_READER_ERRORS)

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    while not deadline.passed():
        time.sleep(min(0.5, deadline.left()))
    for t in threads:  # a rank waiting for a refused stream to come back does not see the deadline
        t.join(timeout=1.0)
    for rank, client in list(clients.items()):
        results[rank]["reconnects"] = client.num_reconnects
        try:
            client.close()
        except Exception:
            pass
    out.put(results)


def stalled_process(ranks: list[int], address: str, job_id: str, deadline: Deadline, max_hold_s: float,
                    counters, out) -> None:
    """A thread per stalled rank: a stream whose messages are never read, opened again whenever it ends."""
    import grpc

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api.channel import SERVICE_NAME, channel_options

    codes: dict[str, int] = {}
    lock = threading.Lock()
    calls: dict[int, object] = {}

    def hold(rank: int) -> None:
        channel = grpc.insecure_channel(address, options=channel_options())
        stream = channel.unary_stream(f"/{SERVICE_NAME}/StreamMicrobatches",
                                      request_serializer=pb.StreamRequest.SerializeToString,
                                      response_deserializer=None)
        try:
            while not deadline.passed():
                call = calls[rank] = stream(pb.StreamRequest(job_id=job_id, dp_rank=rank, start_step=0))
                _add(counters, C_STALL_OPENS)
                opened = time.monotonic()
                while not call.done() and time.monotonic() < min(deadline.get(), opened + max_hold_s):
                    time.sleep(0.2)
                if not call.done():
                    # gRPC Python shows a stream's end only to a reader: a stream the server cut
                    # while messages sat unread stays "not done" here. Past the stall timeout
                    # (plus a margin) it is cancelled here and opened again.
                    call.cancel()
                    if deadline.passed():
                        return
                    _add(counters, C_STALL_GAVE_UP)
                    continue
                code = call.code()
                with lock:
                    codes[code.name] = codes.get(code.name, 0) + 1
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    _add(counters, C_STALL_REFUSED)
                    _add(counters, _refusal_kind(call.details()))
                    pushback = 1.0
                    for key, value in call.trailing_metadata() or ():
                        if key == "grpc-retry-pushback-ms":
                            pushback = min(30.0, max(0.05, int(value) / 1000))
                    time.sleep(min(pushback, deadline.left()))
                elif code == grpc.StatusCode.CANCELLED:
                    _add(counters, C_STALL_CUT)
                else:
                    _add(counters, C_STALL_OTHER)
                    time.sleep(1.0)
        finally:
            channel.close()

    threads = [threading.Thread(target=hold, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive() and not deadline.passed():
            t.join(timeout=0.5)
        t.join(timeout=5)
    for call in list(calls.values()):
        call.cancel()
    out.put({"codes": codes})


# --- the server ---------------------------------------------------------------------------------
def start_server(args, port: int, metrics_port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
           "--memory-budget-bytes", str(int(args.budget_mib * MIB)), "--max-streams-per-client", "0",
           "--stream-stall-timeout-s", str(args.stall_timeout_s), "--shutdown-grace-s", "3"]
    if args.decode_workers is not None:
        cmd += ["--decode-workers", str(args.decode_workers)]
    cmd += args.serve_arg
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    finally:
        log.close()


def wait_ready(process: subprocess.Popen, address: str, log_path: Path, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; "
                                   f"its log:\n{log_path.read_text()[-3000:]}")
            try:
                if "listening on" in log_path.read_text() and stub.Check(
                        health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server is not serving after {timeout_s:g} s")
            time.sleep(0.2)


def open_job(address: str, config: JobConfig) -> str:
    import grpc

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc
    from disttrain_api.spec import spec_from_config

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)),
                                                       timeout=60).job_id


def stop_server(process: subprocess.Popen, known: dict[int, str | None]) -> None:
    """SIGTERM (the server drains and stops its decode workers), SIGKILL if it lingers; then any
    descendant seen during the run that is still alive (same pid and start time) is killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    time.sleep(0.5)
    for pid, started in known.items():
        if pid != process.pid and started is not None and _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _count_lines(path: Path, needle: str) -> int:
    try:
        with open(path, errors="replace") as f:
            return sum(needle in line for line in f)
    except OSError:
        return 0


def _mib(n: float) -> str:
    return f"{n / MIB:.0f}"


# --- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0,
                        help="how long the streams are held, minutes (fractions allowed, e.g. 0.5; default 3)")
    parser.add_argument("--streams", type=int, default=32, help="streams in all = the job's dp_size (default 32)")
    parser.add_argument("--stalled", type=int, default=8,
                        help="of --streams, how many are stalled (never read; re-opened when cut; default 8)")
    parser.add_argument("--client-processes", type=int, default=3,
                        help="processes the reading ranks are spread over, a thread per rank (default 3)")
    parser.add_argument("--budget-mib", type=float, default=1536.0,
                        help="the server's memory budget, MiB (serve --memory-budget-bytes; it covers the whole "
                             "service, the idle interpreter, libraries and decode workers included; default 1536)")
    parser.add_argument("--stall-timeout-s", type=float, default=60.0,
                        help="serve --stream-stall-timeout-s: a stream whose client takes no message this long "
                             "is cut (default 60)")
    parser.add_argument("--decode-workers", type=int, default=None,
                        help="serve --decode-workers (default: the server's own, one per core)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed sequence (default 4096)")
    parser.add_argument("--train-ms", type=float, default=20.0,
                        help="milliseconds a reading rank sleeps per microbatch, standing for training (default 20)")
    parser.add_argument("--interval-s", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--startup-timeout-s", type=float, default=180.0,
                        help="seconds the server may take to report SERVING (default 180)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `serve`, repeatable (e.g. --serve-arg=--memory-wait-s "
                             "--serve-arg=10)")
    parser.add_argument("--workdir", type=Path, help="where the server log goes (default: a new temp directory)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 streams (one stalled) in one client process for 4 s from the first "
                             "microbatch, samples every second, a 3 s stall timeout, one synthetic shard of 40 samples")
    parser.add_argument("--json", type=Path, help="also write the samples and the summary here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.streams, args.stalled, args.client_processes = 4 / 60, 4, 1, 1
        args.interval_s, args.stall_timeout_s = 1.0, 3.0
    if not 0 <= args.stalled < args.streams:
        parser.error("--stalled must be in [0, --streams)")
    if args.minutes <= 0 or args.interval_s <= 0 or args.client_processes < 1:
        parser.error("--minutes and --interval-s must be positive, --client-processes at least 1")

    shards = str(Path(benchjson.quick_shards()[0]).parent if args.quick
                 else ensure_demo_dataset(REPO / "data" / "laion-demo")[0].parent)
    config = JobConfig(shards=(shards,), seq_len=args.seq_len, dp_size=args.streams, num_microbatches=2,
                       seqs_per_microbatch=1, num_epochs=100_000)
    budget = int(args.budget_mib * MIB)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="disttrain-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "server.log"
    port, metrics_port = free_port(), free_port()
    address, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    ctx = mp.get_context("spawn")  # no forked copies of gRPC state
    counters = ctx.Array("q", NUM_COUNTERS)
    out = ctx.Queue()
    procs: list[mp.Process] = []
    known_pids: dict[int, str | None] = {}
    samples: list[dict] = []
    seen_shm: set[str] = set()
    server = None
    num_readers = args.streams - args.stalled
    print(f"soak: {args.streams} streams ({num_readers} reading in {args.client_processes} processes, "
          f"{args.stalled} stalled) on one server for {args.minutes:g} min; budget {args.budget_mib:g} MiB, "
          f"stall timeout {args.stall_timeout_s:g} s, seq_len {args.seq_len}, train {args.train_ms:g} ms/microbatch; "
          f"{os.cpu_count()} cores; server log {log_path}", flush=True)
    try:
        started = time.monotonic()
        server = start_server(args, port, metrics_port, log_path)
        wait_ready(server, address, log_path, args.startup_timeout_s)
        time.sleep(2.0)  # settle
        idle = tree_memory(server.pid)
        for pid in idle["pids"]:
            known_pids[pid] = _start_time(pid)
        print(f"server ready in {time.monotonic() - started:.1f} s: {len(idle['pids'])} processes, idle RSS "
              f"{_mib(idle['rss'])} MiB (PSS {_mib(idle['pss'])} MiB, anon {_mib(idle['anon'])} MiB)", flush=True)
        job_id = open_job(address, config)

        start = time.monotonic()
        # --quick: the seconds count from the first microbatch (or from a start-up timeout without one)
        deadline = Deadline(ctx, math.inf if args.quick else start + args.minutes * 60)
        groups = [list(range(i, num_readers, args.client_processes)) for i in range(args.client_processes)]
        for group in filter(None, groups):
            procs.append(ctx.Process(target=reader_process, args=(group, address, config, deadline,
                                                                  args.train_ms / 1000, counters, out), daemon=True))
        if args.stalled:
            procs.append(ctx.Process(target=stalled_process,
                                     args=(list(range(num_readers, args.streams)), address, job_id, deadline,
                                           args.stall_timeout_s + 10, counters, out), daemon=True))
        for p in procs:
            p.start()

        header = (f"{'t_s':>5} {'rss':>6} {'+idle':>6} {'pss':>6} {'anon':>6} {'shm':>5} {'/dev/shm':>8} "
                  f"{'b_used':>6} {'b_peak':>6} {'guard':>6} {'strm':>4} {'mb/s':>6} {'smp/s':>6} "
                  f"{'refused':>7} {'cuts':>4}")
        print("MiB unless named: rss/pss/anon = server + decode workers (VmRSS sum, PSS sum, private anon); "
              "+idle = rss - idle rss;\n  shm = /dev/shm files the service maps; /dev/shm = whole tmpfs used; "
              "b_used/b_peak = budget charges; guard = the server's own estimate of its memory;\n  "
              "strm = open streams;\n  refused = RESOURCE_EXHAUSTED so far "
              "(readers + stalled); cuts = stalled streams cut by the server so far (its log)", flush=True)
        print(header, flush=True)
        last_t, last_mb, last_samples = start, 0, 0
        next_at = start
        while True:
            now = time.monotonic()
            mem = tree_memory(server.pid)
            for pid in mem["pids"]:
                known_pids.setdefault(pid, _start_time(pid))
            seen_shm.update(mem["shm_files"])
            gauges = scrape(metrics_url)
            with counters.get_lock():
                c = list(counters)
            if deadline.get() == math.inf and (c[C_MICROBATCHES] or now - start > args.startup_timeout_s):
                deadline.set(now + args.minutes * 60)
            dt = max(1e-9, now - last_t)
            sample = {
                "t_s": round(now - start, 1), "rss": mem["rss"], "rss_above_idle": mem["rss"] - idle["rss"],
                "pss": mem["pss"], "anon": mem["anon"], "shmem_rss": mem["shmem"], "processes": len(mem["pids"]),
                "shm_service": sum(mem["shm_files"].values()), "shm_files": len(mem["shm_files"]),
                "dev_shm_used": dev_shm_used(),
                "budget_used": gauges.get("budget_used"), "budget_peak": gauges.get("budget_peak"),
                "budget_total": gauges.get("budget_total"), "budget_resident": gauges.get("budget_resident"),
                "budget_baseline": gauges.get("budget_baseline"), "active_streams": gauges.get("active_streams"),
                "queue_decode": gauges.get("queue_decode"), "queue_send": gauges.get("queue_send"),
                "microbatches_per_s": (c[C_MICROBATCHES] - last_mb) / dt,
                "samples_per_s": (c[C_SAMPLES] - last_samples) / dt,
                "refused": c[C_READER_REFUSED] + c[C_STALL_REFUSED], "stall_cuts": _count_lines(log_path, STALL_LINE),
            }
            samples.append(sample)
            last_t, last_mb, last_samples = now, c[C_MICROBATCHES], c[C_SAMPLES]
            def g(k: str) -> str:
                return "-" if sample[k] is None else _mib(sample[k])  # noqa: B023 (called in this iteration only)
            print(f"{sample['t_s']:5.0f} {_mib(sample['rss']):>6} {_mib(sample['rss_above_idle']):>6} "
                  f"{_mib(sample['pss']):>6} {_mib(sample['anon']):>6} {_mib(sample['shm_service']):>5} "
                  f"{_mib(sample['dev_shm_used']):>8} {g('budget_used'):>6} {g('budget_peak'):>6} "
                  f"{g('budget_resident'):>6} "
                  f"{'-' if sample['active_streams'] is None else int(sample['active_streams']):>4} "
                  f"{sample['microbatches_per_s']:6.1f} {sample['samples_per_s']:6.1f} {sample['refused']:>7} "
                  f"{sample['stall_cuts']:>4}", flush=True)
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} during the run; "
                                   f"its log:\n{log_path.read_text()[-3000:]}")
            if now >= deadline.get():
                break
            next_at += args.interval_s
            time.sleep(max(0.0, min(next_at, deadline.get()) - time.monotonic()))
        elapsed = time.monotonic() - start

        results: dict = {}
        stalled_codes: dict = {}
        for _ in procs:
            try:
                got = out.get(timeout=60)
            except Exception:
                break
            if "codes" in got:
                stalled_codes = got["codes"]
            else:
                results.update(got)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        log_text = log_path.read_text(errors="replace")
        with counters.get_lock():
            c = list(counters)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if server is not None:
            stop_server(server, known_pids)

    leaked = sorted(p for p in seen_shm if os.path.exists(p))
    def peak(k: str):
        return max((s[k] for s in samples if s[k] is not None), default=0)
    errors = [e for r in results.values() for e in r["errors"]]
    served = sum(1 for r in results.values() if r["microbatches"])
    error_lines = [line for line in log_text.splitlines() if " ERROR " in line or line.startswith("Traceback")]
    summary = {
        "duration_s": round(elapsed, 1), "streams": args.streams, "reading_streams": num_readers,
        "stalled_streams": args.stalled, "reading_streams_served": served,
        "budget_total_mib": round((samples[-1]["budget_total"] or budget) / MIB, 1) if samples else args.budget_mib,
        "budget_peak_used_mib": round(peak("budget_peak") / MIB, 1),
        "guard_baseline_mib": round(peak("budget_baseline") / MIB, 1),
        "guard_estimate_peak_mib": round(peak("budget_resident") / MIB, 1),
        "idle_rss_mib": round(idle["rss"] / MIB, 1), "idle_pss_mib": round(idle["pss"] / MIB, 1),
        "peak_rss_mib": round(peak("rss") / MIB, 1), "peak_rss_above_idle_mib": round(peak("rss_above_idle") / MIB, 1),
        "peak_pss_mib": round(peak("pss") / MIB, 1),
        "peak_pss_above_idle_mib": round(max((s["pss"] - idle["pss"] for s in samples), default=0) / MIB, 1),
        "peak_anon_mib": round(peak("anon") / MIB, 1),
        "peak_service_shm_mib": round(peak("shm_service") / MIB, 1),
        "peak_dev_shm_used_mib": round(peak("dev_shm_used") / MIB, 1),
        "microbatches": c[C_MICROBATCHES], "samples": c[C_SAMPLES],
        "microbatches_per_s": round(c[C_MICROBATCHES] / elapsed, 2), "samples_per_s": round(c[C_SAMPLES] / elapsed, 2),
        "resource_exhausted_readers": c[C_READER_REFUSED], "resource_exhausted_stalled": c[C_STALL_REFUSED],
        "resource_exhausted_at_open": c[C_REFUSED_AT_OPEN], "resource_exhausted_budget_wait": c[C_REFUSED_WAITING],
        "reader_stream_failures_other": c[C_READER_FAILED_OTHER],
        "stalled_opens": c[C_STALL_OPENS], "stalled_cut_seen_by_client": c[C_STALL_CUT],
        "stalled_other_endings": c[C_STALL_OTHER], "stalled_reopened_after_hold": c[C_STALL_GAVE_UP],
        "stalled_end_codes": stalled_codes,
        "stall_cancellations_in_server_log": log_text.count(STALL_LINE),
        "server_error_lines": len(error_lines), "reader_errors": errors[:5],
        "service_shm_files_left_after_stop": len(leaked),
    }
    summary["pss_within_budget"] = summary["peak_pss_mib"] <= summary["budget_total_mib"]
    summary["service_shm_within_budget"] = summary["peak_service_shm_mib"] <= summary["budget_total_mib"]
    summary["budget_peak_within_budget"] = summary["budget_peak_used_mib"] <= summary["budget_total_mib"]
    print(f"\nsummary: {args.streams} streams ({num_readers} reading, {args.stalled} stalled) on one server for "
          f"{elapsed:.0f} s, budget {summary['budget_total_mib']:g} MiB, stall timeout {args.stall_timeout_s:g} s "
          f"({os.cpu_count()} cores shared by server, decode workers and clients)")
    for key, value in summary.items():
        print(f"  {key:36s} {value}")
    for line in error_lines[:5]:
        print(f"  server: {line[:300]}")
    doc = benchjson.document("soak", quick=args.quick) | {"summary": summary, "samples": samples}
    doc["tables"] += [
        benchjson.table(
            f"soak: {args.streams} streams ({num_readers} reading, {args.stalled} stalled) on one server for "
            f"{elapsed:.0f} s, budget {summary['budget_total_mib']:g} MiB, stall timeout {args.stall_timeout_s:g} s",
            ["figure", "value"],
            [[key, value if isinstance(value, (int, float, str, bool)) else json.dumps(value)]
             for key, value in summary.items()],
            notes=["the budget covers the whole service, its idle footprint included: compare peak_pss_mib (each "
                   "shared page counted once) with budget_total_mib",
                   "server, decode workers and clients share this machine's cores"]),
        benchjson.table("memory over time (MiB; server and decode workers)",
                        ["t s", "rss", "pss", "anon", "service shm", "budget used", "budget peak", "guard estimate",
                         "open streams", "microbatches/s", "refused", "stall cuts"],
                        [[x["t_s"], *(None if x[k] is None else round(x[k] / MIB, 1) for k in (
                            "rss", "pss", "anon", "shm_service", "budget_used", "budget_peak", "budget_resident")),
                          x["active_streams"], round(x["microbatches_per_s"], 2), x["refused"], x["stall_cuts"]]
                         for x in samples])]
    benchjson.write(args.json, doc)
    return 0 if served else 1


if __name__ == "__main__":
    sys.exit(main())
