"""The grouped NVFP4 GEMMs of the extension (ops.grouped_nvfp4 on the CPU: csrc/cpu/gemm_grouped_nvfp4_cpu.cpp)
against the torch.where path they replace (every expert's NVFP4 GEMM on all the tokens, each row taken from its
own expert's; each expert's wgrad over all the tokens) and the reference (reference.nvfp4), bit for bit: over
routings (empty groups, one group, groups not aligned to 16, rows past offs[-1]), output dtypes, the CPU paths and
thread counts; bad ``offs``; opcheck; no host read of ``offs`` from Python."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import SUPPORTED_ISAS
from grouped_cases import host_reads_of
from tolerances import assert_bitwise_equal

from transformer_linear import _C
from transformer_linear.ops import grouped_nvfp4, nvfp4
from transformer_linear.reference import grouped as reference_grouped
from transformer_linear.reference import nvfp4 as ref

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Group sizes (sum <= tokens; what is left over belongs to no group): not multiples of 16, empty groups
# first / in the middle / last, every token in one group, leftovers past offs[-1], a single block.
ROUTINGS = {
    "uneven": [37, 5, 70, 48],
    "empty_groups": [0, 61, 0, 99],
    "one_group": [0, 0, 160, 0],
    "leftovers": [17, 0, 33, 62],
    "tiny": [1, 2, 3, 4],
    "all_empty": [0, 0, 0, 0],
}
T = 160  # tokens (a multiple of 16: the columnwise copies wgrad reads block them in 16s)


@pytest.fixture(params=SUPPORTED_ISAS)
def gemm_isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


@pytest.fixture(params=[1, 2])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _offs(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _packed(x: torch.Tensor, columnwise: bool = False, rht: bool = False, sr_seed: int = None):
    """(data, packed scales) of x's rowwise or columnwise NVFP4 copy."""
    seed = None if sr_seed is None else torch.tensor(sr_seed, dtype=torch.int64)
    out = nvfp4.quantize_nvfp4_packed(x, rowwise=not columnwise, columnwise=columnwise, rht=rht,
                                      stochastic_rounding=sr_seed is not None, seed=seed)
    return (out[2], out[3]) if columnwise else (out[0], out[1])


def _forward_operands(sizes, k, n, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(T, k) * torch.logspace(-2, 2, T).unsqueeze(1)  # rows of very different magnitudes
    a, a_scale_inv = _packed(x)
    weights = [_packed(torch.randn(n, k) * (g + 1)) for g in range(len(sizes))]
    b = torch.stack([w[0] for w in weights]) if weights else torch.zeros(0, n, k // 2, dtype=torch.uint8)
    b_scale_inv = (torch.stack([w[1].view(torch.uint8) for w in weights]).view(torch.float8_e4m3fn) if weights else
                   torch.zeros(0, nvfp4.packed_scale_numel(n, k), dtype=torch.float8_e4m3fn))
    return a, a_scale_inv, b, b_scale_inv


def _reference_forward(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias):
    total, k = a.shape[0], 2 * a.shape[1]
    n = b.shape[1]
    a_scale, a_global = nvfp4.unpack_scales(a_scale_inv, total, k)
    out = torch.zeros(total, n, dtype=out_dtype)
    for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, total)):
        b_scale, b_global = nvfp4.unpack_scales(b_scale_inv[g], n, k)
        out[start:end] = ref.nvfp4_gemm(a[start:end], a_scale[start:end], a_global, b[g], b_scale, b_global,
                                        out_dtype, None if bias is None else bias[g])
    return out


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_bitwise_the_masked_path_and_the_reference(gemm_isa, routing, out_dtype, with_bias):
    sizes = ROUTINGS[routing]
    k, n = 48, 40
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, k, n)
    offs = _offs(sizes)
    bias = torch.randn(len(sizes), n).to(out_dtype) if with_bias else None
    got = grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    masked = grouped_nvfp4._masked_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    assert_bitwise_equal(got, masked, f"{routing}: grouped kernel vs the torch.where path")
    expected = _reference_forward(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    assert_bitwise_equal(got, expected, f"{routing}: grouped kernel vs the reference")
    assert not got[int(sum(sizes)):].any(), "rows past offs[-1] are 0"


@pytest.mark.parametrize("routing", ["uneven", "one_group", "leftovers"])
def test_forward_threads_and_large_groups(threads, routing):
    """Large groups (split across the threads) and small ones (side by side), the same bits at 1 and 2 threads."""
    sizes = ROUTINGS[routing]
    k, n = 1056, 96  # 2 * rows * n * k above the kernel's threading threshold for the larger groups
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, k, n, seed=1)
    offs = _offs(sizes)
    got = grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.bfloat16)
    masked = grouped_nvfp4._masked_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.bfloat16, None)
    assert_bitwise_equal(got, masked, f"{routing}, {threads} threads: grouped kernel vs the torch.where path")


