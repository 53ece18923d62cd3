"""Bad input to the quantize family: a TypeError or ValueError naming the argument, never a crash."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_linear import _C, ops
from transformer_linear._tensor import desc

E4M3 = torch.float8_e4m3fn


def one() -> torch.Tensor:
    return torch.ones(1)


def raw(t: torch.Tensor, shape=None, strides=None, device: int = 0) -> tuple:
    """A descriptor tuple with hand-set fields (torch cannot make negative strides)."""
    d = desc(t, "test", "t")
    return (d[0], d[1], d[2] if shape is None else shape, d[3] if strides is None else strides, device, -1)


def call_quantize(x, output=None, output_t=None, scale=None, margin=0):
    """_C.quantize with well-formed defaults for every argument but the ones given."""
    x = x if isinstance(x, tuple) else desc(x, "test", "input")
    if output is None and output_t is None:
        output = desc(torch.empty(4, dtype=E4M3), "test", "output")
    return _C.quantize(
        x,
        scale if scale is not None else desc(one(), "test", "scale"),
        output,
        output_t,
        desc(torch.empty(1), "test", "scale_inv"),
        desc(torch.empty(()), "test", "amax"),
        None,
        False,
        margin,
    )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ops.quantize(torch.ones(4, dtype=torch.int32), one(), E4M3), TypeError, "'input' must have dtype"),
        (lambda: ops.quantize(torch.ones(4, dtype=torch.float64), one(), E4M3), TypeError, "'input' .*got float64"),
        (lambda: ops.quantize(torch.ones(4), one(), torch.float16), TypeError, "'dtype' must be torch.float8"),
        (lambda: ops.quantize(torch.ones(4), one(), "float8"), TypeError, "'dtype'"),
        (lambda: ops.quantize(torch.ones(4, 4).t(), one(), E4M3), ValueError, "'input' must be contiguous"),
        (lambda: ops.quantize(torch.ones(4, 8)[:, ::2], one(), E4M3), ValueError, "'input' must be contiguous"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(2), E4M3), ValueError, "'scale' must be a one-element"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, 1), E4M3), ValueError, "'scale' must be a one-element"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, dtype=torch.float64), E4M3), TypeError, "'scale' must have dtype float32"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, device="meta"), E4M3), TypeError, "'scale' must be on cpu"),
        (lambda: ops.quantize([1.0, 2.0], one(), E4M3), TypeError, "'input' must be a torch.Tensor, got list"),
        (lambda: ops.quantize(torch.ones(4), 1.0, E4M3), TypeError, "'scale' must be a torch.Tensor, got float"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=-1), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=1.0), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=math.nan), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=127), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=True), ValueError, "'margin'"),
        (lambda: ops.quantize_fused(torch.ones(4), E4M3, rowwise=False), ValueError, "'rowwise' and 'columnwise'"),
        (lambda: ops.quantize_fused(torch.ones(4), E4M3, dbias_dtype=torch.int8), TypeError, "'dbias_dtype'"),
        (lambda: ops.quantize(torch.ones([1] * 9), one(), E4M3), ValueError, "rank 9 exceeds"),
        (lambda: ops.amax(torch.ones(4, dtype=torch.int64)), TypeError, "amax: argument 'input' must have dtype"),
        (lambda: ops.amax(3.0), TypeError, "amax: argument 'input' must be a torch.Tensor"),
        (lambda: ops.amax(torch.ones(4, 4).t()), ValueError, "amax: argument 'input' must be contiguous"),
        (lambda: ops.dequantize(torch.ones(4), one(), torch.float32), TypeError, "dequantize: argument 'input'"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), one(), torch.int32), TypeError, "'out_dtype'"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), torch.ones(3), torch.float32), ValueError, "'scale_inv'"),
        (lambda: ops.dequantize(torch.ones(4, 4).to(E4M3).t(), one(), torch.float32), ValueError, "'input' must be contiguous"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), None, torch.float32), TypeError, "'scale_inv' must be a torch.Tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_public_functions_reject(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_meta_tensors_take_the_fake_path():
    """All-meta arguments trace shapes (torch.compile's fake tensors) rather than fail."""
    out = ops.quantize_fused(torch.ones(3, 4, device="meta"), E4M3, columnwise=True)
    assert out.data.device.type == "meta" and out.data_t.shape == (4, 3)


def test_meta_descriptor_reaching_the_kernel():
    with pytest.raises((TypeError, ValueError), match="'input'"):
        call_quantize(torch.ones(4, device="meta"))


def test_unknown_device_code():
    with pytest.raises(TypeError, match="'input' must be on cpu or cuda, got an unsupported device"):
        call_quantize(raw(torch.ones(4), device=2))


def test_negative_stride():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="'input' has a negative stride"):
        call_quantize(raw(x, strides=(-1,)))


def test_rank_above_eight_descriptor():
    x = torch.ones(1)
    with pytest.raises(ValueError, match="rank 9 exceeds"):
        call_quantize(raw(x, shape=(1,) * 9, strides=(1,) * 9))


def test_output_shape_mismatch():
    with pytest.raises(ValueError, match="'output' must have the shape of 'input'"):
        call_quantize(torch.ones(5))
    with pytest.raises(ValueError, match="'output_t' must have shape"):
        call_quantize(torch.ones(2, 3), output_t=desc(torch.empty(2, 3, dtype=E4M3), "t", "output_t"))


def test_margin_out_of_range_at_the_kernel():
    with pytest.raises(ValueError, match="'margin' must be in"):
        call_quantize(torch.ones(4), margin=-5)


def test_descriptor_that_is_not_a_tuple():
    with pytest.raises(TypeError):
        _C.amax([1, 2, 3], desc(torch.empty(()), "t", "amax"))
