"""ops.library.call: eager calls on plain CPU tensors go straight to an op's kernel, and every other call (a
dispatch mode, fake tensors, the profiler, torch.compile, tensors needing a gradient, another device)
still goes through the op, so what those see is unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from transformer_linear import ops
from transformer_linear.ops import library

E4M3 = torch.float8_e4m3fn


class _SeenOps(TorchDispatchMode):
    """Records the names of the ops dispatched under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.name()))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that library.call sends straight to a kernel."""
    calls = []
    for op, kernel in list(library._CPU_KERNELS.items()):

        def counted(*args, _kernel=kernel, _op=op):
            calls.append(str(_op))
            return _kernel(*args)

        monkeypatch.setitem(library._CPU_KERNELS, op, counted)
    return calls


def _public_calls(x):
    """Each public entry of the registered ops, on x."""
    q, scale_inv, _ = ops.quantize_current(x, E4M3)
    w, w_scale_inv, _ = ops.quantize_current(x[:8].contiguous(), E4M3)
    block_a = ops.quantize_blockwise_fused(x, E4M3, (1, 128), torch.float32, False)
    block_b = ops.quantize_blockwise_fused(x[:8].contiguous(), E4M3, (128, 128), torch.float32, False)
    return {
        "amax": ops.amax(x),
        "quantize": ops.quantize_fused(x, E4M3, None, columnwise=True),
        "dequantize": ops.dequantize(q, scale_inv, torch.float32),
        "fp8_gemm": ops.fp8_gemm(q, scale_inv, w, w_scale_inv, torch.float32),
        "quantize_blockwise": block_a,
        "fp8_gemm_blockwise": ops.fp8_gemm(block_a.data, block_a.scale_inv, block_b.data, block_b.scale_inv,
                                           torch.float32),
    }


def _flat(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]


def test_every_non_mutating_op_is_registered():
    names = sorted(str(op) for op in library._CPU_KERNELS)
    for name in ("amax", "quantize", "dequantize", "fp8_gemm", "quantize_blockwise", "fp8_gemm_blockwise"):
        assert f"<CustomOpDef(transformer_linear::{name})>" in names


def test_direct_calls_equal_the_dispatched_ones(kernel_calls):
    x = torch.randn(32, 128)
    direct = _public_calls(x)
    assert kernel_calls, "nothing went straight to a kernel"
    kernel_calls.clear()
    with _SeenOps() as seen:
        dispatched = _public_calls(x)
    assert not kernel_calls
    assert {f"transformer_linear::{n}" for n in direct} <= set(seen.names)
    for name in direct:
        for a, b in zip(_flat(direct[name]), _flat(dispatched[name]), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), name


def test_fake_tensors_meta_and_profiler_go_through_the_op(kernel_calls):
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 (test-only import)

    with FakeTensorMode():
        out = ops.quantize_fused(torch.empty(4, 16), E4M3)
    assert type(out.data).__name__ == "FakeTensor"
    out = ops.quantize_fused(torch.empty(4, 16, device="meta"), E4M3)
    assert out.data.device.type == "meta"
    with torch.profiler.profile() as prof:
        ops.quantize_fused(torch.randn(4, 16), E4M3)
    assert any("transformer_linear::quantize" in e.name for e in prof.events())
    assert not kernel_calls


def test_a_tensor_needing_a_gradient_goes_through_the_op(kernel_calls):
    x = torch.randn(4, 16, requires_grad=True)
    ops.amax(x)
    assert not kernel_calls
    with torch.no_grad():
        ops.amax(x)
    assert kernel_calls == ["<CustomOpDef(transformer_linear::amax)>"]


def test_compiled_code_calls_the_op():
    x = torch.randn(8, 32)

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        return ops.quantize_fused(t, E4M3).data

    assert torch.equal(f(x).view(torch.uint8), ops.quantize_fused(x, E4M3).data.view(torch.uint8))


def test_bad_input_raises_the_same_error_either_way():
    x = torch.randn(4, 16)
    scale = torch.tensor([float("nan")])
    with pytest.raises(ValueError, match="scale") as direct:
        ops.quantize_fused(x, E4M3, scale)
    with _SeenOps(), pytest.raises(ValueError, match="scale") as dispatched:
        ops.quantize_fused(x, E4M3, scale)
    assert str(direct.value) == str(dispatched.value)
