"""Result objects of the numerics comparison: tables, dicts/JSON, plots."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from transformer_linear.numerics import plots


SQNR_DIGITS = 1
"""Decimals of an SQNR (dB) in the tables and the risk reasons; risk is judged on the value so shown."""
SATURATION_DIGITS = 2
"""Decimals of a saturation percentage in the tables and the risk reasons."""
UNDERFLOW_DIGITS = 3
"""Decimals of an underflow percentage in the tables and the risk reasons."""


def shown(value: float, digits: int) -> float:
    """``value`` as a table shows it (rounded to ``digits`` decimals), so a judgement on it never contradicts the
    table: 9.96 dB shows as 10.0 and is not below 10."""
    return float(f"{value:.{digits}f}") if math.isfinite(value) else value


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


MIN_EXPERT_TOKENS = 16
"""An expert that received fewer tokens than this in an observed step is flagged ``too_few_tokens``: its
SQNRs come from too few rows to judge (numerics/experts.py)."""


@dataclass
class ExpertStats:
    """One expert of a mixture-of-experts projection under one recipe: its own FP8 error.

    ``output_sqnr`` and ``dgrad_sqnr`` cover the expert's rows of the grouped output and input gradient,
    ``wgrad_sqnr`` its weight's gradient, each against high precision on the same input and grad_output
    (dB; NaN for an expert without tokens). ``too_few_tokens``: fewer than the comparison's
    ``min_expert_tokens`` (default :data:`MIN_EXPERT_TOKENS`) tokens, too few to judge. A row that sums up
    several steps (:func:`worst_experts`) holds the median ``tokens``, the number of ``steps`` and of
    ``judged_steps`` (those with enough tokens, where the SQNRs come from).
    """

    expert: int
    tokens: int
    output_sqnr: float
    dgrad_sqnr: float
    wgrad_sqnr: float
    too_few_tokens: bool = False
    steps: int = 1
    judged_steps: Optional[int] = None

    SQNR_FIELDS = ("output_sqnr", "dgrad_sqnr", "wgrad_sqnr")

    def __post_init__(self) -> None:
        if self.judged_steps is None:  # one observation: judged unless too few tokens
            self.judged_steps = 0 if self.too_few_tokens else self.steps


def _nanmin(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


def worst_experts(observations: Sequence[Sequence[ExpertStats]]) -> list[ExpertStats]:
    """Per expert, the worst figures over several observations of one projection (one list per step).

    The SQNRs are the worst over the steps in which the expert had enough tokens to judge (over all steps
    when it never had); ``tokens`` is its median over the steps (its fewest would say 0 beside figures from
    steps where it had many); ``too_few_tokens`` holds when it had too few in every step.
    """
    by_expert: dict[int, list[ExpertStats]] = {}
    for step in observations:
        for e in step:
            by_expert.setdefault(e.expert, []).append(e)
    out = []
    for expert, group in sorted(by_expert.items()):
        enough = [e for e in group if not e.too_few_tokens]
        out.append(
            ExpertStats(
                expert,
                statistics.median_low(e.tokens for e in group),
                *(_nanmin([getattr(e, f) for e in enough or group]) for f in ExpertStats.SQNR_FIELDS),
                too_few_tokens=not enough,
                steps=sum(e.steps for e in group),
                judged_steps=sum(e.judged_steps for e in group),
            )
        )
    return out


@dataclass
class LayerStats:
    """One Linear layer under one recipe: its FP8 error and how its tensors fit the FP8 range.

    ``output_*``, ``dgrad_*`` and ``wgrad_*`` are the layer's own (isolated)
    error: its FP8 output, input gradient (dX) and weight gradient (dW)
    against the high-precision layer on the same input and grad_output
    (numerics/blame.py). ``e2e_*`` compare the same FP8 results with a
    high-precision pass of the whole model on the same weights and batch:
    the error of every FP8 layer upstream included. ``input``, ``weight``
    and ``grad_output`` hold amax, scale, underflow and saturation under the
    scales the run used (delayed scaling's from its own history). ``steps``
    are the training steps observed (a row that sums up several holds the
    worst figure of each). A mixture-of-experts projection (``<experts
    module>.gate_up_proj``, ...) is one row over all its experts, with one
    :class:`ExpertStats` per expert in ``experts`` (empty for Linear layers).
    ``stale_loss_db`` (delayed scaling only): per result (``output``,
    ``dgrad``, ``wgrad``) the dB its SQNR lost to scales from the amax
    history, against the scales the tensors' own amaxes give (positive:
    the stale scale was worse). A summary row also holds the ``median`` of
    each SQNR over its steps and the ``stale_step`` of the largest loss.
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
    e2e_output_sqnr: float = math.nan
    e2e_dgrad_sqnr: float = math.nan
    e2e_wgrad_sqnr: float = math.nan
    steps: list[int] = field(default_factory=list)
    experts: list[ExpertStats] = field(default_factory=list)
    stale_loss_db: dict[str, float] = field(default_factory=dict)
    median: dict[str, float] = field(default_factory=dict)
    stale_step: Optional[int] = None

    SQNR_FIELDS = ("output_sqnr", "dgrad_sqnr", "wgrad_sqnr", "e2e_output_sqnr", "e2e_dgrad_sqnr", "e2e_wgrad_sqnr")
    MAX_REL_FIELDS = ("output_max_rel", "dgrad_max_rel", "wgrad_max_rel")


