"""Error and range statistics for comparing FP8 results with high precision.

These are the package's one definition of SQNR and relative error; the test
suite's tolerance helpers use them too.
"""

from __future__ import annotations

import math

import torch

from transformer_linear.recipe.kind_tensorwise import range_stats
from transformer_linear.recipe.quantization import TensorQuantizer

__all__ = ["max_relative_error", "quantizer_range_stats", "range_stats", "sqnr"]


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||expected|| / ||actual - expected||).

    ``inf`` when the two are identical; ``-inf`` when ``expected`` is all
    zeros but ``actual`` is not; ``nan`` when either holds a non-finite value.
    """
    ref = expected.detach().double().cpu()
    act = actual.detach().double().cpu()
    if not (torch.isfinite(ref).all() and torch.isfinite(act).all()):
        return math.nan
    noise = (act - ref).norm().item()
    if noise == 0.0:
        return math.inf
    signal = ref.norm().item()
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when identical, inf for a zero reference).

    Normalising by the largest reference magnitude, not elementwise, keeps
    the figure meaningful where the reference crosses zero.
    """
    ref = expected.detach().double().cpu()
    act = actual.detach().double().cpu()
    if ref.numel() == 0:
        return 0.0
    diff = (act - ref).abs().max().item()
    scale = ref.abs().max().item()
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def quantizer_range_stats(
    x: torch.Tensor, quantizer: TensorQuantizer, scale: torch.Tensor | float | None
) -> dict[str, float]:
    """amax, scale, underflow and saturation of ``x`` as ``quantizer`` casts it, rowwise (its scaling kind's
    ScalingKind.range_stats): with ``scale`` where one scale covers the tensor (None: from ``x``'s amax), else
    with its own block scales (``scale`` unused)."""
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale))
    return quantizer.range_stats(x, scale)
