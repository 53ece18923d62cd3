"""Error and range statistics for comparing FP8 results with high precision.

These are the package's one definition of SQNR and relative error; the test
suite's tolerance helpers use them too.
"""

from __future__ import annotations

import math

import torch

from transformer_linear import reference


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


def range_stats(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> dict[str, float]:
    """How a high-precision tensor fares when cast to ``dtype`` with ``scale``.

    Returns:
        ``{"amax", "scale", "underflow", "saturation"}``: underflow is the
        fraction of non-zero elements that the cast flushes to zero;
        saturation the fraction whose scaled magnitude exceeds the format's
        max (they are clamped there).
    """
    x = x.detach().float()
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    n = x.numel()
    if n == 0:
        return {"amax": 0.0, "scale": float(scale_t), "underflow": 0.0, "saturation": 0.0}
    q, _ = reference.quantize(x, scale_t, dtype)
    nonzero = x != 0
    underflow = ((q.float() == 0) & nonzero).sum().item() / n
    # Strictly beyond (with a float32 rounding's slack): under current scaling
    # the amax element itself lands on max, give or take an ulp.
    saturation = ((x * scale_t).abs() > reference.fp8_max(dtype) * (1 + 2**-20)).sum().item() / n
    return {
        "amax": float(reference.amax(x)),
        "scale": float(scale_t),
        "underflow": underflow,
        "saturation": saturation,
    }