_RESULT_LABELS = {"output": "out", "dgrad": "dX", "wgrad": "dW"}


def _stale_cell(s: LayerStats) -> str:
    """The most dB a result lost to delayed scaling's stale scales, which result and at which step
    (``12.3 dX@30``); ``-`` where the recipe keeps no history."""
    losses = {k: v for k, v in s.stale_loss_db.items() if not math.isnan(v)}
    if not losses:
        return "-"
    key = max(losses, key=losses.get)
    where = "" if s.stale_step is None else f"@{s.stale_step}"
    return f"{losses[key]:.{SQNR_DIGITS}f} {_RESULT_LABELS.get(key, key)}{where}"


@dataclass
class CompareReport:
    """Per-layer statistics of each FP8 recipe against high precision.

    Attributes:
        recipes: the recipes' labels.
        layers: one row per (recipe, layer).
        reference_loss: the high-precision loss.
        loss: each recipe's loss.
        loss_label: what the losses are (one step on the same weights, or
            the end of a training run).
        min_expert_tokens: experts with fewer tokens are flagged too few to
            judge (the per-expert table of mixture-of-experts projections).
    """

    recipes: list[str]
    layers: list[LayerStats]
    reference_loss: float
    loss: dict[str, float]
    loss_label: str = "loss of one step on the same weights and batch"
    min_expert_tokens: int = MIN_EXPERT_TOKENS

    def for_recipe(self, recipe: str) -> list[LayerStats]:
        return [s for s in self.layers if s.recipe == recipe]

    _COLUMNS = ("recipe", "layer", "out med", "out min", "dX med", "dX min", "dW med", "dW min", "stale dB",
                "e2e out dB", "out maxrel", "x amax", "w amax", "dy amax", "x uflow%", "dy uflow%", "sat%")

    def _rows(self) -> list[list[str]]:
        """The table's cells: one row per (recipe, layer)."""
        rows = []
        for s in self.layers:
            sat = max(s.input.get("saturation", 0.0), s.weight.get("saturation", 0.0), s.grad_output.get("saturation", 0.0))
            sqnrs = []
            for f in ("output_sqnr", "dgrad_sqnr", "wgrad_sqnr"):
                sqnrs += [_fmt(s.median.get(f, getattr(s, f)), SQNR_DIGITS), _fmt(getattr(s, f), SQNR_DIGITS)]
            rows.append([
                s.recipe, s.name, *sqnrs, _stale_cell(s), _fmt(s.e2e_output_sqnr, SQNR_DIGITS),
                _fmt(s.output_max_rel, 4),
                f"{s.input.get('amax', 0):.3g}", f"{s.weight.get('amax', 0):.3g}", f"{s.grad_output.get('amax', 0):.3g}",
                f"{100 * s.input.get('underflow', 0):.{UNDERFLOW_DIGITS}f}",
                f"{100 * s.grad_output.get('underflow', 0):.{UNDERFLOW_DIGITS}f}",
                f"{100 * sat:.{SATURATION_DIGITS}f}",
            ])
        return rows

    _EXPERT_COLUMNS = ("recipe", "projection", "expert", "tokens", "out dB", "dX dB", "dW dB", "judged")

    def _expert_rows(self) -> list[list[str]]:
        """The per-expert table's cells: one row per (recipe, projection, expert)."""
        rows = []
        for s in self.layers:
            for e in s.experts:
                if e.too_few_tokens:
                    judged = f"no: < {self.min_expert_tokens} tokens" + (" in every step" if e.steps > 1 else "")
                else:
                    judged = "yes" + (f": {e.judged_steps}/{e.steps} steps" if e.steps > 1 else "")
                rows.append([s.recipe, s.name, str(e.expert), str(e.tokens), _fmt(e.output_sqnr, SQNR_DIGITS),
                             _fmt(e.dgrad_sqnr, SQNR_DIGITS), _fmt(e.wgrad_sqnr, SQNR_DIGITS), judged])
        return rows

    def _experts_note(self) -> str:
        return (
            "Per expert of each mixture-of-experts projection: SQNR (dB) of its rows of the output and dX and of "
            f"its dW; experts with fewer than {self.min_expert_tokens} tokens are not judged (too few rows). Over "
            "several steps: tokens is the median per step, the SQNRs the worst over the steps judged."
        )

    def _loss_line(self) -> str:
        losses = ", ".join(f"{r} {_fmt(v, 5)}" for r, v in self.loss.items())
        return f"{self.loss_label}: high precision {_fmt(self.reference_loss, 5)}; {losses}"

    def table(self) -> str:
        """A fixed-width table: one row per (recipe, layer)."""
        rows = self._rows()
        widths = [max([22 if i < 2 else 7] + [len(self._COLUMNS[i])] + [len(r[i]) for r in rows]) for i in range(len(self._COLUMNS))]

        def line(cells):
            return " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        header = line(self._COLUMNS)
        out = [header, "-" * len(header), *(line(r) for r in rows), self._loss_line()]
        expert_rows = self._expert_rows()
        if expert_rows:
            cols = self._EXPERT_COLUMNS
            widths = [max([len(cols[i])] + [len(r[i]) for r in expert_rows]) for i in range(len(cols))]
            header = " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))
            out += ["", self._experts_note(), header, "-" * len(header)]
            out += [" ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                    for r in expert_rows]
        return "\n".join(out)

    def markdown(self) -> str:
        """The same table in markdown (for issues and pull requests)."""
        out = ["| " + " | ".join(self._COLUMNS) + " |", "|" + "---|" * 2 + "---:|" * (len(self._COLUMNS) - 2)]
        out += ["| " + " | ".join(r) + " |" for r in self._rows()]
        text = "\n".join(out) + "\n\n" + self._loss_line()
        expert_rows = self._expert_rows()
        if expert_rows:
            cols = self._EXPERT_COLUMNS
            table = ["| " + " | ".join(cols) + " |", "|" + "---|" * 2 + "---:|" * (len(cols) - 3) + "---|"]
            table += ["| " + " | ".join(r) + " |" for r in expert_rows]
            text += "\n\n" + self._experts_note() + "\n\n" + "\n".join(table)
        return text

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "recipes": self.recipes,
                "loss_label": self.loss_label,
                "reference_loss": self.reference_loss,
                "loss": self.loss,
                "min_expert_tokens": self.min_expert_tokens,
                "layers": [asdict(s) for s in self.layers],
            }
        )

    def to_json(self, path: Optional[str | Path] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    def plot(self, path: str | Path, thresholds: Any = None, risky: Optional[dict[str, list[str]]] = None,
             verdict: Any = None) -> Path:
        """Bar chart of per-layer output / dgrad / wgrad SQNR for each recipe, saved as PNG.

        Args:
            path: the PNG.
            thresholds: a :class:`~transformer_linear.numerics.RiskThresholds` whose SQNR limits are drawn.
            risky: layer name -> reasons; those layers are marked.
            verdict: a :class:`~transformer_linear.numerics.verdict.Verdict`: PASS / FAIL per recipe in the title.
        """
        return plots.sqnr_bars(self, Path(path), thresholds, risky or {}, verdict)


@dataclass
class TrainReport:
    """Loss curves of the reference, the noise-floor runs and each recipe, trained from the same init.

    Attributes:
        steps: optimizer steps per run.
        loss_curves: run label -> loss per step; the first is the reference.
        observations: recipe label -> per-layer statistics at each observed step of its own run.
        final: per (recipe, layer), the worst figures over that recipe's observed steps.
        floor_runs: labels of the high-precision runs that measure the noise floor.
        floor_note: how the floor was chosen (for reports).
        window: the final loss is the mean of the last ``window`` steps.
    """

    steps: int
    loss_curves: dict[str, list[float]]
    observations: dict[str, list[LayerStats]] = field(default_factory=dict)
    final: Optional[CompareReport] = None
    floor_runs: list[str] = field(default_factory=list)
    floor_note: str = ""
    window: int = 10

    @property
    def reference(self) -> str:
        return next(iter(self.loss_curves))

    @property
    def layer_history(self) -> dict[str, list[dict[str, Any]]]:
        """Recipe -> ``[{"step", "layers": {name: {"input", "weight", "grad_output"}}}]``: range statistics per observed step."""
        out: dict[str, list[dict[str, Any]]] = {}
        for label, rows in self.observations.items():
            by_step: dict[int, dict[str, Any]] = {}
            for s in rows:
                step = by_step.setdefault(s.steps[0], {"step": s.steps[0], "layers": {}})
                step["layers"][s.name] = {"input": s.input, "weight": s.weight, "grad_output": s.grad_output}
            out[label] = list(by_step.values())
        return out

    def final_loss(self, name: str, window: Optional[int] = None) -> float:
        """Mean loss over the last ``window`` steps (default :attr:`window`; smooths batch noise)."""
        curve = self.loss_curves[name][-(window or self.window):]
        return sum(curve) / len(curve)

    def loss_gap(self) -> dict[str, float]:
        """Relative final-loss gap of each run to the reference: (run - ref) / ref."""
        ref = self.final_loss(self.reference)
        return {n: (self.final_loss(n) - ref) / ref for n in self.loss_curves if n != self.reference}

    def summary(self) -> str:
        ref = self.reference
        width = max(26, *(len(n) + 1 for n in self.loss_curves))
        lines = [f"{'run':<{width}} {'final loss':>10} {'gap vs ' + ref:>16}"]
        gaps = self.loss_gap()
        for name in self.loss_curves:
            gap = "" if name == ref else f"{100 * gaps[name]:+.2f}%"
            note = "  (noise floor)" if name in self.floor_runs else ""
            lines.append(f"{name:<{width}} {self.final_loss(name):>10.4f} {gap:>16}{note}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(
            {
                "steps": self.steps,
                "window": self.window,
                "final_loss": {n: self.final_loss(n) for n in self.loss_curves},
                "loss_gap": self.loss_gap(),
                "floor_runs": self.floor_runs,
                "floor_note": self.floor_note,
                "loss_curves": self.loss_curves,
                "observations": {k: [asdict(s) for s in v] for k, v in self.observations.items()},
                "final_compare": self.final.to_dict() if self.final else None,
            }
        )

    def plot(self, path: str | Path, gate: Any = None, verdict: Any = None) -> Path:
        """Loss curves of every run and their gap to the reference, saved as PNG.

        Args:
            path: the PNG.
            gate: a :class:`~transformer_linear.numerics.verdict.Gate`: its ±max-gap band is drawn.
            verdict: a :class:`~transformer_linear.numerics.verdict.Verdict`: its ±allowed band is drawn and
                PASS / FAIL per recipe is the title.
        """
        return plots.loss_curves(self, Path(path), gate, verdict)
