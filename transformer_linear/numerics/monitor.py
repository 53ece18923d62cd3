"""FP8 health monitoring during training: ``tl.numerics.monitor``.

    mon = tl.numerics.monitor(model, every=100, log_dir="fp8_logs")
    for batch in data:
        loss = model(batch).sum(); loss.backward(); opt.step()
        mon.step()                      # once per training step, outside any compiled region
    mon.close()                         # or use it as a context manager

Every ``every`` steps the forward hooks keep a sample of each ``tl.Linear``'s
input and output (the first ``sample_rows`` rows) and the input's amax;
``step()`` then computes, outside the model, per layer: amax, scale,
underflow and saturation of the input (on the sample) and of the weight, and
the SQNR of the layer's FP8 output against a float64 recompute of the same
rows. Between recording steps the hooks only test a flag. Under
``torch.compile`` the flag is a guarded Python attribute: the model compiles
once recording and once not (no graph breaks).
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.convert import linear_weight
from transformer_linear.modules.linear import Linear
from transformer_linear.numerics import plots
from transformer_linear.numerics.risk import RiskThresholds
from transformer_linear.numerics.stats import quantizer_range_stats, sqnr
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import TensorQuantizer, quantization_spec
from transformer_linear.recipe.scaling import FP8_STATE_COLUMNS

__all__ = ["FP8HealthWarning", "METRICS", "monitor"]

METRICS = (
    "input_amax",
    "input_scale",
    "input_underflow",
    "input_saturation",
    "weight_amax",
    "weight_scale",
    "weight_underflow",
    "weight_saturation",
    "output_sqnr_db",
)
"""Columns of every record (besides step, layer and recipe); underflow and saturation are fractions."""


class FP8HealthWarning(UserWarning):
    """A layer crossed a :class:`RiskThresholds` limit (issued once per layer)."""


class _Flag:
    """The hooks' switch; an object attribute so Dynamo guards on it instead of breaking the graph."""

    recording: bool = True


