"""PNG plots of the numerics reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping, Optional, Protocol, Sequence


class LayerSQNRs(Protocol):
    """What :func:`sqnr_bars` reads of a report (``CompareReport``): the recipes and each one's layer rows."""

    recipes: Sequence[str]

    def for_recipe(self, recipe: str) -> Sequence[Any]: ...


class LossCurves(Protocol):
    """What :func:`loss_curves` reads of a report (``TrainReport``): each run's losses and which runs are
    the reference and the noise floor."""

    loss_curves: Mapping[str, Sequence[float]]
    reference: str
    floor_runs: Collection[str]
    window: int

_CAP_DB = 120.0  # identical results have infinite SQNR; draw them at the cap


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: list[str]) -> dict[str, str]:
    """One colour per run, the same in every panel; the reference black."""
    palette = [f"C{i}" for i in range(10)]
    return {n: ("black" if i == 0 else palette[(i - 1) % len(palette)]) for i, n in enumerate(names)}


def verdict_text(verdict) -> str:
    """The verdict in one line for a plot's title: each recipe PASS or FAIL with its gap, and the allowed gap."""
    if verdict is None:
        return ""
    runs = ", ".join(f"{r} {'PASS' if v.passed else 'FAIL'} ({100 * v.gap:+.2f}%)" for r, v in verdict.recipes.items())
    return f"verdict: {runs}; allowed |gap| {100 * verdict.allowed:.2f}%"


def sqnr_bars(report: LayerSQNRs, path: Path, thresholds=None, risky: Optional[dict] = None, verdict=None) -> Path:
    """Per-layer SQNR bars of each recipe (isolated error); each panel's own threshold line; risky layers in red
    with a '!'; the verdict (when given) in the title."""
    plt = _pyplot()
    risky = risky or {}
    names = [s.name for s in report.for_recipe(report.recipes[0])]
    quantities = (
        ("output_sqnr", "output", getattr(thresholds, "min_output_sqnr_db", None)),
        ("dgrad_sqnr", "input grad (dX)", getattr(thresholds, "min_grad_sqnr_db", None)),
        ("wgrad_sqnr", "weight grad (dW)", getattr(thresholds, "min_grad_sqnr_db", None)),
    )
    fig, axes = plt.subplots(1, len(quantities), figsize=(5 * len(quantities), 0.35 * len(names) + 2.6), sharey=True)
    height = 0.8 / max(1, len(report.recipes))
    colors = _colors(["reference", *report.recipes])
    for ax, (attr, title, limit) in zip(axes, quantities):
        for i, recipe in enumerate(report.recipes):
            by_name = {s.name: s for s in report.for_recipe(recipe)}
            values = [min(getattr(by_name[n], attr), _CAP_DB) if n in by_name else 0.0 for n in names]
            ax.barh([j + i * height for j in range(len(names))], values, height=height, label=recipe, color=colors[recipe])
        if limit is not None:
            # Each panel names its own line: the output's limit and the gradients' differ.
            ax.axvline(limit, color="red", linestyle="--", linewidth=1.0)
        title += " SQNR, dB (higher is better)" + ("" if limit is None else f"\nrisky below {limit:g} dB (red line)")
        ax.set_title(title, fontsize="medium")
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))])
        ax.set_yticklabels([f"! {n}" if n in risky else n for n in names])
        for label in ax.get_yticklabels():
            if label.get_text().startswith("! "):
                label.set_color("red")
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    title = "each layer's own FP8 error (worst over the observed training steps)"
    if risky:
        title += f"; ! = risky ({len(risky)})"
    if verdict is not None:
        title = f"{verdict_text(verdict)}\n{title}"
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small", frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def loss_curves(report: LossCurves, path: Path, gate=None, verdict=None) -> Path:
    """Left: every run's loss, the reference drawn on top. Right: each run's gap to the reference in percent,
    with the ±max-gap band, the ±allowed band (noise floor included) and the window the verdict averages."""
    plt = _pyplot()
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(report.loss_curves)
    colors = _colors(names)
    ref = report.loss_curves[report.reference]
    steps = len(ref)
    for name in names[1:]:
        curve = report.loss_curves[name]
        style = ":" if name in report.floor_runs else ("--" if "+filter" in name else "-")
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1.0, color=colors[name], linestyle=style, alpha=0.85)
        gap_ax.plot(range(1, len(curve) + 1), [100.0 * (c - r) / r for c, r in zip(curve, ref)], label=name,
                    linewidth=1.0, color=colors[name], linestyle=style)
    ax.plot(range(1, steps + 1), ref, label=f"{report.reference} (fp32)", linewidth=2.2, color="black", zorder=10)
    window_start = steps - report.window + 1
    for a in (ax, gap_ax):
        a.axvspan(window_start, steps, color="gold", alpha=0.2, label=f"verdict window (last {report.window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("training loss (same init, same batches)", fontsize="medium")
    gap_ax.axhline(0.0, color="black", linewidth=0.8)
    if gate is not None:
        gap_ax.axhspan(-100 * gate.max_gap, 100 * gate.max_gap, color="green", alpha=0.08, label=f"±max-gap {100 * gate.max_gap:g}%")
    if verdict is not None and verdict.allowed > (gate.max_gap if gate is not None else 0.0):
        for sign in (-1, 1):
            gap_ax.axhline(sign * 100 * verdict.allowed, color="green", linestyle="--", linewidth=0.8,
                           label=f"±allowed {100 * verdict.allowed:.2f}% (noise floor)" if sign > 0 else None)
    gap_ax.set_xlabel("step")
    gap_ax.set_ylabel("% vs reference (either sign counts)")
    gap_ax.set_title(f"loss relative to {report.reference}: closer to 0 is better", fontsize="medium")
    for a in (ax, gap_ax):
        a.grid(alpha=0.3)
    gap_ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if verdict is not None:
        fig.suptitle(verdict_text(verdict), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
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
