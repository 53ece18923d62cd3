"""The CPU kernel of the grouped columnwise copy (csrc/cpu/quantize_grouped_cpu.cpp) against the
PyTorch-op path of ops.grouped_quantize (which CUDA, meta and fake tensors take), bitwise: every
token block and scale option, fp32/bf16/fp16 inputs, every CPU path, routings with empty groups,
groups starting inside token blocks, total not a multiple of the block, tokens past the last group;
C above one column band; threads; bad ``offs``; the fake path's shapes."""

from __future__ import annotations

import pytest
import torch
from blockwise_cases import E4M3, E5M2
from cpu_paths import SUPPORTED_ISAS
from grouped_cases import PATTERNS, offsets, routing

from transformer_linear import _C
from transformer_linear.formats.grouped_scaling import WHOLE
from transformer_linear.ops import grouped_quantize
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise

TOKEN_BLOCKS = [128, 32, WHOLE]


def _torch_ops_path(monkeypatch, *args):
    """The copy made of PyTorch ops (the path CUDA takes), computed on the CPU."""
    with monkeypatch.context() as m:
        m.setattr(grouped_quantize, "_on_host", lambda t: False)
        return quantize_grouped_columnwise(*args)


def _assert_same_bits(got, want, what):
    assert got.data_t.dtype == want.data_t.dtype and got.data_t.shape == want.data_t.shape, what
    assert got.scale_inv_t.dtype == want.scale_inv_t.dtype and got.scale_inv_t.shape == want.scale_inv_t.shape, what
    for name, a, b in (("data_t", got.data_t, want.data_t), ("scale_inv_t", got.scale_inv_t, want.scale_inv_t)):
        if a.numel() == 0:  # shapes checked above; an empty tensor's strides may not allow the byte view
            continue
        diff = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).nonzero()
        assert len(diff) == 0, f"{what}: {name} first mismatch at {diff[0].tolist()}"


def _input(total, cols, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, cols, generator=gen) * torch.exp2(torch.randint(-8, 9, (total, 1), generator=gen).float())
    if total > 40:
        x[20:40] = 0.0  # an all-zero stretch: scale 1
    return x.to(dtype)


@pytest.fixture(params=SUPPORTED_ISAS)
def cpu_isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


@pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_torch_ops_bitwise(monkeypatch, cpu_isa, token_block, pattern, x_dtype):
    """total (301) not a multiple of either token block; groups start inside blocks."""
    total, cols = 301, 40
    x = _input(total, cols, x_dtype)
    offs = offsets(routing(pattern, total, 5))
    for fp8 in (E4M3, E5M2):
        got = quantize_grouped_columnwise(x, offs, fp8, token_block)
        _assert_same_bits(got, _torch_ops_path(monkeypatch, x, offs, fp8, token_block),
                          f"{cpu_isa} {token_block} {pattern} {x_dtype} {fp8}")


@pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
@pytest.mark.parametrize("power_2_scale", [False, True])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_cpu_kernel_scale_options(monkeypatch, token_block, power_2_scale, rounding):
    x = _input(150, 24, torch.float32) * 300
    offs = offsets([40, 0, 3, 67, 40])
    args = (x, offs, E5M2, token_block, power_2_scale, rounding)
    _assert_same_bits(quantize_grouped_columnwise(*args), _torch_ops_path(monkeypatch, *args),
                      f"{token_block} {power_2_scale} {rounding}")


@pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
def test_cpu_kernel_wide_fp16_noncontiguous_and_threads(monkeypatch, token_block):
    """C over two column bands (256), an fp16 transposed view, 1 and 2 threads give the same bits."""
    x = _input(600, 2 * 300, torch.float16).t().contiguous().t()[:, :530]
    x = x[: 600 - 7]  # total 593, not a multiple of the block
    offs = offsets([0, 129, 1, 250, 0, 200])
    want = _torch_ops_path(monkeypatch, x, offs, E4M3, token_block)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _assert_same_bits(quantize_grouped_columnwise(x, offs, E4M3, token_block), want, f"{token_block} {n}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("total, cols, sizes", [(0, 8, [0, 0]), (16, 0, [10, 6]), (12, 8, []), (0, 0, [])])
def test_cpu_kernel_empty(monkeypatch, total, cols, sizes):
    x = torch.randn(total, cols)
    offs = offsets(sizes) if sizes else torch.zeros(0, dtype=torch.int32)
    for token_block in TOKEN_BLOCKS:
        _assert_same_bits(quantize_grouped_columnwise(x, offs, E4M3, token_block),
                          _torch_ops_path(monkeypatch, x, offs, E4M3, token_block), f"{token_block} {total}x{cols}")


@pytest.mark.parametrize("bad", [[5, 3, 10], [-1, 4, 10], [4, 8, 31], [0, 0, 2**31 - 1]])
def test_cpu_kernel_bad_offs_values(bad):
    x = torch.randn(30, 8)
    with pytest.raises(ValueError, match="'offs'"):
        quantize_grouped_columnwise(x, torch.tensor(bad, dtype=torch.int32), E4M3, 128)


def test_fake_tensors_take_the_torch_ops_path():
    """Meta tensors (what register_fake and tracing see) never reach the kernel: same shapes and dtypes."""
    x = torch.randn(130, 24)
    offs = offsets([60, 0, 70])
    for token_block in TOKEN_BLOCKS:
        real = quantize_grouped_columnwise(x, offs, E4M3, token_block)
        meta = quantize_grouped_columnwise(x.to("meta"), offs.to("meta"), E4M3, token_block)
        assert meta.data_t.shape == real.data_t.shape and meta.scale_inv_t.shape == real.scale_inv_t.shape
        assert meta.scale_inv_t.dtype == real.scale_inv_t.dtype


@pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
def test_traced_cpu_calls_hold_the_kernel_op(token_block):
    """Traced on the CPU, the copy is the C++ kernel's op, opaque to the graph (Inductor's CPU code has no
    E8M0 type to compute MXFP8's scales in): bitwise eager's under Inductor, with any routing, and the op
    passes opcheck."""
    x = torch.randn(130, 24)
    torch.library.opcheck(grouped_quantize._quantize_cpu_op,
                          (x, offsets([60, 0, 70]), E4M3, token_block, False, "ceil"))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, offs: quantize_grouped_columnwise(x, offs, E4M3, token_block),
                             backend="inductor", fullgraph=True)
    for sizes in ([60, 0, 70], [130, 0, 0], [10, 20, 30]):
        offs = offsets(sizes)
        _assert_same_bits(compiled(x, offs), quantize_grouped_columnwise(x, offs, E4M3, token_block),
                          f"token_block {token_block}, groups {sizes}")
