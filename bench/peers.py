"""disttrain against its peers on the same corpus and the same work, in interleaved rounds.

    python bench/peers.py --setup                 # once: .venv-peers/ with the peers (never ours)
    python bench/peers.py [--quick] [--rounds 3] [--json FILE] [--shards TAR ...] [--scale]

Corpus: the demo's LAION-layout shards (data/laion-demo/0000[0-3].tar, 1,000 samples: ~80% one
JPEG + caption, ~10% 2-8 images, 5% PNG and 5% WebP first images, 3% EXIF-rotated, ~10% with 1-2
audio clips, 5% interleaved, 5% text-to-image targets, 3% conversations; photo-like images of
150-4000 px). The corrupt shard is left out: not every peer survives it.

Work, the same for every row (peers_work.py): parse with the service's parser, tokenize with the
byte tokenizer (int32), decode + EXIF-orient + resize every image to imaging.target_size under the
default ImageConfig (uint8), decode audio to log-mel frames, deliver to a consumer process.

Rows (each a fresh process tree; CPU is that whole tree's, children included: the harness is their
subreaper, so every process that ran is reaped here, and the larger of RUSAGE_CHILDREN and the sum
of every process's CPU as last sampled (every 0.2 s) counts; see TreeSampler):
  floor       one bare process, our decode path, no delivery: samples per CPU-second.
  disttrain   embedded service (default decode workers) + 2 client ranks (DataClient), forked from
              one trainer process that imported the client (torch) once and started with the
              service, as a DataLoader's workers fork from its trainer.
  dl-ours     torch DataLoader(num_workers=2) + webdataset, our decoder in the workers.
  dl-pillow   the same with the user's Pillow decode + resize.
  tf-service  tf.data service: dispatcher + worker in one process, consumer in another
              (tf.py_function running the Pillow work, num_parallel_calls=2).
  ray         Ray Data read_webdataset(decoder=None).map(Pillow work), num_cpus=2, driver consumes.
  energon     Megatron-Energon: CrudeWebdataset (raw bytes) + a cooker doing the Pillow work, its
              loader with WorkerConfig(num_workers=2); `energon prepare` runs once before the rounds.
MosaicML Streaming is not run: its install would replace torch (see --setup), and it reads only its
own MDS format (a converted copy of the corpus).
Start-up (launch to first delivered sample) is reported apart; samples/s and CPU per sample are
steady state (first to last sample; CPU after the first sample), beside the total CPU per sample.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import peers_setup  # noqa: E402

PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"
if not PROJECT_PYTHON.exists():  # a worktree uses the main checkout's venv
    PROJECT_PYTHON = Path("/work/main/.venv/bin/python")
SYSTEMS = {  # row -> (interpreter, peer name in peers_setup (None: the project's own venv))
    "floor": (PROJECT_PYTHON, None),
    "disttrain": (PROJECT_PYTHON, None),
    "dl-ours": (PROJECT_PYTHON, None),
    "dl-pillow": (PROJECT_PYTHON, None),
    "tf-service": (peers_setup.python(), "tf.data service"),
    "ray": (peers_setup.python(), "Ray Data"),
    "energon": (peers_setup.python(), "Megatron-Energon"),
}
NOT_RUN = {"MosaicML Streaming": "it would also need the corpus converted to its MDS format"}
HZ = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36


def descendants() -> list[int]:
    """Every live process below this one."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    me, out = os.getpid(), []
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1):
            p = parent[p]
            if p == me:
                out.append(pid)
                break
    return out


