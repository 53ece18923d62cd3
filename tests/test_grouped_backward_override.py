"""Transformer Engine's ``backward_override`` on tl.GroupedLinear (and the HF experts path, which runs the
same op), over the recipes the grouped GEMMs take.

Checked bitwise against a hand-computed reference, a loop over the experts of torch matmuls:
``"high_precision"``: dx[rows of e] = g W_e, dW_e = g[rows of e]ᵀ x[rows of e] from the original tensors;
``"dequantized"``: the same with x and each W_e replaced by the forward's quantized copies dequantized by
hand (test_backward_override.hand_dequantize; each expert's weight with its own scales). The forward is
the recipe's, unchanged; torch.compile(fullgraph=True) equals eager; opcheck of the high-precision grouped
GEMM ops and of grouped_linear_fwd with the override; delayed / fused wgrad and the weight cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from grouped_cases import offsets, routing
from test_backward_override import hand_dequantize
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear.modules.grouped_linear_args import GroupedLinearFwdArgs
from transformer_linear.modules.grouped_linear_ops import grouped_linear_fwd
from transformer_linear.modules.hf_experts import ExpertsFP8State
from transformer_linear.ops.grouped_high_precision import grouped_mm_dgrad, grouped_mm_wgrad
from transformer_linear.recipe.quantization import quantization_spec

RECIPES = {
    "tensorwise": lambda mode: tl.recipe.Float8CurrentScaling(backward_override=mode),
    "block": lambda mode: tl.recipe.Float8BlockScaling(backward_override=mode),
    "mxfp8": lambda mode: tl.recipe.MXFP8BlockScaling(backward_override=mode),
    "rowwise": lambda mode: tl.recipe.Float8RowwiseScaling(backward_override=mode),
    "nvfp4": lambda mode: tl.recipe.NVFP4BlockScaling(backward_override=mode),
}
MODES = ["high_precision", "dequantized"]
G, K, N, T = 4, 64, 48, 96


def _module(recipe, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    return tl.GroupedLinear(G, K, N, recipe=recipe, dtype=dtype, **kwargs)


def _run(module, x, sizes, g):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, sizes)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def _reference(recipe, mode, x, weight, g, sizes, dtype):
    """(dx, dW, db) as a loop over experts of torch matmuls on the operands ``mode`` names."""
    if mode == "high_precision":
        x_ref, w_ref = x, weight
    else:
        spec = quantization_spec(recipe)
        x_ref = hand_dequantize(spec.input, x).to(dtype)
        w_ref = torch.stack([hand_dequantize(spec.weight, weight[e]).to(dtype) for e in range(G)])
        assert not torch.equal(x_ref, x)  # really the quantized copy
    ends = [0, *offsets(sizes).tolist()]
    dx = torch.zeros_like(x)
    dw, db = [], []
    for e in range(G):
        rows = slice(ends[e], ends[e + 1])
        dx[rows] = torch.mm(g[rows], w_ref[e])
        dw.append(torch.mm(g[rows].t(), x_ref[rows]))
        db.append(g[rows].float().sum(0).to(dtype))
    return dx, torch.stack(dw), torch.stack(db)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", ["skewed", "empty_groups"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RECIPES)
def test_backward_matches_hand_reference(name, mode, pattern, dtype):
    recipe = RECIPES[name](mode)
    module = _module(recipe, dtype)
    sizes = routing(pattern, T, G)
    torch.manual_seed(1)
    x, g = torch.randn(T, K, dtype=dtype), torch.randn(T, N, dtype=dtype)
    y, dx, dw, db = _run(module, x, sizes, g)
    # The forward is the recipe's, unchanged by the override.
    quantized = _module(RECIPES[name](None), dtype)
    assert_bitwise_equal(y, quantized(x, sizes).detach(), "forward output")
    dx_ref, dw_ref, db_ref = _reference(recipe, mode, x, module.weight.detach(), g, sizes, dtype)
    assert_bitwise_equal(dx, dx_ref, "dgrad")
    assert_bitwise_equal(dw, dw_ref, "wgrad")
    torch.testing.assert_close(db, db_ref)  # fp32 sums per group (group_sums), in another order


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tensorwise", "mxfp8", "nvfp4"])
def test_saved_tensors(name, mode):
    """high_precision keeps the original input and weights; dequantized the forward's quantized rowwise
    copies, never a high-precision activation nor a columnwise copy."""
    module = _module(RECIPES[name](mode))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(torch.randn(T, K, requires_grad=True), routing("skewed", T, G))
    big = sorted((tuple(t.shape), t.dtype) for t in saved if t.numel() > 4 * G)
    if mode == "high_precision":
        assert big == sorted([((T, K), torch.float32), ((G, N, K), torch.float32)])
    elif name == "nvfp4":
        assert [shape for shape, dtype in big if dtype == torch.uint8] == sorted([(T, K // 2), (G, N, K // 2)])
    else:
        fp8 = [shape for shape, dtype in big if dtype == torch.float8_e4m3fn]
        assert fp8 == sorted([(T, K), (G, N, K)])


@pytest.fixture
def fresh_dynamo():
    """Each compiled module's graphs dropped afterwards: GroupedLinear.forward is one code object for every
    module, and dynamo's recompile limit counts its graphs across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tensorwise", "block", "nvfp4"])
def test_compile_fullgraph_equals_eager(name, mode):
    eager = _module(RECIPES[name](mode))
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    x, g = torch.randn(T, K), torch.randn(T, N)
    for pattern in ("skewed", "empty_groups"):  # a routing change must not break the graph either
        sizes = torch.tensor(routing(pattern, T, G))
        expected = _run(eager, x, sizes, g)
        eager.zero_grad(set_to_none=True)
        got = _run(compiled, x, sizes, g)
        compiled_module.zero_grad(set_to_none=True)
        for what, a, b in zip(("out", "dx", "dw", "db"), got, expected):
            assert_bitwise_equal(a, b, f"{name} {mode} {pattern} {what}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tensorwise", "nvfp4"])
