"""tl.GroupedLinear under NVFP4BlockScaling (ops.grouped_nvfp4): forward, dgrad and wgrad against the float64
product of the reference-quantized operands (reference.nvfp4), each expert's wgrad operands its tokens masked
to its group, for any token count (the columnwise copies pad the tokens with zero rows); close to a loop of
nn.Linear; no host read of the routing; torch.compile with changing routing and no recompile; torch.export;
bad shapes."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from grouped_cases import host_reads_of, nothing, offsets, routing
from tolerances import assert_close_to_reference, sqnr

import transformer_linear as tl
from transformer_linear.reference import grouped as reference_grouped
from transformer_linear.reference import nvfp4 as ref

G, K, N, T = 4, 64, 48, 96
# Groups of any size (not multiples of 16) and empty ones.
ROUTINGS = ["uniform", "skewed", "empty_groups"]
# NVFP4 (E2M1, 1x16 / 16x16 E4M3 block scales) against fp32 over these shapes: measured 16.5 / 14.8 / 15.6 dB.
MIN_SQNR_DB = {"out": 13.0, "dgrad": 12.0, "wgrad": 12.0}


def _recipe(exact=False):
    """``exact``: no RHT and no stochastic rounding, so that the reference quantizes as the kernels do."""
    return tl.recipe.NVFP4BlockScaling(disable_rht=exact, disable_stochastic_rounding=exact)


def _module(exact=False, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return tl.GroupedLinear(G, K, N, recipe=_recipe(exact), dtype=dtype)


def _run(module, x, m_splits, grad):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x, m_splits)
    y.backward(grad)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def _dequantized(t, scaling_2d=False, columnwise=False):
    """``t`` (2-D) through the reference NVFP4 quantizer and back, float64 (columnwise: of tᵀ, its tokens padded
    with zero rows to a multiple of 16, as the columnwise copies hold any token count)."""
    if columnwise:
        t = torch.cat([t, t.new_zeros((-t.shape[0] % 16, t.shape[1]))])
    q = ref.quantize_nvfp4(t.float(), t.abs().max().float(), rowwise=not columnwise, columnwise=columnwise,
                           scaling_2d=scaling_2d)
    if columnwise:
        return ref.dequantize_nvfp4(q.data_t, q.scale_t, q.global_scale_t).double()
    return ref.dequantize_nvfp4(q.data, q.scale, q.global_scale).double()


@pytest.mark.parametrize("tokens", [T, T - 7], ids=["multiple_of_16", "ragged"])
@pytest.mark.parametrize("pattern", ROUTINGS)
def test_matches_the_reference_quantized_operands(pattern, tokens):
    module = _module(exact=True)
    sizes = routing(pattern, tokens, G)
    x, grad = torch.randn(tokens, K), torch.randn(tokens, N)
    y, dx, dw, db = _run(module, x, torch.tensor(sizes), grad)
    bounds = reference_grouped.group_bounds(offsets(sizes), tokens)
    weight = module.weight.detach()
    xq, gq = _dequantized(x), _dequantized(grad)
    for g, (start, end) in enumerate(bounds):
        wq = _dequantized(weight[g], scaling_2d=True)  # 16x16 weight tiles: its transpose is the same blocks
        rows = slice(start, end)
        out = xq[rows] @ wq.t() + module.bias[g].detach().double()
        assert_close_to_reference(y[rows], out, out.float(), what=f"out group {g}")
        dgrad = gq[rows] @ wq
        assert_close_to_reference(dx[rows], dgrad, dgrad.float(), what=f"dgrad group {g}")
        # wgrad: the tokens of other groups zeroed, then quantized columnwise (blocks of 16 tokens).
        mask = torch.zeros(tokens, 1)
        mask[rows] = 1
        wgrad = _dequantized(grad * mask, columnwise=True) @ _dequantized(x * mask, columnwise=True).t()
        assert_close_to_reference(dw[g], wgrad, wgrad.float(), what=f"wgrad group {g}")
        assert torch.allclose(db[g], grad[rows].sum(0), rtol=1e-5, atol=1e-5)
    assert not y[bounds[-1][1]:].any()


@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_a_loop_of_nn_linear(pattern, dtype):
    module = _module(dtype=dtype)
    sizes = routing(pattern, T, G)
    x, grad = torch.randn(T, K, dtype=dtype), torch.randn(T, N, dtype=dtype)
    y, dx, dw, _ = _run(module, x, torch.tensor(sizes), grad)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    x_ref = x.float().requires_grad_(True)
    weight = module.weight.detach().float().requires_grad_(True)
    y_ref = torch.cat([part @ weight[g].t() + module.bias[g].detach().float()
                       for g, part in enumerate(x_ref.split(sizes))])
    y_ref.backward(grad.float())
    keep = [s > 0 for s in sizes]
    for name, actual, expected in (("out", y, y_ref), ("dgrad", dx, x_ref.grad),
                                   ("wgrad", dw[keep], weight.grad[keep])):
        got = sqnr(actual.float(), expected.detach())
        assert got >= MIN_SQNR_DB[name], f"{name}: SQNR {got:.1f} dB"
    assert not dw[[not k for k in keep]].any(), "an empty expert's weight gradient is 0"


def test_no_host_read_of_the_routing():
    module = _module()
    x = torch.randn(T, K, requires_grad=True)
    m_splits = torch.tensor(routing("skewed", T, G))
    with host_reads_of(m_splits) as reads:
        module(x, m_splits).backward(torch.randn(T, N))
    assert reads == []


def test_compile_fullgraph_changing_routing_no_recompile():
    module, eager = _module(exact=True), _module(exact=True)
    x = torch.randn(T, K)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    for pattern in ROUTINGS:
        m_splits = torch.tensor(routing(pattern, T, G))
        with torch._dynamo.config.patch(error_on_recompile=True) if counter.frame_count else nothing():
            got = _run(compiled, x, m_splits, torch.ones(T, N))
        want = _run(eager, x, m_splits, torch.ones(T, N))
        for a, b, name in zip(got, want, ("out", "dgrad", "wgrad", "dbias")):
            assert torch.equal(a, b), f"{pattern}: {name}"
    assert counter.frame_count == 1


def test_export():
    module = _module()
    x = torch.randn(T, K)
    program = torch.export.export(module, (x, torch.tensor(routing("skewed", T, G))))
    m_splits = torch.tensor(routing("empty_groups", T, G))
    assert torch.equal(program.module()(x, m_splits), module(x, m_splits))


def test_functional_form_and_autocast():
    module = _module()
    x, m_splits = torch.randn(T, K), torch.tensor(routing("skewed", T, G))
    offs = torch.cumsum(m_splits, 0, dtype=torch.int32)
    want = module(x, m_splits)
    assert torch.equal(tl.grouped_linear(x, module.weight, offs, module.bias, recipe=_recipe()), want)
    module.recipe = None
    with tl.autocast(recipe=_recipe()):
        assert torch.equal(module(x, m_splits), want)


def test_bad_grouped_nvfp4_arguments_name_the_argument():
    from transformer_linear.ops.grouped_nvfp4 import nvfp4_grouped_gemm, nvfp4_grouped_gemm_wgrad

    a = torch.zeros(16, 8, dtype=torch.uint8)
    scales = torch.zeros(2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="'b'"):
        nvfp4_grouped_gemm(a, scales[0], torch.zeros(2, 16, 8), scales, torch.tensor([8, 16], dtype=torch.int32),
                           torch.float32)
    with pytest.raises(ValueError, match="one entry per group"):
        nvfp4_grouped_gemm(a, scales[0], torch.zeros(2, 16, 8, dtype=torch.uint8), scales,
                           torch.tensor([16], dtype=torch.int32), torch.float32)
    # Compact wgrad copies of 16 tokens cannot be those of 3 groups (16 + 16 * 2 tokens at least).
    with pytest.raises(ValueError, match="compact copies"):
        nvfp4_grouped_gemm_wgrad(torch.zeros(16, 8, dtype=torch.uint8), scales.reshape(-1),
                                 torch.zeros(16, 8, dtype=torch.uint8), scales.reshape(-1), torch.float32,
                                 torch.tensor([8, 16, 16], dtype=torch.int32))
