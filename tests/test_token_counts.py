"""Every recipe trains any token count (issue 32 item 5): a Linear's and a GroupedLinear's forward and backward
at 1, 15, 17 and 51 rows, against an emulation built from the reference alone, and under ``torch.compile``
with a changing token count and no recompile.

NVFP4's columnwise copies (the weight gradient's operands, contracted over the tokens) hold blocks of 16
tokens: the quantize pads the tokens with zero rows to a multiple of 16 (formats.nvfp4.pad_rows), which add
nothing to the sum. The emulation quantizes each operand from its high-precision tensor as the recipe's
quantizers describe (one scale per tensor, per block, NVFP4 with its Hadamard transform and stochastic
rounding), the columnwise copies of NVFP4 from the zero-padded tensor; the layer's GEMMs must be within the
package tolerance of the float64 products of those operands.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from tolerances import assert_bitwise_equal, assert_close_to_reference

import transformer_linear as tl
from transformer_linear import recipe, reference
from transformer_linear.recipe.quantization import TensorQuantizer, quantization_spec
from transformer_linear.reference import nvfp4 as ref_nvfp4

NAMES = recipe.available_names()
ROWS = (1, 15, 17, 51)
# Compiled: sizes 0 and 1 are specialized by torch, so the changing counts start at 2.
COMPILED_ROWS = (15, 17, 51, 33)
IN_FEATURES, OUT_FEATURES = 64, 32  # multiples of 16: NVFP4's rowwise copies hold 16-element blocks of a row
SEED = 1234


def _tensors(rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x (rows, in), weight (out, in), bias (out,), grad_output (rows, out)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN_FEATURES, generator=gen)
    w = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) / IN_FEATURES**0.5
    return x, w, torch.randn(OUT_FEATURES, generator=gen), torch.randn(rows, OUT_FEATURES, generator=gen)


def _step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """(out, dx, dweight, dbias) of one forward and backward; backward's stochastic-rounding seed is the first
    draw after torch.manual_seed(SEED)."""
    x = x.detach().clone().requires_grad_()
    out = layer(x, *args)
    torch.manual_seed(SEED)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _linear(name: str, w: torch.Tensor, b: torch.Tensor) -> tl.Linear:
    layer = tl.Linear(IN_FEATURES, OUT_FEATURES, recipe=recipe.from_name(name))
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _sr_seed() -> int:
    """The seed backward's grad_output quantize draws (ops.nvfp4.sr_seed: one int64 of the default generator)."""
    torch.manual_seed(SEED)
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows up to a multiple of 16 (NVFP4's token blocks), written out here."""
    return torch.cat([t, t.new_zeros((-t.shape[0] % 16, t.shape[1]))])


def _nvfp4_copy(q: TensorQuantizer, t: torch.Tensor, rowwise: bool, seed: int) -> torch.Tensor:
    """The dequantized NVFP4 copy of ``t``: rowwise (blocks along its rows), or columnwise (of tᵀ, blocks along
    t's zero-padded rows, Hadamard-transformed where the quantizer says), from reference/nvfp4 alone."""
    rows, t = t.shape[0], _padded(t)
    rht = q.rht and not rowwise
    amax_t = ref_nvfp4.hadamard_transform(t.t()).abs().amax() if rht else None
    c = ref_nvfp4.quantize_nvfp4(t, t.abs().amax(), amax_t, rowwise=rowwise, columnwise=not rowwise,
                                 scaling_2d=q.block_shape == [16, 16], rht=rht,
                                 stochastic_rounding=q.stochastic_rounding, seed=seed)
    if rowwise:
        return ref_nvfp4.dequantize_nvfp4(c.data, c.scale, c.global_scale)[:rows].double()
    return ref_nvfp4.dequantize_nvfp4(c.data_t, c.scale_t, c.global_scale_t).double()


def _copy(q: TensorQuantizer, t: torch.Tensor, rowwise: bool, seed: int = 0) -> torch.Tensor:
    """The dequantized (float64, exact) copy of ``t`` a GEMM reads: rowwise, or columnwise (the copy of tᵀ).
    One scale per tensor: current scaling (delayed scaling's first step is just in time); blocks: per block
    (``[1, 0]``: a whole row)."""
    if q.is_nvfp4:
        return _nvfp4_copy(q, t, rowwise, seed)
    t = t if rowwise else t.t().contiguous()
    if not q.blockwise:
        data, scale_inv, _ = reference.quantize_current(t, q.dtype, q.margin)
        return data.double() * scale_inv.double()
    block = (q.block_shape[0], q.block_shape[1] or t.shape[1])
    data, scale_inv = reference.quantize_blockwise_ref(t, q.dtype, block, q.scale_dtype, q.power_2_scale,
                                                       q.e8m0_rounding)
    return data.double() * reference.expand_scale_inv(scale_inv, block, *t.shape)


def _assert_gemm_close(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str, bias=None) -> None:
    """``actual`` within the package tolerance of ``a @ b.T`` (+ bias) in float64, the float32 product of the
    same operands the baseline."""
    exact, baseline = a @ b.t(), a.float() @ b.float().t()
    if bias is not None:
        exact, baseline = exact + bias.double(), baseline + bias
    assert_close_to_reference(actual, exact, baseline, what=what)


def _assert_matches_emulation(name: str, result: tuple, x, w, dy, bias, what: str) -> None:
    spec = quantization_spec(recipe.from_name(name))
    seed = _sr_seed()
    out, dx, dw, db = result
    _assert_gemm_close(out, _copy(spec.input, x, True), _copy(spec.weight, w, True), f"{what} out", bias)
    _assert_gemm_close(dx, _copy(spec.grad_output, dy, True, seed), _copy(spec.weight, w, False), f"{what} dx")
    _assert_gemm_close(dw, _copy(spec.grad_output, dy, False, seed), _copy(spec.input, x, False), f"{what} dw")
    assert_close_to_reference(db, dy.double().sum(0), dy.sum(0), what=f"{what} dbias")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", NAMES)
def test_linear_trains_any_token_count(name, rows):
    x, w, b, dy = _tensors(rows)
    result = _step(_linear(name, w, b), x, dy)
    assert result[0].shape == (rows, OUT_FEATURES) and result[1].shape == x.shape
    _assert_matches_emulation(name, result, x, w, dy, b, f"{name} rows={rows}")


# Each expert's tokens: one, both ragged, an empty expert.
SPLITS = {1: (1, 0), 15: (7, 8), 17: (5, 12), 51: (0, 51)}
# Bounds of the normwise relative error against the float64 product of the high-precision tensors: a few
# times the quantization error of the formats (E4M3 / E5M2 operands ~3-7%, NVFP4 ~15%) at these sizes.
QUANTIZATION_ERROR = {True: 0.3, False: 0.12}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", NAMES)
def test_grouped_linear_trains_any_token_count(name, rows):
    """Each expert's output rows, input gradient rows, weight and bias gradients against the float64 products of
    its own rows, within the recipe's quantization error (the experts' tokens share one quantize, so no
    per-expert emulation applies); an empty expert's gradients are exactly zero."""
    x, _, _, dy = _tensors(rows)
    splits = SPLITS[rows]
    layer = tl.GroupedLinear(len(splits), IN_FEATURES, OUT_FEATURES, recipe=recipe.from_name(name))
    out, dx, dw, db = _step(layer, x, dy, list(splits))
    bound = QUANTIZATION_ERROR[quantization_spec(recipe.from_name(name)).input.is_nvfp4]
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    start = 0
    for g, size in enumerate(splits):
        tokens = slice(start, start + size)
        start += size
        if size == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g])) and torch.equal(db[g], torch.zeros_like(db[g]))
            continue
        xg, dyg = x[tokens].double(), dy[tokens].double()
        for got, exact, what in ((out[tokens], xg @ w[g].t() + b[g], "out"), (dx[tokens], dyg @ w[g], "dx"),
                                 (dw[g], dyg.t() @ xg, "dw")):
            error = ((got.double() - exact).norm() / exact.norm()).item()
            assert error < bound, f"{name} expert {g} {what}: relative error {error:.3f} (bound {bound})"
        assert_close_to_reference(db[g], dyg.sum(0), dy[tokens].sum(0), what=f"{name} expert {g} dbias")


@pytest.mark.parametrize("name", NAMES)
def test_compiled_linear_takes_a_changing_token_count_without_recompiling(name):
    """fullgraph, dynamic: one graph for every token count, each step bitwise the eager one (two layers of the
    same weights, one compiled)."""
    x, w, b, dy = _tensors(max(COMPILED_ROWS))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    layers = {"eager": _linear(name, w, b), "compiled": _linear(name, w, b)}
    runs = {"eager": layers["eager"],
            "compiled": torch.compile(layers["compiled"], backend=counter, fullgraph=True, dynamic=True)}
    for rows in COMPILED_ROWS:
        steps = {}
        for kind, run in runs.items():
            layers[kind].zero_grad()
            steps[kind] = _step(run, x[:rows], dy[:rows])
        for what, got, expected in zip(("out", "dx", "dw", "db"), steps["compiled"], steps["eager"]):
            assert_bitwise_equal(got, expected, f"{name} {what} rows={rows}")
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} graphs for token counts {COMPILED_ROWS}"
