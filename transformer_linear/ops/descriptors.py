"""Builds the descriptor tuples the C++ kernels take, and the launch context.

The extension does not link libtorch. Each tensor crosses into C++ as
``(data_ptr, dtype_code, shape, strides, device_code, device_index)``
(csrc/bindings/tensor_caster.h); the C++ side validates it.
"""

from __future__ import annotations

from typing import Optional

import torch

# Must match tl::DType in csrc/include/transformer_linear/tensor.h.
_DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.float64: 5,
    torch.int64: 6,
    torch.int32: 7,
    torch.int16: 8,
    torch.int8: 9,
    torch.uint8: 10,
    torch.bool: 11,
}
_OTHER_DTYPE = 12
_DEVICE_CODES = {"cpu": 0, "cuda": 1}


def desc(t: Optional[torch.Tensor], op: str, name: str) -> Optional[tuple]:
    """Describe ``t`` for the kernels; ``None`` passes through as an absent argument.

    Raises:
        TypeError: ``t`` is neither a tensor nor None.
    """
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    device = t.device
    return (
        t.data_ptr(),
        _DTYPE_CODES.get(t.dtype, _OTHER_DTYPE),
        tuple(t.shape),
        tuple(t.stride()),
        _DEVICE_CODES.get(device.type, 2),
        -1 if device.index is None else device.index,
    )


def stream_for(t: torch.Tensor) -> int:
    """The launch argument of a kernel call on ``t``'s device.

    On CUDA, the raw stream to launch on; read on every call, so kernels follow
    ``torch.cuda.stream(...)`` contexts and CUDA-graph capture. On the CPU, the
    thread count: ``torch.get_num_threads()`` of the calling thread, which the
    kernels read once per call (another thread changing it cannot affect a
    call in progress).
    """
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return torch.get_num_threads()


# cuBLASLt's recommended workspace on Hopper and newer.
CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024


def cublas_workspace(device: torch.device) -> torch.Tensor:
    """A cuBLASLt workspace on ``device``, from torch's caching allocator (stream-ordered, so
    CUDA-graph capturable); it must stay referenced until the kernel call has returned."""
    return torch.empty(CUBLAS_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
