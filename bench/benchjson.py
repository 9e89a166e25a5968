"""The JSON every bench writes with ``--json FILE``, and that bench/report.py renders into
docs/benchmarks.md: one shape for all, so that every figure in the docs has its command, machine
and date beside it.

    {"format": "disttrain-bench/1", "bench": "stream", "command": "python bench/stream.py --quick",
     "machine": {"cores": 2, "cpu": "...", "python": "3.11.2", "torch": "2.13.0+cpu", "host": "..."},
     "date": "2026-11-26T12:00:00Z", "quick": false, "title": "stream (optional: a bench writing several)",
     "tables": [{"title": "...", "columns": ["system", "samples/s"], "rows": [["floor", 147.7]],
                 "notes": ["..."]}],
     ...}                         # any other keys a bench keeps (raw runs, goals): report.py ignores them

Usage in a bench::

    doc = benchjson.document("stream", quick=args.quick)
    doc["tables"].append(benchjson.table("end to end", ["metric", "value"], rows, notes=[...]))
    benchjson.write(args.json, doc)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

FORMAT = "disttrain-bench/1"
REPO = Path(__file__).resolve().parent.parent


def machine() -> dict:
    """What ran the bench: cores this process may use, CPU model, interpreter and torch versions, and
    the machine's 1-minute load average when the bench started (other work shares the cores)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        torch = version("torch")
    except Exception:  # not installed in this interpreter (a peer's venv without torch)
        torch = None
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "python": platform.python_version(),
            "torch": torch, "os": platform.platform(terse=True), "load_1min": round(os.getloadavg()[0], 2)}


def command(argv: list[str] | None = None) -> str:
    """The command line as a user types it from the repository root (``python bench/x.py ...``)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = argv[0] if argv else "?"
    return shlex.join([".venv/bin/python", shown, *argv[1:]])


def document(bench: str, *, quick: bool = False, argv: list[str] | None = None) -> dict:
    """A new result document for ``bench`` (the bench's file name without .py)."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return {"format": FORMAT, "bench": bench, "command": command(argv), "machine": machine(),
            "date": now.isoformat().replace("+00:00", "Z"), "quick": quick, "tables": []}


def table(title: str, columns: list[str], rows: list[list], *, notes: list[str] | None = None) -> dict:
    """One table; every row has one cell per column (numbers or strings)."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"table {title!r}: a row has {len(row)} cells for {len(columns)} columns: {row!r}")
    return {"title": title, "columns": list(columns), "rows": [list(r) for r in rows], "notes": list(notes or [])}


def check(doc: dict) -> dict:
    """Validates a result document's shape (report.py and the bench tests use it); returns it."""
    missing = [k for k in ("format", "bench", "command", "machine", "date", "tables") if k not in doc]
    if missing:
        raise ValueError(f"bench result lacks {missing}")
    if doc["format"] != FORMAT:
        raise ValueError(f"bench result format is {doc['format']!r}, expected {FORMAT!r}")
    for t in doc["tables"]:
        table(t["title"], t["columns"], t["rows"], notes=t.get("notes"))
    return doc


def write(path: Path | str | None, doc: dict) -> None:
    """Writes ``doc`` to ``path`` (nothing when path is None), checked first."""
    if path is None:
        return
    Path(path).write_text(json.dumps(check(doc), indent=1, default=_plain) + "\n")


def _plain(value):
    """numpy scalars and arrays, Paths: as plain JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def quick_shards(num_shards: int = 1, samples_per_shard: int = 40) -> list[str]:
    """A small synthetic LAION-style shard set for ``--quick`` runs (written once under
    data/bench-quick/, deterministic), so that a smoke run never waits for the 1,000-sample demo."""
    from disttrain_tools import synth  # the project's venv only (quick runs are ours)

    out = REPO / "data" / "bench-quick" / f"{num_shards}x{samples_per_shard}"
    config = synth.SynthConfig(num_shards=num_shards, samples_per_shard=samples_per_shard)
    return [str(p) for p in synth.ensure_dataset(out, config)]
