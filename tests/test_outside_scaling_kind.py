"""A scaling kind the package has never seen, defined here with its public API only, runs everywhere a
built-in one does: tl.Linear, tl.GroupedLinear, FSDP2's FP8 all-gather, quantized_model_init, the numerics
compare, torch.compile and torch.export. No package file names it.

The kind: FP8 data with one power-of-two (E8M0) scale per 1 x 64 block. Its copies are quantized by
``ops.quantize_blockwise_fused`` with 1 x 64 blocks; the FP8 GEMMs read 1 x 32 E8M0 scales (MX), so the kind
hands them each scale twice (``gemm_scale``): the same values, read per 32 elements. The grouped weight
gradient reads MX-style copies with 32-token blocks (the grouped kernels' E8M0 token block).
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from dist_harness import run_ranks
from tolerances import assert_bitwise_equal, assert_close_to_reference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import transformer_linear as tl
from transformer_linear import ops, reference
from transformer_linear.ops.grouped import fp8_grouped_gemm, fp8_grouped_gemm_wgrad_blockwise
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise

E8M0 = torch.float8_e8m0fnu
BLOCK = 64
GEMM_BLOCK = 32  # what the FP8 GEMMs read E8M0 scales per


class Pow2Blocks64(tl.recipe.ScalingKind):
    """One E8M0 scale per 1 x 64 block; the columnwise copy is quantized on its own (blocks along the rows)."""

    name = "test-pow2-1x64"

    def check(self, q):
        super().check(q)
        if list(q.block_shape) != [1, BLOCK] or q.scale_dtype != E8M0:
            raise ValueError(f"{self.name}: takes [1, 64] blocks of E8M0 scales, got {q.block_shape} {q.scale_dtype}")

    def gemm_scaling(self, q):
        return "BlockWise1x32"

    def quantize(self, q, x, rowwise, columnwise, scale=None, dbias_dtype=None, global_amax=None):
        if not (rowwise or columnwise):
            return tl.recipe.no_usages(q, x)
        out = ops.quantize_blockwise_fused(x, q.dtype, (1, BLOCK), E8M0, rowwise=rowwise, columnwise=columnwise)
        return tl.recipe.Quantized(*out)

    def dequantize(self, q, data, scale_inv, dtype):
        return (data.float() * self._per_element(scale_inv, data)).to(dtype)

    def gemm_scale(self, q, scale_inv, operand):
        scale = scale_inv.reshape(*operand.shape[:-2], *self.scale_grid(q, *operand.shape[-2:]))
        gemm_cols = -(-operand.shape[-1] // GEMM_BLOCK)
        return scale.repeat_interleave(BLOCK // GEMM_BLOCK, dim=-1)[..., :gemm_cols].contiguous()

    def _per_element(self, scale_inv, data):
        rows, cols = data.shape
        scale = reference.e8m0_to_float(scale_inv.reshape(self.scale_grid(None, rows, cols)))
        return scale.repeat_interleave(BLOCK, dim=1)[:, :cols]

    def scale_grid(self, q, rows, cols):
        return rows, -(-cols // BLOCK)

    def grouped_problem(self, input, weight, grad_output):
        return None

    def grouped_gemm(self, q_a, a, a_scale_inv, q_b, b, b_scale_inv, offs, out_dtype, bias=None):
        return fp8_grouped_gemm(a, self.gemm_scale(q_a, a_scale_inv, a), b, self.gemm_scale(q_b, b_scale_inv, b),
                                    offs, out_dtype, bias, scalings=("BlockWise1x32", "BlockWise1x32"))

    def grouped_columnwise(self, q, t, offs, rowwise):
        copy_t = quantize_grouped_columnwise(t, offs, q.dtype, GEMM_BLOCK)
        return copy_t.data_t, copy_t.scale_inv_t

    def grouped_wgrad(self, q, grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype):
        return fp8_grouped_gemm_wgrad_blockwise(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype, GEMM_BLOCK)

    def range_stats(self, q, x, scale):
        x = x.detach().float().reshape(-1, x.shape[-1])
        data, scale_inv = reference.quantize_blockwise_ref(x, q.dtype, (1, BLOCK), E8M0)
        underflow = ((data.float() == 0) & (x != 0)).float().mean().item() if x.numel() else 0.0
        largest = reference.e8m0_to_float(scale_inv).max().item() if x.numel() else 1.0
        amax = reference.amax(x).item() if x.numel() else 0.0
        return {"amax": amax, "scale": 1 / largest, "underflow": underflow, "saturation": 0.0}


tl.recipe.register_scaling_kind(Pow2Blocks64())


def _quantizer(role: str) -> tl.TensorQuantizer:
    dtype = torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn
    return tl.TensorQuantizer(dtype, [1, BLOCK], E8M0, False, kind=Pow2Blocks64.name)


RECIPE = tl.recipe.CustomRecipe(_quantizer)
IN, OUT = 128, 256


def _emulated_linear(x, weight, bias):
    """The Linear's forward under the kind, emulated in float64 from the kind's own copies."""
    q_x, q_w = _quantizer("input"), _quantizer("weight")
    x_q, w_q = q_x.quantize(x, rowwise=True), q_w.quantize(weight, rowwise=True)
    x_hp = q_x.dequantize(x_q.data, x_q.scale_inv, torch.float64)
    w_hp = q_w.dequantize(w_q.data, w_q.scale_inv, torch.float64)
    return x_hp @ w_hp.t() + bias.double()


def test_no_package_file_names_the_kind():
    root = pathlib.Path(tl.__file__).parent
    hits = [p for p in root.rglob("*.py") if Pow2Blocks64.name in p.read_text() or "Pow2Blocks64" in p.read_text()]
    assert hits == [], hits


def test_quantizer_names_its_kind_and_unknown_kinds_fail():
    q = _quantizer("input")
    assert q.scaling_kind.name == Pow2Blocks64.name and q.gemm_scaling == "BlockWise1x32"
    assert not q.columnwise_is_transpose and q.columnwise_is_copy
    with pytest.raises(ValueError, match="no scaling kind 'nope'"):
        tl.TensorQuantizer(torch.float8_e4m3fn, [1, BLOCK], E8M0, False, kind="nope")
    with pytest.raises(ValueError, match="takes \\[1, 64\\] blocks"):
        tl.TensorQuantizer(torch.float8_e4m3fn, [1, 32], E8M0, False, kind=Pow2Blocks64.name)


def test_linear_forward_backward():
    torch.manual_seed(0)
    layer = tl.Linear(IN, OUT, recipe=RECIPE)
    x = torch.randn(48, IN, requires_grad=True)
    y = layer(x)
    assert_close_to_reference(y, _emulated_linear(x.detach(), layer.weight.detach(), layer.bias.detach()),
                              what="forward under the 1x64 kind")
    y.square().mean().backward()
    exact = nn.Linear(IN, OUT)
    with torch.no_grad():
        exact.weight.copy_(layer.weight)
        exact.bias.copy_(layer.bias)
    x_exact = x.detach().clone().requires_grad_(True)
    exact(x_exact).square().mean().backward()
    for what, got, want in (("dX", x.grad, x_exact.grad), ("dW", layer.weight.grad, exact.weight.grad)):
        assert tl.numerics.sqnr(got, want) > 20, (what, tl.numerics.sqnr(got, want))


def test_grouped_linear_matches_per_expert_linears():
    torch.manual_seed(1)
    grouped = tl.GroupedLinear(3, IN, 128, recipe=RECIPE)
    sizes = [40, 0, 88]
    x = torch.randn(sum(sizes), IN, requires_grad=True)
    out = grouped(x, sizes)
    out.square().mean().backward()
    x_exact = x.detach().clone().requires_grad_(True)
    weights = grouped.weight.detach().clone().requires_grad_(True)
    pieces, start = [], 0
    for e, n in enumerate(sizes):
        pieces.append(x_exact[start : start + n] @ weights[e].t() + grouped.bias[e].detach())
        start += n
    torch.cat(pieces).square().mean().backward()
    for what, got, want in (("out", out, torch.cat(pieces)), ("dX", x.grad, x_exact.grad),
                            ("dW", grouped.weight.grad, weights.grad)):
        assert tl.numerics.sqnr(got, want) > 20, (what, tl.numerics.sqnr(got, want))


def test_quantized_model_init_keeps_both_copies_bitwise_the_forward_quantized_weight():
    torch.manual_seed(2)
    with tl.quantized_model_init(recipe=RECIPE, preserve_high_precision_init_val=True):
        layer = tl.Linear(IN, OUT, recipe=RECIPE)
    assert tl.quantized_weight_bytes(layer) < IN * OUT * 4 * 0.6  # FP8 copies, not the fp32 weight
    assert layer.weight.weight_fp8_t is not None  # the columnwise copy has blocks of its own
    master = tl.get_high_precision_init_val(layer)
    plain = tl.Linear(IN, OUT, recipe=RECIPE)
    with torch.no_grad():
        plain.weight.copy_(master)
        plain.bias.copy_(layer.bias)
    x = torch.randn(32, IN)
    assert_bitwise_equal(layer(x), plain(x), "quantized_model_init weight vs the weight quantized in forward")
    assert_bitwise_equal(layer.weight.dequantize(), _quantizer("weight").dequantize(
        layer.weight.weight_fp8, layer.weight.weight_scale_inv, torch.float32), "dequantize")


def test_compile_fullgraph_and_export():
    torch.manual_seed(3)
    model = nn.Sequential(tl.Linear(IN, OUT, recipe=RECIPE), nn.GELU(), tl.Linear(OUT, IN, recipe=RECIPE))
    x = torch.randn(64, IN)
    eager = model(x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
        assert_bitwise_equal(compiled(x), eager, "torch.compile(fullgraph=True)")
    finally:
        torch._dynamo.reset()
    program = torch.export.export(model, (x,))
    assert_bitwise_equal(program.module()(x), eager, "torch.export")


def test_numerics_compare_reports_the_kind():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.GELU(), nn.Linear(OUT, IN))
    report = tl.numerics.compare(model, torch.randn(32, IN), recipes=[RECIPE])
    rows = report.layers
    assert len(rows) == 2, "compare reported no layer"
    assert all(r.output_sqnr > 20 for r in rows), [(r.layer, r.output_sqnr) for r in rows]


def _fsdp_rank(rank, world):
    """Two layers sharded by fully_shard with FP8 all-gather of the kind's copies (1x64 blocks of each
    rank's 128 rows: no block straddles a shard), 3 AdamW steps bitwise those of the high-precision gather."""
    def build(fp8_all_gather):
        torch.manual_seed(5)
        model = nn.Sequential(tl.Linear(IN, OUT, recipe=RECIPE), nn.GELU(), tl.Linear(OUT, OUT, recipe=RECIPE))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            tl.distributed.fully_shard(layer, mesh=mesh, fp8_all_gather=fp8_all_gather)
        return tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)

    runs = []
    for fp8_all_gather in (True, False):
        model = build(fp8_all_gather)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(6 + rank)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(16, IN)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append(torch.stack(losses))
    assert_bitwise_equal(runs[0], runs[1], f"rank {rank}: losses with FP8 all-gather vs high precision")
    return True


def test_fsdp2_fp8_all_gather():
    assert run_ranks(_fsdp_rank, world_size=2, timeout=180.0) == [True, True]