def _proc_cpu(pid: int) -> tuple[tuple[int, int], float]:
    """((pid, start time), utime + stime in seconds) of one live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return (pid, -1), 0.0
    return (pid, int(fields[19])), (int(fields[11]) + int(fields[12])) / HZ


class TreeSampler:
    """CPU and memory of this process's descendants, sampled: the CPU last seen of every process that
    ever ran below us (so processes whose parent discards their usage, e.g. with SIGCHLD ignored
    as Ray's daemons do, still count; a process is missed after its last sample, <= one period)."""

    def __init__(self):
        self.seen: dict[tuple[int, int], float] = {}
        self.names: dict[tuple[int, int], str] = {}
        self.pss: dict[tuple[int, int], float] = {}
        self.peak_pss_mib = 0.0
        self.lock = threading.Lock()

    def sample(self, memory: bool = True) -> float:
        """Updates the figures; returns the CPU seconds seen so far."""
        with self.lock:
            pids = descendants()
            total = 0.0
            for pid in pids:
                key, cpu = _proc_cpu(pid)
                self.seen[key] = max(cpu, self.seen.get(key, 0.0))
                if key not in self.names:
                    self.names[key] = _role(pid)
                if memory:
                    pss = _pss_mib(pid)
                    self.pss[key] = max(pss, self.pss.get(key, 0.0))
                    total += pss
            if memory:
                self.peak_pss_mib = max(self.peak_pss_mib, total)
            return sum(self.seen.values())


def _role(pid: int) -> str:
    """What a process is, from its command line (for the per-process breakdown)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    for marker, role in (("forkserver", "fork server / decode worker"), ("resource_tracker", "resource tracker"),
                         ("spawn_main", "spawned child"), ("peers_systems.py", "main")):
        if marker in cmd:
            return role
    return cmd[:60]


def _pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def prepare_energon(urls: list[str], workdir: Path) -> list[str]:
    """energon reads a prepared folder (see peers_systems.prepare_energon); made once, not timed."""
    root = workdir / "energon"
    subprocess.run([str(SYSTEMS["energon"][0]), str(BENCH / "peers_systems.py"), "energon-prepare",
                    str(workdir / "energon-prepare.json"), str(root), *urls], check=True)
    return [str(root)]


def measure(system: str, urls: list[str], workdir: Path) -> dict:
    """One run of ``system`` as a fresh process tree: its figures, or {"error": ...}."""
    python, _ = SYSTEMS[system]
    result = workdir / f"{system}.json"
    result.unlink(missing_ok=True)
    base_cpu, first = _children_cpu(), {}
    start = time.time()
    proc = subprocess.Popen([str(python), str(BENCH / "peers_systems.py"), system, str(result), *urls],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()

    tree = TreeSampler()

    def watch_stdout():
        for line in proc.stdout:
            if line.strip() == "PEERS-FIRST" and not first:
                first["cpu"] = tree.sample(memory=False)

    threading.Thread(target=watch_stdout, daemon=True).start()
    while proc.poll() is None:
        tree.sample()
        time.sleep(0.2)
    _reap_orphans(tree)
    # Both are lower bounds: reaped usage misses what a parent discarded, sampling misses each
    # process's last period; the larger is the closer.
    cpu = max(_children_cpu() - base_cpu, sum(tree.seen.values()))
    peak_pss = tree.peak_pss_mib
    if proc.returncode != 0 or not result.exists():
        return {"error": f"exit {proc.returncode}: " + " | ".join(line.strip() for line in stderr[-4:])}
    got = json.loads(result.read_text())
    n = got["samples"]
    steady_s = got["t_last"] - got["t_first"]
    processes = sorted(([tree.names.get(k, "?"), round(c, 2), round(tree.pss.get(k, 0.0))]
                        for k, c in tree.seen.items()), key=lambda p: -p[1])
    print(f"    per process (role, CPU s, peak PSS MiB): {processes}", flush=True)
    return {"samples": n, "startup_s": got["t_first"] - start, "samples_per_s": (n - 1) / steady_s,
            "cpu_s": cpu, "cpu_per_sample": cpu / n, "steady_cpu_per_sample": (cpu - first["cpu"]) / (n - 1),
            "peak_pss_mib": peak_pss, "wall_s": time.time() - start}


def _reap_orphans(tree: TreeSampler, timeout_s: float = 20.0) -> None:
    """Waits for the processes the run left behind (reparented here), killing them after timeout_s."""
    deadline = time.time() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            tree.sample()
            if time.time() > deadline:
                for p in descendants():
                    os.kill(p, 9)
            time.sleep(0.1)


def summarise(runs: list[dict]) -> dict:
    """Median and range of every figure over the rounds that succeeded."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    return {key: {"median": statistics.median(r[key] for r in ok), "min": min(r[key] for r in ok),
                  "max": max(r[key] for r in ok)} for key in ok[0]} | {"rounds": len(ok)}


