"""disttrain against its peers on the same corpus and the same work, in interleaved rounds.

    python bench/peers.py --setup                 # once: .venv-peers/ with the peers (never ours)
    python bench/peers.py [--quick] [--rounds 3] [--long] [--json FILE] [--corpus demo|camera] [--shards TAR ...]
                          [--scale]

Corpus: the demo's LAION-layout shards (data/laion-demo/0000[0-3].tar, 1,000 samples: ~80% one
JPEG + caption, ~10% 2-8 images, 5% PNG and 5% WebP first images, 3% EXIF-rotated, ~10% with 1-2
audio clips, 5% interleaved, 5% text-to-image targets, 3% conversations; photo-like images of
150-4000 px). The corrupt shard is left out: not every peer survives it. ``--corpus camera``: users'
data instead, camera photos in img2dataset's layout with its parquet manifests (bench/peers_corpus.py:
2,940 JPEGs of 1-12 MP with camera EXIF, some progressive, greyscale or CMYK), which the service
plans from the parquet by default (manifests="auto"). --long reads the corpus
LONG_PASSES times over (disttrain with JobConfig.num_epochs, the others the shard list repeated),
so that start-up is amortised.

Work, the same for every row (peers_work.py): parse with the service's parser, tokenize with the
byte tokenizer (int32), decode + EXIF-orient + resize every image to imaging.target_size under the
default ImageConfig (uint8), decode audio to log-mel frames, deliver to a consumer process.

Rows (each a fresh process tree; CPU is that whole tree's, children included: the harness is their
subreaper, so every process that ran is reaped here, and the larger of RUSAGE_CHILDREN and the sum
of every process's CPU as last sampled counts; see peers_tree.TreeSampler):
  floor              the true floor: one process per core, each decoding its share of the samples
                     with our decode path into one reused buffer; nothing delivered.
  disttrain          embedded service (default decode workers) + 2 client ranks (DataClient), forked
                     from one trainer process that imported the client (torch) once and started with
                     the service, as a DataLoader's workers fork from its trainer.
  dl-ours            torch DataLoader(num_workers=2, batch_size=16, batches as lists) + webdataset,
                     our decoder in the workers;  dl-ours-nobatch: the same at batch_size=None.
  dl-pillow          the same with Pillow at its best (draft() to the target size, then resize);
                     dl-pillow-nodraft: without draft(), as users often write it.
  tf-pillow/tf-ours  tf.data service: dispatcher + worker in one process, consumer in another
                     (tf.py_function doing the work, num_parallel_calls=2), Pillow (draft) or ours.
  ray-pillow/ray-ours  Ray Data read_webdataset(decoder=None).map_batches(work, batch_size=16),
                     num_cpus=2, the driver consumes batches of 16.
  energon-pillow     Megatron-Energon: CrudeWebdataset (raw bytes) + a cooker doing the Pillow (draft)
                     work, batches of 16, WorkerConfig(num_workers=2); `energon prepare` runs once
                     before the rounds.
MosaicML Streaming is not run: its install would replace torch (see --setup), and it reads only its
own MDS format (a converted copy of the corpus).

Accounting (peers_figures.py): the whole run (all CPU until the last sample per sample, samples per
second since launch) is the headline; the common window runs from the moment the k-th sample
reached the consumer to the last, with k = MARK_FRACTION of one pass over the corpus, the same k for
every system (short and long runs): by then every system is past its start-up (disttrain's first
delivery waits for its shuffle buffer and its first planned step). Start-up is launch to the first
sample. A figure implying more CPU-seconds per second than the cores this bench may use fails it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import benchjson
import peers_corpus
import peers_figures as figures
import peers_setup
import peers_tree

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"
if not PROJECT_PYTHON.exists():  # a worktree uses the main checkout's venv
    PROJECT_PYTHON = Path("/work/main/.venv/bin/python")
SYSTEMS = {  # row -> (interpreter, peer name in peers_setup (None: the project's own venv), in --long)
    "floor": (PROJECT_PYTHON, None, True),
    "disttrain": (PROJECT_PYTHON, None, True),
    "dl-ours": (PROJECT_PYTHON, None, True),
    "dl-ours-nobatch": (PROJECT_PYTHON, None, False),
    "dl-pillow": (PROJECT_PYTHON, None, True),
    "dl-pillow-nodraft": (PROJECT_PYTHON, None, False),
    "tf-pillow": (peers_setup.python(), "tf.data service", True),
    "tf-ours": (peers_setup.python(), "tf.data service", True),
    "ray-pillow": (peers_setup.python(), "Ray Data", True),
    "ray-ours": (peers_setup.python(), "Ray Data", True),
    "energon-pillow": (peers_setup.python(), "Megatron-Energon", True),
}
QUICK_SYSTEMS = ("floor", "disttrain", "dl-ours")
NOT_RUN = {"MosaicML Streaming": "it would also need the corpus converted to its MDS format"}
PR_SET_CHILD_SUBREAPER = 36
MARK_FRACTION = 0.3
"""The common window starts at sample k = MARK_FRACTION x the samples of one pass over the corpus."""
LONG_PASSES = 10
"""Passes over the corpus in --long."""
SAMPLE_PERIOD_S = 0.2


def corpus_samples(urls: list[str]) -> int:
    """Samples (distinct keys) in the shards: one pass over the corpus."""
    keys = 0
    for url in urls:
        with tarfile.open(url) as tar:
            keys += len({(os.path.dirname(m.name), os.path.basename(m.name).partition(".")[0])
                         for m in tar if m.isfile()})
    return keys


def prepare_energon(urls: list[str], workdir: Path) -> list[str]:
    """energon reads a prepared folder (see peers_systems.prepare_energon); made once, not timed."""
    root = workdir / "energon"
    subprocess.run([str(SYSTEMS["energon-pillow"][0]), str(BENCH / "peers_systems.py"), "energon-prepare",
                    str(workdir / "energon-prepare.json"), "0", "1", str(root), *urls], check=True)
    return [str(root)]


def measure(system: str, urls: list[str], workdir: Path, mark_at: int, passes: int) -> dict:
    """One run of ``system`` as a fresh process tree: its figures, or {"error": ...}."""
    python = SYSTEMS[system][0]
    result = workdir / f"{system}.json"
    result.unlink(missing_ok=True)
    tree, series, base_cpu = peers_tree.TreeSampler(), [], peers_tree.children_cpu()

    def snapshot(memory: bool) -> None:
        cpu = tree.sample(memory=memory)
        series.append((time.time(), cpu))

    launch = time.time()
    proc = subprocess.Popen([str(python), str(BENCH / "peers_systems.py"), system, str(result), str(mark_at),
                             str(passes), *urls], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def watch_stdout():
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.strip() in ("PEERS-MARK", "PEERS-END"):
                snapshot(memory=False)

    watcher = threading.Thread(target=watch_stdout, daemon=True)
    watcher.start()
    while proc.poll() is None:
        snapshot(memory=True)
        time.sleep(SAMPLE_PERIOD_S)
    peers_tree.reap_orphans(tree)
    watcher.join(timeout=5)
    exit_time = time.time()
    snapshot(memory=False)
    # Both are lower bounds: reaped usage misses what a parent discarded, sampling misses each
    # process's last period; the larger is the closer.
    cpu_total = max(peers_tree.children_cpu() - base_cpu, series[-1][1])
    if proc.returncode != 0 or not result.exists():
        return {"error": f"exit {proc.returncode}: " + " | ".join(line.strip() for line in stderr[-4:])}
    got = json.loads(result.read_text())
    processes = sorted(((tree.names.get(k, "?"), round(c, 2), round(tree.system.get(k, 0.0), 2),
                         tree.faults.get(k, 0), round(tree.pss.get(k, 0.0)))
                        for k, c in tree.seen.items()), key=lambda p: -p[1])
    print(f"    per process (role, CPU s, of it system s, minor faults, peak PSS MiB): {processes[:8]}", flush=True)
    try:
        run = figures.run_figures([tuple(e) for e in got["events"]], sorted(series), cpu_total, mark_at, launch,
                                  exit_time)
    except ValueError as e:  # it delivered too few samples to be compared
        return {"error": str(e)}
    samples = max(run["samples"], 1)
    # as sampled (a process's last period is missed): where the CPU goes, not the headline
    return run | {"peak_pss_mib": tree.peak_pss_mib, "system_cpu_per_sample": sum(tree.system.values()) / samples,
                  "minor_faults_per_sample": sum(tree.faults.values()) / samples}


def _cell(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    f = row[key]
    return f"{scale * f['median']:{fmt}} ({scale * f['min']:{fmt}}-{scale * f['max']:{fmt}})"


RUN_COLUMNS = ["system", "samples", "samples/s", "CPU ms/sample", "cores used", "start-up s", "peak PSS MiB",
               "teardown CPU s", "of CPU: system ms/sample", "minor faults/sample"]
WINDOW_COLUMNS = ["system", "from sample", "samples", "samples/s", "CPU ms/sample", "cores used"]


def tables(rows: dict, label: str) -> list[dict]:
    """The whole-run and common-window tables of one set of rows (medians (min-max))."""
    run, window = [], []
    for system, row in rows.items():
        if "error" in row:
            run.append([system, "FAILED", row["error"][:160], "", "", "", "", "", "", ""])
            continue
        run.append([system, f"{row['samples']['median']:.0f}", _cell(row, "run_samples_per_s", ".1f"),
                    _cell(row, "run_cpu_per_sample", ".2f", 1000), _cell(row, "cores_run", ".2f"),
                    _cell(row, "startup_s", ".2f"), _cell(row, "peak_pss_mib", ".0f"),
                    _cell(row, "teardown_cpu_s", ".2f"),
                    _cell(row, "system_cpu_per_sample", ".2f", 1000) if "system_cpu_per_sample" in row else "",
                    _cell(row, "minor_faults_per_sample", ".0f") if "minor_faults_per_sample" in row else ""])
        window.append([system, f"{row['window_first_sample']['median']:.0f}", f"{row['window_samples']['median']:.0f}",
                       _cell(row, "window_samples_per_s", ".1f"), _cell(row, "window_cpu_per_sample", ".2f", 1000),
                       _cell(row, "cores_window", ".2f")])
    return [benchjson.table(f"{label}: whole run (launch to last sample)", RUN_COLUMNS, run,
                            notes=["CPU: every process of the tree until the last sample; samples/s: since launch",
                                   "system CPU and minor faults: every process as last sampled (where the CPU goes)",
                                   "teardown: CPU after the last sample (not counted above)"]),
            benchjson.table(f"{label}: common window (k-th sample to the last)", WINDOW_COLUMNS, window,
                            notes=["the same k for every system"])]


def print_table(table: dict) -> None:
    widths = [max(len(str(c)) for c in [col] + [r[i] for r in table["rows"]]) for i, col in enumerate(table["columns"])]
    print(f"\n{table['title']}")
    for line in [table["columns"], *table["rows"]]:
        cells = [f"{str(c):>{w}s}" if i else f"{str(c):{w}s}" for i, (c, w) in enumerate(zip(line, widths))]
        print("  " + " ".join(cells))
    for note in table["notes"]:
        print(f"  ({note})")


def _like_with_like(make, rows: dict, long_rows: dict) -> list[list]:
    """The rows ``make`` builds (a key first, a figure second) from the short runs, replaced by those
    from the long run where both sides of a comparison ran long: disttrain is compared with a peer
    over the same number of samples."""
    out = {row[0]: [row[0], "short", *row[1:]] for row in make(rows)}
    for row in make(long_rows) if long_rows else []:
        if row[1] == row[1]:  # nan: a side that did not run long
            out[row[0]] = [row[0], "long", *row[1:]]
    return list(out.values())


def summary_tables(rows: dict, long_rows: dict) -> list[dict]:
    """Decoder-normalised ratios (the headline), the decoder's own gain and the goals, each from the
    long run where both sides ran long, else from the short runs (the "run" column)."""
    def headline(rs):
        return [[peer, cpu, rate, wcpu, wrate]
                for (peer, cpu, rate), (_, wcpu, wrate) in zip(figures.ratios(rs, "run"), figures.ratios(rs, "window"))]

    def goals(rs):
        return [[name, value, target, figures.verdict(value, target, met)]
                for name, value, target, met in figures.goals(rs, rows)]

    def fmt(table: list[list], digits: int) -> list[list]:
        return [[c if isinstance(c, str) else f"{c:.{digits}f}" for c in row] for row in table]

    floor = figures.med(long_rows if "floor" in long_rows else rows, "floor", "run_cpu_per_sample")
    columns = ["peer", "run", "samples per CPU-s (whole run)", "samples/s (whole run)", "samples per CPU-s (window)",
               "samples/s (window)"]
    goal_rows = [[name, "short" if name.startswith("start-up") else run, f"{value:.3f}", f"{target:g}", verdict]
                 for name, run, value, target, verdict in _like_with_like(goals, rows, long_rows)]
    return [benchjson.table("disttrain / peer, our decoder on both sides", columns,
                            fmt(_like_with_like(headline, rows, long_rows), 2),
                            notes=["decoder-normalised: the same decoder (ours) in disttrain and the peer"]),
            benchjson.table("the decoder's own gain: Pillow's CPU per sample / ours in one harness",
                            ["rows", "run", "ratio"], fmt(_like_with_like(figures.decoder_gain, rows, long_rows), 2)),
            benchjson.table("goals (issue 49): disttrain against each, whole run", [
                "goal", "run", "measured", "target", "verdict"], goal_rows,
                notes=[f"true floor: {1 / floor:.1f} samples per CPU-second" if floor == floor else "floor not run",
                       "start-up from the short runs"])]


def run_rounds(systems: list[str], inputs: dict, workdir: Path, rounds: int, mark_at: int, passes: int) -> dict:
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(rounds):
        for system in systems:
            runs[system].append(measure(system, inputs[system], workdir, mark_at, passes))
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in runs[system][-1].items()}
            print(f"  {'long ' if passes > 1 else ''}round {r + 1} {system:17s} {json.dumps(shown)[:400]}", flush=True)
    return runs


def impossible_runs(runs: dict, cores: int) -> list[str]:
    return [f"{system} round {i + 1}: {why}" for system, rs in runs.items() for i, r in enumerate(rs)
            if "error" not in r for why in figures.impossible(r, cores)]


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
                        "from disttrain_tools.jobs import ensure_demo_dataset; "
                        "ensure_demo_dataset(__import__('pathlib').Path(sys.argv[2]))", str(REPO), str(demo)],
                       check=True)
    return [str(p) for p in sorted(demo.glob("0000[0-9].tar"))]


def report(doc: dict, runs: dict, long_runs: dict, meta: dict) -> list[str]:
    """Prints the tables of the runs and adds them to ``doc``; returns the impossible figures."""
    rows = {s: figures.summarise(rs) for s, rs in runs.items()}
    long_rows = {s: figures.summarise(rs) for s, rs in long_runs.items()}
    out = tables(rows, f"short runs ({meta['samples_per_pass']} samples)")
    if long_rows:
        out += tables(long_rows, f"long run ({meta['long_passes']} x {meta['samples_per_pass']} samples)")
    out += summary_tables(rows, long_rows)
    out = [table for table in out if table["rows"]]  # e.g. no decoder-gain pairs in --quick
    for table in out:
        print_table(table)
    for system, reason in doc["skipped"].items():
        print(f"{system}: skipped: {reason}")
    bad = impossible_runs(runs, meta["cores"]) + impossible_runs(long_runs, meta["cores"])
    for why in bad:
        print(f"WARNING: impossible figure (more cores than this machine's {meta['cores']}): {why}", flush=True)
    doc["tables"] += out
    goals = _like_with_like(lambda rs: [list(g) for g in figures.goals(rs, rows)], rows, long_rows)
    doc |= meta | {"runs": runs, "rows": rows, "long_runs": long_runs, "long_rows": long_rows, "impossible": bad,
                   "goals": [{"goal": g, "run": r, "value": v, "target": t, "met": m} for g, r, v, t, m in goals]}
    return bad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="create .venv-peers/ with the peers, then exit")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small synthetic shard, one round of {', '.join(QUICK_SYSTEMS)}, no long run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians and ranges)")
    parser.add_argument("--long", action="store_true", help=f"also a long run: {LONG_PASSES} passes over the corpus")
    parser.add_argument("--long-rounds", type=int, default=1, help="interleaved rounds of the long run")
    parser.add_argument("--long-systems", nargs="+", choices=list(SYSTEMS),
                        help="rows of the long run (default: every row but the -nobatch and -nodraft variants)")
    parser.add_argument("--corpus", choices=("demo", "camera"), default="demo",
                        help="demo: the demo set's four clean shards; camera: camera photos in img2dataset's "
                             "layout with parquet manifests (bench/peers_corpus.py, written once)")
    parser.add_argument("--shards", nargs="+", help="tar files (instead of --corpus)")
    parser.add_argument("--systems", nargs="*", choices=list(SYSTEMS), help="rows to run (none: only --scale)")
    parser.add_argument("--json", type=Path, help="also write the tables, every run and the goals here")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: the tables of the runs a previous --json wrote (its command kept)")
    parser.add_argument("--scale", action="store_true",
                        help="also: the service's planning + layout CPU per sample and memory for 2..128 DP "
                             "ranks, samples per sequence and images per sample (bench/peers_scale.py)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        peers_setup.setup()
        return 0
    doc = benchjson.document("peers", quick=args.quick, argv=None if argv is None else ["bench/peers.py", *argv])
    if args.render:
        old = json.loads(args.render.read_text())
        doc |= {k: old[k] for k in ("command", "machine", "date", "quick", "urls", "skipped")}
        meta = {k: old[k] for k in ("cores", "window_from_sample", "samples_per_pass", "long_passes")}
        bad = report(doc, old["runs"], old.get("long_runs", {}), meta)
        rendered_by = benchjson.command(sys.argv if argv is None else ["bench/peers.py", *argv])
        benchjson.write(args.json, doc | {"rendered_by": rendered_by})
        return 1 if bad else 0
    if args.shards:
        urls = args.shards
    elif args.quick:
        urls = benchjson.quick_shards()
    else:
        urls = peers_corpus.ensure() if args.corpus == "camera" else demo_shards()
    urls = [str(Path(u).resolve()) for u in urls]
    rounds = 1 if args.quick else args.rounds
    wanted = args.systems if args.systems is not None else list(QUICK_SYSTEMS if args.quick else SYSTEMS)
    installed = peers_setup.installed()
    peer = {s: str(SYSTEMS[s][1]) for s in wanted if SYSTEMS[s][1]}
    skipped = {s: f"{name} not installed: {installed.get(name, 'run --setup')}"
               for s, name in peer.items() if installed.get(name) != "ok"}
    skipped |= {s: "not run in --quick" for s in SYSTEMS if s not in wanted and args.quick and args.systems is None}
    skipped |= dict(NOT_RUN)
    systems = [s for s in wanted if s not in skipped]
    doc |= {"urls": urls, "skipped": skipped}
    if args.corpus == "camera" and not args.shards and not args.quick:
        doc["title"] = "peers: camera photos"
    if not systems:  # --scale alone
        doc["scale"] = run_scale(urls, args.quick) if args.scale else []
        benchjson.write(args.json, doc)
        return 0
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    cores = len(os.sched_getaffinity(0))
    per_pass = corpus_samples(urls)
    mark_at = max(1, math.ceil(MARK_FRACTION * per_pass))
    long_wanted = args.long_systems or [s for s in systems if SYSTEMS[s][2]]
    long_systems = [s for s in systems if s in long_wanted] if args.long and not args.quick else []
    print(f"{len(urls)} shards ({per_pass} samples), {rounds} interleaved rounds of {', '.join(systems)}; "
          f"long run ({LONG_PASSES} passes): {', '.join(long_systems) or 'none'}; "
          f"window from sample {mark_at}; {cores} cores ({os.cpu_count()} online); load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="peers-") as workdir:
        inputs = {s: urls for s in systems}
        if "energon-pillow" in systems:
            try:
                inputs["energon-pillow"] = prepare_energon(urls, Path(workdir))
            except subprocess.CalledProcessError as e:
                skipped["energon-pillow"] = f"energon prepare failed (exit {e.returncode})"
                systems.remove("energon-pillow")
                long_systems = [s for s in long_systems if s in systems]
        runs = run_rounds(systems, inputs, Path(workdir), rounds, mark_at, 1)
        long_runs = run_rounds(long_systems, inputs, Path(workdir), args.long_rounds, mark_at, LONG_PASSES)
    meta = {"cores": cores, "window_from_sample": mark_at, "samples_per_pass": per_pass, "long_passes": LONG_PASSES}
    bad = report(doc, runs, long_runs, meta)
    if args.scale:
        doc["scale"] = run_scale(urls, args.quick)
    benchjson.write(args.json, doc)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