def _wgrad_operands(sizes, n, k, rht=False, sr=False, seed=0):
    """Each group's columnwise copies of the tokens masked to it, stacked (as the GroupedLinear's backward)."""
    torch.manual_seed(seed)
    grad = torch.randn(T, n) * torch.logspace(1, -1, T).unsqueeze(1)
    x = torch.randn(T, k)
    group = grouped_nvfp4.group_of_rows(T, _offs(sizes)).unsqueeze(1)
    copies = {"grad_t": [], "x_t": []}
    for g in range(len(sizes)):
        for name, t, sr_seed in (("grad_t", grad, 100 + g if sr else None), ("x_t", x, None)):
            copies[name].append(_packed(torch.where(group == g, t, 0.0), columnwise=True, rht=rht, sr_seed=sr_seed))

    def stacked(parts, rows):
        if not parts:
            return (torch.zeros(0, rows, T // 2, dtype=torch.uint8),
                    torch.zeros(0, nvfp4.packed_scale_numel(rows, T), dtype=torch.float8_e4m3fn))
        return (torch.stack([p[0] for p in parts]),
                torch.stack([p[1].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn))

    return (*stacked(copies["grad_t"], n), *stacked(copies["x_t"], k))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("quantizer", ["rne", "rht_sr"])
def test_wgrad_bitwise_the_full_loop_and_the_reference(gemm_isa, routing, out_dtype, quantizer):
    sizes = ROUTINGS[routing]
    n, k = 40, 48
    rht = sr = quantizer == "rht_sr"
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, n, k, rht=rht, sr=sr)
    offs = _offs(sizes)
    got = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, out_dtype, offs=offs)
    full = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, out_dtype)
    assert_bitwise_equal(got, full, f"{routing}: the group's token blocks vs every token")
    for g in range(len(sizes)):
        gs, gg = nvfp4.unpack_scales(grad_scale[g], n, T)
        xs, xg = nvfp4.unpack_scales(x_scale[g], k, T)
        expected = ref.nvfp4_gemm(grad_t[g], gs, gg, x_t[g], xs, xg, out_dtype)
        assert_bitwise_equal(got[g], expected, f"{routing}: group {g} vs the reference")
    for g, size in enumerate(sizes):
        if size == 0:
            assert not got[g].any(), f"empty group {g}: zero weight gradient"


@pytest.mark.parametrize("routing", ["uneven", "one_group", "leftovers"])
def test_wgrad_threads_and_large_groups(threads, routing):
    sizes = ROUTINGS[routing]
    n, k = 256, 272
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, n, k, seed=3)
    offs = _offs(sizes)
    got = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32, offs=offs)
    full = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32)
    assert_bitwise_equal(got, full, f"{routing}, {threads} threads")


def test_no_groups():
    a, a_scale_inv, b, b_scale_inv = _forward_operands([], 32, 8)
    offs = torch.zeros(0, dtype=torch.int32)
    out = grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.float32)
    assert out.shape == (T, 8) and not out.any()
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands([], 8, 16)
    assert grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32,
                                                  offs=offs).shape == (0, 8, 16)


def test_no_host_read_of_offs():
    sizes = ROUTINGS["uneven"]
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, 32, 16)
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, 16, 32)
    offs = _offs(sizes)
    with host_reads_of(offs) as reads:
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.float32)
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32, offs=offs)
    assert reads == []


@pytest.mark.parametrize("bad", [[40, 30, 100, 150], [-1, 30, 100, 150], [10, 30, 100, T + 1]])
def test_bad_offs_raise_naming_offs(bad):
    sizes = ROUTINGS["uneven"]
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, 32, 16)
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, 16, 32)
    offs = torch.tensor(bad, dtype=torch.int32)
    with pytest.raises(ValueError, match="'offs'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.float32)
    with pytest.raises(ValueError, match="'offs'"):
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32, offs=offs)


def test_bad_arguments_name_the_argument():
    sizes = ROUTINGS["uneven"]
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, 32, 16)
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, 16, 32)
    offs = _offs(sizes)
    with pytest.raises(TypeError, match="'offs'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs.long(), torch.float32)
    with pytest.raises(ValueError, match="'offs'"):
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale, torch.float32, offs=offs[:3])
    with pytest.raises(ValueError, match="'b_scale_inv'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv[:, :-1], offs, torch.float32)
    with pytest.raises(ValueError, match="'a_scale_inv'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv[:-1], b, b_scale_inv, offs, torch.float32)
    with pytest.raises(ValueError, match="'x_t'"):
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t[:, :, :-8], x_scale, torch.float32, offs=offs)
    with pytest.raises(TypeError, match="'bias'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.float32,
                                         torch.zeros(4, 16, dtype=torch.bfloat16))
    # A non-finite global scale (packed in the scales' first 8 elements) is rejected, as nvfp4_gemm does.
    nan_scale = b_scale_inv.clone()
    nan_scale.view(torch.uint8)[1, :8] = torch.tensor([0, 0, 0, 0, 0, 0xC, 0xF, 0x7], dtype=torch.uint8)
    with pytest.raises(ValueError, match="finite"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, nan_scale, offs, torch.float32)


def test_opcheck():
    sizes = ROUTINGS["leftovers"]
    a, a_scale_inv, b, b_scale_inv = _forward_operands(sizes, 32, 16)
    grad_t, grad_scale, x_t, x_scale = _wgrad_operands(sizes, 16, 32)
    offs = _offs(sizes)
    bias = torch.randn(4, 16)
    torch.library.opcheck(torch.ops.transformer_linear.nvfp4_grouped_gemm.default,
                          (a, a_scale_inv, b, b_scale_inv, offs, torch.float32, bias))
    torch.library.opcheck(torch.ops.transformer_linear.nvfp4_grouped_gemm_wgrad.default,
                          (grad_t, grad_scale, x_t, x_scale, offs, torch.bfloat16))
