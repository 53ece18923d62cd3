"""Error and range statistics for comparing FP8 results with high precision.

These are the package's one definition of SQNR and relative error; the test
suite's tolerance helpers use them too.
"""

from __future__ import annotations

import math

import torch

from transformer_linear import reference
from transformer_linear.recipe.quantization import TensorQuantizer
from transformer_linear.reference import nvfp4 as nvfp4_reference


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


def block_range_stats(
    x: torch.Tensor, dtype: torch.dtype, block_shape: tuple[int, int], scale_dtype: torch.dtype, power_2_scale: bool
) -> dict[str, float]:
    """:func:`range_stats` of a 2-D tensor under block scaling (reference.quantize_blockwise_ref).

    ``scale`` is the smallest block scale (the block with the largest amax); a
    block's scale comes from its own amax and is never rounded up, so nothing
    saturates, and underflow counts the elements flushed within their block.
    """
    x = x.detach().float().reshape(-1, x.shape[-1])
    q, scale_inv = reference.quantize_blockwise_ref(x, dtype, block_shape, scale_dtype, power_2_scale)
    scale_inv = reference.e8m0_to_float(scale_inv) if scale_inv.dtype == reference.E8M0_DTYPE else scale_inv
    n = x.numel()
    underflow = ((q.float() == 0) & (x != 0)).sum().item() / n if n else 0.0
    return {
        "amax": float(reference.amax(x)) if n else 0.0,
        "scale": float(1 / scale_inv.max()) if n else 1.0,
        "underflow": underflow,
        "saturation": 0.0,
    }


def nvfp4_range_stats(x: torch.Tensor, scaling_2d: bool) -> dict[str, float]:
    """:func:`range_stats` of a 2-D tensor quantized to NVFP4, rowwise (reference.nvfp4.quantize_nvfp4).

    ``scale`` is the smallest effective scale, 1 / (largest block decode scale x global decode scale);
    nothing saturates (the global scale maps the amax onto E4M3's and E2M1's maxima); underflow counts
    the elements rounded to zero within their block.
    """
    x = x.detach().float().reshape(-1, x.shape[-1])
    n = x.numel()
    if n == 0:
        return {"amax": 0.0, "scale": 1.0, "underflow": 0.0, "saturation": 0.0}
    amax = reference.amax(x)
    q = nvfp4_reference.quantize_nvfp4(x, amax, scaling_2d=scaling_2d)
    codes = nvfp4_reference.unpack_e2m1(q.data)
    underflow = (((codes & 7) == 0) & (x != 0)).sum().item() / n
    return {
        "amax": float(amax),
        "scale": float(1 / (q.scale.float().max() * q.global_scale)),
        "underflow": underflow,
        "saturation": 0.0,
    }


def quantizer_range_stats(
    x: torch.Tensor, quantizer: TensorQuantizer, scale: torch.Tensor | float | None
) -> dict[str, float]:
    """:func:`range_stats` of ``x`` as ``quantizer`` casts it: with ``scale`` when it is tensorwise,
    else with its own block scales (:func:`block_range_stats`, the rowwise layout; ``scale`` unused)."""
    if quantizer.is_nvfp4:
        return nvfp4_range_stats(x, quantizer.block_shape == [16, 16])
    if quantizer.blockwise:
        block = quantizer.block_for(x.shape[-1])
        return block_range_stats(x, quantizer.dtype, block, quantizer.scale_dtype, quantizer.power_2_scale)
    return range_stats(x, quantizer.dtype, scale)


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
