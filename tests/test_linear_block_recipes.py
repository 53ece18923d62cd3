"""tl.Linear under the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling,
Float8RowwiseScaling): eager fwd+bwd against a pure-torch emulation built from
the reference, SQNR against fp32, torch.compile / torch.export, FP8 saved
activations, and the weight-cache and wgrad options."""

import copy
import functools

import pytest
import torch
import torch._dynamo.testing
import torch.utils.checkpoint
from linear_emulation import E4M3, E5M2, E8M0, ROW, EmulatedRecipe, RoleQuantizer, assert_bias_grad, emulate_linear
from tolerances import assert_bitwise_equal, assert_close_to_reference, relative_error, sqnr

import transformer_linear as tl
from transformer_linear import recipe, reference
from transformer_linear.modules import linear_ops
from transformer_linear.modules.linear_args import LinearBwdArgs
from transformer_linear.numerics.compare import resolve_recipe
from transformer_linear.recipe.quantization import quantization_spec

# recipe -> what it means (TE / DeepSeek-V3 / OCP MX / torchao), written out independently of
# quantization.py: linear_emulation.py emulates the Linear from it.
RECIPES = {
    "block": (recipe.from_name("block"), EmulatedRecipe(
        RoleQuantizer(E4M3, (1, 128), power_2_scale=True), RoleQuantizer(E4M3, (128, 128), power_2_scale=True),
        RoleQuantizer(E4M3, (1, 128), power_2_scale=True),
    )),
    "block_hybrid_1x128_w": (
        recipe.from_name("block", fp8_format=recipe.Format.HYBRID, w_block_scaling_dim=1, power_2_scale=False),
        EmulatedRecipe(RoleQuantizer(E4M3, (1, 128)), RoleQuantizer(E4M3, (1, 128)), RoleQuantizer(E5M2, (1, 128))),
    ),
    "mxfp8": (recipe.from_name("mxfp8"), EmulatedRecipe(*(RoleQuantizer(E4M3, (1, 32), E8M0) for _ in range(3)))),
    "rowwise": (recipe.from_name("rowwise"), EmulatedRecipe(*(RoleQuantizer(E4M3, ROW, power_2_scale=True)
                                                              for _ in range(3)))),
}

# Minimum SQNR (dB) vs fp32 nn.Linear, measured on _data() (in=256, out=192, 70 rows, seed 0): e4m3
# operands give ~28-29 dB per GEMM (block, MXFP8, rowwise alike: with these magnitudes their
# power-of-two scales mostly coincide); HYBRID's e5m2 gradients ~25 dB. The floors leave ~3 dB.
SQNR_FLOOR_DB = {"out": 25.0, "dx": 25.0, "dw": 25.0}
SQNR_FLOOR_HYBRID_GRADS_DB = 21.0