def goals(rows: dict) -> list[tuple[str, float, float, bool]]:
    """(goal, measured, target, met) of issue 20, from the medians; CPU figures are steady state."""
    def med(system, key):
        row = rows.get(system, {})
        return row[key]["median"] if key in row else float("nan")

    def per_cpu(system):
        return 1.0 / med(system, "steady_cpu_per_sample")

    out = [("CPU-s per sample / bare floor (<= 1.05)",
            med("disttrain", "steady_cpu_per_sample") / med("floor", "steady_cpu_per_sample"), 1.05, "le"),
           ("samples per CPU-s / DataLoader + our decoder (>= 0.95)", per_cpu("disttrain") / per_cpu("dl-ours"), 0.95,
            "ge"),
           ("samples per CPU-s / DataLoader + Pillow (>= 1.5)", per_cpu("disttrain") / per_cpu("dl-pillow"), 1.5, "ge"),
           ("start-up s: launch to first sample (<= 2.0)", med("disttrain", "startup_s"), 2.0, "le"),
           ("peak PSS / DataLoader + our decoder (<= 2.0)",
            med("disttrain", "peak_pss_mib") / med("dl-ours", "peak_pss_mib"), 2.0, "le")]
    for peer in SYSTEMS:
        if peer not in ("floor", "disttrain") and "error" not in rows.get(peer, {"error": 1}):
            if not peer.startswith("dl-"):  # the DataLoader rows have their own goals above
                out.append((f"samples per CPU-s / {peer} (>= 1.0)", per_cpu("disttrain") / per_cpu(peer), 1.0, "ge"))
            out.append((f"samples/s / {peer} (>= 1.0)",
                        med("disttrain", "samples_per_s") / med(peer, "samples_per_s"), 1.0, "ge"))
    return [(name, value, target, value <= target if how == "le" else value >= target)
            for name, value, target, how in out]


def print_table(rows: dict, skipped: dict) -> None:
    def cell(row, key, fmt):
        f = row[key]
        return f"{f['median']:{fmt}} ({f['min']:{fmt}}-{f['max']:{fmt}})"

    print(f"{'system':11s} {'samples':>7s} {'samples/s':>22s} {'CPU ms/sample steady':>24s} "
          f"{'CPU ms/sample total':>22s} {'peak PSS MiB':>20s} {'start-up s':>20s}")
    for system, row in rows.items():
        if "error" in row:
            print(f"{system:11s} FAILED: {row['error'][:160]}")
            continue
        ms = {k: {s: 1000 * v for s, v in row[k].items()} for k in ("steady_cpu_per_sample", "cpu_per_sample")}
        print(f"{system:11s} {row['samples']['median']:7.0f} {cell(row, 'samples_per_s', '6.1f'):>22s} "
              f"{cell(ms, 'steady_cpu_per_sample', '6.2f'):>24s} {cell(ms, 'cpu_per_sample', '6.2f'):>22s} "
              f"{cell(row, 'peak_pss_mib', '5.0f'):>20s} {cell(row, 'startup_s', '5.2f'):>20s}")
    floor = rows.get("floor", {})
    if "steady_cpu_per_sample" in floor:
        print(f"floor: {1 / floor['steady_cpu_per_sample']['median']:.1f} samples per CPU-second (one bare process)")
    for peer, reason in skipped.items():
        print(f"{peer}: skipped: {reason}")


