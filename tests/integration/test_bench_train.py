"""bench/train.py, shortened: the measured run and the simulator's prediction beside it."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train.py"


def _load():
    if "bench_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_train", BENCH)
        bench = importlib.util.module_from_spec(spec)
        sys.modules["bench_train"] = bench  # dataclasses look their module up
        spec.loader.exec_module(bench)
    return sys.modules["bench_train"]


def test_quick_bench_pairs_each_measured_step_with_its_predicted_plan(tmp_path, capsys):
    bench = _load()
    benchjson = sys.modules["benchjson"]  # the bench imported it from its own folder
    out = tmp_path / "train.json"
    assert bench.main(["--quick", "--procs", "2", "--data", str(tmp_path / "data"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["data"]["no_image_share"] > 0.05  # the mix has sequences without media
    spread = result["data"]["encoder_tokens_percentiles"]
    assert spread["0"] == 0 and spread["100"] > bench.QUICK["seq_len"] / 4  # sequences without and with many
    rows = {row["reorder"]: row for row in result["rows"]}
    assert set(rows) == {"arrival", "ours"}
    for row in rows.values():
        assert row["steps"] == 1 and row["kind"] == "monolithic" and row["seqs_per_microbatch"] == 1
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        # how close the prediction is, is the benchmark's figure, not a test's: a measured time
        # depends on the machine's load
        assert math.isfinite(row["error"]) and row["error"] == pytest.approx(
            (row["predicted_s"] - row["measured_s"]) / row["measured_s"], rel=1e-6, abs=1e-9), row
        assert 0 <= row["predicted_bubble"] < 1 and math.isfinite(row["vs_arrival"])
    printed = capsys.readouterr().out
    assert "data heterogeneity" in printed and "prediction error" in printed
    assert benchjson.check(result)["bench"] == "train" and result["quick"] is True
    (table,) = result["tables"]
    assert [row[:3] for row in table["rows"]] == [[rows[r]["layout"], 1, r] for r in ("arrival", "ours")]
    assert table["columns"][-2:] == ["vs off predicted", "steps"]


def test_the_microbatch_sizes_must_divide_the_global_batch(capsys):
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--global-batch", "8", "--seqs-per-microbatch", "1,3"])
    assert "must be >= 1 and divide --global-batch 8, got [1, 3]" in capsys.readouterr().err


def test_a_problem_at_S_holds_S_mean_sequences_per_microbatch():
    bench = _load()
    from trainer.orchestration.measure import Measured
    from trainer.orchestration.profile import Content

    measured = Measured(enc_s_per_token=1e-4, bb_s_per_token=5e-5, gen_s_per_image=0.01, bwd_factor=(2.0, 2.0, 1.0),
                        content=Content(tokens=2000, image_tokens=800, gen_images=0.25), microbatches=6)
    one, four = (bench.problem_at(measured, S, 2, 8, 4) for S in (1, 4))
    assert one == measured.problem(2, 8, 4) and four.seqs_per_microbatch == 4
    assert (four.content.tokens, four.content.image_tokens, four.content.gen_images) == (8000, 3200, 1.0)
