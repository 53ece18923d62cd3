"""NVFP4 global amaxes: the CPU kernel (max |x| and max |H(x.T)| in one pass) bitwise the reference's definition
(``x.float().abs().amax()`` and ``hadamard_transform(x.T).abs().amax()``, the transform's own stage order) on every
CPU path and thread count; the torch form kept for fake, meta and traced tensors."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import SUPPORTED_ISAS
from tolerances import assert_bitwise_equal
from torch._subclasses.fake_tensor import FakeTensorMode

from transformer_linear import _C
from transformer_linear.ops import nvfp4 as ops
from transformer_linear.ops import nvfp4_quantize
from transformer_linear.ops.descriptors import desc
from transformer_linear.reference import nvfp4 as ref

HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Rows a multiple of 16 (the transform's blocks); columns below, at and past the widest vector (16 lanes) and
# the kernel's 64-column chunks, with tails of every length class.
SHAPES = [(16, 1), (16, 7), (32, 16), (48, 70), (64, 129), (160, 256), (256, 301)]


@pytest.fixture(params=SUPPORTED_ISAS)
def cpu_isa(request):
    """Each path (avx512_bf16 included) compiles the amax kernel on its own vector width."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


@pytest.fixture(params=[1, 2])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _input(shape, dtype, seed=0):
    """Values over many binades (row scales 2^-20 .. 2^20), subnormals in some rows, so the maximum is unique."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 21, (m, 1), generator=g).float())
    x[::5] *= 1e-38
    return x.to(dtype)


def _reference(x):
    return x.float().abs().amax(), ref.hadamard_transform(x.t()).abs().amax()


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_amaxes_match_reference(cpu_isa, threads, shape, dtype):
    x = _input(shape, dtype)
    amax, amax_rht = _reference(x)
    assert_bitwise_equal(ops.nvfp4_amax(x), amax, f"amax {cpu_isa} {threads} threads")
    assert_bitwise_equal(ops.nvfp4_amax(x, rht=True), amax_rht, f"rht amax {cpu_isa} {threads} threads")
    # Both in the one pass the packed quantize takes.
    both = nvfp4_quantize._amaxes(x, True, True)
    assert_bitwise_equal(both[0], amax, "fused amax")
    assert_bitwise_equal(both[1], amax_rht, "fused rht amax")


@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_amax_maximum_in_every_position(cpu_isa, dtype):
    """The largest value in each row and column (vector lanes, chunk tails, every row of a band) is found."""
    m, k = 32, 83
    for r, c in [(0, 0), (15, 63), (16, 64), (31, 82), (7, 79), (20, 8)]:
        x = torch.full((m, k), 0.5).to(dtype)
        x[r, c] = -3.0
        amax, amax_rht = _reference(x)
        assert_bitwise_equal(ops.nvfp4_amax(x), amax, f"amax, -3 at {(r, c)}")
        assert_bitwise_equal(ops.nvfp4_amax(x, rht=True), amax_rht, f"rht amax, -3 at {(r, c)}")


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("special", ["inf", "-inf", "nan", "two_inf"])
def test_amax_special_values(cpu_isa, dtype, special):
    """An inf is the amax (and inf or, where the transform meets inf - inf, NaN of the transformed copy), as
    the torch form gives; a NaN makes both NaN."""
    x = _input((32, 40), torch.float32)
    if special == "two_inf":
        x[3, 5], x[4, 5] = float("inf"), float("inf")  # one block: the butterfly makes inf - inf
    else:
        x[17, 33] = float(special)
    x = x.to(dtype)
    amax, amax_rht = _reference(x)
    assert_bitwise_equal(ops.nvfp4_amax(x), amax, "amax", any_nan=True)
    assert_bitwise_equal(ops.nvfp4_amax(x, rht=True), amax_rht, "rht amax", any_nan=True)
    assert torch.isnan(ops.nvfp4_amax(x, rht=True)) == torch.isnan(amax_rht)


def test_amax_empty_and_noncontiguous():
    assert ops.nvfp4_amax(torch.empty(0, 32)).item() == 0.0
    assert ops.nvfp4_amax(torch.empty(0, 32), rht=True).item() == 0.0
    x = _input((64, 48), torch.float32).t()  # (48, 64), a transposed view
    amax, amax_rht = _reference(x)
    assert_bitwise_equal(ops.nvfp4_amax(x), amax, "amax of a view")
    assert_bitwise_equal(ops.nvfp4_amax(x, rht=True), amax_rht, "rht amax of a view")


def test_amax_torch_form_off_the_cpu_kernel():
    """Meta and fake tensors take the torch ops (shape inference, tracing)."""
    out = ops.nvfp4_amax(torch.empty(32, 16, device="meta"), rht=True)
    assert out.device.type == "meta" and out.shape == () and out.dtype == torch.float32
    with FakeTensorMode():
        out = ops.nvfp4_amax(torch.empty(32, 16), rht=True)
    assert isinstance(out, torch._subclasses.FakeTensor)


def test_amax_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.nvfp4_amax(torch.ones(20, 16), rht=True)
    x = torch.ones(32, 16)
    out = torch.empty((), dtype=torch.float32)
    with pytest.raises(ValueError, match="at least one of 'amax' and 'amax_rht'"):
        _C.nvfp4_amax(desc(x, "t", "x"), None, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        _C.nvfp4_amax(desc(torch.ones(20, 16), "t", "x"), None, desc(out, "t", "amax_rht"))
    with pytest.raises(TypeError, match="'x'"):
        _C.nvfp4_amax(desc(torch.ones(32, 16, dtype=torch.int32), "t", "x"), desc(out, "t", "amax"), None)
    with pytest.raises((TypeError, ValueError), match="'amax'"):
        _C.nvfp4_amax(desc(x, "t", "x"), desc(torch.empty(2), "t", "amax"), None)
    with pytest.raises(ValueError, match="contiguous"):
        _C.nvfp4_amax(desc(torch.ones(32, 32).t()[:, :16], "t", "x"), desc(out, "t", "amax"), None)
