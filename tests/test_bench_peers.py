"""bench/peers.py's pure parts: medians and ranges over rounds, the goal ratios, the CUDA guard of
--setup, and the CPU accounting of a process tree (a child that burns CPU in a grandchild)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import peers_setup  # noqa: E402


def _run(cpu_per_sample: float, rate: float, samples: int = 100) -> dict:
    return {"samples": samples, "startup_s": 1.0, "samples_per_s": rate, "cpu_s": cpu_per_sample * samples,
            "cpu_per_sample": cpu_per_sample, "steady_cpu_per_sample": cpu_per_sample, "peak_pss_mib": 100.0,
            "wall_s": 2.0}


def test_summarise_gives_median_and_range_of_the_rounds_that_ran():
    rows = peers.summarise([_run(0.01, 100), {"error": "exit 1"}, _run(0.03, 50), _run(0.02, 80)])
    assert rows["rounds"] == 3
    assert rows["samples_per_s"] == {"median": 80, "min": 50, "max": 100}
    assert peers.summarise([{"error": "exit 1"}]) == {"error": "exit 1"}


def test_goals_compare_disttrain_with_the_floor_and_every_peer():
    rows = {name: peers.summarise([_run(cpu, rate)]) for name, cpu, rate in
            [("floor", 0.010, 50), ("disttrain", 0.0104, 120), ("dl-ours", 0.011, 100), ("dl-pillow", 0.02, 60),
             ("ray", 0.05, 130)]}
    goals = {name: (value, met) for name, value, _, met in peers.goals(rows)}
    value, met = goals["CPU-s per sample / bare floor (<= 1.05)"]
    assert abs(value - 1.04) < 1e-9 and met
    value, met = goals["samples per CPU-s / DataLoader + Pillow (>= 1.5)"]
    assert abs(value - 0.02 / 0.0104) < 1e-9 and met
    assert goals["samples/s / ray (>= 1.0)"][1] is False
    assert not any("tf-service" in name for name in goals)  # a peer that did not run has no goal
    assert goals["start-up s: launch to first sample (<= 2.0)"] == (1.0, True)
    assert goals["peak PSS / DataLoader + our decoder (<= 2.0)"] == (1.0, True)
    heavy = dict(rows, disttrain=peers.summarise([_run(0.0104, 120) | {"peak_pss_mib": 201.0, "startup_s": 2.5}]))
    goals = {name: (value, met) for name, value, _, met in peers.goals(heavy)}
    assert goals["start-up s: launch to first sample (<= 2.0)"] == (2.5, False)
    assert goals["peak PSS / DataLoader + our decoder (<= 2.0)"] == (2.01, False)


def test_setup_refuses_a_dry_run_that_brings_cuda_or_another_torch():
    bad = "Would install nvidia-cublas-13.1 torch-2.9.1 triton-3.5.0 numpy-2.4.6"
    found = sorted(set(m.group(0) for m in peers_setup._FORBIDDEN.finditer(bad)))
    assert found == ["nvidia-cublas-13", "torch-2", "triton-3"]
    assert not list(peers_setup._FORBIDDEN.finditer("Would install numpy-2.4.6 pillow-13.0.0"))


def test_tree_sampler_counts_a_grandchild_whose_usage_its_parent_discards():
    sampler = peers.TreeSampler()
    # The child ignores SIGCHLD, so the kernel discards the grandchild's usage: RUSAGE_CHILDREN
    # alone would miss it; the sampler saw it while it ran.
    script = ("import signal, subprocess, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
              "subprocess.Popen([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
              "while time.process_time() - t < 0.6: pass']).wait()")
    proc = subprocess.Popen([sys.executable, "-c", script])
    while proc.poll() is None:
        sampler.sample(memory=False)
    assert sum(sampler.seen.values()) >= 0.4
