"""bench/peers.py's pure parts: one run's whole-run and common-window figures from its deliveries and
CPU snapshots, the core-count sanity check, medians and ranges over rounds, the goal ratios, the
CUDA guard of --setup, the consumers' mark at the k-th sample, and the CPU accounting of a process
tree (a child that burns CPU in a grandchild). The bench modules are loaded from their files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO

BENCH = REPO / "bench"


def _load(name: str):
    """bench/NAME.py as module NAME (registered, so that the bench modules' own imports of each
    other find it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


PATH_BEFORE = list(sys.path)
benchjson = _load("benchjson")
peers_setup = _load("peers_setup")
peers_tree = _load("peers_tree")
figures = _load("peers_figures")
peers_corpus = _load("peers_corpus")
peers = _load("peers")
PATH_AFTER = list(sys.path)  # now: other test modules collected later may import benches that do edit it


def test_loading_the_bench_leaves_sys_path_alone():
    assert PATH_AFTER == PATH_BEFORE


def test_cpu_at_interpolates_between_snapshots_and_clamps_outside():
    series = [(10.0, 1.0), (12.0, 3.0), (14.0, 3.0), (15.0, 5.0)]
    assert figures.cpu_at(series, 11.0) == pytest.approx(2.0)
    assert figures.cpu_at(series, 13.0) == pytest.approx(3.0)
    assert figures.cpu_at(series, 14.5) == pytest.approx(4.0)
    assert figures.cpu_at(series, 12.0) == pytest.approx(3.0)
    assert figures.cpu_at(series, 5.0) == 1.0 and figures.cpu_at(series, 99.0) == 5.0


def test_run_figures_charge_the_same_window_from_the_kth_sample():
    # Two consumers deliver batches of 4 at t = 11, 12, ..., 20 (launch at 10): 40 samples. The
    # tree burns 1 CPU-s per second from launch to the last sample, then 3 CPU-s of teardown.
    events = [(10.0 + i, 4) for i in range(1, 11, 2)] + [(10.0 + i, 4) for i in range(2, 11, 2)]
    series = [(10.0 + i / 2, i / 2) for i in range(0, 21)] + [(21.0, 13.0)]
    run = figures.run_figures(events, series, cpu_total_s=13.5, mark_at=10, launch=10.0, exit_time=22.0)
    assert run["samples"] == 40
    assert run["startup_s"] == pytest.approx(1.0)
    # Whole run: everything but the CPU sampled after the last sample (13 - 10), per sample.
    assert run["teardown_cpu_s"] == pytest.approx(3.0)
    assert run["run_cpu_s"] == pytest.approx(10.5)
    assert run["run_cpu_per_sample"] == pytest.approx(10.5 / 40)
    assert run["run_samples_per_s"] == pytest.approx(40 / 10)
    # Window: the delivery that brings the count to >= 10 is the third (t = 13, 12 samples); the
    # samples after it over the CPU and seconds after it.
    assert run["window_first_sample"] == 12
    assert run["window_samples"] == 28 and run["window_s"] == pytest.approx(7.0)
    assert run["window_cpu_s"] == pytest.approx(7.0)
    assert run["window_cpu_per_sample"] == pytest.approx(7.0 / 28)
    assert run["window_samples_per_s"] == pytest.approx(4.0)
    assert run["cores_window"] == pytest.approx(1.0)
    assert run["cores_run"] == pytest.approx(1.05)
    assert run["cores_total"] == pytest.approx(13.5 / 12)


def test_run_figures_refuse_a_run_that_never_reached_the_window():
    with pytest.raises(ValueError, match="fewer than the window's start"):
        figures.run_figures([(1.0, 3)], [(0.0, 0.0), (2.0, 1.0)], 1.0, mark_at=4, launch=0.0, exit_time=2.0)


def test_a_figure_implying_more_cores_than_the_machine_is_impossible():
    fine = {"cores_run": 1.9, "cores_window": 2.0 * figures.CORE_SLACK, "cores_total": 0.5}
    assert figures.impossible(fine, cores=2) == []
    bad = fine | {"cores_window": 2.1}
    (why,) = figures.impossible(bad, cores=2)
    assert why.startswith("cores_window = 2.100")
    assert len(figures.impossible(fine | {"cores_run": 4.5, "cores_total": 4.1}, cores=4)) == 2
    runs = {"disttrain": [bad, {"error": "exit 1"}, fine]}
    assert peers.impossible_runs(runs, 2) == [f"disttrain round 1: {why}"]


def _run(cpu_per_sample: float, rate: float, samples: int = 100, **extra) -> dict:
    return {"samples": samples, "startup_s": 1.0, "run_samples_per_s": rate, "run_cpu_per_sample": cpu_per_sample,
            "window_samples_per_s": rate * 1.1, "window_cpu_per_sample": cpu_per_sample * 0.9,
            "peak_pss_mib": 100.0} | extra


def test_summarise_gives_median_and_range_of_the_rounds_that_ran():
    rows = figures.summarise([_run(0.01, 100), {"error": "exit 1"}, _run(0.03, 50), _run(0.02, 80)])
    assert rows["rounds"] == 3
    assert rows["run_samples_per_s"] == {"median": 80, "min": 50, "max": 100}
    assert figures.summarise([{"error": "exit 1"}]) == {"error": "exit 1"}


def _rows(**systems) -> dict:
    return {name: figures.summarise([run]) for name, run in systems.items()}


def test_goals_compare_disttrain_with_the_floor_and_every_peer():
    rows = _rows(floor=_run(0.010, 50), disttrain=_run(0.0102, 120), **{
        "dl-ours": _run(0.0130, 100), "dl-pillow": _run(0.02, 60), "dl-pillow-nodraft": _run(0.04, 30),
        "ray-pillow": _run(0.05, 130)})
    goals = {name: (value, met) for name, value, _, met in figures.goals(rows, rows)}
    value, met = goals["all CPU per sample / true floor"]
    assert value == pytest.approx(1.02) and met  # issue 49: at most 1.03
    value, met = goals["samples per CPU-s / dl-ours (batched DataLoader, our decoder)"]
    assert value == pytest.approx(0.013 / 0.0102) and met  # at least 1.25
    assert goals["samples/s / dl-ours"] == (pytest.approx(1.2), True)  # at least 1.2 against dl-ours
    slower = _rows(floor=_run(0.010, 50), disttrain=_run(0.0104, 119), **{"dl-ours": _run(0.0125, 100)})
    slower_goals = {name: met for name, _, _, met in figures.goals(slower, slower)}
    assert not slower_goals["all CPU per sample / true floor"]
    assert not slower_goals["samples per CPU-s / dl-ours (batched DataLoader, our decoder)"]
    assert not slower_goals["samples/s / dl-ours"]
    # A peer's own best decoder is its row with the least CPU per sample.
    value, met = goals["samples per CPU-s / dl-pillow (DataLoader, own best decoder)"]
    assert value == pytest.approx(0.02 / 0.0102) and met
    assert not any("dl-pillow-nodraft (DataLoader" in name for name in goals)
    assert goals["samples per CPU-s / ray-pillow (Ray Data, own best decoder)"][1] is True
    assert goals["samples/s / ray-pillow"] == (pytest.approx(120 / 130), False)
    assert goals["samples/s / dl-pillow-nodraft"][1] is True
    assert not any("tf-" in name for name in goals)  # a peer that did not run has no goal
    assert not any(name == "samples/s / floor" for name in goals)
    assert goals["start-up s: launch to first sample"] == (1.0, True)
    assert goals["peak PSS / dl-ours"] == (1.0, True)
    heavy = dict(rows, disttrain=figures.summarise([_run(0.0104, 120, peak_pss_mib=151.0, startup_s=2.5)]))
    short = dict(rows, disttrain=figures.summarise([_run(0.0104, 120, startup_s=1.5)]))
    goals = {name: (value, met) for name, value, _, met in figures.goals(heavy, short)}
    assert goals["start-up s: launch to first sample"] == (1.5, True)  # start-up from the short runs
    assert goals["peak PSS / dl-ours"] == (pytest.approx(1.51), False)


def test_verdict_says_by_how_much_a_goal_is_missed():
    assert figures.verdict(1.04, 1.05, True) == "met"
    assert figures.verdict(1.26, 1.05, False) == "NOT met: 20.0% over"
    assert figures.verdict(0.99, 1.1, False) == "NOT met: 10.0% short"
    assert figures.verdict(float("nan"), 1.1, False) == "not measured"


def test_ratios_put_the_same_decoder_on_both_sides():
    rows = _rows(disttrain=_run(0.010, 200), **{"dl-ours": _run(0.012, 150), "dl-pillow": _run(0.018, 90),
                                               "ray-ours": _run(0.02, 100), "ray-pillow": _run(0.03, 80)})
    assert figures.ratios(rows) == [("dl-ours", pytest.approx(1.2), pytest.approx(200 / 150)),
                                    ("ray-ours", pytest.approx(2.0), pytest.approx(2.0))]
    (dl, _, _), (ray, _, _) = figures.ratios(rows, "window")
    assert (dl, ray) == ("dl-ours", "ray-ours")
    assert figures.decoder_gain(rows) == [("dl-pillow / dl-ours", pytest.approx(1.5)),
                                          ("ray-pillow / ray-ours", pytest.approx(1.5))]


def test_the_tables_follow_the_bench_json_shape():
    rows = _rows(floor=_run(0.010, 50), disttrain=_run(0.0104, 120), **{"dl-ours": _run(0.012, 100)})
    for row in rows.values():
        for key in ("cores_run", "cores_window", "teardown_cpu_s", "window_first_sample", "window_samples"):
            row[key] = {"median": 1.0, "min": 1.0, "max": 1.0}
    rows["ray-ours"] = {"error": "exit 1: boom"}
    doc = benchjson.document("peers", argv=["bench/peers.py", "--quick"])
    doc["tables"] += peers.tables(rows, "short") + peers.summary_tables(rows, {})
    benchjson.check(doc)
    run, window = doc["tables"][:2]
    assert [r[0] for r in run["rows"]] == ["floor", "disttrain", "dl-ours", "ray-ours"]
    assert run["rows"][-1][1] == "FAILED"
    assert [r[0] for r in window["rows"]] == ["floor", "disttrain", "dl-ours"]


def test_comparisons_are_long_only_where_both_sides_ran_long():
    short = _rows(floor=_run(0.010, 50), disttrain=_run(0.020, 60), **{"dl-ours": _run(0.022, 55),
                                                                       "ray-ours": _run(0.030, 40)})
    long = _rows(floor=_run(0.009, 50), disttrain=_run(0.010, 100), **{"dl-ours": _run(0.012, 80)})
    ratios = peers._like_with_like(lambda rs: [list(r) for r in figures.ratios(rs)], short, long)
    assert ratios == [["dl-ours", "long", pytest.approx(1.2), pytest.approx(100 / 80)],
                      ["ray-ours", "short", pytest.approx(1.5), pytest.approx(1.5)]]
    goals = {row[0]: row[1:3] for row in peers.summary_tables(short, long)[2]["rows"]}
    assert goals["all CPU per sample / true floor"] == ["long", "1.111"]
    assert goals["samples/s / ray-ours"] == ["short", "1.500"]
    assert goals["start-up s: launch to first sample"][0] == "short"


def test_consumers_mark_the_kth_sample_once_across_processes():
    script = ("import multiprocessing as mp, peers_systems as ps\n"
              "shared = mp.Value('q', 0)\n"
              "a, b = ps.Tally(shared, mark_at=5), ps.Tally(shared, mark_at=5)\n"
              "a.add(2, 10); print('after 2'); b.add(2, 10); print('after 4'); a.add(3, 10); print('after 7')\n"
              "b.add(3, 10)\n"
              "print(ps.merged([a.as_dict(), b.as_dict()])['samples'])\n")
    out = subprocess.run([sys.executable, "-u", "-c", script], cwd=BENCH, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["after", "2", "after", "4", "PEERS-MARK", "after", "7", "10"]


def test_setup_refuses_a_dry_run_that_brings_cuda_or_another_torch():
    bad = "Would install nvidia-cublas-13.1 torch-2.9.1 triton-3.5.0 numpy-2.4.6"
    found = sorted(set(m.group(0) for m in peers_setup._FORBIDDEN.finditer(bad)))
    assert found == ["nvidia-cublas-13", "torch-2", "triton-3"]
    assert not list(peers_setup._FORBIDDEN.finditer("Would install numpy-2.4.6 pillow-13.0.0"))


def test_tree_sampler_counts_a_grandchild_whose_usage_its_parent_discards():
    sampler = peers_tree.TreeSampler()
    # The child ignores SIGCHLD, so the kernel discards the grandchild's usage: RUSAGE_CHILDREN
    # alone would miss it; the sampler saw it while it ran.
    script = ("import signal, subprocess, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
              "subprocess.Popen([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
              "while time.process_time() - t < 0.6: pass']).wait()")
    proc = subprocess.Popen([sys.executable, "-c", script])
    while proc.poll() is None:
        sampler.sample(memory=False)
    assert sum(sampler.seen.values()) >= 0.4


def test_the_camera_corpus_is_img2dataset_s_layout_with_camera_jpegs_and_is_deterministic(tmp_path):
    """bench/peers_corpus.py: per shard a tar, a parquet the service plans from and a stats file;
    every photo a JPEG whose stored size (read by Pillow) is the parquet's, with a camera's EXIF
    orientation, make and model; a seed gives the same bytes."""
    import hashlib
    import io
    import tarfile

    import pyarrow.parquet as pq
    from PIL import Image

    from preprocess_service.adapters.io import img2dataset

    config = peers_corpus.CameraCorpus(shards=2, per_shard=6, megapixels=(0.02, 0.06))
    tars = peers_corpus.ensure(tmp_path / "a", config, log=lambda *_: None)
    assert [p.rsplit("/", 1)[1] for p in tars] == ["00000.tar", "00001.tar"]
    for tar_path in tars:
        rows = {r["key"]: r for r in pq.read_table(tar_path.replace(".tar", ".parquet")).to_pylist()}
        assert len(rows) == config.per_shard and all(r["status"] == "success" for r in rows.values())
        with tarfile.open(tar_path) as tar:
            jpgs = {m.name.split(".")[0]: tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")}
        assert set(jpgs) == set(rows)
        for key, data in jpgs.items():
            image = Image.open(io.BytesIO(data))
            assert image.format == "JPEG" and image.size == (rows[key]["width"], rows[key]["height"])
            exif = image.getexif()
            assert exif.get(0x0112) in range(1, 9) and exif.get(0x010F) and exif.get(0x0110)
            assert hashlib.sha256(data).hexdigest() == rows[key]["sha256"]
        manifest = img2dataset.read_manifest(tar_path)
        assert manifest is not None and manifest.plannable, "the service would not plan it from the parquet"
    again = peers_corpus.ensure(tmp_path / "b", config, log=lambda *_: None)
    assert [open(p, "rb").read() for p in again] == [open(p, "rb").read() for p in tars]
    written = []
    assert peers_corpus.ensure(tmp_path / "a", config, log=written.append) == tars
    assert not written, f"a corpus already on disk was written again: {written}"