def test_wgrad_options_and_weight_cache(name, mode):
    """delay_wgrad_compute, fuse_wgrad_accumulation and a cached weight give the plain module's gradients."""
    recipe = RECIPES[name](mode)
    sizes = routing("skewed", T, G)
    torch.manual_seed(4)
    x, g = torch.randn(T, K), torch.randn(T, N)
    base = _module(recipe)
    expected = _run(base, x, sizes, g)
    delayed = _module(recipe, delay_wgrad_compute=True)
    fused = _module(recipe, fuse_wgrad_accumulation=True)
    cached = _module(recipe)
    _run(delayed, x, sizes, g)
    assert delayed.weight.grad is None
    delayed.backward_dw()
    _run(fused, x, sizes, g)
    cached(x, sizes, is_first_microbatch=True)
    cached.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    cached(xc, sizes, is_first_microbatch=False).backward(g)
    assert_bitwise_equal(delayed.weight.grad, expected[2], "delayed wgrad")
    assert_bitwise_equal(fused.weight.main_grad, expected[2], "main_grad")
    assert_bitwise_equal(xc.grad, expected[1], "cached-weight dgrad")
    assert_bitwise_equal(cached.weight.grad, expected[2], "cached-weight wgrad")


@pytest.mark.parametrize("mode", MODES)
def test_functional_and_autocast(mode):
    """tl.grouped_linear with the recipe and a module under tl.autocast take the override too."""
    recipe = RECIPES["mxfp8"](mode)
    module = _module(None)
    sizes = routing("uniform", T, G)
    torch.manual_seed(5)
    x, g = torch.randn(T, K), torch.randn(T, N)
    with tl.autocast(recipe=recipe):
        _, dx, dw, _ = _run(module, x, sizes, g)
    dx_ref, dw_ref, _ = _reference(recipe, mode, x, module.weight.detach(), g, sizes, torch.float32)
    assert_bitwise_equal(dx, dx_ref, "autocast dgrad")
    assert_bitwise_equal(dw, dw_ref, "autocast wgrad")
    xf = x.clone().requires_grad_(True)
    w = module.weight.detach().clone().requires_grad_(True)
    tl.grouped_linear(xf, w, offsets(sizes), recipe=recipe).backward(g)
    assert_bitwise_equal(xf.grad, dx_ref, "functional dgrad")
    assert_bitwise_equal(w.grad, dw_ref, "functional wgrad")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["block", "nvfp4"])
def test_hf_experts_state(name, mode):
    """transformers' experts (register_hf_experts) run the same op through ExpertsFP8State: the override too."""
    recipe = RECIPES[name](mode)
    state = ExpertsFP8State(recipe)
    sizes = routing("skewed", T, G)
    torch.manual_seed(7)
    x = torch.randn(T, K, requires_grad=True)
    weight = (torch.randn(G, N, K) / 8).requires_grad_(True)
    g = torch.randn(T, N)
    state(x, weight, offsets(sizes)).backward(g)
    dx_ref, dw_ref, _ = _reference(recipe, mode, x.detach(), weight.detach(), g, sizes, torch.float32)
    assert_bitwise_equal(x.grad, dx_ref, "experts dgrad")
    assert_bitwise_equal(weight.grad, dw_ref, "experts wgrad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_high_precision_grouped_gemms(dtype):
    torch.manual_seed(6)
    offs = offsets(routing("rows_left_over", T, G))
    g, w, x = torch.randn(T, N, dtype=dtype), torch.randn(G, N, K), torch.randn(T, K, dtype=dtype)
    for op, args in ((grouped_mm_dgrad, (g, w, offs, dtype)), (grouped_mm_wgrad, (g, x, offs, torch.float32))):
        torch.library.opcheck(op, args)
    dx = grouped_mm_dgrad(g, w, offs, dtype)
    assert not dx[int(offs[-1]):].any()  # rows past the last group
    empty = grouped_mm_wgrad(g[:0], x[:0], torch.zeros(G, dtype=torch.int32), torch.float32)
    assert empty.shape == (G, N, K) and not empty.any()


@pytest.mark.parametrize("ends", [[T // 2, T // 4, T, T], [-1, T, T, T], [0, 0, 0, T + 1]],
                         ids=["decreasing", "negative", "past the tokens"])
def test_high_precision_grouped_gemms_bad_offs(ends):
    """offs read on the host are checked as the FP8 grouped GEMMs check them, not sliced into garbage."""
    g, w, x = torch.randn(T, N), torch.randn(G, N, K), torch.randn(T, K)
    offs = torch.tensor(ends, dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_mm_dgrad: argument 'offs'"):
        grouped_mm_dgrad(g, w, offs, torch.float32)
    with pytest.raises(ValueError, match="grouped_mm_wgrad: argument 'offs'"):
        grouped_mm_wgrad(g, x, offs, torch.float32)


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tensorwise", "block"])
def test_opcheck_grouped_linear_fwd(name, mode):
    module = _module(RECIPES[name](mode))
    x = torch.randn(T, K, requires_grad=True)
    args = GroupedLinearFwdArgs(
        inp=x, weight=module.weight, bias=module.bias, offs=offsets(routing("skewed", T, G)),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=True,
        quantization=quantization_spec(module.recipe), delayed=None, out_dtype=torch.float32,
        cached_weight=None, main_grad=None, wgrad_queue=-1,
    )
    assert args.quantization.backward_override == mode
    flat = grouped_linear_fwd.flatten(args)
    torch.library.opcheck(grouped_linear_fwd.op, flat,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
