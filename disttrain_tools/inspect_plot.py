"""The PNG of ``inspect``: a grid of histograms drawn with matplotlib's Agg canvas (no display, no
pyplot state). matplotlib is optional (``pip install 'disttrain[inspect]'``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DPI = 80
SIZE_INCHES = (14, 7.5)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def render_png(values: dict[str, np.ndarray], stats: dict, path: Path) -> None:
    """Draws the histograms of ``values`` (datastats.series) into ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("the plot needs matplotlib: pip install 'disttrain[inspect]' (or pass --no-plot)") \
            from None
    planner = stats["job"]["reorder_algorithm"]
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 3).ravel()
    panels = [
        ("image resolution (megapixels)", {"planned": values["image_megapixels"],
                                           "downloaded * (parquet)": values["manifest_original_megapixels"]}, True),
        ("image tokens per image", {"planned": values["image_tokens"]}, False),
        ("text tokens per document", {"planned": values["text_tokens"]}, True),
        ("sequence forward cost per module (s)", {"encoder": values["encoder_s"], "backbone": values["backbone_s"],
                                                  "generator": values["generator_s"]}, True),
        ("DP imbalance per step (max/mean rank load)", {"arrival order": values["step_arrival_imbalance"],
                                                        planner: values["step_imbalance"]}, False),
        ("simulated 1F1B iteration / lower bound, per step", {"arrival order": values["step_arrival_over_bound"],
                                                              planner: values["step_planned_over_bound"]}, False),
    ]
    for ax, (title, groups, log) in zip(axes, panels):
        _histogram(ax, title, groups, log)
    job = stats["job"]
    figure.suptitle(f"inspect: {job['what']}, {stats['samples']['planned']} samples planned, seq_len {job['seq_len']}, "
                    f"{job['dp_size']} DP ranks x {job['num_microbatches']} microbatches, planner {planner}")
    figure.savefig(path, format="png")


def _histogram(ax, title: str, groups: dict[str, np.ndarray], log: bool) -> None:
    ax.set_title(title, fontsize=10)
    counts = {name: len(v) for name, v in groups.items()}
    groups = {name: np.asarray(v, dtype=float) for name, v in groups.items()}
    groups = {name: v[v > 0] if log else v for name, v in groups.items()}  # a log axis has no zero
    groups = {name: v for name, v in groups.items() if len(v)}
    if not groups:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    low = min(float(v.min()) for v in groups.values())
    high = max(float(v.max()) for v in groups.values())
    if high <= low:
        high = low + max(abs(low) * 0.01, 1e-9)
    bins = np.geomspace(low, high, 41) if log else np.linspace(low, high, 41)
    for name, v in groups.items():
        shown = f"n={len(v)}" if len(v) == counts[name] else f"n={len(v)} > 0 of {counts[name]}"
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{name} ({shown})")
    if log:
        ax.set_xscale("log")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)
