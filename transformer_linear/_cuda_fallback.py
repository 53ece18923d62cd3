"""A working path for CUDA tensors when the extension was built without CUDA kernels.

A CPU-only build (``TL_CUDA=0``, or ``auto`` on a machine without nvcc and
cuBLASLt) still has to work on a GPU machine: each custom op in ``ops.py``
asks :func:`active` first and, when it says so, computes its result here with
plain torch on the GPU (the ``reference`` definitions, and ``torch._scaled_mm``
for the GEMM where it applies). The first such call warns once, naming how to
build the kernels.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from transformer_linear import _C, reference

BUILD_HINT = "pip install nvidia-cublas && TL_CUDA=1 pip install --no-build-isolation --force-reinstall ."

_HAS_CUDA_KERNELS = _C.built_with_cuda()
_warned = False


def active(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor and this build has no CUDA kernels (warns once)."""
    if t.device.type != "cuda" or _HAS_CUDA_KERNELS:
        return False
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "transformer_linear was built without its CUDA kernels, so CUDA tensors take a slower "
            f"fallback (torch._scaled_mm and plain torch ops). To build the kernels: {BUILD_HINT}",
            UserWarning,
            stacklevel=3,
        )
    return True


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a new 0-dim float32 tensor."""
    return reference.amax(x).clone()


def quantize(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    dtype: torch.dtype,
    margin: int,
    rowwise: bool,
    columnwise: bool,
    dbias_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The five outputs of ``transformer_linear::quantize`` (unrequested ones empty)."""
    if scale is None:
        q, scale_inv, x_amax = reference.quantize_current(x, dtype, margin)
    else:
        q, scale_inv = reference.quantize(x, scale, dtype)
        x_amax = reference.amax(x)
    q_t = reference.transpose_2d(q) if columnwise else x.new_empty(0, dtype=dtype)
    if not rowwise:
        q = x.new_empty(0, dtype=dtype)
    if dbias_dtype is not None:
        dbias = reference.bias_grad(x, dbias_dtype)
    else:
        dbias = x.new_empty(0, dtype=torch.float32)
    # Custom-op outputs must not be views of each other or of the inputs.
    return q, q_t, scale_inv.clone(), x_amax.reshape(()).clone(), dbias


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """float(q) * scale_inv in ``out_dtype``."""
    return reference.dequantize(q, scale_inv, out_dtype)


def _dequantized_product(a, a_scale_inv, b, b_scale_inv) -> torch.Tensor:
    """(a @ b.T) * scales in float32, from the exactly decoded FP8 values."""
    alpha = a_scale_inv.float().reshape(()) * b_scale_inv.float().reshape(())
    return (a.float() @ b.float().t()) * alpha


def _scaled_mm_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch._scaled_mm: FP8 tensor cores (sm_89+), dimensions in multiples of
    # 16, `a` row-major and `b.t()` column-major, not e5m2 x e5m2.
    both_e5m2 = a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2
    return (
        a.device.type == "cuda"
        and not both_e5m2
        and a.stride(-1) == 1
        and b.stride(-1) == 1
        and all(s % 16 == 0 for s in (*a.shape, b.shape[0]))
        and torch.cuda.get_device_capability(a.device) >= (8, 9)
    )


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    use_split_accumulator: bool,
) -> torch.Tensor:
    """(a @ b.T) * a_scale_inv * b_scale_inv [+ bias] in ``out_dtype``."""
    if _scaled_mm_applies(a, b):
        try:
            return torch._scaled_mm(
                a,
                b.t(),
                scale_a=a_scale_inv.float().reshape(()),
                scale_b=b_scale_inv.float().reshape(()),
                bias=bias,
                out_dtype=out_dtype,
                use_fast_accum=not use_split_accumulator,
            )
        except RuntimeError:
            pass  # e.g. a bias dtype this torch's _scaled_mm rejects: use the general path
    out = _dequantized_product(a, a_scale_inv, b, b_scale_inv)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm_accumulate_(
    a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor, out: torch.Tensor
) -> None:
    """out += (a @ b.T) * a_scale_inv * b_scale_inv, summed in float32."""
    out.copy_(out.float() + _dequantized_product(a, a_scale_inv, b, b_scale_inv))