class monitor:  # noqa: N801 (used like a function / context manager, as torch.no_grad)
    """Record per-layer FP8 statistics of ``model`` every ``every`` steps.

    Args:
        model: a model holding ``tl.Linear`` layers (convert it first).
        every: record on steps 0, every, 2*every, ... (counted by :meth:`step`).
        log_dir: where ``metrics.jsonl``, ``metrics.csv`` and (when the
            ``tensorboard`` package is installed) TensorBoard events go;
            None keeps the records in :attr:`records` only.
        sample_rows: rows of each layer's input and output kept per recording
            (bounds the cost of the float64 recompute).
        recipe: the recipe of layers without their own, when ``step()`` is
            called outside ``tl.autocast``; layers with no recipe at all run
            in high precision and are not recorded.
        thresholds: when to warn (once per layer).
        tensorboard: False to skip TensorBoard even when installed.

    Raises:
        ValueError: no ``tl.Linear`` layers in ``model``, or ``every`` / ``sample_rows`` below 1.
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 100,
        log_dir: Optional[str | Path] = None,
        sample_rows: int = 256,
        recipe: Optional[Recipe] = None,
        thresholds: RiskThresholds = RiskThresholds(),
        tensorboard: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"monitor: 'model' must be an nn.Module, got {type(model).__name__}")
        for name, value in (("every", every), ("sample_rows", sample_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"monitor: '{name}' must be a positive integer, got {value!r}")
        self.layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Linear)}
        if not self.layers:
            raise ValueError(f"monitor: the model ({type(model).__name__}) has no tl.Linear layers; convert_to_fp8 it first")
        self.every, self.sample_rows, self.recipe, self.thresholds = every, sample_rows, recipe, thresholds
        self.records: list[dict[str, Any]] = []
        self.steps = 0
        self._flag = _Flag()
        self._captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._warned: set[str] = set()
        self._handles = [m.register_forward_hook(self._hook(fqn)) for fqn, m in self.layers.items()]
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._jsonl = self._csv = self._tb = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a")
            csv_path = self.log_dir / "metrics.csv"
            header = not csv_path.exists() or csv_path.stat().st_size == 0
            self._csv_file = open(csv_path, "a", newline="")
            self._csv = csv.DictWriter(self._csv_file, fieldnames=("step", "layer", "recipe", *METRICS))
            if header:
                self._csv.writeheader()
            if tensorboard:
                self._tb = _tensorboard_writer(self.log_dir)

    def _hook(self, fqn: str):
        flag, captured, rows = self._flag, self._captured, self.sample_rows

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if flag.recording:
                x = args[0].detach()
                captured[fqn] = (
                    x.reshape(-1, x.shape[-1])[:rows],
                    output.detach().reshape(-1, output.shape[-1])[:rows],
                    x.abs().amax(),
                )

        return hook

    @property
    def recording(self) -> bool:
        """Whether the coming step's forwards are sampled."""
        return self._flag.recording

    def step(self) -> list[dict[str, Any]]:
        """End one training step: write the records of a sampled step; returns them (empty otherwise)."""
        records = [self._record(fqn, *self._captured[fqn]) for fqn in self.layers if fqn in self._captured]
        records = [r for r in records if r is not None]
        self._captured.clear()
        for r in records:
            self._write(r)
        self.steps += 1
        self._flag.recording = self.steps % self.every == 0
        return records

    @torch.no_grad()
    def _record(self, fqn: str, x: torch.Tensor, y: torch.Tensor, x_amax: torch.Tensor) -> Optional[dict[str, Any]]:
        layer = self.layers[fqn]
        recipe = layer_recipe(layer.recipe) or self.recipe
        if recipe is None:
            return None  # the layer ran in high precision
        spec = quantization_spec(recipe)
        w = linear_weight(layer).detach()  # (out, in), Conv1DLinear included
        x_scale = _history_scale(layer, spec.input, "input")
        w_scale = _history_scale(layer, spec.weight, "weight")
        xs = quantizer_range_stats(x.reshape(-1, x.shape[-1]), spec.input, x_scale)
        ws = quantizer_range_stats(w, spec.weight, w_scale)
        bias = layer.bias.detach().double() if layer.bias is not None else None
        exact = F.linear(x.double(), w.double(), bias)
        record: dict[str, Any] = {"step": self.steps, "layer": fqn, "recipe": type(recipe).__name__}
        record.update({f"input_{k}": v for k, v in xs.items()})
        record.update({f"weight_{k}": v for k, v in ws.items()})
        record["input_amax"] = float(x_amax)
        record["output_sqnr_db"] = sqnr(y, exact)
        self._warn(record)
        return record

    def _warn(self, r: dict[str, Any]) -> None:
        t = self.thresholds
        crossed = []
        if r["output_sqnr_db"] < t.min_output_sqnr_db:
            crossed.append(f"output SQNR {r['output_sqnr_db']:.1f} dB < {t.min_output_sqnr_db:g}")
        for k in ("input", "weight"):
            if r[f"{k}_saturation"] > t.max_saturation:
                crossed.append(f"{k} saturation {100 * r[f'{k}_saturation']:.2f}% > {100 * t.max_saturation:g}%")
        if r["input_underflow"] > t.max_underflow:
            crossed.append(f"input underflow {100 * r['input_underflow']:.2f}% > {100 * t.max_underflow:g}%")
        if crossed and r["layer"] not in self._warned:
            self._warned.add(r["layer"])
            warnings.warn(f"FP8 layer {r['layer']} at step {r['step']}: {'; '.join(crossed)}", FP8HealthWarning, stacklevel=3)

    def _write(self, r: dict[str, Any]) -> None:
        self.records.append(r)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in r.items()}) + "\n")
            self._jsonl.flush()
            self._csv.writerow(r)
            self._csv_file.flush()
        if self._tb is not None:
            for k in METRICS:
                if math.isfinite(r[k]):
                    self._tb.add_scalar(f"{r['layer']}/{k}", r[k], r["step"])

    def close(self) -> None:
        """Remove the hooks and close the log files."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for f in (self._jsonl, getattr(self, "_csv_file", None), self._tb):
            if f is not None:
                f.close()
        self._jsonl = self._csv = self._tb = None

    def __enter__(self) -> "monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _history_scale(layer: nn.Module, quantizer: TensorQuantizer, column: str) -> Optional[torch.Tensor]:
    """The scale the last forward of ``layer`` used for its ``column`` ("input" or "weight") where it comes
    from the amax history; None elsewhere: the quantizer's kind computes the scales from the tensor (one
    from its amax, or one per block: ScalingKind.range_stats)."""
    used = getattr(layer, "fp8_fwd_scale", None)
    if quantizer.scale_from_history and used is not None:
        return used[FP8_STATE_COLUMNS[column]]  # the scales the last forward quantized with
    return None


def _tensorboard_writer(log_dir: Path):
    """A SummaryWriter when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: JSONL and CSV are always written
        return None
    return SummaryWriter(str(log_dir))


def load_records(log_dir: str | Path) -> list[dict[str, Any]]:
    """The records a monitor wrote to ``log_dir/metrics.jsonl``."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found (is {log_dir} a monitor log_dir?)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records")
    return [{k: (float(v) if k in METRICS else v) for k, v in r.items()} for r in records]


def monitor_report(log_dir: str | Path, out: Optional[str | Path] = None) -> list[Path]:
    """Plot the time series a monitor wrote to ``log_dir`` as PNGs (into ``out``, default ``log_dir``)."""
    records = load_records(log_dir)
    out = Path(out) if out is not None else Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plots.monitor_series(records, out / "monitor.png")]
