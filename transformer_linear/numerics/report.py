"""Result objects of the numerics comparison: tables, dicts/JSON, plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional


def _fmt(value: float, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}f}"


def _json_safe(obj: Any) -> Any:
    """JSON has no inf/NaN: write them as strings so the file parses everywhere."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


@dataclass
class LayerStats:
    """One Linear layer under one recipe, against the high-precision run.

    Errors are end to end: the layer's input already carries the error of
    the FP8 layers before it, as in training.
    """

    name: str
    recipe: str
    output_sqnr: float
    output_max_rel: float
    dgrad_sqnr: float
    dgrad_max_rel: float
    wgrad_sqnr: float
    wgrad_max_rel: float
    input: dict[str, float] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    grad_output: dict[str, float] = field(default_factory=dict)


@dataclass
class CompareReport:
    """Per-layer statistics of each FP8 recipe against the reference run."""

    recipes: list[str]
    layers: list[LayerStats]
    reference_loss: float
    loss: dict[str, float]

    def for_recipe(self, recipe: str) -> list[LayerStats]:
        return [s for s in self.layers if s.recipe == recipe]

    _COLUMNS = ("recipe", "layer", "out dB", "dX dB", "dW dB", "out maxrel", "x amax", "w amax", "dy amax",
                "x uflow%", "dy uflow%", "sat%")

    def _rows(self) -> list[list[str]]:
        """The table's cells: one row per (recipe, layer)."""
        rows = []
        for s in self.layers:
            sat = max(s.input.get("saturation", 0.0), s.weight.get("saturation", 0.0), s.grad_output.get("saturation", 0.0))
            rows.append([
                s.recipe, s.name, _fmt(s.output_sqnr), _fmt(s.dgrad_sqnr), _fmt(s.wgrad_sqnr), _fmt(s.output_max_rel, 4),
                f"{s.input.get('amax', 0):.3g}", f"{s.weight.get('amax', 0):.3g}", f"{s.grad_output.get('amax', 0):.3g}",
                f"{100 * s.input.get('underflow', 0):.3f}", f"{100 * s.grad_output.get('underflow', 0):.3f}",
                f"{100 * sat:.2f}",
            ])
        return rows

    def _loss_line(self) -> str:
        losses = ", ".join(f"{r}: {_fmt(v, 5)}" for r, v in self.loss.items())
        return f"loss: reference {_fmt(self.reference_loss, 5)}; {losses}"

    def table(self) -> str:
        """A fixed-width table: one row per (recipe, layer)."""
        rows = self._rows()
        widths = [max([22 if i < 2 else 7] + [len(self._COLUMNS[i])] + [len(r[i]) for r in rows]) for i in range(len(self._COLUMNS))]

        def line(cells):
            return " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        header = line(self._COLUMNS)
        return "\n".join([header, "-" * len(header), *(line(r) for r in rows), self._loss_line()])

    def markdown(self) -> str:
        """The same table in markdown (for issues and pull requests)."""
        out = ["| " + " | ".join(self._COLUMNS) + " |", "|" + "---|" * 2 + "---:|" * (len(self._COLUMNS) - 2)]
        out += ["| " + " | ".join(r) + " |" for r in self._rows()]
        return "\n".join(out) + "\n\n" + self._loss_line()

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "recipes": self.recipes,
                "reference_loss": self.reference_loss,
                "loss": self.loss,
                "layers": [asdict(s) for s in self.layers],
            }
        )

    def to_json(self, path: Optional[str | Path] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    def plot(self, path: str | Path) -> Path:
        """Bar chart of per-layer output / dgrad / wgrad SQNR for each recipe, saved as PNG."""
        from transformer_linear.numerics import plots

        return plots.sqnr_bars(self, Path(path))


@dataclass
class TrainReport:
    """Loss curves of the reference and each recipe trained from the same init."""

    steps: int
    loss_curves: dict[str, list[float]]
    layer_history: dict[str, list[dict[str, Any]]]
    final: Optional[CompareReport] = None

    @property
    def reference(self) -> str:
        return next(iter(self.loss_curves))

    def final_loss(self, name: str, window: int = 10) -> float:
        """Mean loss over the last ``window`` steps (smooths batch noise)."""
        curve = self.loss_curves[name][-window:]
        return sum(curve) / len(curve)

    def loss_gap(self) -> dict[str, float]:
        """Relative final-loss gap of each recipe to the reference: (recipe - ref) / ref."""
        ref = self.final_loss(self.reference)
        return {n: (self.final_loss(n) - ref) / ref for n in self.loss_curves if n != self.reference}

    def summary(self) -> str:
        ref = self.reference
        width = max(26, *(len(n) + 1 for n in self.loss_curves))
        lines = [f"{'run':<{width}} {'final loss':>10} {'gap vs ' + ref:>16}"]
        gaps = self.loss_gap()
        for name in self.loss_curves:
            gap = "" if name == ref else f"{100 * gaps[name]:+.2f}%"
            lines.append(f"{name:<{width}} {self.final_loss(name):>10.4f} {gap:>16}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "steps": self.steps,
                "final_loss": {n: self.final_loss(n) for n in self.loss_curves},
                "loss_gap": self.loss_gap(),
                "loss_curves": self.loss_curves,
                "layer_history": self.layer_history,
                "final_compare": self.final.to_dict() if self.final else None,
            }
        )

    def plot(self, path: str | Path) -> Path:
        """Loss curves of every run, saved as PNG."""
        from transformer_linear.numerics import plots

        return plots.loss_curves(self, Path(path))
