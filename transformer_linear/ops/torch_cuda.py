"""A working path for CUDA tensors the extension's CUDA kernels cannot take.

That is: a CPU-only build (``TL_CUDA=0``, or ``auto`` on a machine without
nvcc and cuBLASLt); a CUDA build whose runtime needs a newer NVIDIA driver than
the one installed (checked at import); a GPU the build has no code for (e.g.
sm_75 with the default architectures). Each custom op in ``ops`` asks
:func:`active` first and, when it says so, computes its result here with plain
torch on the GPU (the ``reference`` definitions, and ``torch._scaled_mm`` for
the GEMM where it applies). The first such call warns once, naming the reason
and the remedy.

Each custom op of ``ops`` registers the extension's kernel for the CPU and,
through :func:`register_cuda_kernel`, a CUDA kernel that picks the extension
or this fallback per call (:func:`active`).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from transformer_linear import _C, reference
from transformer_linear.formats.layout import fp8_tensor_cores_take

REBUILD = "TL_CUDA=1 pip install --no-build-isolation --force-reinstall ."
BUILD_HINT = f"pip install nvidia-cublas && {REBUILD}"

_BUILD_INFO: Optional[dict] = _C.cuda_build_info()
_warned = False
_problems: dict[int, Optional[str]] = {}


def build_info() -> Optional[dict]:
    """``_C.cuda_build_info()`` of this build: None for a CPU-only build."""
    return _BUILD_INFO


def driver_supports(runtime_version: int, driver_version: int) -> bool:
    """Whether a driver (``cudaDriverGetVersion``) runs code built with a CUDA runtime.

    CUDA's minor-version compatibility: a driver runs any runtime of its own
    major version or older (CUDA 13.x needs driver R580+, 12.x R525+); 0 means
    no driver at all.
    """
    return driver_version > 0 and driver_version >= (runtime_version // 1000) * 1000


def has_image(capability: tuple[int, int], archs: str) -> bool:
    """Whether code built for ``archs`` (CMake's form, comma-separated) runs on a GPU.

    Machine code for sm_XY runs on sm_XZ with Z >= Y (``a`` variants: on XY
    only); PTX for compute_XY is compiled by the driver for any GPU >= XY.
    ``80`` is both, ``90-real`` machine code only, ``90-virtual`` PTX only.
    """
    major, minor = capability
    for entry in filter(None, (e.strip() for e in archs.split(","))):
        name, _, kind = entry.partition("-")
        specific = name.endswith(("a", "f"))
        number = int(name.rstrip("af"))
        arch = (number // 10, number % 10)
        if kind != "virtual":
            if arch == (major, minor) or (not specific and arch[0] == major and arch[1] <= minor):
                return True
        if kind != "real" and not specific and arch <= (major, minor):
            return True
    return False


def kernel_problem(build_info: Optional[dict], capability: tuple[int, int]) -> Optional[str]:
    """Why the extension's CUDA kernels cannot run on a GPU of ``capability``, or None.

    Args:
        build_info: ``_C.cuda_build_info()``: None for a CPU-only build.
        capability: the GPU's compute capability (major, minor).
    """
    if build_info is None:
        return (
            "transformer_linear was built without its CUDA kernels, so CUDA tensors take a slower "
            f"fallback (torch._scaled_mm and plain torch ops). To build the kernels: {BUILD_HINT}"
        )
    runtime, driver = build_info["runtime_version"], build_info["driver_version"]
    if not driver_supports(runtime, driver):
        have = f"CUDA {driver // 1000}.{driver % 1000 // 10}" if driver else "no CUDA driver"
        return (
            f"transformer_linear's CUDA kernels were built with CUDA {runtime // 1000}.{runtime % 1000 // 10}, "
            f"which needs an NVIDIA driver for CUDA {runtime // 1000}.0 or newer (R580+ for CUDA 13, R525+ for "
            f"CUDA 12); this machine has {have}. CUDA tensors take a slower torch fallback. Update the driver, "
            "or rebuild against the CUDA 12 toolkit and cuBLAS (nvidia-cublas-cu12)."
        )
    if not has_image(capability, build_info["archs"]):
        cc = f"{capability[0]}{capability[1]}"
        return (
            f"transformer_linear's CUDA kernels were built for {build_info['archs']}, which has no code for "
            f"this GPU (sm_{cc}), so CUDA tensors take a slower torch fallback. To build for it: "
            f"TL_CUDA_ARCHS='{cc};{build_info['archs'].replace(',', ';')}' {REBUILD}"
        )
    return None


def active(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor the extension's kernels cannot take (warns once)."""
    if t.device.type != "cuda":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _problems:
        _problems[index] = kernel_problem(_BUILD_INFO, torch.cuda.get_device_capability(index))
    problem = _problems[index]
    if problem is None:
        return False
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(problem, UserWarning, stacklevel=3)
    return True


def cuda_kernel(extension: Callable, fallback: Callable, check: Optional[Callable] = None) -> Callable:
    """An op's CUDA kernel: ``extension`` where the extension's CUDA kernels can run on the
    first argument's GPU, else ``fallback`` (plain torch, warning once: :func:`active`).

    Args:
        extension: the extension's implementation, with the op's arguments.
        fallback: the torch implementation, with the op's arguments.
        check: argument checks of the op, run before either implementation.
    """

    def kernel(*args):
        if check is not None:
            check(*args)
        return (fallback if active(args[0]) else extension)(*args)

    return kernel


def register_cuda_kernel(
    op: torch.library.CustomOpDef, extension: Callable, fallback: Callable, check: Optional[Callable] = None
) -> None:
    """Register :func:`cuda_kernel` as ``op``'s CUDA kernel (its CPU kernel is the extension's)."""
    op.register_kernel("cuda", cuda_kernel(extension, fallback, check))


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
    # torch._scaled_mm takes `a` row-major and `b.t()` column-major (fp8_tensor_cores_take), on
    # FP8 tensor cores: sm_89+.
    return (
        a.device.type == "cuda"
        and fp8_tensor_cores_take(a, b, aligned=False)
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
        # _scaled_mm takes no bias with a float32 output: add it after, in
        # float32. Its errors (out of memory, CUDA errors) propagate: the
        # cases it does not support are excluded above, not caught.
        bias_after = bias is not None and out_dtype == torch.float32
        out = torch._scaled_mm(
            a,
            b.t(),
            scale_a=a_scale_inv.float().reshape(()),
            scale_b=b_scale_inv.float().reshape(()),
            bias=None if bias_after else bias,
            out_dtype=out_dtype,
            use_fast_accum=not use_split_accumulator,
        )
        return out.add_(bias) if bias_after else out
    out = _dequantized_product(a, a_scale_inv, b, b_scale_inv)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm_accumulate_(
    a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor, out: torch.Tensor,
    use_split_accumulator: bool = True,
) -> None:
    """out += (a @ b.T) * a_scale_inv * b_scale_inv, summed in float32 (so use_split_accumulator has no effect)."""
    out.copy_(out.float() + _dequantized_product(a, a_scale_inv, b, b_scale_inv))