def run_scale(urls: list[str], quick: bool) -> list[dict]:
    """bench/peers_scale.py in the project's venv (it plans with the service's own code)."""
    with tempfile.TemporaryDirectory(prefix="peers-scale-") as workdir:
        out = Path(workdir) / "scale.json"
        subprocess.run([str(PROJECT_PYTHON), str(BENCH / "peers_scale.py"), str(out), "quick" if quick else "full",
                        *urls], check=True)
        return json.loads(out.read_text())


def demo_shards() -> list[str]:
    """The demo set's clean shards, generated (deterministically) if this checkout lacks them."""
    demo = REPO / "data" / "laion-demo"
    if not list(demo.glob("0000[0-9].tar")):
        subprocess.run([str(PROJECT_PYTHON), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from preprocess_service.service.cli import ensure_demo_dataset; "
                        "ensure_demo_dataset(__import__('pathlib').Path(sys.argv[2]))", str(REPO), str(demo)],
                       check=True)
    return [str(p) for p in sorted(demo.glob("0000[0-9].tar"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="create .venv-peers/ with the peers, then exit")
    parser.add_argument("--quick", action="store_true", help="one shard, one round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians and ranges)")
    parser.add_argument("--shards", nargs="+", help="tar files (default: the demo set's four clean shards)")
    parser.add_argument("--systems", nargs="*", choices=list(SYSTEMS), default=list(SYSTEMS),
                        help="rows to run (none: only --scale)")
    parser.add_argument("--json", type=Path, help="also write every run and the goals here")
    parser.add_argument("--scale", action="store_true",
                        help="also: the service's planning + layout CPU per sample and memory for 2..128 DP "
                             "ranks, samples per sequence and images per sample (bench/peers_scale.py)")
    args = parser.parse_args(argv)
    if args.setup:
        peers_setup.setup()
        return 0
    urls = args.shards or demo_shards()
    urls, rounds = (urls[:1], 1) if args.quick else (urls, args.rounds)
    if not args.systems:  # --scale alone
        scale = run_scale(urls, args.quick) if args.scale else []
        if args.json:
            args.json.write_text(json.dumps({"urls": urls, "scale": scale}, indent=1))
        return 0
    installed = peers_setup.installed()
    skipped = {name: f"not installed: {installed.get(name, 'run --setup')}" for _, name in SYSTEMS.values()
               if name and installed.get(name) != "ok"}
    skipped |= {name: reason if installed.get(name) == "ok" else f"{reason}; install: {installed.get(name)}"
                for name, reason in NOT_RUN.items()}
    systems = [s for s in args.systems if SYSTEMS[s][1] is None or installed.get(SYSTEMS[s][1]) == "ok"]
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    print(f"{len(urls)} shards, {rounds} interleaved rounds of {', '.join(systems)}; "
          f"{os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="peers-") as workdir:
        inputs = {s: urls for s in systems}
        if "energon" in systems:
            inputs["energon"] = prepare_energon(urls, Path(workdir))
        for r in range(rounds):
            for system in systems:
                runs[system].append(measure(system, inputs[system], Path(workdir)))
                print(f"  round {r + 1} {system:10s} {json.dumps(runs[system][-1])[:300]}", flush=True)
    rows = {s: summarise(rs) for s, rs in runs.items()}
    print()
    print_table(rows, skipped)
    measured = goals(rows)
    print("\ngoals (issue 20), disttrain against each, medians:")
    for name, value, _, met in measured:
        verdict = "not measured" if value != value else "met" if met else "NOT met"
        print(f"  {name:58s} {value:6.2f}  {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"urls": urls, "runs": runs, "rows": rows, "skipped": skipped,
                                         "goals": [{"goal": g, "value": v, "target": t, "met": m}
                                                   for g, v, t, m in measured]}, indent=1))
    if args.scale:
        scale = run_scale(urls, args.quick)
        if args.json:
            args.json.with_suffix(".scale.json").write_text(json.dumps(scale, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
