"""PNG plots of the numerics reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformer_linear.numerics.report import CompareReport, TrainReport

_CAP_DB = 120.0  # identical results have infinite SQNR; draw them at the cap


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sqnr_bars(report: "CompareReport", path: Path) -> Path:
    plt = _pyplot()
    names = [s.name for s in report.for_recipe(report.recipes[0])]
    quantities = (("output_sqnr", "output"), ("dgrad_sqnr", "input grad"), ("wgrad_sqnr", "weight grad"))
    fig, axes = plt.subplots(1, len(quantities), figsize=(5 * len(quantities), 0.35 * len(names) + 2), sharey=True)
    height = 0.8 / max(1, len(report.recipes))
    for ax, (attr, title) in zip(axes, quantities):
        for i, recipe in enumerate(report.recipes):
            values = [min(getattr(s, attr), _CAP_DB) for s in report.for_recipe(recipe)]
            ax.barh([j + i * height for j in range(len(names))], values, height=height, label=recipe)
        ax.set_title(f"{title} SQNR (dB, higher is better)")
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))])
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_curves(report: "TrainReport", path: Path) -> Path:
    """Left: every run's loss. Right: each recipe's loss relative to the reference, in percent."""
    plt = _pyplot()
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4))
    ref = report.loss_curves[report.reference]
    for name, curve in report.loss_curves.items():
        steps = range(1, len(curve) + 1)
        ax.plot(steps, curve, label=name, linewidth=1.2)
        if name != report.reference:
            gap_ax.plot(steps, [100.0 * (c - r) / r for c, r in zip(curve, ref)], label=name, linewidth=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("training loss")
    gap_ax.axhline(0.0, color="black", linewidth=0.8)
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel("% vs reference")
    gap_ax.set_title(f"loss relative to {report.reference} (lower is better)")
    for a in (ax, gap_ax):
        a.grid(alpha=0.3)
        a.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def monitor_series(records: list[dict], path: Path) -> Path:
    """Per-layer time series of a monitor's records: output SQNR, input amax, underflow and saturation."""
    plt = _pyplot()
    panels = (
        ("output_sqnr_db", "output SQNR (dB)", 1.0),
        ("input_amax", "input amax", 1.0),
        ("input_underflow", "input underflow (%)", 100.0),
        ("input_saturation", "input saturation (%)", 100.0),
    )
    layers = list(dict.fromkeys(r["layer"] for r in records))
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (key, title, factor) in zip(axes.flat, panels):
        for layer in layers:
            rows = [r for r in records if r["layer"] == layer]
            ax.plot([r["step"] for r in rows], [min(factor * r[key], _CAP_DB) for r in rows], label=layer, linewidth=1.0)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
