"""tl.GroupedLinear and tl.grouped_linear (mixture-of-experts): forward and backward against the
float64 oracle of the grouped GEMMs (reference.grouped) on the reference-quantized operands, and
against a loop of nn.Linear within an FP8 SQNR bound; no host read of the routing; torch.compile
with changing routing and no recompile; torch.export; state_dict (both weight layouts); bad input;
opcheck of the op."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from blockwise_cases import E4M3, E5M2
from grouped_cases import dequantized_grouped_fp32, host_reads_of, nothing, offsets, routing
from tolerances import assert_close_to_reference, assert_grouped_close_to_reference, sqnr

import transformer_linear as tl
from transformer_linear import reference
from transformer_linear.modules.grouped_linear_args import GroupedLinearFwdArgs
from transformer_linear.modules.grouped_linear_ops import grouped_linear_fwd
from transformer_linear.recipe.quantization import quantization_spec
from transformer_linear.reference import grouped as reference_grouped

TENSORWISE_RECIPES = {"current": tl.recipe.Float8CurrentScaling, "delayed": tl.recipe.DelayedScaling}
BLOCK_RECIPES = {"block": tl.recipe.Float8BlockScaling, "mxfp8": tl.recipe.MXFP8BlockScaling,
                 "rowwise": tl.recipe.Float8RowwiseScaling}
RECIPES = {**TENSORWISE_RECIPES, **BLOCK_RECIPES}
ROUTINGS = ["uniform", "skewed", "empty_groups"]
G, K, N, T = 4, 64, 48, 96
# FP8 (E4M3 forward, E5M2 gradients) against fp32: the SQNR every result must reach, in dB (dbias: fp32 sums of
# the high-precision gradient).
MIN_SQNR_DB = {"out": 25.0, "dgrad": 20.0, "wgrad": 20.0, "dbias": 120.0}


def _module(recipe_name, dtype=torch.float32, bias=True, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return tl.GroupedLinear(G, K, N, bias=bias, recipe=RECIPES[recipe_name](), dtype=dtype, device=device)


def _splits(sizes, kind, device="cpu"):
    return sizes if kind == "list" else torch.tensor(sizes, device=device)


def _run(module, x, splits, grad):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x, splits)
    y.backward(grad)
    return y, x.grad, module.weight.grad, None if module.bias is None else module.bias.grad


def _reference_step(module, x, sizes, grad, per_expert_weight_scales):
    """The forward and backward GEMMs of the oracle on the reference-quantized operands, with their
    fp32 baselines: {name: (expected float64, baseline)}."""
    offs = offsets(sizes)
    weight = module.weight.detach().cpu()
    x, grad = x.cpu(), grad.cpu()
    xq, sx, _ = reference.quantize_current(x.detach().float(), E4M3)
    if per_expert_weight_scales:
        quantized = [reference.quantize_current(weight[g].float(), E4M3) for g in range(G)]
    else:  # delayed scaling: the first step's scale of the whole weight, shared by the experts
        _, s_all, _ = reference.quantize_current(weight.float().reshape(-1, K), E4M3)
        quantized = [(reference.quantize(weight[g].float(), 1 / s_all, E4M3)[0], s_all) for g in range(G)]
    wq = torch.stack([q for q, _, *_ in quantized])
    sw = torch.stack([s.reshape(()) for _, s, *_ in quantized])
    gq, sg, _ = reference.quantize_current(grad.float(), E5M2)
    bias = None if module.bias is None else module.bias.detach().cpu().to(x.dtype)
    out = reference_grouped.fp8_grouped_gemm(xq, sx, wq, sw, offs, torch.float64, bias)
    out_base = dequantized_grouped_fp32(xq, sx, wq, sw, offs, x.dtype, bias)
    wq_t = wq.transpose(1, 2).contiguous()
    dgrad = reference_grouped.fp8_grouped_gemm(gq, sg, wq_t, sw, offs, torch.float64)
    dgrad_base = dequantized_grouped_fp32(gq, sg, wq_t, sw, offs, x.dtype)
    wgrad = reference_grouped.fp8_grouped_gemm_wgrad(gq, sg, xq, sx, offs, torch.float64)
    return {"out": (out, out_base), "dgrad": (dgrad, dgrad_base), "wgrad": (wgrad, (gq, sg, xq, sx))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits_kind", ["list", "tensor"])
@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("recipe_name", list(TENSORWISE_RECIPES))
def test_matches_per_expert_reference(recipe_name, pattern, splits_kind, dtype, device):
    module = _module(recipe_name, dtype, device=device)
    sizes = routing(pattern, T, G)
    x = torch.randn(T, K, dtype=dtype, device=device)
    grad = torch.randn(T, N, dtype=dtype, device=device)
    y, dx, dw, db = (t.cpu() for t in _run(module, x, _splits(sizes, splits_kind, device), grad))
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == dtype
    x, grad = x.cpu(), grad.cpu()
    expected = _reference_step(module, x, sizes, grad, per_expert_weight_scales=recipe_name == "current")
    bounds = reference_grouped.group_bounds(offsets(sizes), T)
    assert_grouped_close_to_reference(y, *expected["out"], bounds, what="out")
    assert_grouped_close_to_reference(dx, *expected["dgrad"], bounds, what="dgrad")
    wgrad, (gq, sg, xq, sx) = expected["wgrad"]
    for g, (start, end) in enumerate(bounds):
        baseline = ((gq[start:end].float() * sg).t() @ (xq[start:end].float() * sx)).to(dtype)
        assert_close_to_reference(dw[g], wgrad[g], baseline, what=f"wgrad group {g}")
    expected_db = torch.stack([grad[s:e].double().sum(0) for s, e in bounds]).to(dtype)
    assert_close_to_reference(db, expected_db, what="dbias")


def _block_reference_step(module, x, sizes, grad):
    """The block-scaled GEMMs of the oracle on operands the reference quantizes as the recipe's quantizers
    say: rowwise input and grad_output, each expert's weight rowwise and columnwise, and the grouped
    columnwise copies (token blocks restarting at each group) for wgrad. {name: (expected, baseline)}."""
    spec = quantization_spec(module.recipe)
    offs = offsets(sizes)
    x, grad, weight = x.detach().cpu().float(), grad.cpu().float(), module.weight.detach().cpu().float()

    def rowwise(q, t):
        return reference.quantize_blockwise_ref(t, q.dtype, q.block_for(t.shape[1]), q.scale_dtype, q.power_2_scale,
                                                q.e8m0_rounding)

    def grouped_t(q, t):
        block = 0 if q.block_shape[1] == 0 else q.block_shape[1]
        return reference_grouped.quantize_grouped_columnwise(t, offs, q.dtype, block, q.power_2_scale, q.e8m0_rounding)

    xq, sx = rowwise(spec.input, x)
    gq, sg = rowwise(spec.grad_output, grad)
    w_rows = [rowwise(spec.weight, weight[g]) for g in range(G)]
    w_cols = [rowwise(spec.weight, weight[g].t().contiguous()) for g in range(G)]
    wq, sw = torch.stack([q for q, _ in w_rows]), torch.stack([s for _, s in w_rows])
    wq_t, sw_t = torch.stack([q for q, _ in w_cols]), torch.stack([s for _, s in w_cols])
    bias = None if module.bias is None else module.bias.detach().cpu().to(x.dtype)
    out = reference_grouped.fp8_grouped_gemm(xq, sx, wq, sw, offs, torch.float64, bias)
    dgrad = reference_grouped.fp8_grouped_gemm(gq, sg, wq_t, sw_t, offs, torch.float64)
    block = 0 if spec.input.block_shape[1] == 0 else spec.input.block_shape[1]
    g_t, sg_t = grouped_t(spec.grad_output, grad)
    x_t, sx_t = grouped_t(spec.input, x)
    wgrad = reference_grouped.fp8_grouped_gemm_wgrad_blockwise(g_t, sg_t, x_t, sx_t, offs, torch.float64, block)
    return {
        "out": (out, dequantized_grouped_fp32(xq, sx, wq, sw, offs, torch.float32, bias)),
        "dgrad": (dgrad, dequantized_grouped_fp32(gq, sg, wq_t, sw_t, offs, torch.float32)),
        "wgrad": (wgrad, None),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("recipe_name", list(BLOCK_RECIPES))
def test_block_recipes_match_per_expert_reference(recipe_name, pattern, dtype, device):
    """Float8BlockScaling (1x128 x 128x128), MXFP8 (1x32) and rowwise scaling: forward, dgrad and the
    block-scaled grouped wgrad against the oracle on the reference-quantized operands."""
    module = _module(recipe_name, dtype, device=device)
    sizes = routing(pattern, T, G)
    x = torch.randn(T, K, dtype=dtype, device=device)
    grad = torch.randn(T, N, dtype=dtype, device=device)
    y, dx, dw, db = (t.cpu() for t in _run(module, x, _splits(sizes, "tensor", device), grad))
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == dtype
    expected = _block_reference_step(module, x, sizes, grad)
    bounds = reference_grouped.group_bounds(offsets(sizes), T)
    for name, actual in (("out", y), ("dgrad", dx)):
        reference_out, baseline = expected[name]
        assert_grouped_close_to_reference(actual, reference_out, baseline.to(dtype), bounds, what=name)
    for g in range(G):
        assert_close_to_reference(dw[g], expected["wgrad"][0][g], what=f"wgrad group {g}")
    expected_db = torch.stack([grad.cpu()[s:e].double().sum(0) for s, e in bounds]).to(dtype)
    assert_close_to_reference(db, expected_db, what="dbias")


@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_close_to_a_loop_of_nn_linear_fp32(recipe_name, pattern):
    module = _module(recipe_name)
    sizes = routing(pattern, T, G)
    linears = []
    for g in range(G):
        linear = torch.nn.Linear(K, N)
        with torch.no_grad():
            linear.weight.copy_(module.weight[g])
            linear.bias.copy_(module.bias[g])
        linears.append(linear)
    x = torch.randn(T, K)
    grad = torch.randn(T, N)
    y, dx, dw, db = _run(module, x, torch.tensor(sizes), grad)
    x_ref = x.clone().requires_grad_(True)
    y_ref = torch.cat([lin(part) for lin, part in zip(linears, x_ref.split(sizes))])
    y_ref.backward(grad)
    results = {
        "out": (y, y_ref),
        "dgrad": (dx, x_ref.grad),
        "wgrad": (dw, torch.stack([lin.weight.grad for lin in linears])),
        "dbias": (db, torch.stack([lin.bias.grad for lin in linears])),
    }
    for name, (actual, expected) in results.items():
        if name in ("wgrad", "dbias"):  # an empty expert's gradient is exactly 0
            for g, size in enumerate(sizes):
                if size == 0:
                    assert torch.equal(actual[g], torch.zeros_like(actual[g])), f"{name} of empty expert {g}"
            actual, expected = actual[[s > 0 for s in sizes]], expected[[s > 0 for s in sizes]]
        assert sqnr(actual, expected) >= MIN_SQNR_DB[name], f"{name}: SQNR {sqnr(actual, expected):.1f} dB"


def test_no_recipe_is_a_loop_of_f_linear_bitwise():
    torch.manual_seed(0)
    module = tl.GroupedLinear(G, K, N)
    sizes = routing("skewed", T, G)
    x = torch.randn(T, K)
    y = module(x, sizes)
    expected = torch.cat([F.linear(p, module.weight[g], module.bias[g]) for g, p in enumerate(x.split(sizes))])
    assert torch.equal(y, expected)
    assert torch.equal(module(x, torch.tensor(sizes)), expected)


def test_leading_dims_are_tokens():
    module = _module("current")
    sizes = routing("skewed", T, G)
    x = torch.randn(2, T // 2, K)
    y = module(x, sizes)
    assert y.shape == (2, T // 2, N)
    assert torch.equal(y.reshape(T, N), module(x.reshape(T, K), sizes))


def test_torch_autocast_output_dtype():
    module = _module("current")
    x = torch.randn(T, K, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x, torch.tensor(routing("skewed", T, G)))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and module.weight.grad.dtype == torch.float32


def test_autocast_recipe_turns_fp8_on():
    module = _module("current")
    plain = tl.GroupedLinear(G, K, N)
    plain.load_state_dict(module.state_dict())
    x, sizes = torch.randn(T, K), routing("uniform", T, G)
    with tl.autocast(recipe=tl.recipe.Float8CurrentScaling()):
        assert torch.equal(plain(x, sizes), module(x, sizes))


def test_functional_form_matches_the_module():
    module = _module("current")
    sizes = routing("skewed", T, G)
    x = torch.randn(T, K)
    expected = module(x, sizes)
    out = tl.grouped_linear(x, module.weight, offsets(sizes), module.bias, recipe=tl.recipe.Float8CurrentScaling())
    assert torch.equal(out, expected)
    # Rows past offs[-1] belong to no expert: zeros, as in the grouped GEMM.
    short = tl.grouped_linear(x, module.weight, offsets([10, 0, 20, 30]), recipe=tl.recipe.Float8CurrentScaling())
    assert torch.equal(short[60:], torch.zeros(T - 60, N))
    hp = tl.grouped_linear(x, module.weight, offsets([10, 0, 20, 30]))
    assert torch.equal(hp[60:], torch.zeros(T - 60, N))
    assert torch.equal(hp[:10], F.linear(x[:10], module.weight[0]))


def test_functional_form_refuses_delayed_scaling():
    w = torch.randn(G, N, K)
    with pytest.raises(ValueError, match="tl.GroupedLinear"):
        tl.grouped_linear(torch.randn(T, K), w, offsets([T, 0, 0, 0]), recipe=tl.recipe.DelayedScaling())


def _custom(quantizers):
    return tl.recipe.CustomRecipe(lambda role: quantizers[role.removeprefix("linear_")])


_TENSORWISE_Q = tl.TensorQuantizer(E4M3, [], torch.float32, False)
_UNSUPPORTED = {
    "mixed scalings": _custom({"input": _TENSORWISE_Q, "grad_output": _TENSORWISE_Q,
                               "weight": tl.TensorQuantizer(E4M3, [128, 128], torch.float32, False)}),
    "2-D input blocks": _custom({"input": tl.TensorQuantizer(E4M3, [128, 128], torch.float32, False),
                                 "grad_output": tl.TensorQuantizer(E5M2, [1, 128], torch.float32, False),
                                 "weight": tl.TensorQuantizer(E4M3, [128, 128], torch.float32, False)}),
    "input and grad blocks differ": _custom({"input": tl.TensorQuantizer(E4M3, [1, 0], torch.float32, False),
                                             "grad_output": tl.TensorQuantizer(E5M2, [1, 128], torch.float32, False),
                                             "weight": tl.TensorQuantizer(E4M3, [1, 0], torch.float32, False)}),
}


@pytest.mark.parametrize("case", list(_UNSUPPORTED))
def test_unsupported_quantizers_raise_naming_the_recipe(case):
    recipe = _UNSUPPORTED[case]
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        tl.GroupedLinear(G, K, N, recipe=recipe)
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        tl.grouped_linear(torch.randn(T, K), torch.randn(G, N, K), offsets([T, 0, 0, 0]), recipe=recipe)
    # An autocast recipe is checked where the forward meets it.
    module = tl.GroupedLinear(G, K, N)
    with tl.autocast(recipe=recipe), pytest.raises(NotImplementedError, match="CustomRecipe"):
        module(torch.randn(T, K), [T, 0, 0, 0])


@pytest.mark.parametrize("recipe_name", list(BLOCK_RECIPES))
def test_block_recipes_from_autocast_and_functional_form(recipe_name):
    """tl.autocast and tl.grouped_linear run the block recipes too, as the module does."""
    module = _module(recipe_name)
    sizes = routing("skewed", T, G)
    x = torch.randn(T, K)
    want = module(x, sizes)
    plain = tl.GroupedLinear(G, K, N)
    plain.load_state_dict(module.state_dict())
    with tl.autocast(recipe=RECIPES[recipe_name]()):
        assert torch.equal(plain(x, sizes), want)
    got = tl.grouped_linear(x, module.weight, offsets(sizes), module.bias, recipe=RECIPES[recipe_name]())
    assert torch.equal(got, want)


@pytest.mark.parametrize("recipe_name", list(TENSORWISE_RECIPES))
def test_delayed_state_records_one_history_per_role(recipe_name):
    module = _module(recipe_name)
    x = torch.randn(T, K)
    _run(module, x, routing("skewed", T, G), torch.randn(T, N))
    history, grad_history = module.fp8_amax_history, module.fp8_grad_amax_history
    if recipe_name == "delayed":
        # The update rolls the history: this step's amaxes are its last row.
        assert torch.equal(history[-1], torch.stack([x.abs().max(), module.weight.detach().abs().max()]))
        assert grad_history[-1, 0] > 0
        assert not torch.equal(module.fp8_scale, torch.ones(2))
    else:  # no state is kept
        assert not history.any() and not grad_history.any()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_no_host_read_of_the_routing(recipe_name, device):
    module = _module(recipe_name, device=device)
    x = torch.randn(T, K, requires_grad=True, device=device)
    module(x, torch.tensor(routing("uniform", T, G), device=device)).sum().backward()  # first step: just in time
    m_splits = torch.tensor(routing("skewed", T, G), device=device)
    with host_reads_of(m_splits) as reads:
        y = module(x, m_splits)
        y.backward(torch.randn(T, N, device=device))
    assert reads == []
    # The detector sees the host read of the high-precision path.
    module.recipe = None
    with host_reads_of(m_splits) as reads:
        module(x, m_splits)
    assert reads == ["tolist"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_compile_fullgraph_changing_routing_no_recompile(recipe_name, backend):
    torch._dynamo.reset()  # GroupedLinear.forward's graphs of the other cases count toward the recompile limit
    module = _module(recipe_name)
    eager = _module(recipe_name)
    x = torch.randn(T, K)
    # The first steps eagerly on both, so that the delayed-scaling states agree before compiling.
    for m in (module, eager):
        _run(m, x, torch.tensor(routing("uniform", T, G)), torch.ones(T, N))
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    for pattern in ["skewed", "empty_groups", "uniform"]:
        m_splits = torch.tensor(routing(pattern, T, G))
        with torch._dynamo.config.patch(error_on_recompile=True) if counter.frame_count else nothing():
            got = _run(compiled, x, m_splits, torch.ones(T, N))
        want = _run(eager, x, m_splits, torch.ones(T, N))
        for a, b, name in zip(got, want, ("out", "dgrad", "wgrad", "dbias")):
            assert torch.equal(a, b), f"{pattern}: {name}"
    assert counter.frame_count == 1


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_export_save_load(recipe_name):
    module = _module(recipe_name)
    x = torch.randn(T, K)
    m_splits = torch.tensor(routing("skewed", T, G))
    program = torch.export.export(module, (x, m_splits))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for pattern in ROUTINGS:
        m_splits = torch.tensor(routing(pattern, T, G))
        assert torch.equal(loaded.module()(x, m_splits), module(x, m_splits)), pattern


def test_copies_dtype_change_and_meta_init():
    module = _module("delayed")
    x, sizes = torch.randn(T, K), routing("skewed", T, G)
    module(x, sizes)
    for copy_ in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert torch.equal(copy_(x, sizes), module(x, sizes))
    half = copy.deepcopy(module).to(torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half.fp8_amax_history.dtype == torch.float32
    assert half(x.bfloat16(), sizes).dtype == torch.bfloat16
    with torch.device("meta"):
        deferred = tl.GroupedLinear(G, K, N, recipe=tl.recipe.Float8CurrentScaling())
    deferred.to_empty(device="cpu")
    deferred.load_state_dict(_module("current").state_dict())
    assert torch.equal(deferred(x, sizes), _module("current")(x, sizes))


@pytest.mark.parametrize("recipe_name", list(TENSORWISE_RECIPES))
def test_state_dict_round_trip(recipe_name):
    module = _module(recipe_name)
    _run(module, torch.randn(T, K), routing("skewed", T, G), torch.randn(T, N))
    state = module.state_dict()
    assert state["weight"].shape == (G, N, K) and state["bias"].shape == (G, N)
    other = _module(recipe_name, seed=1)
    other.load_state_dict(state)
    for key, value in module.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_loads_transformer_engine_per_expert_layout():
    module = _module("current")
    te_state = {f"weight{g}": module.weight[g].detach().clone() for g in range(G)}
    te_state.update({f"bias{g}": module.bias[g].detach().clone() for g in range(G)})
    other = _module("current", seed=1)
    other.load_state_dict(te_state, strict=True)  # the delayed-scaling state starts fresh
    assert torch.equal(other.weight, module.weight) and torch.equal(other.bias, module.bias)
    with pytest.raises(RuntimeError, match="weight"):  # an expert missing: neither layout is complete
        del te_state["weight3"]
        _module("current").load_state_dict(te_state)


def test_init_like_nn_linear_per_expert():
    """The same random numbers as G nn.Linear layers built one after the other."""
    torch.manual_seed(0)
    module = tl.GroupedLinear(G, K, N)
    torch.manual_seed(0)
    linears = [torch.nn.Linear(K, N) for _ in range(G)]
    for g, linear in enumerate(linears):
        assert torch.equal(module.weight[g], linear.weight) and torch.equal(module.bias[g], linear.bias), g


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("splits_kind", ["list", "tensor"])
def test_zero_tokens(recipe_name, splits_kind):
    module = _module(recipe_name)
    y, dx, dw, db = _run(module, torch.randn(0, K), _splits([0] * G, splits_kind), torch.randn(0, N))
    assert y.shape == (0, N) and dx.shape == (0, K)
    assert torch.equal(dw, torch.zeros(G, N, K)) and torch.equal(db, torch.zeros(G, N))


def _bad_calls():
    x = torch.randn(T, K)
    sizes = routing("uniform", T, G)
    return {
        "m_splits length": (lambda m: m(x, sizes[:-1]), ValueError, "m_splits"),
        "m_splits tensor length": (lambda m: m(x, torch.tensor(sizes[:-1])), ValueError, "m_splits"),
        "m_splits sum": (lambda m: m(x, [*sizes[:-1], sizes[-1] + 1]), ValueError, "m_splits"),
        "m_splits negative": (lambda m: m(x, [-1, *sizes[1:-1], sizes[-1] + 1]), ValueError, "m_splits"),
        # A tensor's values are not read on the host; the kernels check the offsets made from them.
        "m_splits tensor sum over": (lambda m: m(x, torch.tensor([*sizes[:-1], sizes[-1] + 1])), ValueError,
                                     "'offs' must not pass"),
        "m_splits tensor negative": (lambda m: m(x, torch.tensor([-1, *sizes[1:-1], sizes[-1] + 1])), ValueError,
                                     "'offs' must be non-decreasing and non-negative"),
        "m_splits float tensor": (lambda m: m(x, torch.tensor(sizes, dtype=torch.float32)), TypeError, "m_splits"),
        "m_splits floats": (lambda m: m(x, [float(s) for s in sizes]), TypeError, "m_splits"),
        "m_splits meta": (lambda m: m(x, torch.tensor(sizes, device="meta")), TypeError, "m_splits"),
        "inp meta": (lambda m: m(x.to("meta"), sizes), TypeError, "weight"),
        "inp int": (lambda m: m(x.to(torch.int32), sizes), TypeError, "inp"),
        "inp features": (lambda m: m(torch.randn(T, K + 1), sizes), ValueError, "inp"),
        "inp 0-D": (lambda m: m(torch.tensor(1.0), sizes), ValueError, "inp"),
        "inp list": (lambda m: m(x.tolist(), sizes), TypeError, "inp"),
    }


@pytest.mark.parametrize("fp8", [True, False], ids=["current", "high_precision"])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_names_the_argument(case, fp8):
    call, error, match = _bad_calls()[case]
    module = _module("current")
    if not fp8:
        module.recipe = None
    with pytest.raises(error, match=match):
        call(module)


@pytest.mark.parametrize("fp8", [True, False], ids=["current", "high_precision"])
@pytest.mark.parametrize("ends", [[T // 2, T // 4, T, T], [-1, T, T, T], [0, 0, 0, T + 1]],
                         ids=["decreasing", "negative", "past the tokens"])
def test_functional_bad_offs_values(ends, fp8):
    """offs values that would slice past the tokens (or backwards) raise, with or without FP8."""
    recipe = RECIPES["current"]() if fp8 else None
    with pytest.raises(ValueError, match="'offs'"):
        tl.grouped_linear(torch.randn(T, K), torch.randn(G, N, K), torch.tensor(ends, dtype=torch.int32), recipe=recipe)


def test_bad_constructor_and_functional_arguments():
    with pytest.raises(ValueError, match="num_gemms"):
        tl.GroupedLinear(0, K, N)
    with pytest.raises(TypeError, match="recipe"):
        tl.GroupedLinear(G, K, N, recipe="fp8")
    w = torch.randn(G, N, K)
    with pytest.raises(ValueError, match="offs"):
        tl.grouped_linear(torch.randn(T, K), w, offsets([T, 0, 0]))
    with pytest.raises(ValueError, match="offs"):
        tl.grouped_linear(torch.randn(T, K), w, offsets([T, 0, 0, 0]).long())
    with pytest.raises(ValueError, match="weight"):
        tl.grouped_linear(torch.randn(T, K), w[0], offsets([T, 0, 0, 0]))
    with pytest.raises(ValueError, match="bias"):
        tl.grouped_linear(torch.randn(T, K), w, offsets([T, 0, 0, 0]), torch.randn(N))
    with pytest.raises(TypeError, match="offs"):
        tl.grouped_linear(torch.randn(T, K), w, [T, 0, 0, 0])


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe_name", ["current", *BLOCK_RECIPES])
def test_opcheck(recipe_name, bias):
    module = _module(recipe_name, bias=bias)
    x = torch.randn(T, K, requires_grad=True)
    args = GroupedLinearFwdArgs(
        inp=x, weight=module.weight, bias=module.bias, offs=offsets(routing("skewed", T, G)),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=bias,
        quantization=quantization_spec(RECIPES[recipe_name]()), delayed=None, out_dtype=torch.float32,
        cached_weight=None, main_grad=None, wgrad_queue=-1,
    )
    flat = grouped_linear_fwd.flatten(args)
    op = grouped_linear_fwd.op
    torch.library.opcheck(op, flat, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    # test_aot_dispatch_dynamic sums every output (no FP8 sum kernel): forward only, detached; forward and
    # backward under AOT are test_compile_fullgraph_changing_routing_no_recompile's.
    detached = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in flat)
    torch.library.opcheck(op, detached, test_utils="test_aot_dispatch_dynamic")
