"""The one way the package defines a custom op, and eager calls of its CPU kernels that skip the
dispatcher where it would add nothing.

Every op of the package is registered by :func:`custom_op` (``torch.library.custom_op`` plus what the
package needs of each op), directly for ops with typed parameters, or through ``ops.args_op`` for the
Linear's ops, whose parameters it derives from an argument dataclass. Kernels for other devices are
added to the op with ``register_kernel``; Triton kernels are ``torch.library.triton_op`` ops of their
own (ops/triton/), called for CUDA tensors, so torch.compile sees into them.

A call through a ``torch.library.custom_op`` passes two Python trampolines of
the dispatcher (its autograd kernel, then its backend kernel) and checks of
its outputs: about 50 us per call, against 2 us for a small quantize kernel. A
``tl.Linear`` forward and backward make about seven such calls inside its own
ops, so on small layers most of their host time was dispatch.

:func:`call` runs an op's CPU kernel directly where the dispatcher would do
nothing else: plain eager execution, no torch.compile / export tracing, no
dispatch, function or functorch mode, no profiler (so traces still name the
ops), plain CPU tensors of which none needs a gradient. Anywhere else, and for
ops that mutate an argument (the dispatcher bumps its version counter), the call
goes through the op as before, so what torch.compile, torch.export, opcheck,
fake tensors and autograd see is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

__all__ = ["call", "custom_op", "triton_op"]

_CPU_KERNELS: dict[Any, Callable[..., Any]] = {}


def custom_op(
    name: str,
    fn: Optional[Callable[..., Any]] = None,
    *,
    mutates_args: Sequence[str] = (),
    device_types: Union[None, str, Sequence[str]] = None,
) -> Any:
    """``torch.library.custom_op(name, fn, mutates_args=..., device_types=...)``, as a decorator without
    ``fn``. Where the function is the op's CPU kernel (``device_types`` "cpu") and mutates nothing,
    :func:`call` may run it directly.

    Args:
        name: ``"transformer_linear::op"``.
        fn: the op's implementation, its schema inferred from the annotations.
        mutates_args: the parameters it writes to.
        device_types: the devices ``fn`` implements the op for (None: every device).
    """

    def define(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args), device_types=device_types)
        if device_types == "cpu" and not mutates_args:
            _CPU_KERNELS[op] = fn
        return op

    return define if fn is None else define(fn)


def triton_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.triton_op(name, mutates_args=...)`` as a decorator: an op whose function launches
    Triton kernels through ``torch.library.wrap_triton`` (and otherwise calls torch ops only).

    torch.compile traces into such an op (its graph holds the kernels, which Inductor schedules with the
    rest), where a ``custom_op`` is opaque; torch.export keeps it as one op. Eager calls launch the
    kernels directly, on CUDA tensors or, under ``TRITON_INTERPRET=1``, on CPU tensors.
    """

    def define(fn: Callable[..., Any]) -> Any:
        return torch.library.triton_op(name, fn, mutates_args=tuple(mutates_args))

    return define


def _plain_cpu_call(args: tuple) -> bool:
    """The arguments are plain CPU tensors (or non-tensors), none needing a gradient."""
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return False
            if a.device.type != "cpu" or (grad and a.requires_grad):
                return False
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return False
    return True


def _plain_eager() -> bool:
    """Nothing but the kernel would run inside the dispatcher."""
    return (
        torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._functorch.peek_interpreter_stack() is None
        and not torch.autograd.profiler._is_profiler_enabled
    )


def call(op: Any, *args: Any) -> Any:
    """``op(*args)``, straight to its CPU kernel where the dispatcher would add nothing but time."""
    if torch.compiler.is_compiling():  # first: torch.compile traces the op call, and nothing else here
        return op(*args)
    kernel = _CPU_KERNELS.get(op)
    if kernel is not None and _plain_cpu_call(args) and _plain_eager():
        return kernel(*args)
    return op(*args)
