"""The verdict of ``transformer-linear compare``: FP8's loss gap judged against a noise floor.

A run's gap is its final loss (mean of the last ``window`` steps) relative
to the fp32 reference's, on the same batches from the same init. The noise
floor is the largest |gap| of the high-precision runs beside the reference
that no one would call broken: a bf16 autocast run, and reference runs whose
initial weights are perturbed by the size of one bf16 rounding (seeds). An
FP8 run passes when

    |gap| <= max(max_gap, noise_factor * floor)

so a noisy comparison (a short run, a small batch) does not fail FP8 for
noise that high precision shows too, and a quiet one is held to ``max_gap``.

A ``+filter`` run (the risky layers kept in high precision) is judged the
same way, and its effect by the same margin: it helped when its |gap| is
smaller than the recipe's by more than ``noise_factor * floor`` (the
comparison's resolution), it hurt when larger by more than that, and
otherwise the two runs are indistinguishable from noise. Only a filter that
helped is suggested.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from transformer_linear.numerics.report import TrainReport

__all__ = ["FILTERED", "FilterEffect", "Gate", "RunVerdict", "Verdict", "bf16_is_fast", "floor_runs", "judge"]

FILTERED = " +filter"
"""Suffix of the runs that keep the risky layers in high precision."""

NOISE_FLOOR_CHOICES = ("auto", "bf16", "seeds", "none")


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls run at least as fast as fp32 here: a CUDA GPU with bf16, or a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    cpu = getattr(torch._C, "_cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if cpu is not None and all(hasattr(cpu, p) for p in probes):
        return any(getattr(cpu, p)() for p in probes)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


@dataclass(frozen=True)
class FloorRun:
    """A high-precision run beside the reference that measures the noise floor."""

    label: str
    autocast_dtype: Optional[torch.dtype] = None
    perturb_seed: Optional[int] = None


def floor_runs(noise_floor: str, seeds: int, device: torch.device) -> tuple[list[FloorRun], str]:
    """The noise-floor runs for ``--noise-floor`` and ``--seeds``, and a sentence saying which and why.

    ``auto``: a bf16 autocast run where :func:`bf16_is_fast`, else one
    perturbed-init reference run (seed 1); ``seeds`` additional perturbed
    runs come on top (``seeds`` counts the reference itself).
    """
    if noise_floor not in NOISE_FLOOR_CHOICES:
        raise ValueError(f"noise_floor: expected one of {', '.join(NOISE_FLOOR_CHOICES)}, got {noise_floor!r}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds: expected a positive integer, got {seeds!r}")
    fast = bf16_is_fast(device)
    bf16 = noise_floor == "bf16" or (noise_floor == "auto" and fast)
    n_seeds = seeds - 1
    if noise_floor in ("auto", "seeds") and not bf16:
        n_seeds = max(n_seeds, 1)
    runs = [FloorRun("bf16 autocast", autocast_dtype=torch.bfloat16)] if bf16 else []
    runs += [FloorRun(f"fp32 init perturbed (seed {s})", perturb_seed=s) for s in range(1, n_seeds + 1)]
    if noise_floor == "none" and not runs:
        return [], "no noise floor (--noise-floor none): the gate is --max-gap alone"
    parts = []
    if bf16:
        why = "" if noise_floor == "bf16" else f" ({device.type} runs bf16 natively)"
        parts.append(f"a bf16 autocast run{why}")
    if n_seeds:
        why = f" (bf16 is slow on this {device.type}, so the floor is a perturbed-init run)" if noise_floor == "auto" and not fast else ""
        parts.append(f"{n_seeds} fp32 run(s) from the init perturbed by the size of one bf16 rounding{why}")
    return runs, "noise floor: " + " and ".join(parts)


@dataclass(frozen=True)
class Gate:
    """The pass rule: ``|gap| <= max(max_gap, noise_factor * floor)``.

    Attributes:
        max_gap: the allowed relative loss gap either way (0.01 is 1%).
        noise_factor: how many times the noise floor a gap may reach.
    """

    max_gap: float = 0.01
    noise_factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_gap", "noise_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"Gate: '{name}' must be a finite non-negative number, got {value!r}")


class FilterEffect(str, enum.Enum):
    """What keeping the risky layers in high precision did to a recipe's |gap|, judged against the noise."""

    HELPED = "helped"
    HURT = "hurt"
    WITHIN_NOISE = "within noise"


@dataclass(frozen=True)
class RunVerdict:
    """One FP8 run judged: its gap, and whether it passes."""

    run: str
    gap: float
    passed: bool


