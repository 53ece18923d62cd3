"""NVFP4 ops: quantize to NVFP4 and the NVFP4 block-scaled GEMM (the family's public names, from
ops.nvfp4_quantize, ops.nvfp4_gemm and ops.nvfp4_packed_scales; importing this module registers the ops).

Each op is a ``torch.library`` custom op with a fake implementation, so it
traces under ``torch.compile``; the CPU kernels are the extension's
(csrc/cpu/quantize_nvfp4_cpu.cpp, gemm_nvfp4_cpu.cpp; the global amaxes, plain and
of the Hadamard-transformed columnwise copy, in one pass: quantize_nvfp4_cpu_amax.h;
fake, meta and traced tensors take the torch form), the CUDA kernels are
registered by ``ops.nvfp4_cuda`` (Triton, and cuBLASLt's NVFP4 matmul where the
GPU and build have it). The format and every
numeric rule: :mod:`transformer_linear.formats.nvfp4` and
``transformer_linear/reference/nvfp4.py``. The public functions validate
their arguments and raise errors naming the argument; the custom ops
themselves check devices and dtypes again (they can be called directly
through ``torch.ops``) and the C++ front end checks everything once more.

The custom ops carry packed FP4 data as its uint8 bytes: torch implements no
``copy_`` for ``float4_e2m1fn_x2``, and tracing and ``opcheck`` copy a custom
op's tensors. The public functions take and return ``float4_e2m1fn_x2`` views.
"""

from transformer_linear.ops.nvfp4_gemm import nvfp4_gemm, nvfp4_gemm_packed
from transformer_linear.ops.nvfp4_packed_scales import (
    GLOBAL_SCALE_ELEMENTS,
    pack_scales,
    packed_scale_numel,
    unpack_scales,
)
from transformer_linear.ops.nvfp4_quantize import (
    NVFP4Tensors,
    nvfp4_amax,
    quantize_nvfp4,
    quantize_nvfp4_packed,
    sr_seed,
)

__all__ = [
    "GLOBAL_SCALE_ELEMENTS",
    "NVFP4Tensors",
    "nvfp4_amax",
    "nvfp4_gemm",
    "nvfp4_gemm_packed",
    "pack_scales",
    "packed_scale_numel",
    "quantize_nvfp4",
    "quantize_nvfp4_packed",
    "sr_seed",
    "unpack_scales",
]
