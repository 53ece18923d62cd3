"""The grouped NVFP4 kernels of the extension (ops.grouped_nvfp4 on the CPU: csrc/cpu/gemm_grouped_nvfp4_cpu.cpp,
quantize_grouped_nvfp4_cpu.cpp) against the paths they replace (every expert's NVFP4 GEMM on all the tokens, each
row taken from its own expert's; each expert's wgrad over all the tokens; each group's masked copy of all the
tokens quantized) and the reference (reference.nvfp4), bit for bit: over routings (empty groups, one group, groups
not aligned to 16, rows past offs[-1]), dtypes, the CPU paths and thread counts; bad ``offs``; opcheck; no host
read of ``offs`` from Python; tl.GroupedLinear's NVFP4 training step bitwise the old path. The wgrad operands are
compact (each group's 16-token bands only): compared with the masked copies by expanding them back
(ops.grouped_nvfp4.expand_columnwise), and the bytes a training step saves for backward measured."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from cpu_paths import QUANTIZE_ISAS, SUPPORTED_ISAS
from grouped_cases import host_reads_of
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear import _C
from transformer_linear.formats.nvfp4 import hadamard_amax_of_transpose
from transformer_linear.recipe import kind_nvfp4
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
T = 160  # tokens (any count is taken: test_grouped_quantize_takes_any_token_count)


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


def _packed(x: torch.Tensor, columnwise: bool = False, rht: bool = False, sr_seed: Optional[int] = None):
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


def _masked_wgrad_operands(sizes, n, k, rht=False, sr=False, seed=0):
    """Each group's columnwise copies of the tokens masked to it, stacked (as the GroupedLinear's backward made
    them before the compact form): (G, R, T/2) data, (G, 8 + R * T/16) packed scales, for grad and x."""
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


def _wgrad_operands(sizes, n, k, rht=False, sr=False, seed=0):
    """The compact form (ops.grouped_nvfp4.compact_columnwise) of :func:`_masked_wgrad_operands`."""
    grad_t, grad_scale, x_t, x_scale = _masked_wgrad_operands(sizes, n, k, rht, sr, seed)
    offs = _offs(sizes)
    return (*grouped_nvfp4.compact_columnwise(grad_t, grad_scale, offs),
            *grouped_nvfp4.compact_columnwise(x_t, x_scale, offs))


def _assert_expands_to(data, scales, masked_data, masked_scales, offs, what):
    expanded_data, expanded_scales = grouped_nvfp4.expand_columnwise(data, scales, offs)
    assert_bitwise_equal(expanded_data, masked_data, f"{what}: data expanded vs the masked copies")
    assert_bitwise_equal(expanded_scales.view(torch.uint8), masked_scales.view(torch.uint8),
                         f"{what}: scales expanded vs the masked copies")


@pytest.mark.parametrize("routing", ROUTINGS)
def test_compact_form_round_trips_and_is_input_sized(routing):
    """compact_columnwise keeps each group's bands (the rest of a masked copy is zeros), expand_columnwise gives
    the masked copies back bit for bit, and the compact copy holds T + 16 (G - 1) tokens."""
    sizes = ROUTINGS[routing]
    offs = _offs(sizes)
    masked = _masked_wgrad_operands(sizes, 24, 40, rht=True, sr=True)
    for rows, (data_t, scale_t) in ((24, masked[:2]), (40, masked[2:])):
        data, scales = grouped_nvfp4.compact_columnwise(data_t, scale_t, offs)
        capacity = grouped_nvfp4.compact_tokens(T, len(sizes))
        assert capacity == T + 16 * (len(sizes) - 1)
        assert data.shape == (rows, capacity // 2) and scales.shape == (8 * len(sizes) + rows * capacity // 16,)
        _assert_expands_to(data, scales, data_t, scale_t, offs, routing)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("quantizer", ["rne", "rht_sr"])
def test_wgrad_bitwise_the_full_loop_and_the_reference(gemm_isa, routing, out_dtype, quantizer):
    sizes = ROUTINGS[routing]
    n, k = 40, 48
    rht = sr = quantizer == "rht_sr"
    masked = _masked_wgrad_operands(sizes, n, k, rht=rht, sr=sr)
    grad_t, grad_scale, x_t, x_scale = masked
    compact = _wgrad_operands(sizes, n, k, rht=rht, sr=sr)
    offs = _offs(sizes)
    got = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(*compact, out_dtype, offs=offs)
    full = grouped_nvfp4._looped_wgrad(*masked, out_dtype)
    assert_bitwise_equal(got, full, f"{routing}: the group's bands vs every token of the masked copies")
    expanded = grouped_nvfp4._expanded_wgrad(*compact, offs, out_dtype)
    assert_bitwise_equal(expanded, full, f"{routing}: the torch path (expanded copies) vs every token")
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
    offs = _offs(sizes)
    got = grouped_nvfp4.nvfp4_grouped_gemm_wgrad(*_wgrad_operands(sizes, n, k, seed=3), torch.float32, offs=offs)
    full = grouped_nvfp4._looped_wgrad(*_masked_wgrad_operands(sizes, n, k, seed=3), torch.float32)
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
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t[:, :-8], x_scale, torch.float32, offs=offs)
    with pytest.raises(ValueError, match="'x_t_scale_inv'"):
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t, grad_scale, x_t, x_scale[:-1], torch.float32, offs=offs)
    with pytest.raises(TypeError, match="'grad_t'"):
        grouped_nvfp4.nvfp4_grouped_gemm_wgrad(grad_t.unsqueeze(0), grad_scale, x_t, x_scale, torch.float32, offs=offs)
    with pytest.raises(TypeError, match="'bias'"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, torch.float32,
                                         torch.zeros(4, 16, dtype=torch.bfloat16))
    # A non-finite global scale (packed in the scales' first 8 elements) is rejected, as nvfp4_gemm does.
    nan_scale = b_scale_inv.clone()
    nan_scale.view(torch.uint8)[1, :8] = torch.tensor([0, 0, 0, 0, 0, 0xC, 0xF, 0x7], dtype=torch.uint8)
    with pytest.raises(ValueError, match="finite"):
        grouped_nvfp4.nvfp4_grouped_gemm(a, a_scale_inv, b, nan_scale, offs, torch.float32)


@pytest.mark.usefixtures("allclose_on_fp8")
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


QUANTIZE_OPTIONS = {"rne": {}, "rht": {"rht": True}, "sr": {"stochastic_rounding": True},
                    "rht_sr": {"rht": True, "stochastic_rounding": True}}


@pytest.fixture(params=QUANTIZE_ISAS)
def quantize_isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def _check_grouped_copies(x, sizes, option, what):
    offs = _offs(sizes)
    kwargs = QUANTIZE_OPTIONS[option]
    seeds = torch.tensor([(-1) ** g * (12345 + 2**40 * g) for g in range(len(sizes))], dtype=torch.int64)
    if not kwargs.get("stochastic_rounding"):
        seeds = None
    data, scales = grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x, offs, seeds=seeds, **kwargs)
    rht, sr = kwargs.get("rht", False), kwargs.get("stochastic_rounding", False)
    masked_data, masked_scale = grouped_nvfp4._masked_grouped_quantize(x, offs, rht, sr, seeds)
    _assert_expands_to(data, scales, masked_data, masked_scale, offs, what)
    torch_data, torch_scales = grouped_nvfp4._compact_grouped_quantize(x, offs, rht, sr, seeds)
    assert_bitwise_equal(data, torch_data, f"{what}: compact data vs the torch path's")
    assert_bitwise_equal(scales.view(torch.uint8), torch_scales.view(torch.uint8),
                         f"{what}: compact scales vs the torch path's")
    data_t, scale_t = grouped_nvfp4.expand_columnwise(data, scales, offs)
    for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, x.shape[0])):
        masked = x.new_zeros((-(-x.shape[0] // 16) * 16, x.shape[1]))  # the tokens padded to a multiple of 16
        masked[start:end] = x[start:end]
        amax = masked.float().abs().amax()
        amax_t = hadamard_amax_of_transpose(masked) if kwargs.get("rht") else None
        q = ref.quantize_nvfp4(masked, amax, amax_t, rowwise=False, columnwise=True,
                               seed=0 if seeds is None else int(seeds[g]), **kwargs)
        assert_bitwise_equal(data_t[g], q.data_t.view(torch.uint8), f"{what}: group {g} data vs the reference")
        packed = nvfp4.pack_scales(q.scale_t, q.global_scale_t)
        assert_bitwise_equal(scale_t[g].view(torch.uint8), packed.view(torch.uint8),
                             f"{what}: group {g} scales vs the reference")


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("option", QUANTIZE_OPTIONS)
def test_grouped_quantize_bitwise_the_masked_copies_and_the_reference(quantize_isa, routing, dtype, option):
    torch.manual_seed(4)
    x = (torch.randn(T, 48) * torch.logspace(-3, 3, T).unsqueeze(1)).to(dtype)
    _check_grouped_copies(x, ROUTINGS[routing], option, routing)


@pytest.mark.parametrize("option", ["rne", "rht_sr"])
@pytest.mark.parametrize("sizes", [[0, 1], [7, 0, 8], [37, 5, 70, 39]], ids=["1", "15", "151"])
def test_grouped_quantize_takes_any_token_count(quantize_isa, option, sizes):
    """Tokens not a multiple of 16 (the last one's group included): the copies of the tokens padded with zero
    rows of no group, bitwise the masked copies' and the reference's."""
    torch.manual_seed(6)
    _check_grouped_copies(torch.randn(sum(sizes), 48), sizes, option, f"{sum(sizes)} tokens")


@pytest.mark.parametrize("option", ["rne", "rht_sr"])
def test_grouped_quantize_threads_and_wide_rows(threads, option):
    torch.manual_seed(5)
    x = torch.randn(T, 528)  # wider than the kernel's column chunk
    _check_grouped_copies(x, ROUTINGS["uneven"], option, f"{threads} threads")


def test_grouped_quantize_bad_input():
    x = torch.randn(T, 32)
    offs = _offs(ROUTINGS["uneven"])
    with pytest.raises(ValueError, match="'offs'"):
        grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x, torch.tensor([50, 40, 100, 150], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'offs' must be nondecreasing cumulative row ends in \[0, 152\]"):
        grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x[:T - 8], offs)  # offs past the rows (not the padding)
    with pytest.raises(ValueError, match="'seeds'"):
        grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x, offs, stochastic_rounding=True)
    with pytest.raises(TypeError, match="'offs'"):
        grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x, offs.long())
    x[50, 3] = float("inf")  # group 2's global amax: as quantize_nvfp4, a ValueError
    with pytest.raises(ValueError, match="finite"):
        grouped_nvfp4.quantize_nvfp4_grouped_columnwise(x, offs)


@pytest.mark.usefixtures("allclose_on_fp8")
def test_opcheck_grouped_quantize():
    x = torch.randn(T, 32)
    offs = _offs(ROUTINGS["leftovers"])
    seeds = torch.arange(4, dtype=torch.int64)
    for rht, sr in ((False, False), (True, True)):
        torch.library.opcheck(torch.ops.transformer_linear.quantize_nvfp4_grouped_columnwise.default,
                              (x, offs, rht, sr, seeds if sr else None))


def _old_masked_path(monkeypatch):
    """The GroupedLinear's NVFP4 path as it was: masked copies quantized one by one, every expert on all tokens."""
    def masked_columnwise(q, t, offs):
        copies = [q.quantize(masked, rowwise=False, columnwise=True) for masked in kind_nvfp4.masked_to_groups(t, offs)]
        qt = tl.recipe.stack_experts(copies, rowwise=False, columnwise=True)
        return qt.data_t, qt.scale_inv_t

    def wgrad(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, out_dtype, offs=None):
        return grouped_nvfp4._looped_wgrad(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, out_dtype)

    monkeypatch.setattr(kind_nvfp4, "masked_columnwise", masked_columnwise)
    monkeypatch.setattr(kind_nvfp4, "nvfp4_grouped_gemm", grouped_nvfp4._masked_grouped_gemm)
    monkeypatch.setattr(kind_nvfp4, "nvfp4_grouped_gemm_wgrad", wgrad)


@pytest.mark.parametrize("routing", ["uneven", "empty_groups", "leftovers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_bitwise_the_old_path(monkeypatch, routing, dtype):
    """tl.GroupedLinear under the default NVFP4BlockScaling (RHT, stochastic rounding, 16x16 weights): out, dgrad,
    wgrad and dbias bit for bit as the torch.where / masked-copies path gave them, from the same seeds."""
    sizes = ROUTINGS[routing]
    torch.manual_seed(0)
    module = tl.GroupedLinear(len(sizes), 64, 48, recipe=tl.recipe.NVFP4BlockScaling(), dtype=dtype)
    x, grad = torch.randn(T, 64, dtype=dtype), torch.randn(T, 48, dtype=dtype)

    def run():
        torch.manual_seed(1)  # the stochastic-rounding seeds
        inp = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        y = module(inp, torch.tensor(sizes))
        y.backward(grad)
        return y.detach(), inp.grad, module.weight.grad, module.bias.grad

    new = run()
    with monkeypatch.context() as m:
        _old_masked_path(m)
        old = run()
    for name, a, b in zip(("out", "dgrad", "wgrad", "dbias"), new, old):
        assert_bitwise_equal(a, b, f"{routing}: {name} vs the old path")


@pytest.mark.parametrize("sizes", [[128] * 8, [300, 0, 17, 400, 1, 90, 0, 200]], ids=["uniform", "skewed"])
def test_grouped_linear_saves_the_input_fp4_size_not_groups_times_it(sizes):
    """What autograd keeps of a GroupedLinear NVFP4 step (saved_tensors_hooks) is the weight's columnwise copies
    and the input's compact wgrad copy, T + 16 (G - 1) tokens of FP4 with its scales: about the input's FP4
    size, where each group's masked copy of all the tokens kept G times it."""
    groups, tokens, k, n = len(sizes), 1024, 256, 32
    torch.manual_seed(0)
    module = tl.GroupedLinear(groups, k, n, recipe=tl.recipe.NVFP4BlockScaling(), dtype=torch.bfloat16)
    x = torch.randn(tokens, k, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, tuple[int, tuple, torch.dtype]] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x, torch.tensor(sizes))
    capacity = grouped_nvfp4.compact_tokens(tokens, groups)
    inp_fp4 = k * capacity // 2 + 8 * groups + k * capacity // 16
    weight_fp4 = groups * (n * k // 2 + nvfp4.packed_scale_numel(n, k))
    assert (k * capacity // 2, (k, capacity // 2), torch.uint8) in saved.values(), "the input's compact copy"
    total = sum(nbytes for nbytes, _, _ in saved.values())
    masked_fp4 = groups * (k * tokens // 2 + nvfp4.packed_scale_numel(k, tokens))
    assert inp_fp4 + weight_fp4 <= total <= inp_fp4 + weight_fp4 + 1024, (
        f"saved {total} bytes: want the input's compact copy {inp_fp4} + the weight's {weight_fp4} "
        f"(the masked copies were {masked_fp4})")
    assert inp_fp4 < 1.15 * (k * tokens // 2 + k * tokens // 16), "about the input's FP4 size"
    y.backward(torch.ones_like(y))  # the saved copies are what backward reads
    assert module.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_stochastic_rounding_matches_eager(backend):
    """The default recipe (RHT, stochastic rounding: one seed drawn per group for the wgrad copies) compiled with
    fullgraph=True gives eager's bits from the same torch.manual_seed: no draw merged or reordered."""
    torch.manual_seed(0)
    module = tl.GroupedLinear(4, 64, 48, recipe=tl.recipe.NVFP4BlockScaling())
    x, grad = torch.randn(T, 64), torch.randn(T, 48)
    compiled = torch.compile(module, backend=backend, fullgraph=True)

    def run(mod, sizes):
        torch.manual_seed(7)
        inp = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        y = mod(inp, torch.tensor(sizes))
        y.backward(grad)
        return y.detach(), inp.grad, module.weight.grad.clone()

    for routing in ("uneven", "one_group"):
        got, want = run(compiled, ROUTINGS[routing]), run(module, ROUTINGS[routing])
        for name, a, b in zip(("out", "dgrad", "wgrad"), got, want):
            assert_bitwise_equal(a, b, f"{backend}, {routing}: {name}")
