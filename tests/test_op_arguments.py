"""Every op of the package refuses a meta tensor (and a wrong dtype) in any one argument (issue 32 item 2).

A 'meta' tensor among CPU ones routes a custom op's call to its fake implementation, which returns
uninitialized memory (or, for an in-place op, does nothing): every op must raise a TypeError, ValueError
or RuntimeError naming the argument instead. Two walks, each over a table of small valid calls that a new
op or public function without an entry fails:

- every op registered under ``torch.ops.transformer_linear``, called through ``torch.ops`` (where no public
  function checks first), with the arguments of a valid call recorded while a package function or a layer's
  step makes it;
- every public function of the ``transformer_linear.ops`` modules that reaches a kernel (those of the
  ``ops`` namespace itself: tests/test_bad_input.py).

A meta tensor that is the only tensor on the op's device (a shape-only call, as a module on the meta device
makes) gives meta outputs, like torch's own ops. Values read on the host (stochastic-rounding seeds, a
gather handle) are CPU tensors whatever the device of the others. The raw kernels (``_C``) are walked with
the descriptors those calls hand them: a meta tensor's descriptor (null data, an unknown device) and a
null data pointer on the CPU, in any one argument, raise too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys
from typing import Any, Callable, Optional

import pytest
import torch
from test_triton_ops_traced import TRITON_OPS as TRITON_OP_NAMES
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_linear as tl
from transformer_linear import _C, ops, recipe
from transformer_linear._handles import NO_HANDLE
from transformer_linear.modules import fsdp_gather_usages
from transformer_linear.ops import descriptors, grouped, grouped_nvfp4, grouped_quantize, triton_route
from transformer_linear.ops import nvfp4 as n4
from transformer_linear.recipe import delayed_scaling

NAMESPACE = "transformer_linear"
E4M3 = torch.float8_e4m3fn
ERRORS = (TypeError, ValueError, RuntimeError)

# Arguments a message names as the kernels' C API does (TE's names: the input 'input', the GEMM output 'd').
ALIASES = {"x": "input", "q": "input", "out": "d"}
# Read on the host: CPU tensors whatever the device of the others (a meta one among CPU tensors raises).
HOST_ARGUMENTS = {"seed", "seeds", "missing_rowwise"}


# ---------------------------------------------------------------------------
# Small valid operands
# ---------------------------------------------------------------------------


def fp8(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale_inv, _ = ops.quantize_current(torch.randn(shape), E4M3)
    return q, scale_inv


def block_operands() -> tuple[torch.Tensor, ...]:
    a, sa = ops.quantize_blockwise(torch.randn(8, 256), E4M3, (1, 128))
    b, sb = ops.quantize_blockwise(torch.randn(4, 256), E4M3, (128, 128))
    return a, sa, b, sb


OFFS = (10, 32)  # two groups of 32 tokens: 10 and 22


def offs() -> torch.Tensor:
    return torch.tensor(OFFS, dtype=torch.int32)


def nvfp4_grouped_operands() -> tuple[torch.Tensor, ...]:
    a, sa, _, _ = n4.quantize_nvfp4_packed(torch.randn(32, 32))
    experts = [n4.quantize_nvfp4_packed(torch.randn(16, 32)) for _ in OFFS]
    b = torch.stack([e[0] for e in experts])
    sb = torch.stack([e[1].view(torch.uint8) for e in experts]).view(E4M3)
    return a, sa, b, sb


def nvfp4_compact(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_nvfp4.quantize_nvfp4_grouped_columnwise(torch.randn(32, rows), offs())


def nvfp4_seeds() -> torch.Tensor:
    return torch.stack([n4.sr_seed(torch.empty(0)) for _ in OFFS])


def layer_step(name: str, grouped_layer: bool = False, r: Optional[Any] = None) -> None:
    """One training step of a small Linear (or GroupedLinear) under the recipe ``name``."""
    r = r if r is not None else recipe.from_name(name)
    x = torch.randn(32, 256, requires_grad=True)
    if grouped_layer:
        tl.GroupedLinear(len(OFFS), 256, 32, recipe=r)(x, [OFFS[0], OFFS[1] - OFFS[0]]).sum().backward()
    else:
        tl.Linear(256, 32, recipe=r)(x).sum().backward()


def hp_backward_step() -> None:
    layer_step("", grouped_layer=True, r=recipe.Float8CurrentScaling(backward_override="high_precision"))


# ---------------------------------------------------------------------------
# The registered ops: a call that makes each (its first call is recorded)
# ---------------------------------------------------------------------------

X = torch.randn(16, 256)

# First: the first call of each op is the one walked, and a delayed-scaling layer's ops take the most tensors.
OP_CALLS: dict[str, Callable[[], Any]] = {
    "delayed_scaling_update": lambda: layer_step("delayed"),
    "quantize_grad_output": lambda: layer_step("delayed"),
    "amax": lambda: ops.amax(X),
    "quantize": lambda: ops.quantize(X, torch.ones(1), E4M3),
    "dequantize": lambda: ops.dequantize(*fp8((4, 8)), torch.float32),
    "transpose": lambda: ops.transpose(fp8((4, 8))[0]),
    "bias_grad": lambda: ops.bias_grad(X, torch.bfloat16),
    "fp8_gemm": lambda: ops.fp8_gemm(*fp8((4, 32)), *fp8((8, 32)), torch.float32, torch.zeros(8)),
    "fp8_gemm_accumulate": lambda: ops.fp8_gemm_accumulate_(*fp8((4, 32)), *fp8((8, 32)), torch.zeros(4, 8)),
    "quantize_fp8_gemm": lambda: ops.quantize_fp8_gemm(X, E4M3, torch.ones(1), *fp8((8, 256)), torch.float32,
                                                       torch.zeros(8)),
    "fp8_gemm_blockwise": lambda: ops.fp8_gemm(*block_operands(), torch.float32, torch.zeros(4)),
    "fp8_gemm_blockwise_accumulate": lambda: ops.fp8_gemm_accumulate_(*block_operands(), torch.zeros(8, 4)),
    "quantize_blockwise": lambda: ops.quantize_blockwise(X, E4M3, (1, 128)),
    "quantize_blockwise_flat": lambda: layer_step("block"),
    "fp8_grouped_gemm": lambda: grouped.fp8_grouped_gemm(
        *fp8((32, 32)), fp8((2, 16, 32))[0], torch.ones(2), offs(), torch.float32, torch.zeros(2, 16)),
    "fp8_grouped_gemm_wgrad": lambda: grouped.fp8_grouped_gemm_wgrad(
        *fp8((32, 16)), *fp8((32, 8)), offs(), torch.float32),
    "fp8_grouped_gemm_wgrad_blockwise": lambda: layer_step("block", grouped_layer=True),
    "grouped_linear_fwd": lambda: layer_step("current", grouped_layer=True),
    "grouped_mm_dgrad": hp_backward_step,
    "grouped_mm_wgrad": hp_backward_step,
    "linear_fwd": lambda: layer_step("current"),
    "linear_dgrad": lambda: layer_step("current"),
    "linear_wgrad": lambda: layer_step("current"),
    "delayed_scaling_flush": lambda: delayed_scaling.delayed_scaling_flush(torch.zeros(4, 3), torch.ones(3),
                                                                           NO_HANDLE),
    "quantize_grouped_columnwise": lambda: grouped_quantize._quantize_cpu_op(
        torch.randn(32, 16), offs(), E4M3, 128, False, "ceil"),
    "fsdp_rowwise_copy": lambda: fsdp_gather_usages.rowwise_copy(
        torch.full((), NO_HANDLE, dtype=torch.int64), *fp8((4, 8))),
    "nvfp4_gemm": lambda: n4.nvfp4_gemm(*n4.quantize_nvfp4(X, torch.ones(()))[:3],
                                        *n4.quantize_nvfp4(X[:8], torch.ones(()))[:3], torch.float32,
                                        torch.zeros(8)),
    "nvfp4_gemm_packed": lambda: n4.nvfp4_gemm_packed(*n4.quantize_nvfp4_packed(X)[:2],
                                                      *n4.quantize_nvfp4_packed(X[:8])[:2]),
    "nvfp4_grouped_gemm": lambda: grouped_nvfp4.nvfp4_grouped_gemm(
        *nvfp4_grouped_operands(), offs(), torch.float32, torch.zeros(2, 16)),
    "nvfp4_grouped_gemm_wgrad": lambda: grouped_nvfp4.nvfp4_grouped_gemm_wgrad(
        *nvfp4_compact(16), *nvfp4_compact(32), torch.float32, offs()),
    "quantize_nvfp4_grouped_columnwise": lambda: grouped_nvfp4.quantize_nvfp4_grouped_columnwise(
        torch.randn(32, 32), offs(), stochastic_rounding=True, seeds=nvfp4_seeds()),
    "quantize_nvfp4": lambda: n4.quantize_nvfp4(X, torch.ones(()), torch.ones(()), columnwise=True),
    "quantize_nvfp4_packed": lambda: n4.quantize_nvfp4_packed(
        X, stochastic_rounding=True, seed=n4.sr_seed(X), amax=torch.ones(())),
    "nvfp4_sr_seed": lambda: n4.sr_seed(X),
}

# Ops of the layers: their tensors are what the layer made, so only their devices are walked (torch
# arithmetic takes their state in any floating dtype).
LAYER_OPS = {"linear_fwd", "linear_dgrad", "linear_wgrad", "grouped_linear_fwd", "delayed_scaling_update",
             "delayed_scaling_flush", "quantize_grad_output", "fsdp_rowwise_copy",
             "quantize_blockwise_flat"}
# Arguments of no one device or dtype, and why.
ANY_DEVICE = {("nvfp4_sr_seed", "like"): "only orders the draw after the tensor it rounds (the seed is on the CPU)"}
ANY_DTYPE = {
    ("nvfp4_sr_seed", "like"): ANY_DEVICE[("nvfp4_sr_seed", "like")],
    **{(op, arg): "torch.mm in grad's dtype: any floating dtype is computed right"
       for op, args in (("grouped_mm_dgrad", ("grad", "weight")), ("grouped_mm_wgrad", ("grad", "inp")))
       for arg in args},
}


def registered_ops() -> list[str]:
    prefix = NAMESPACE + "::"
    return sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


class _Recorder(TorchDispatchMode):
    """Records the first call of each op of the namespace (its arguments as they were before the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, tuple[Any, tuple, dict]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == NAMESPACE and name not in self.calls:
            self.calls[name] = (func, _clone(args), _clone(kwargs))
        return func(*args, **kwargs)


@functools.cache
def recorded_calls() -> dict[str, tuple[Any, tuple, dict]]:
    """op -> (OpOverload, args, kwargs) of a valid call, from running each distinct entry of OP_CALLS once."""
    torch.manual_seed(0)
    calls: dict[str, tuple[Any, tuple, dict]] = {}
    for name, make in OP_CALLS.items():
        if name in calls:
            continue
        recorder = _Recorder()
        with recorder:
            make()
        assert name in recorder.calls, f"OP_CALLS['{name}'] does not call torch.ops.{NAMESPACE}.{name}"
        for op, call in recorder.calls.items():
            calls.setdefault(op, call)
    return calls


def tensor_arguments(op: str) -> list[str]:
    """The tensor arguments (by schema name) of op's recorded call."""
    func, args, _ = recorded_calls()[op]
    return [a.name for a, v in zip(func._schema.arguments, args) if isinstance(v, torch.Tensor)]


def call_with(op: str, arg: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
    """The recorded call of ``op`` with ``change`` applied to its argument ``arg`` (a fresh copy each time)."""
    func, args, kwargs = recorded_calls()[op]
    names = [a.name for a in func._schema.arguments]
    changed = [change(v) if name == arg else v for name, v in zip(names, _clone(args))]
    return functools.partial(func, *changed, **_clone(kwargs))


def _outputs(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (list, tuple)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def assert_names(info: pytest.ExceptionInfo, op: str, arg: str, what: str) -> None:
    message = str(info.value)
    names = {arg, ALIASES.get(arg, arg)}
    assert any(f"'{n}'" in message for n in names), f"{op}: the error does not name '{arg}': {message}"
    assert what in message, f"{op}: the error does not say {what!r}: {message}"


def wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype a caller could plausibly pass by mistake, never one the argument takes."""
    if t.dtype == torch.uint8:
        return t.to(torch.float64)
    if t.element_size() == 1:  # FP8 data, E4M3 and E8M0 scales: their bits as uint8
        return t.view(torch.uint8)
    if t.dtype in (torch.int32, torch.int64):
        return t.to(torch.int64 if t.dtype == torch.int32 else torch.int32)
    return t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)


# The Triton ops run on CUDA tensors (CPU ones only under TRITON_INTERPRET=1, set before triton is imported):
# test_triton_ops_traced.py opchecks them on a GPU and checks their refusal of CPU tensors here.
TRITON_OPS = {f"triton_{name}" for name in TRITON_OP_NAMES}


def test_every_registered_op_has_a_valid_call():
    """A new op in the namespace fails here until OP_CALLS has a call that makes it."""
    triton_route.kernels()  # registers the Triton ops (imported on first GPU use)
    assert sorted(OP_CALLS) == sorted(set(registered_ops()) - TRITON_OPS)
    assert TRITON_OPS <= set(registered_ops())
    assert set(recorded_calls()) >= set(OP_CALLS)


META_WALK = [(op, arg) for op in sorted(OP_CALLS) for arg in tensor_arguments(op)]
DTYPE_WALK = [(op, arg) for op, arg in META_WALK if op not in LAYER_OPS and (op, arg) not in ANY_DTYPE]


def _device_arguments(op: str) -> list[str]:
    return [a for a in tensor_arguments(op) if a not in HOST_ARGUMENTS and (op, a) not in ANY_DEVICE]


@pytest.mark.parametrize("op, arg", META_WALK, ids=lambda v: v)
def test_registered_op_refuses_one_meta_argument(op, arg):
    call = call_with(op, arg, lambda t: t.to("meta"))
    if (op, arg) in ANY_DEVICE:
        out = call()
        assert all(t.device.type == "cpu" for t in _outputs(out)), f"{op}: {ANY_DEVICE[(op, arg)]}"
        return
    if _device_arguments(op) == [arg]:  # shape inference, as torch's own ops on meta tensors
        out = call()
        assert _outputs(out) and all(t.device.type == "meta" for t in _outputs(out))
        return
    with pytest.raises(ERRORS) as info:
        call()
    assert_names(info, op, arg, "meta")


@pytest.mark.parametrize("op, arg", DTYPE_WALK, ids=lambda v: v)
def test_registered_op_refuses_a_wrong_dtype(op, arg):
    func, args, _ = recorded_calls()[op]
    bad = wrong_dtype(dict(zip((a.name for a in func._schema.arguments), args))[arg])
    with pytest.raises((TypeError, ValueError)) as info:
        call_with(op, arg, wrong_dtype)()
    assert_names(info, op, arg, str(bad.dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------
# The public functions of the ops modules that reach a kernel
# ---------------------------------------------------------------------------

# Modules whose public functions reach no kernel of their own, and why.
NO_KERNEL_MODULES = {
    "descriptors": "builds the kernels' descriptors (the C++ side validates them: the raw-kernel walk below)",
    "library": "defines the ops, and calls an op's CPU kernel where the dispatcher would add nothing (the ops "
    "check their arguments)",
    "args_op": "registers the Linear's ops on their args dataclasses (walked above: linear_fwd, ...)",
    "triton_route": "decides which CUDA calls of the public ops take the Triton ops (their checks first)",
    "nvfp4_checks": "the NVFP4 ops' argument checks",
    "nvfp4_packed_scales": "torch ops packing and unpacking NVFP4 scales",
    "torch_cuda": "the CUDA ops' torch fallbacks and their registration, reached after the ops' checks",
    "gemm_block_cuda": "cuBLASLt's block-scaled GEMM, reached from the CUDA kernel of fp8_gemm after its checks",
    "nvfp4_cuda": "cuBLASLt's NVFP4 GEMM, reached from the CUDA kernel of nvfp4_gemm after its checks",
    "triton": "the Triton kernels, reached from the ops' CUDA kernels after their checks",
}
NO_KERNEL_FUNCTIONS = {
    "grouped_high_precision.group_ends": "reads offs on the host for the grouped_mm ops (walked above)",
    **{f"grouped_nvfp4.{name}": "torch ops on offs' device: the grouped NVFP4 ops' bands and compact copies"
       for name in ("compact_columnwise", "compact_tokens", "expand_columnwise", "group_bands", "group_of_rows")},
}


def _nvfp4_gemm_kwargs() -> dict:
    a, b = n4.quantize_nvfp4(X, torch.ones(())), n4.quantize_nvfp4(X[:8], torch.ones(()))
    return {"a": a.data, "a_scale": a.scale, "a_global_scale": a.global_scale, "b": b.data, "b_scale": b.scale,
            "b_global_scale": b.global_scale, "bias": torch.zeros(8)}


def _nvfp4_grouped_gemm_kwargs() -> dict:
    a, sa, b, sb = nvfp4_grouped_operands()
    return {"a": a, "a_scale_inv": sa, "b": b, "b_scale_inv": sb, "offs": offs(), "out_dtype": torch.float32,
            "bias": torch.zeros(2, 16)}


def _nvfp4_grouped_wgrad_kwargs() -> dict:
    (g, sg), (x, sx) = nvfp4_compact(16), nvfp4_compact(32)
    return {"grad_t": g, "grad_t_scale_inv": sg, "x_t": x, "x_t_scale_inv": sx, "out_dtype": torch.float32,
            "offs": offs()}


def _fp8_grouped_gemm_kwargs() -> dict:
    (a, sa), (b, _) = fp8((32, 32)), fp8((2, 16, 32))
    return {"a": a, "a_scale_inv": sa, "b": b, "b_scale_inv": torch.ones(2), "offs": offs(),
            "out_dtype": torch.float32, "bias": torch.zeros(2, 16)}


def _fp8_grouped_wgrad_kwargs() -> dict:
    (g, sg), (x, sx) = fp8((32, 16)), fp8((32, 8))
    return {"grad": g, "grad_scale_inv": sg, "x": x, "x_scale_inv": sx, "offs": offs(), "out_dtype": torch.float32}


def _fp8_grouped_wgrad_blockwise_kwargs() -> dict:
    g = grouped_quantize.quantize_grouped_columnwise(torch.randn(32, 16), offs(), E4M3, 128)
    x = grouped_quantize.quantize_grouped_columnwise(torch.randn(32, 8), offs(), E4M3, 128)
    return {"grad_t": g.data_t, "grad_t_scale_inv": g.scale_inv_t, "x_t": x.data_t, "x_t_scale_inv": x.scale_inv_t,
            "offs": offs(), "out_dtype": torch.float32, "token_block": 128}


PUBLIC_CALLS: dict[str, Callable[[], dict]] = {
    "grouped.fp8_grouped_gemm": _fp8_grouped_gemm_kwargs,
    "grouped.fp8_grouped_gemm_wgrad": _fp8_grouped_wgrad_kwargs,
    "grouped.fp8_grouped_gemm_wgrad_blockwise": _fp8_grouped_wgrad_blockwise_kwargs,
    "grouped_high_precision.grouped_mm_dgrad": lambda: {
        "grad": torch.randn(32, 16), "weight": torch.randn(2, 16, 8), "offs": offs(), "out_dtype": torch.float32},
    "grouped_high_precision.grouped_mm_wgrad": lambda: {
        "grad": torch.randn(32, 16), "inp": torch.randn(32, 8), "offs": offs(), "out_dtype": torch.float32},
    "grouped_nvfp4.nvfp4_grouped_gemm": _nvfp4_grouped_gemm_kwargs,
    "grouped_nvfp4.nvfp4_grouped_gemm_wgrad": _nvfp4_grouped_wgrad_kwargs,
    "grouped_nvfp4.quantize_nvfp4_grouped_columnwise": lambda: {
        "x": torch.randn(32, 32), "offs": offs(), "stochastic_rounding": True, "seeds": nvfp4_seeds()},
    "grouped_quantize.quantize_grouped_columnwise": lambda: {
        "x": torch.randn(32, 16), "offs": offs(), "dtype": E4M3, "token_block": 128},
    "nvfp4_gemm.nvfp4_gemm": _nvfp4_gemm_kwargs,
    "nvfp4_gemm.nvfp4_gemm_packed": lambda: dict(zip(
        ("a", "a_scale_inv", "b", "b_scale_inv"),
        (*n4.quantize_nvfp4_packed(X)[:2], *n4.quantize_nvfp4_packed(X[:8])[:2]))),
    "nvfp4_quantize.nvfp4_amax": lambda: {"x": X, "rht": True},
    "nvfp4_quantize.quantize_nvfp4": lambda: {"x": X, "amax": torch.ones(()), "amax_t": torch.ones(()),
                                              "columnwise": True},
    "nvfp4_quantize.quantize_nvfp4_packed": lambda: {
        "x": X, "stochastic_rounding": True, "seed": n4.sr_seed(X), "amax": torch.ones(())},
    "nvfp4_quantize.sr_seed": lambda: {"like": X},
}
PUBLIC_ANY_DEVICE = {"nvfp4_quantize.sr_seed": ANY_DEVICE[("nvfp4_sr_seed", "like")]}


def public_functions() -> dict[str, Any]:
    """'module.name' -> each public function (or custom op) of the ops modules, by the module defining it,
    but those of the ``ops`` namespace (walked by tests/test_bad_input.py)."""
    walked_there = {id(v) for v in vars(ops).values()}
    found = {}
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"{ops.__name__}.{info.name}")
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        for name in names:
            value = getattr(module, name)
            if name.startswith("_") or inspect.isclass(value) or not callable(value) or id(value) in walked_there:
                continue
            home = getattr(value, "__module__", None) or ""
            home = home if home.startswith(ops.__name__) else module.__name__  # a custom op: where it is defined
            found[f"{home.removeprefix(ops.__name__ + '.')}.{name}"] = value
    return found


def test_every_public_function_is_walked_or_reaches_no_kernel():
    """A new public function of an ops module fails here until it is in PUBLIC_CALLS or said to reach no
    kernel of its own."""
    public = public_functions()
    exempt = {k for k in public if k.split(".")[0] in NO_KERNEL_MODULES or k in NO_KERNEL_FUNCTIONS}
    assert sorted(set(public) - exempt) == sorted(PUBLIC_CALLS)
    assert set(NO_KERNEL_FUNCTIONS) <= set(public)


def _kwarg_tensors(key: str) -> list[str]:
    return [k for k, v in PUBLIC_CALLS[key]().items() if isinstance(v, torch.Tensor)]


PUBLIC_WALK = [(key, arg) for key in sorted(PUBLIC_CALLS) for arg in _kwarg_tensors(key)]


@pytest.mark.parametrize("key, arg", PUBLIC_WALK, ids=lambda v: v)
def test_public_function_refuses_one_meta_argument(key, arg):
    kwargs = PUBLIC_CALLS[key]()
    device_tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in HOST_ARGUMENTS]
    kwargs[arg] = kwargs[arg].to("meta")
    call = functools.partial(public_functions()[key], **kwargs)
    if key in PUBLIC_ANY_DEVICE:
        assert all(t.device.type == "cpu" for t in _outputs(call())), PUBLIC_ANY_DEVICE[key]
        return
    if device_tensors == [arg]:
        out = call()
        assert _outputs(out) and all(t.device.type == "meta" for t in _outputs(out))
        return
    with pytest.raises(ERRORS) as info:
        call()
    assert_names(info, key.split(".")[-1], arg, "meta")


# ---------------------------------------------------------------------------
# The raw kernels: the descriptors the ops hand them, one made bad at a time
# ---------------------------------------------------------------------------


def _is_descriptor(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 6 and isinstance(value[0], int) and isinstance(value[2], tuple)


@functools.cache
def kernel_calls() -> dict[str, tuple]:
    """_C function -> the arguments of its first call while every op of OP_CALLS and PUBLIC_CALLS runs once.

    Descriptors carry raw pointers: every tensor described for a kernel (temporaries of the ops included) is
    kept alive in :data:`DESCRIBED` for the walk, through ``descriptors.desc`` wrapped wherever it is used.
    """
    calls: dict[str, tuple] = {}
    names = [n for n in dir(_C) if not n.startswith("_") and callable(getattr(_C, n))]
    originals = {n: getattr(_C, n) for n in names}

    def recording(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.setdefault(name, args)
            return originals[name](*args)
        return call

    describe = descriptors.desc

    def keeping(t: Optional[torch.Tensor], op: str, name: str) -> Optional[tuple]:
        DESCRIBED.append(t)
        return describe(t, op, name)

    mp = pytest.MonkeyPatch()
    try:
        for name in names:
            mp.setattr(_C, name, recording(name))
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith(NAMESPACE) and getattr(module, "desc", None) is describe:
                mp.setattr(module, "desc", keeping)
        mp.setattr(descriptors, "desc", keeping)
        torch.manual_seed(0)
        for make in OP_CALLS.values():
            make()
        for key, make in PUBLIC_CALLS.items():
            public_functions()[key](**make())
    finally:
        mp.undo()
    return calls


DESCRIBED: list[Optional[torch.Tensor]] = []


def _bad_descriptors(d: tuple) -> dict[str, tuple]:
    # A meta tensor's descriptor: data_ptr() 0 and an unknown device code; and a null pointer on the CPU.
    return {"meta": (0, d[1], d[2], d[3], 2, -1), "null": (0, *d[1:])}


def _kernel_walk() -> list[tuple[str, int, str]]:
    walk = []
    for name, args in sorted(kernel_calls().items()):
        for i, d in enumerate(args):
            if _is_descriptor(d) and all(s > 0 for s in d[2]):
                walk += [(name, i, kind) for kind in ("meta", "null")]
    return walk


def test_the_kernel_walk_covers_every_tensor_kernel():
    """Every _C function that takes tensors is called by some op above (CUDA-only ones aside)."""
    cuda_only = {"fp8_gemm_blockwise_cublaslt", "fp8_grouped_gemm_cublaslt", "nvfp4_gemm_cublaslt"}
    assert {"amax", "quantize", "fp8_gemm", "nvfp4_grouped_gemm"} <= set(kernel_calls())
    takes_tensors = {n for n in dir(_C) if "TensorDesc" in (getattr(getattr(_C, n), "__doc__", None) or "")}
    assert takes_tensors - cuda_only <= set(kernel_calls())


@pytest.mark.parametrize("name, index, kind", _kernel_walk(), ids=str)
def test_kernel_refuses_a_bad_descriptor(name, index, kind):
    """A meta tensor's descriptor (or a null data pointer) in any one argument: an error naming the op and
    that it is null or on no supported device, never a read of address 0 or a silently skipped argument."""
    args = list(kernel_calls()[name])
    args[index] = _bad_descriptors(args[index])[kind]
    with pytest.raises((TypeError, ValueError), match=r"null data pointer|must be on cpu|unsupported device"):
        getattr(_C, name)(*args)
