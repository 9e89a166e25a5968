"""bench/peers.py's arithmetic, pure: one run's figures from what its consumers and the harness
recorded, medians over rounds, the core-count sanity check, the ratios and the goals.

A run gives
  events   [(time, samples delivered)]: every delivery of every consumer (time.time());
  series   [(time, CPU-s)]: snapshots of the process tree's CPU (every sampling period, and when a
           consumer printed PEERS-MARK or PEERS-END), ascending in time;
  cpu_total_s the tree's CPU from launch to its last process's exit (teardown included);
  launch, exit: wall times of the launch and of the last process's exit.

Figures (one run):
  whole run     launch to the last delivered sample: all CPU spent until then (the total less the
                CPU sampled after the last sample) per sample, and samples / (last - launch);
  common window from the moment the k-th sample (``mark_at``, the same k for every system)
                reached the consumer to the last: CPU in between (interpolated on the series at both
                ends) per sample delivered after the k-th, and those samples / the window's seconds;
  start-up      launch to the first delivered sample;
  cores_*       CPU-seconds per wall-second of each, which no run can raise above its cores.
"""

from __future__ import annotations

import bisect
import statistics

CORE_SLACK = 1.02
"""A figure may imply at most this many times the cores it ran on (clock-tick rounding) before
the bench calls it impossible."""


def cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """The tree's CPU at wall time ``t``, linear between the snapshots around it (clamped to the first
    and last snapshot outside them)."""
    times = [s[0] for s in series]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return series[0][1]
    if i == len(series):
        return series[-1][1]
    (t0, c0), (t1, c1) = series[i - 1], series[i]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def run_figures(events: list[tuple[float, int]], series: list[tuple[float, float]], cpu_total_s: float,
                mark_at: int, launch: float, exit_time: float) -> dict:
    """One run's figures (see the module's docstring)."""
    events = sorted(events)
    samples, delivered, t_mark, n_mark = 0, 0, None, 0
    for t, n in events:
        delivered += n
        if t_mark is None and delivered >= mark_at:
            t_mark, n_mark = t, delivered
    samples = delivered
    if t_mark is None:
        raise ValueError(f"the run delivered {samples} samples, fewer than the window's start ({mark_at})")
    t_first, t_last = events[0][0], events[-1][0]
    teardown = max(0.0, series[-1][1] - cpu_at(series, t_last))
    run_cpu = cpu_total_s - teardown
    window_cpu = cpu_at(series, t_last) - cpu_at(series, t_mark)
    window_s, window_samples = t_last - t_mark, samples - n_mark
    run_s = t_last - launch
    return {"samples": samples, "startup_s": t_first - launch,
            "run_s": run_s, "run_samples_per_s": samples / run_s, "run_cpu_s": run_cpu,
            "run_cpu_per_sample": run_cpu / samples,
            "window_first_sample": n_mark, "window_samples": window_samples, "window_s": window_s,
            "window_samples_per_s": window_samples / window_s if window_s > 0 else float("nan"),
            "window_cpu_s": window_cpu,
            "window_cpu_per_sample": window_cpu / window_samples if window_samples else float("nan"),
            "teardown_cpu_s": teardown, "total_cpu_s": cpu_total_s, "wall_s": exit_time - launch,
            "cores_run": run_cpu / run_s, "cores_window": window_cpu / window_s if window_s > 0 else 0.0,
            "cores_total": cpu_total_s / (exit_time - launch)}


def impossible(figures: dict, cores: int) -> list[str]:
    """Why a run's figures cannot be (more CPU-seconds per wall-second than ``cores``), or []."""
    return [f"{key} = {figures[key]:.3f} CPU-s per wall-s > {cores} cores x {CORE_SLACK}"
            for key in ("cores_run", "cores_window", "cores_total") if figures[key] > cores * CORE_SLACK]


