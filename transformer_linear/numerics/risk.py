"""Which layers are risky in FP8, and the ``module_filter_fn`` that keeps them in high precision."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from torch import nn

from transformer_linear.numerics.report import SATURATION_DIGITS, SQNR_DIGITS, UNDERFLOW_DIGITS, CompareReport, LayerStats, shown

__all__ = ["RiskThresholds", "keep_high_precision", "risky_layers", "filter_source"]


@dataclass(frozen=True)
class RiskThresholds:
    """When a layer counts as risky in FP8 (any one criterion suffices).

    The defaults sit well below what healthy layers show: e4m3 outputs
    typically reach 25-30 dB SQNR and e5m2 gradients 17-25 dB, with well
    under 1% of elements saturated (delayed scaling clamps a few when
    gradients grow between steps) or flushed to zero.

    Attributes:
        min_output_sqnr_db: output SQNR below this is risky.
        min_grad_sqnr_db: input- or weight-gradient SQNR below this is risky.
        max_saturation: fraction of input, weight or grad_output elements clamped at the format's max.
        max_underflow: fraction of input or grad_output elements flushed to zero.
    """

    min_output_sqnr_db: float = 20.0
    min_grad_sqnr_db: float = 10.0
    max_saturation: float = 0.01
    max_underflow: float = 0.01

    def __post_init__(self) -> None:
        for name in ("min_output_sqnr_db", "min_grad_sqnr_db", "max_saturation", "max_underflow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"RiskThresholds: '{name}' must be a number, got {value!r}")
        for name in ("max_saturation", "max_underflow"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RiskThresholds: '{name}' must be a fraction in [0, 1], got {getattr(self, name)!r}")

    def reasons(self, s: LayerStats) -> list[str]:
        """Why ``s`` is risky (empty when it is not). NaN SQNR (no gradient recorded) counts as no evidence."""
        # Each figure is judged as the tables show it (report.shown), so no reason reads "10.0 dB < 10".
        out = []
        for label, value, limit in (("output", s.output_sqnr, self.min_output_sqnr_db),
                                    ("dX", s.dgrad_sqnr, self.min_grad_sqnr_db),
                                    ("dW", s.wgrad_sqnr, self.min_grad_sqnr_db)):
            if shown(value, SQNR_DIGITS) < limit:
                out.append(f"{label} SQNR {value:.{SQNR_DIGITS}f} dB < {limit:g}")
        for kind, digits, limit, tensors in (
            ("saturation", SATURATION_DIGITS, self.max_saturation, (("x", s.input), ("w", s.weight), ("dy", s.grad_output))),
            ("underflow", UNDERFLOW_DIGITS, self.max_underflow, (("x", s.input), ("dy", s.grad_output))),
        ):
            for label, stats in tensors:
                percent = 100 * stats.get(kind, 0.0)
                if shown(percent, digits) > 100 * limit:
                    out.append(f"{label} {kind} {percent:.{digits}f}% > {100 * limit:g}%")
        return out


def risky_layers(report: CompareReport, thresholds: RiskThresholds = RiskThresholds()) -> dict[str, list[str]]:
    """Layer name -> reasons, over every recipe in ``report`` (reasons prefixed by the recipe)."""
    risky: dict[str, list[str]] = {}
    for s in report.layers:
        for reason in thresholds.reasons(s):
            risky.setdefault(s.name, []).append(f"{s.recipe}: {reason}")
    return risky


def keep_high_precision(names: Iterable[str]) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` for ``convert_to_fp8`` that leaves the named layers in high precision.

    A mixture-of-experts projection (``model.layers.0.mlp.experts.down_proj``) keeps its experts module
    (``model.layers.0.mlp.experts``, the unit the filter sees) in high precision.
    """
    keep = frozenset(names)

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        return fqn not in keep and not any(name.startswith(fqn + ".") for name in keep)

    return module_filter_fn


def filter_source(names: Iterable[str]) -> str:
    """The suggested filter as Python source to paste next to ``convert_to_fp8``."""
    listed = "".join(f"    {n!r},\n" for n in sorted(names))
    return (
        f"KEEP_HIGH_PRECISION = {{\n{listed}}}\n"
        "tl.convert_to_fp8(model, recipe, module_filter_fn=tl.numerics.keep_high_precision(KEEP_HIGH_PRECISION))"
    )