def _data(rows=70, k=256, n=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    dy = torch.randn(rows, n, generator=g)
    return x, w, b, dy


def _layer(r, w, b):
    layer = tl.Linear(w.shape[1], w.shape[0], recipe=r)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _run(layer, x, dy, unbacked_rows=False, **kw):
    x = x.detach().clone().requires_grad_()
    if unbacked_rows:
        torch._dynamo.decorators.mark_unbacked(x, 0)
    out = layer(x, **kw)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("name", list(RECIPES))
# (rows, in, out): several blocks; one block; rows of a single 1x32 / 1x128 block with many rows; one
# input and/or output feature (a one-column tensor, whose (1, 1) rowwise block is not a square block)
@pytest.mark.parametrize(
    "shape",
    [(70, 256, 192), (5, 64, 32), (1, 40, 8), (256, 32, 32), (200, 64, 128), (7, 1, 5), (7, 5, 1), (7, 1, 1), (1, 1, 1)],
)
def test_eager_matches_reference_emulation(name, shape):
    r, spec = RECIPES[name]
    x, w, b, dy = _data(*shape)
    out, dx, dw, db = _run(_layer(r, w, b), x, dy)
    e_out, e_dx, e_dw = emulate_linear(spec, x, w, b, dy)
    # Exact up to the kernels' fp32 accumulation: within the package tolerance of the float64 emulation.
    assert_close_to_reference(out, *e_out, what="out")
    assert_close_to_reference(dx, *e_dx, what="dx")
    assert_close_to_reference(dw, *e_dw, what="dw")
    assert_bias_grad(db, dy)


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mxfp8_e8m0_rounding_matches_reference_emulation(rounding):
    """MXFP8BlockScaling(e8m0_rounding=) reaches every quantize of the forward and backward."""
    r, spec = recipe.MXFP8BlockScaling(e8m0_rounding=rounding), RECIPES["mxfp8"][1]
    x, w, b, dy = _data(5, 64, 32)
    out, dx, dw, _ = _run(_layer(r, w, b), x, dy)
    emulated = emulate_linear(spec.with_e8m0_rounding(rounding), x, w, b, dy)
    for what, got, (exact, baseline) in zip(("out", "dx", "dw"), (out, dx, dw), emulated):
        assert_close_to_reference(got, exact, baseline, what=f"{rounding} {what}")
    other = emulate_linear(spec.with_e8m0_rounding("floor" if rounding == "ceil" else "ceil"), x, w, b, dy)
    assert not torch.equal(out, other[0][0].float())


@pytest.mark.parametrize("name", list(RECIPES))
def test_sqnr_vs_fp32(name):
    r, spec = RECIPES[name]
    x, w, b, dy = _data()
    out, dx, dw, _ = _run(_layer(r, w, b), x, dy)
    ref_out, ref_dx, ref_dw, _ = _run(_layer(None, w, b), x, dy)
    grads_floor = SQNR_FLOOR_HYBRID_GRADS_DB if spec.grad_output.dtype == E5M2 else SQNR_FLOOR_DB["dx"]
    assert sqnr(out, ref_out) >= SQNR_FLOOR_DB["out"], sqnr(out, ref_out)
    assert sqnr(dx, ref_dx) >= grads_floor, sqnr(dx, ref_dx)
    assert sqnr(dw, ref_dw) >= grads_floor, sqnr(dw, ref_dw)


@pytest.mark.parametrize("name", list(RECIPES))
def test_saved_activations_are_fp8(name):
    """Autograd keeps the FP8 columnwise input and weight (plus scales), never the fp32 input."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data()
    layer = _layer(r, w, b)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    xr = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(xr)
    out.backward(dy)
    dtypes = {t.dtype for t in saved}
    assert torch.float32 not in {t.dtype for t in saved if t.numel() >= x.numel()}, dtypes
    fp8_bytes = sum(t.nbytes for t in saved if t.dtype in reference.FP8_DTYPES)
    assert fp8_bytes == x.numel() + w.numel()  # xᵀ and Wᵀ in FP8: a quarter of fp32's bytes


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("enable", ["module", "autocast", "convert"])
def test_every_way_to_enable(name, enable):
    r, _ = RECIPES[name]
    x, w, b, dy = _data(rows=8)
    expected = _run(_layer(r, w, b), x, dy)
    if enable == "convert":
        model = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0]))
        with torch.no_grad():
            model[0].weight.copy_(w)
            model[0].bias.copy_(b)
        tl.convert_to_fp8(model, recipe=r)
        got = _run(model[0], x, dy)
    else:
        layer = _layer(r if enable == "module" else None, w, b)
        with tl.autocast(recipe=r):
            got = _run(layer, x, dy)
    for a, e, what in zip(got, expected, ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


# Batch sizes of one partial row block, exactly one block, one row past it, several blocks, and 2 rows.
BATCH_ROWS = (7, 128, 129, 300, 2)


def _zero_grads(*layers):
    for layer in layers:
        layer.zero_grad()


@pytest.mark.parametrize("name", list(RECIPES))
# Rows shorter than a block (24 < 32 < 128) take the separately quantized transposes (quantization.py).
@pytest.mark.parametrize("features", [(256, 192), (24, 16)], ids=["long_rows", "short_rows"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic_dynamic"])
def test_compile_equals_eager_without_recompiles(name, features, dynamic):
    """Exactly the graphs torch.nn.Linear gets over the same batch sizes: with dynamic=True one for every
    batch of 2 or more rows, however many row blocks it has (1 row gets a second: torch specializes an
    input size of 1); by default a static first graph, then one dynamic graph for the rest."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data(300, *features)
    eager = _layer(r, w, b)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()  # graphs of earlier tests count towards the recompile limit
    counter, nn_counter = (torch._dynamo.testing.CompileCounterWithBackend("aot_eager") for _ in range(2))
    compiled = torch.compile(compiled_layer, backend=counter, fullgraph=True, dynamic=dynamic)
    nn_compiled = torch.compile(torch.nn.Linear(*features), backend=nn_counter, fullgraph=True, dynamic=dynamic)
    for rows in BATCH_ROWS + (1,):
        xs, dys = x[:rows], dy[:rows]
        _zero_grads(eager, compiled_layer)
        for a, e, what in zip(_run(compiled, xs, dys), _run(eager, xs, dys), ("out", "dx", "dw", "db")):
            assert_bitwise_equal(a, e, f"{what} rows={rows}")
        _run(nn_compiled, xs, dys)
        assert counter.frame_count == nn_counter.frame_count, f"rows={rows}: {counter.frame_count} graphs"
    assert counter.frame_count == (2 if dynamic else 3)


@pytest.mark.parametrize("name", list(RECIPES))
def test_compile_unbacked_batch_one_graph(name):
    """A batch dim marked unbacked (torch._dynamo.mark_unbacked) gives one graph for every size, 1 included:
    nothing in the block path guards on the row count."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data(rows=300)
    eager = _layer(r, w, b)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_layer, backend=counter, fullgraph=True)
    for rows in (1,) + BATCH_ROWS:
        xs, dys = x[:rows], dy[:rows]
        _zero_grads(eager, compiled_layer)
        got = _run(compiled, xs, dys, unbacked_rows=True)
        for a, e, what in zip(got, _run(eager, xs, dys), ("out", "dx", "dw", "db")):
            assert_bitwise_equal(a, e, f"{what} rows={rows}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_export_dynamic_batch_equals_eager(name, grad, tmp_path):
    """A dynamic batch and sequence (torch.export.Dim): one program for every size, saved, loaded and run
    bitwise equal to eager (also sizes with a single row block, or a single row)."""
    r, _ = RECIPES[name]
    x, w, b, _ = _data(rows=300)
    layer = _layer(r, w, b)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    example = x[:120].reshape(4, 30, -1)  # 120 rows: fewer than one 128-row block
    with torch.set_grad_enabled(grad):
        program = torch.export.export(layer, (example,), dynamic_shapes=({0: batch, 1: seq},))
    path = tmp_path / "linear.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for shape in ((1, 1), (1, 7), (2, 64), (3, 43), (5, 60)):
        xs = x[: shape[0] * shape[1]].reshape(*shape, -1)
        with torch.no_grad():
            assert_bitwise_equal(loaded(xs), layer(xs), f"shape={shape}")


class _TwiceCalled(torch.nn.Module):
    """One block-scaled Linear called twice, then a head."""

    def __init__(self, r):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = tl.Linear(64, 64, recipe=r), tl.Linear(64, 16, recipe=r)

    def forward(self, x):
        return self.head(self.inner(torch.relu(self.inner(x)) + 1.0))


@pytest.mark.parametrize("name", list(RECIPES))
def test_export_unflatten_same_linear_called_twice(name):
    """torch.export.unflatten of a dynamic-batch program that calls one layer twice: the submodules come
    back and every batch size runs bitwise equal to eager."""
    model = _TwiceCalled(RECIPES[name][0])
    example = torch.randn(150, 64)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    unflat = torch.export.unflatten(program)
    assert any(fqn.startswith("inner") for fqn, _ in unflat.named_modules())
    for rows in (1, 7, 130):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            assert_bitwise_equal(unflat(x), model(x), f"rows={rows}")


def _gemm_operands(rows, a_block, b_block, scale_dtype, k=160, n=48):
    x, w = torch.randn(rows, k), torch.randn(n, k)
    return (*RoleQuantizer(E4M3, a_block, scale_dtype).quantize(x), *RoleQuantizer(E4M3, b_block, scale_dtype).quantize(w))


class _Gemm(torch.nn.Module):
    def forward(self, a, a_scale_inv, b, b_scale_inv):
        return tl.ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32)


GEMM_SCALINGS = pytest.mark.parametrize(
    "a_block, b_block, scale_dtype",
    [
        ((1, 128), (128, 128), torch.float32),
        ((1, 128), (1, 128), torch.float32),
        ((1, 32), (1, 32), E8M0),
        (ROW, ROW, torch.float32),
    ],
    ids=["1x128_128x128", "1x128_1x128", "mxfp8", "rowwise"],
)


@GEMM_SCALINGS
def test_fp8_gemm_export_with_dynamic_rows(a_block, b_block, scale_dtype):
    """ops.fp8_gemm exported with a dynamic row count (a's and its scale's, one Dim): one program for
    every M, 1 and 7 (one row block) included; a scale of other rows fails its run-time check."""
    operands = functools.partial(_gemm_operands, a_block=a_block, b_block=b_block, scale_dtype=scale_dtype)
    rows = torch.export.Dim("rows")
    program = torch.export.export(_Gemm(), operands(200), dynamic_shapes=({0: rows}, {0: rows}, None, None))
    for m in (1, 7, 129, 300):
        args = operands(m)
        assert_bitwise_equal(program.module()(*args), _Gemm()(*args), f"rows={m}")
    a, a_scale_inv, b, b_scale_inv = operands(300)
    with pytest.raises(AssertionError, match="a_scale_inv"):
        program.module()(a, a_scale_inv[:100], b, b_scale_inv)


@GEMM_SCALINGS
def test_fp8_gemm_compiled_with_dynamic_rows(a_block, b_block, scale_dtype):
    """ops.fp8_gemm in compiled code, its operands and scales graph inputs with dynamic sizes: one graph
    for every M of 2 rows or more (one row block or several)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_Gemm(), backend=counter, fullgraph=True, dynamic=True)
    for rows in (200, 7, 300, 129):
        args = _gemm_operands(rows, a_block, b_block, scale_dtype)
        assert_bitwise_equal(compiled(*args), _Gemm()(*args), f"rows={rows}")
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(RECIPES))
def test_cached_weight_is_first_microbatch(name):
    """is_first_microbatch=False reuses the FP8 weight (both layouts): the same results as requantizing."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data(rows=16)
    layer = _layer(r, w, b)
    first = _run(layer, x, dy, is_first_microbatch=True)
    with torch.no_grad():
        layer.weight.mul_(2)  # not seen: the cached FP8 weight is used
    layer.zero_grad()
    cached = _run(layer, x, dy, is_first_microbatch=False)
    for a, e, what in zip(cached, first, ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


@pytest.mark.parametrize("name", ["block", "mxfp8", "rowwise"])
def test_delay_wgrad_compute_and_fused_accumulation(name):
    r, _ = RECIPES[name]
    x, w, b, dy = _data(rows=16)
    expected = _run(_layer(r, w, b), x, dy)
    delayed = tl.Linear(w.shape[1], w.shape[0], recipe=r, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        delayed.weight.copy_(w)
        delayed.bias.copy_(b)
    out, dx, dw, db = _run(delayed, x, dy)
    assert dw is None and db is None
    delayed.backward_dw()
    assert_bitwise_equal(out, expected[0], "out")
    assert_bitwise_equal(dx, expected[1], "dx")
    assert_bitwise_equal(delayed.weight.main_grad, expected[2], "main_grad")
    assert_bitwise_equal(delayed.bias.grad, expected[3], "dbias")


@pytest.mark.parametrize("name", ["block", "mxfp8", "rowwise"])
def test_numerics_tools_take_the_block_recipes(name):
    """compare's names and the monitor's range statistics work for block recipes (per-block scales:
    nothing saturates; the tiny elements of a block with a large amax underflow)."""
    r, _ = RECIPES[name]
    assert resolve_recipe(name) == r
    x, w, b, _ = _data(rows=8)
    x[:, 1] = 1e-30  # below e4m3's smallest subnormal at any scale a block of O(1) values gets
    layer = _layer(r, w, b)
    with tl.numerics.monitor(layer, every=1) as mon:
        layer(x)
        (record,) = mon.step()
    assert record["input_saturation"] == 0.0
    assert record["input_underflow"] == pytest.approx(8 / x.numel())
    assert record["output_sqnr_db"] > SQNR_FLOOR_DB["out"]


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("cached", [False, True])
def test_opcheck_linear_fwd(name, cached):
    """The block path's fake implementation (the forward itself, on fake tensors) agrees with it."""
    r, _ = RECIPES[name]
    x, w, b, _ = _data(rows=20, k=64, n=48)
    layer = _layer(r, w, b)
    if cached:
        layer(x, is_first_microbatch=True)
    args = layer._fwd_args(x.requires_grad_(), r, False if cached else None)
    assert (args.cached_weight is not None) == cached
    flat = linear_ops.linear_fwd.flatten(args)
    op = linear_ops.linear_fwd.op
    torch.library.opcheck(op, flat, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    # test_aot_dispatch_dynamic sums every output (no FP8 sum kernel): forward only, detached.
    detached = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in flat)
    torch.library.opcheck(op, detached, test_utils="test_aot_dispatch_dynamic")


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("name", list(RECIPES))
def test_opcheck_linear_dgrad_and_wgrad(name):
    """The block path's backward ops, on what the backward hands them (1-D activation scales), agree with
    their fake implementations and give the emulation's dx and dW."""
    r, emulated_recipe = RECIPES[name]
    x, w, b, dy = _data(rows=20, k=64, n=48)
    spec = quantization_spec(r)
    qx = spec.input.quantize_flat(x, rowwise=False, columnwise=True)
    qw = spec.weight.quantize(w, rowwise=False, columnwise=True)
    qg = spec.grad_output.quantize_flat(dy, rowwise=True, columnwise=True)
    args = LinearBwdArgs(
        grad_output=qg.data,
        grad_output_t=qg.data_t,
        grad_output_scale_inv=qg.scale_inv,
        grad_output_t_scale_inv=qg.scale_inv_t,
        inp=qx.data_t,
        inp_scale_inv=qx.scale_inv_t,
        weight=qw.data_t,
        weight_scale_inv=qw.scale_inv_t,
        input_shape=list(x.shape),
        dgrad_dtype=torch.float32,
        wgrad_dtype=torch.float32,
        quantization=spec,
    )
    _, e_dx, e_dw = emulate_linear(emulated_recipe, x, w, b, dy)
    for op, expected, what in ((linear_ops.linear_dgrad, e_dx, "dx"), (linear_ops.linear_wgrad, e_dw, "dw")):
        torch.library.opcheck(op.op, op.flatten(args))
        assert_close_to_reference(op(args), *expected, what=what)


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("tensor", ["input", "weight", "grad_output"])
@pytest.mark.parametrize("layouts", [(True, True), (True, False), (False, True)], ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("shape", [(70, 256), (5, 20)])
def test_quantize_flat_is_quantize_with_1d_scales(name, tensor, layouts, shape):
    """The backward's grad_output quantize (one op, 1-D scales): the same tensors as quantize, scale_grid
    restoring the scales' shapes; opcheck passes."""
    quantizer = getattr(quantization_spec(RECIPES[name][0]), tensor)
    x = torch.randn(shape)
    flat, full = quantizer.quantize_flat(x, *layouts), quantizer.quantize(x, *layouts)
    rows, cols = shape
    for got, expected, grid, what in (
        (flat.scale_inv, full.scale_inv, quantizer.scale_grid(rows, cols), "scale_inv"),
        (flat.scale_inv_t, full.scale_inv_t, quantizer.scale_grid(cols, rows), "scale_inv_t"),
    ):
        assert got.dim() == 1
        assert_bitwise_equal(got.view(torch.uint8), expected.reshape(-1).view(torch.uint8), what)
        if expected.numel():
            assert tuple(expected.shape) == grid, what
    for got, expected, what in ((flat.data, full.data, "data"), (flat.data_t, full.data_t, "data_t")):
        assert_bitwise_equal(got.view(torch.uint8), expected.view(torch.uint8), what)
    op = torch.ops.transformer_linear.quantize_blockwise_flat.default
    args = (x, quantizer.dtype, quantizer.block_shape, quantizer.scale_dtype, quantizer.power_2_scale, *layouts,
            quantizer.e8m0_rounding)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("shape", [(70, 256, 192), (256, 32, 32)])
def test_input_without_grad_gives_the_same_weight_gradient(name, shape):
    """No dgrad: grad_output is quantized columnwise only (also on rows shorter than one block)."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data(*shape)
    expected = _run(_layer(r, w, b), x, dy)
    layer = _layer(r, w, b)
    out = layer(x)
    out.backward(dy)
    assert_bitwise_equal(out.detach(), expected[0], "out")
    assert_bitwise_equal(layer.weight.grad, expected[2], "dw")


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("mode", ["eager", "compiled_selective"])
def test_activation_checkpointing_matches_plain_backward(name, mode):
    """Block recipes keep no state: a recompute quantizes exactly as the forward did."""
    r, _ = RECIPES[name]

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(tl.Linear(64, 96, recipe=r), torch.nn.ReLU(), tl.Linear(96, 32, recipe=r))

    plain, checkpointed = mlp(), mlp()
    kwargs = {"use_reentrant": False}
    if mode == "compiled_selective":
        kwargs["context_fn"] = tl.selective_checkpoint_contexts

    def run(x):
        return torch.utils.checkpoint.checkpoint(checkpointed, x, **kwargs)

    if mode == "compiled_selective":
        run = torch.compile(run, backend="aot_eager", fullgraph=True)
    x = torch.randn(40, 64)
    x_plain, x_ckpt = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_plain, y_ckpt = plain(x_plain), run(x_ckpt)
    y_plain.square().sum().backward()
    y_ckpt.square().sum().backward()
    assert_bitwise_equal(y_ckpt, y_plain, "output")
    assert_bitwise_equal(x_ckpt.grad, x_plain.grad, "input grad")
    for (pname, p), p_plain in zip(checkpointed.named_parameters(), plain.parameters()):
        assert_bitwise_equal(p.grad, p_plain.grad, f"{pname}.grad")


@pytest.mark.parametrize("name", ["block", "mxfp8", "rowwise"])
def test_inductor_equals_eager(name):
    """Inductor runs the same custom ops: out, dx, dw bitwise; the bias gradient is a plain fp32
    column sum, which inductor may reorder (normwise within a relative 1e-5)."""
    r, _ = RECIPES[name]
    x, w, b, dy = _data(rows=200)
    eager = _layer(r, w, b)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, backend="inductor", fullgraph=True)
    got, expected = _run(compiled, x, dy), _run(eager, x, dy)
    for a, e, what in zip(got[:3], expected[:3], ("out", "dx", "dw")):
        assert_bitwise_equal(a, e, what)
    assert relative_error(got[3], expected[3]) <= 1e-5  # normwise: single sums may cancel