@dataclass
class Verdict:
    """Every FP8 run judged against the gate.

    Attributes:
        floor: the noise floor: the largest |gap| of the floor runs (0 without any).
        floor_gaps: each floor run's gap.
        allowed: the |gap| an FP8 run may reach.
        recipes: each recipe as converted.
        filtered: each recipe with its risky layers kept in high precision (its ``+filter`` run), when there is one.
        exit_code: 0 every recipe passes as converted; 3 each failing recipe
            passes with the filter, which helped it beyond the noise (apply
            it); 1 some recipe fails (with its filter too, or the filter did
            not measurably help, or there is none).
    """

    gate: Gate
    floor: float
    floor_gaps: dict[str, float]
    allowed: float
    recipes: dict[str, RunVerdict]
    filtered: dict[str, RunVerdict] = field(default_factory=dict)

    @property
    def resolution(self) -> float:
        """The smallest change of |gap| this comparison resolves: ``noise_factor x floor`` (the gate's margin)."""
        return self.gate.noise_factor * self.floor

    @property
    def exit_code(self) -> int:
        failing = [r for r, v in self.recipes.items() if not v.passed]
        if not failing:
            return 0
        fixed = all(r in self.filtered and self.filtered[r].passed and self.filter_helped(r) for r in failing)
        return 3 if fixed else 1

    def filter_effect(self, recipe: str) -> Optional[FilterEffect]:
        """What the ``+filter`` run did to ``recipe``'s |gap|, beyond :attr:`resolution` (None without a +filter run)."""
        if recipe not in self.filtered:
            return None
        before, after = abs(self.recipes[recipe].gap), abs(self.filtered[recipe].gap)
        if not math.isfinite(after):
            return FilterEffect.HURT if math.isfinite(before) else FilterEffect.WITHIN_NOISE
        if not math.isfinite(before) or before - after > self.resolution:
            return FilterEffect.HELPED
        if after - before > self.resolution:
            return FilterEffect.HURT
        return FilterEffect.WITHIN_NOISE

    def filter_helped(self, recipe: str) -> Optional[bool]:
        """Whether the +filter run's |gap| is smaller than the recipe's by more than the noise resolves
        (None without a +filter run)."""
        effect = self.filter_effect(recipe)
        return None if effect is None else effect is FilterEffect.HELPED

    @property
    def filter_suggested_for(self) -> list[str]:
        """The recipes whose +filter run helped: the filter is suggested for these (and only these)."""
        return [r for r in self.filtered if self.filter_helped(r)]

    def _effect_words(self, recipe: str) -> str:
        effect = self.filter_effect(recipe)
        change = abs(self.filtered[recipe].gap) - abs(self.recipes[recipe].gap)
        margin = f"{self.gate.noise_factor:g} x noise floor = {100 * self.resolution:.4f}%"
        if effect is FilterEffect.HELPED:
            return f"the filter helped: |gap| {100 * change:+.4f}%, beyond {margin}"
        if effect is FilterEffect.HURT:
            return f"the filter made it worse: |gap| {100 * change:+.4f}%, beyond {margin}; not suggested"
        return f"no measurable effect: |gap| {100 * change:+.4f}%, within {margin}; not suggested"

    def lines(self) -> list[str]:
        """The verdict in words, one line per recipe, then the rule."""
        out = []
        for recipe, v in self.recipes.items():
            line = f"{recipe}: gap {100 * v.gap:+.2f}% {'PASS' if v.passed else 'FAIL'}"
            if recipe in self.filtered:
                f = self.filtered[recipe]
                line += f"; with the filter {100 * f.gap:+.2f}% {'PASS' if f.passed else 'FAIL'} ({self._effect_words(recipe)})"
            out.append(line)
        floor = ", ".join(f"{n} {100 * g:+.2f}%" for n, g in self.floor_gaps.items()) or "none"
        out.append(
            f"rule: |gap| <= max(--max-gap {100 * self.gate.max_gap:g}%, {self.gate.noise_factor:g} x noise floor "
            f"{100 * self.floor:.2f}%) = {100 * self.allowed:.2f}%  (floor runs: {floor})"
        )
        if self.floor > self.gate.max_gap:
            out.append(
                "the noise floor exceeds --max-gap: this comparison cannot resolve a gap that small "
                "(more --steps, a larger batch or --seeds narrow it)"
            )
        return out

    def to_dict(self) -> dict:
        return {
            "rule": "|gap| <= max(max_gap, noise_factor * floor)",
            "max_gap": self.gate.max_gap,
            "noise_factor": self.gate.noise_factor,
            "floor": self.floor,
            "floor_gaps": self.floor_gaps,
            "allowed": self.allowed,
            "recipes": {r: {"gap": v.gap, "passed": v.passed} for r, v in self.recipes.items()},
            "resolution": self.resolution,
            "filtered": {
                r: {"gap": v.gap, "passed": v.passed, "helped": self.filter_helped(r), "effect": self.filter_effect(r).value}
                for r, v in self.filtered.items()
            },
            "filter_suggested_for": self.filter_suggested_for,
            "exit_code": self.exit_code,
        }


def judge(train: TrainReport, recipes: list[str], gate: Gate) -> Verdict:
    """Judge each recipe's run (and its ``+filter`` run, when ``train`` has one) against ``gate``."""
    gaps = train.loss_gap()
    floor_gaps = {n: gaps[n] for n in train.floor_runs if n in gaps}
    floor = max((abs(g) for g in floor_gaps.values() if math.isfinite(g)), default=0.0)
    allowed = max(gate.max_gap, gate.noise_factor * floor)

    def run(name: str) -> RunVerdict:
        gap = gaps[name]
        return RunVerdict(name, gap, math.isfinite(gap) and abs(gap) <= allowed)

    filtered = {r: run(r + FILTERED) for r in recipes if r + FILTERED in gaps}
    return Verdict(gate, floor, floor_gaps, allowed, {r: run(r) for r in recipes if r in gaps}, filtered)
