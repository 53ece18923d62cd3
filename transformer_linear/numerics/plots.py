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
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in report.loss_curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("FP8 recipes vs reference: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