def summarise(runs: list[dict]) -> dict:
    """Median and range of every figure over the rounds that succeeded."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    return {key: {"median": statistics.median(r[key] for r in ok), "min": min(r[key] for r in ok),
                  "max": max(r[key] for r in ok)} for key in ok[0]} | {"rounds": len(ok)}


def med(rows: dict, system: str, key: str) -> float:
    row = rows.get(system, {})
    return row[key]["median"] if key in row else float("nan")


OWN_DECODER = {"DataLoader": ("dl-pillow", "dl-pillow-nodraft"), "tf.data service": ("tf-pillow",),
               "Ray Data": ("ray-pillow",), "Megatron-Energon": ("energon-pillow",)}
"""Each peer's rows with its own (Pillow) decoder; its best is the one with the least CPU per sample."""
OUR_DECODER = {"DataLoader": "dl-ours", "tf.data service": "tf-ours", "Ray Data": "ray-ours"}
"""Each peer's row given our decoder, where it can call it."""


def _best_own(rows: dict, peer: str) -> str | None:
    present = [s for s in OWN_DECODER[peer] if "error" not in rows.get(s, {"error": 1})]
    return min(present, key=lambda s: med(rows, s, "run_cpu_per_sample")) if present else None


def ratios(rows: dict, prefix: str = "run") -> list[tuple[str, float, float]]:
    """Decoder-normalised: (peer row, disttrain's samples per CPU-s / the peer's, samples/s / the
    peer's), our decoder on both sides; ``prefix`` "run" (whole run) or "window"."""
    out = []
    cpu, rate = f"{prefix}_cpu_per_sample", f"{prefix}_samples_per_s"
    for row in OUR_DECODER.values():
        if "error" not in rows.get(row, {"error": 1}) and "error" not in rows.get("disttrain", {"error": 1}):
            out.append((row, med(rows, row, cpu) / med(rows, "disttrain", cpu),
                        med(rows, "disttrain", rate) / med(rows, row, rate)))
    return out


def decoder_gain(rows: dict) -> list[tuple[str, float]]:
    """The decoder's own gain in one harness: (rows compared, Pillow's CPU per sample / ours)."""
    pairs = [("dl-pillow", "dl-ours"), ("dl-pillow-nodraft", "dl-ours"), ("tf-pillow", "tf-ours"),
             ("ray-pillow", "ray-ours")]
    return [(f"{theirs} / {ours}", med(rows, theirs, "run_cpu_per_sample") / med(rows, ours, "run_cpu_per_sample"))
            for theirs, ours in pairs
            if all("error" not in rows.get(s, {"error": 1}) for s in (theirs, ours))]


def goals(rows: dict, startup_rows: dict) -> list[tuple[str, float, float, bool]]:
    """(goal, measured, target, met) of issue 49 on whole-run figures of ``rows`` (the long run where
    there is one); start-up from ``startup_rows`` (the short runs)."""
    dt, cpu = "disttrain", "run_cpu_per_sample"
    out = [("all CPU per sample / true floor", med(rows, dt, cpu) / med(rows, "floor", cpu), 1.03, "le"),
           ("samples per CPU-s / dl-ours (batched DataLoader, our decoder)",
            med(rows, "dl-ours", "run_cpu_per_sample") / med(rows, dt, "run_cpu_per_sample"), 1.25, "ge")]
    for peer in OWN_DECODER:
        if (best := _best_own(rows, peer)) is not None:
            out.append((f"samples per CPU-s / {best} ({peer}, own best decoder)",
                        med(rows, best, "run_cpu_per_sample") / med(rows, dt, "run_cpu_per_sample"), 1.5, "ge"))
    for system in rows:
        if system not in ("floor", dt) and "error" not in rows[system]:
            rate = med(rows, dt, "run_samples_per_s") / med(rows, system, "run_samples_per_s")
            out.append((f"samples/s / {system}", rate, 1.2 if system == "dl-ours" else 1.0, "ge"))
    out += [("start-up s: launch to first sample", med(startup_rows, dt, "startup_s"), 1.5, "le"),
            ("peak PSS / dl-ours", med(rows, dt, "peak_pss_mib") / med(rows, "dl-ours", "peak_pss_mib"), 1.3, "le")]
    return [(name, value, target, value <= target if how == "le" else value >= target)
            for name, value, target, how in out]


def verdict(value: float, target: float, met: bool) -> str:
    """'met', or by how much it is not."""
    if value != value:
        return "not measured"
    if met:
        return "met"
    if value > target:
        return f"NOT met: {100 * (value / target - 1):.1f}% over"
    return f"NOT met: {100 * (1 - value / target):.1f}% short"
