"""Every bench runs, in its --quick mode, and writes the result shape bench/report.py renders; the
docs' benchmark page is what the committed results give. So no bench rots unnoticed again."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SUPPORT = {"benchjson", "report"}
"""Modules of bench/ that other benches import or run, not benches of their own; so are every
``peers_*.py`` (bench/peers.py's parts) and ``reference_*.py`` (bench/reorder.py's reference)."""
COVERED = {"train": "tests/integration/test_bench_train.py runs its --quick and checks each step against its plan",
           "faults": "tests/integration/test_faults.py runs its --quick (network namespaces) and checks its verdicts"}
"""Benches whose --quick run another test makes already (each a torchrun training: a minute)."""
BENCHES = sorted(p.stem for p in BENCH.glob("*.py")
                 if p.stem not in SUPPORT | set(COVERED) and not p.stem.startswith(("peers_", "reference_")))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchjson = _module("benchjson")


@pytest.fixture
def report(monkeypatch):
    """bench/report.py, which imports benchjson as a sibling script does."""
    monkeypatch.setitem(sys.modules, "benchjson", benchjson)
    return _module("report")


@pytest.mark.parametrize("bench", BENCHES)
def test_every_bench_runs_quick_and_writes_its_result(bench, tmp_path):
    out = tmp_path / f"{bench}.json"
    proc = subprocess.run([sys.executable, str(BENCH / f"{bench}.py"), "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench/{bench}.py --quick failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    doc = benchjson.check(json.loads(out.read_text()))
    assert doc["bench"] == bench and doc["quick"] is True
    assert "--quick" in doc["command"] and f"bench/{bench}.py" in doc["command"]
    assert doc["tables"] and all(t["rows"] for t in doc["tables"]), f"bench/{bench}.py wrote an empty table"


def test_the_decode_bench_s_trim_part_runs_quick_on_camera_photos(tmp_path):
    """bench/decode.py --only trim (not part of its default run): every policy measured."""
    out = tmp_path / "trim.json"
    proc = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--quick", "--only", "trim", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = benchjson.check(json.loads(out.read_text()))
    (table,) = doc["tables"]
    assert [row[0] for row in table["rows"]] == list(doc["trim"]) and len(table["rows"]) == 4
    assert all(row["cpu_ms"] > 0 and row["minor_faults"] >= 0 for row in doc["trim"].values())


def test_table_rejects_rows_that_do_not_fit_their_columns():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        benchjson.table("t", ["a", "b", "c"], [[1, 2]])
    with pytest.raises(ValueError, match="lacks"):
        benchjson.check({"format": benchjson.FORMAT, "bench": "x"})


def _result(tmp_path: Path, name: str, **extra) -> Path:
    doc = benchjson.document(name, argv=[str(BENCH / f"{name}.py"), "--rounds", "3"]) | extra
    doc["tables"].append(benchjson.table("figures", ["system", "samples/s"], [["floor", 147.25], ["ours", 264.9]],
                                         notes=["a note"]))
    path = tmp_path / f"{name}.json"
    benchjson.write(path, doc)
    return path


def test_report_renders_each_result_with_its_command_machine_and_date(report, tmp_path):
    _result(tmp_path, "stream")
    _result(tmp_path, "peers")
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path), "--output", str(out)]) == 0
    text = out.read_text()
    assert text.index("## peers") < text.index("## stream"), "headline comparisons come first"
    assert "Command: `.venv/bin/python bench/peers.py --rounds 3`" in text
    assert "| floor | 147.2 |" in text and "- a note" in text
    assert f"{benchjson.machine()['cores']} cores" in text
    assert report.main(["--check", "--results", str(tmp_path), "--output", str(out)]) == 0
    out.write_text(text.replace("147.2", "150.0"))  # a hand edit is caught
    assert report.main(["--check", "--results", str(tmp_path), "--output", str(out)]) == 1


def test_report_refuses_quick_runs(report, tmp_path):
    _result(tmp_path, "stream", quick=True)
    with pytest.raises(ValueError, match="--quick run"):
        report.load_results(tmp_path)


def test_the_committed_benchmarks_page_is_what_the_committed_results_give(report):
    assert report.main(["--check"]) == 0, "docs/benchmarks.md is stale or hand-edited: run python bench/report.py"
