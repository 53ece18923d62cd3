"""Which calls run the package's Triton kernels directly, as the ``triton_op`` ops of ``ops.triton``
(which torch.compile traces into: Inductor sees and schedules the kernels), rather than inside a custom
op's CUDA kernel (opaque to it).

The public wrappers take the Triton op themselves for CUDA tensors wherever Triton is what the custom
op would run, decided from what tracing knows (the device, the build, the GPU, the shapes, the
scalings): ``ops.quantize_blockwise_fused``, the grouped wgrad GEMMs and ``ops.nvfp4.quantize_nvfp4``
always; ``ops.fp8_gemm`` with block scales and ``ops.grouped.fp8_grouped_gemm`` where cuBLASLt has no
kernel for the problem. The custom ops keep CUDA kernels of their own (cuBLASLt first where it has one,
Triton otherwise, also when cuBLASLt declines at run time), for calls through ``torch.ops`` and for the
ops that call them: the NVFP4 GEMM (cuBLASLt's FP4 matmul where the GPU has one, decided beside its
kernels in ops/nvfp4_cuda.py), NVFP4's packed ops (whose stochastic-rounding seed is read on the host),
the accumulating GEMMs and the blocks of 3-D tensors (recipe/kind_block.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["kernels", "routes"]


def routes(t: torch.Tensor) -> bool:
    """Whether a call on ``t``'s device runs Triton kernels (a CUDA tensor)."""
    return t.device.type == "cuda"


def kernels() -> ModuleType:
    """``transformer_linear.ops.triton``, imported on first GPU use: triton is an optional dependency (the
    ``cuda`` extra) and importing it costs seconds."""
    import transformer_linear.ops.triton as triton_kernels  # noqa: PLC0415 (optional dependency)

    return triton_kernels
