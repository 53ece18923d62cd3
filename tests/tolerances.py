"""The one place that decides whether a result is close enough.

Rules:
  * Quantize-family outputs are held bitwise to transformer_linear.reference:
    :func:`assert_bitwise_equal` reports the first mismatching index.
  * GEMMs and Linear results follow the flash-attention rule: the error of
    the result against a float64 reference may be at most
    ``ERROR_RATIO`` times the error that plain PyTorch makes on the same
    inputs at the same precision (the baseline), plus a floor of a few
    output-dtype ulps for results that are exact up to final rounding.
  * NVFP4 GEMMs: the same rule on the block-scaled (dequantized) operands,
    :func:`assert_nvfp4_gemm_close`.
  * Column sums (the bias gradient), whose float32 accumulation order is the kernel's own:
    :func:`assert_column_sums_close`, the error bound of any order of n - 1 float32 additions.
  * FP8-vs-high-precision comparisons (numerics of the Linear against
    torch.nn.Linear) use SQNR in dB: :func:`sqnr`.
"""

from __future__ import annotations

from typing import Optional

import torch

# The package's own definition of SQNR, so tests and the numerics report agree.
from transformer_linear.numerics.stats import sqnr  # noqa: F401

# Allowed ratio of the kernel's error to plain PyTorch's at the same precision.
ERROR_RATIO = 2.0
# Floor on the normwise relative error, per output dtype: a few ulps of the
# final rounding, which even an exact accumulation cannot avoid.
RELATIVE_ERROR_FLOOR = {
    torch.float32: 4 * 2.0**-24,
    torch.bfloat16: 4 * 2.0**-8,
    torch.float16: 4 * 2.0**-11,
}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.contiguous().view(view_dtype)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "", any_nan: bool = False) -> None:
    """Bit-for-bit equality; on failure names the first mismatching index and both values.

    With ``any_nan`` a NaN matches any NaN: sign and payload of a NaN are
    implementation-defined where torch itself is inconsistent (its scalar and
    vector dtype conversions treat them differently).
    """
    prefix = f"{what}: " if what else ""
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a_bits, e_bits = _as_bits(actual.cpu()), _as_bits(expected.cpu())
    differ = a_bits != e_bits
    if any_nan:
        differ &= ~(torch.isnan(actual.cpu().float()) & torch.isnan(expected.cpu().float()))
    mismatch = differ.flatten().nonzero()
    if mismatch.numel():
        flat = int(mismatch[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape)) if actual.dim() else ()
        a_val = actual.cpu().flatten()[flat].float().item()
        e_val = expected.cpu().flatten()[flat].float().item()
        raise AssertionError(
            f"{prefix}{mismatch.numel()} of {actual.numel()} elements differ; first at index {index}: "
            f"got {a_val!r} (bits {int(a_bits.flatten()[flat]):#x}), "
            f"expected {e_val!r} (bits {int(e_bits.flatten()[flat]):#x})"
        )


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Normwise relative error ||actual - reference|| / ||reference|| in float64."""
    ref = reference.double().cpu()
    diff = actual.double().cpu() - ref
    denom = ref.norm().item()
    if denom == 0.0:
        return diff.norm().item()
    return diff.norm().item() / denom


def assert_close_to_reference(
    actual: torch.Tensor,
    reference: torch.Tensor,
    baseline: Optional[torch.Tensor] = None,
    what: str = "",
) -> None:
    """Error of ``actual`` vs the float64 ``reference`` is within the package tolerance.

    Args:
        actual: the kernel's result.
        reference: the float64 (or exact) result.
        baseline: plain PyTorch's result at the kernel's precision (e.g. an
            fp32 ``torch.mm`` of the dequantized operands); its error sets the
            budget. Without it only the output-dtype floor applies.
        what: a label for the failure message.
    """
    prefix = f"{what}: " if what else ""
    assert actual.shape == reference.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual.double()).all() == torch.isfinite(reference.double()).all(), (
        f"{prefix}non-finite values differ from the reference"
    )
    if actual.numel() == 0:
        return
    err = relative_error(actual, reference)
    floor = RELATIVE_ERROR_FLOOR[actual.dtype]
    budget = floor
    if baseline is not None:
        budget = max(floor, ERROR_RATIO * relative_error(baseline, reference))
    assert err <= budget, f"{prefix}relative error {err:.3e} exceeds budget {budget:.3e}"


def assert_nvfp4_gemm_close(
    actual: torch.Tensor, a_values: torch.Tensor, b_values: torch.Tensor, alpha: float, bias: Optional[torch.Tensor] = None
) -> None:
    """NVFP4 GEMM tolerance: the flash-attention rule on the dequantized operands.

    ``a_values`` / ``b_values`` are the operands with their block scales applied
    (float32, exact: E2M1 times E4M3 always is) and ``alpha`` the product of the
    two global scales. The reference is their float64 product; the baseline is a
    plain float32 ``torch.mm`` of the same operands. Each 16-element K block sums
    exactly in float32, so the kernel's only rounding is the float32 sum over K
    blocks and the epilogue, well within ERROR_RATIO times the baseline's error.
    (The tests also hold it bitwise to reference.nvfp4.nvfp4_gemm, which sums the
    blocks in the kernel's order.)
    """
    def finish(acc: torch.Tensor) -> torch.Tensor:
        out = acc * alpha
        return out if bias is None else out + bias.to(out.dtype)

    reference = finish(a_values.double() @ b_values.double().T)
    baseline = finish(a_values.float() @ b_values.float().T).to(actual.dtype)
    assert_close_to_reference(actual, reference, baseline, what="nvfp4_gemm")


def assert_grouped_close_to_reference(
    actual: torch.Tensor,
    reference: torch.Tensor,
    baseline: Optional[torch.Tensor],
    bounds: list[tuple[int, int]],
    what: str = "",
) -> None:
    """Grouped GEMMs (one GEMM per group of rows, ops.grouped.fp8_grouped_gemm): the rule of
    :func:`assert_close_to_reference` applied to each group's rows on its own, so that a small
    group's error is not hidden by a large group's norm; rows past the last group (``bounds``:
    each group's (start, end)) must be exactly 0.
    """
    prefix = f"{what}: " if what else ""
    assert actual.shape == reference.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    for g, (start, end) in enumerate(bounds):
        assert_close_to_reference(
            actual[start:end], reference[start:end], None if baseline is None else baseline[start:end],
            what=f"{prefix}group {g} (rows {start}:{end})",
        )
    last = bounds[-1][1] if bounds else 0
    rest = actual[last:]
    assert torch.equal(rest, torch.zeros_like(rest)), f"{prefix}rows past the last group ({last}:) are not 0"


def assert_column_sums_close(actual: torch.Tensor, values: torch.Tensor, what: str = "") -> None:
    """``actual`` is the column sums of ``values`` (viewed as (rows, last dim)) accumulated in float32 in any
    order and rounded to ``actual``'s dtype: each within the bound of n - 1 float32 additions,
    (n - 1) * 2^-24 * sum |x| (Higham, recursive summation), plus the final rounding.

    A relative-error budget against torch's own sum would hold one summation order to another's luck: a
    column whose sum nearly cancels has a large relative error under any order.
    """
    prefix = f"{what}: " if what else ""
    cols = values.shape[-1] if values.dim() else 1
    rows_values = values.double().reshape(values.numel() // cols if cols else 0, cols)
    exact, magnitude = rows_values.sum(0), rows_values.abs().sum(0)
    assert actual.shape == exact.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    n = rows_values.shape[0]
    bound = magnitude * max(n - 1, 0) * 2.0**-24 + exact.abs() * torch.finfo(actual.dtype).eps
    err = (actual.double() - exact).abs()
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (
        f"{prefix}{bad.shape[0]} of {exact.numel()} sums off; first at column {int(bad[0, 0])}: "
        f"got {float(actual.reshape(-1)[bad[0, 0]])}, exact {float(exact[bad[0, 0]])}, "
        f"error {float(err[bad[0, 0]]):.3e} > bound {float(bound[bad[0, 0]]):.3e}"
    )
