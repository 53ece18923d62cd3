"""tl.Linear under recipe.NVFP4BlockScaling: eager fwd+bwd against an emulation built from
reference/nvfp4 (the quantized operands bitwise, the GEMMs within the package tolerance), the built-in
GPT trained within 3% of fp32, every way to enable it, torch.compile / torch.export, state_dict,
stochastic rounding's unbiased sums, and the shapes it refuses."""

import copy

import pytest
import torch
import torch._dynamo.testing
from linear_emulation import assert_bias_grad, nvfp4_amax, nvfp4_copies
from tolerances import assert_bitwise_equal, assert_nvfp4_gemm_close

import transformer_linear as tl
from transformer_linear import recipe, reference
from transformer_linear.modules import linear, linear_ops
from transformer_linear.numerics.compare import recipe_label, train_run
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss
from transformer_linear.numerics.stats import quantizer_range_stats
from transformer_linear.ops import nvfp4 as nvfp4_ops
from transformer_linear.reference import nvfp4 as ref

# The recipe and its switches, each turning one of TE's features off.
VARIANTS = {
    "default": recipe.from_name("nvfp4"),
    "no_rht": recipe.NVFP4BlockScaling(disable_rht=True),
    "no_sr": recipe.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "no_2d": recipe.NVFP4BlockScaling(disable_2d_quantization=True),
}
SEED = 1234


def _features(r):
    """(rht, stochastic rounding, 16x16 weight tiles) of a variant, written out from TE's recipe."""
    return not r.disable_rht, not r.disable_stochastic_rounding, not r.disable_2d_quantization


def _sr_seed(manual_seed):
    """The seed the Linear's grad_output quantize draws after torch.manual_seed(manual_seed): one int64 from
    the default CPU generator (ops.nvfp4.sr_seed)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))


def _data(rows=48, k=64, n=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    dy = torch.randn(rows, n, generator=g)
    return x.to(dtype), w, b, dy.to(dtype)


def _layer(r, w, b):
    layer = tl.Linear(w.shape[1], w.shape[0], recipe=r)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _run(layer, x, dy, **kw):
    """out, dx, dW, db of one forward and backward, the SR seed drawn after torch.manual_seed(SEED)."""
    x = x.detach().clone().requires_grad_()
    out = layer(x, **kw)
    torch.manual_seed(SEED)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _emulate(r, x, w, dy, seed):
    """The three tensors' NVFP4 copies as reference/nvfp4 makes them under the recipe's rules."""
    rht, sr, w2d = _features(r)
    return nvfp4_copies(x, w, dy, rht=rht, stochastic_rounding=sr, weight_2d=w2d, seed=seed)


def _spy(monkeypatch):
    seen = {}

    def spy(key, fn):
        def wrapper(args, *rest):
            seen[key] = args
            out = fn(args, *rest)
            seen[key + "_out"] = out
            return out

        return wrapper

    monkeypatch.setattr(linear, "linear_fwd", spy("fwd", linear.linear_fwd))
    monkeypatch.setattr(linear_ops, "linear_dgrad", spy("dgrad", linear_ops.linear_dgrad))
    monkeypatch.setattr(linear_ops, "compute_wgrad", spy("wgrad", linear_ops.compute_wgrad))
    return seen


def _assert_copy_equal(data, packed_scales, expected_data, expected_scale, expected_global, what):
    """A Linear's NVFP4 copy (uint8 data, packed scales) bitwise equal to the reference's."""
    rows, cols = expected_scale.shape[0], expected_scale.shape[1] * 16
    scale, global_scale = nvfp4_ops.unpack_scales(packed_scales, rows, cols)
    assert_bitwise_equal(data, expected_data.view(torch.uint8), f"{what} data")
    assert_bitwise_equal(scale.view(torch.uint8), expected_scale.view(torch.uint8), f"{what} block scales")
    assert_bitwise_equal(global_scale, expected_global, f"{what} global scale")


def _dequantized(data, scale):
    return ref.dequantize_nvfp4(data, scale, torch.tensor(1.0))


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (rows, in, out): several blocks each way; one 16x16 tile; more rows than features
@pytest.mark.parametrize("shape", [(48, 64, 32), (16, 16, 16), (160, 96, 48)])
def test_eager_matches_reference_emulation(name, dtype, shape, monkeypatch):
    r = VARIANTS[name]
    x, w, b, dy = _data(*shape, dtype=dtype)
    seen = _spy(monkeypatch)
    out, dx, dw, db = _run(_layer(r, w, b), x, dy)
    qx, qw, qg = _emulate(r, x, w, dy, _sr_seed(SEED))

    # The quantized operands, bitwise: what forward saved and backward read.
    o, d, wg = seen["fwd_out"], seen["dgrad"], seen["wgrad"]
    _assert_copy_equal(o.inp_saved, o.inp_scale_inv, qx.data_t, qx.scale_t, qx.global_scale_t, "input (columnwise)")
    _assert_copy_equal(o.weight_fp8, o.weight_scale_inv, qw.data, qw.scale, qw.global_scale, "weight")
    _assert_copy_equal(o.weight_fp8_t, o.weight_scale_inv_t, qw.data_t, qw.scale_t, qw.global_scale_t, "weight_t")
    _assert_copy_equal(d.grad_output, d.grad_output_scale_inv, qg.data, qg.scale, qg.global_scale, "grad_output")
    _assert_copy_equal(wg.grad_output_t, wg.grad_output_t_scale_inv, qg.data_t, qg.scale_t, qg.global_scale_t,
                       "grad_output (columnwise)")

    # The GEMMs of those operands, within the package tolerance of their float64 product.
    gemms = {
        "out": (out, qx.data, qx.scale, qx.global_scale, qw.data, qw.scale, qw.global_scale, b.to(dtype)),
        "dx": (dx, qg.data, qg.scale, qg.global_scale, qw.data_t, qw.scale_t, qw.global_scale_t, None),
        "dw": (dw, qg.data_t, qg.scale_t, qg.global_scale_t, qx.data_t, qx.scale_t, qx.global_scale_t, None),
    }
    for what, (actual, a, a_s, a_g, bb, b_s, b_g, bias) in gemms.items():
        alpha = float(a_g) * float(b_g)
        assert_nvfp4_gemm_close(actual.float().to(actual.dtype), _dequantized(a, a_s), _dequantized(bb, b_s), alpha,
                                bias)
    assert_bias_grad(db, dy)


def test_rht_and_sr_change_only_what_they_should(monkeypatch):
    """RHT touches only the wgrad operands' columnwise copies, SR only grad_output; 2D only the weight."""
    x, w, b, dy = _data()
    copies = {}
    for name, r in VARIANTS.items():
        seen = _spy(monkeypatch)
        _run(_layer(r, w, b), x, dy)
        o, d, wg = seen["fwd_out"], seen["dgrad"], seen["wgrad"]
        copies[name] = {"x_t": o.inp_saved, "w": o.weight_fp8, "w_t": o.weight_fp8_t, "g": d.grad_output,
                        "g_t": wg.grad_output_t}
    differs = {name: {k for k in copies["default"] if not torch.equal(copies[name][k], copies["default"][k])}
               for name in VARIANTS if name != "default"}
    assert differs == {"no_rht": {"x_t", "g_t"}, "no_sr": {"g", "g_t"}, "no_2d": {"w", "w_t"}}


# --- the built-in GPT (numerics.compare.train_run, as tests/test_gpt_training.py trains the FP8 recipes) ---

STEPS, BATCH, LR = 50, 8, 3e-3
FINAL_STEPS = 10
# Measured (tiny config, seed 0, 50 steps; fp32 ends at 1.709): default +1.9%, no RHT +2.2%, no SR +2.3%,
# no 2D +1.7%. FP8 recipes end within 0.1% (test_gpt_training.py); FP4's 3% is the issue's bound.
FINAL_LOSS_TOLERANCE = 0.03


def _final_loss(curve):
    return sum(curve[-FINAL_STEPS:]) / FINAL_STEPS


@pytest.fixture(scope="module")
def workload():
    cfg = GPTConfig.named("tiny")
    data = SyntheticText(cfg, seed=0)
    batches = [data.batch(BATCH) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    fp32, _, _ = train_run(model, None, batches, lm_loss, LR)
    assert _final_loss(fp32) < 0.6 * data.uniform_loss, fp32
    return model, batches, fp32


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpt_final_loss_within_3_percent_of_fp32(name, workload):
    model, batches, fp32 = workload
    torch.manual_seed(0)
    fp4, _, trained = train_run(model, VARIANTS[name], batches, lm_loss, LR)
    linears = [m for m in trained.modules() if isinstance(m, tl.Linear)]
    assert len(linears) == 5 and all(m.recipe == VARIANTS[name] for m in linears)
    gap = abs(_final_loss(fp4) - _final_loss(fp32)) / _final_loss(fp32)
    final, reference_final = _final_loss(fp4), _final_loss(fp32)
    assert gap <= FINAL_LOSS_TOLERANCE, f"{name}: final {final:.4f} vs fp32 {reference_final:.4f} ({gap:.2%})"


# --- every way to enable it; compile; export; state_dict ---


@pytest.mark.parametrize("name", ["default", "no_2d"])
@pytest.mark.parametrize("enable", ["autocast", "convert"])
def test_every_way_to_enable_equals_the_module_recipe(name, enable):
    r = VARIANTS[name]
    x, w, b, dy = _data(rows=32)
    expected = _run(_layer(r, w, b), x, dy)
    if enable == "convert":
        model = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0]))
        with torch.no_grad():
            model[0].weight.copy_(w)
            model[0].bias.copy_(b)
        tl.convert_to_fp8(model, recipe=r)
        got = _run(model[0], x, dy)
    else:
        layer = _layer(None, w, b)
        with tl.autocast(recipe=r):
            got = _run(layer, x, dy)
    for a, e, what in zip(got, expected, ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


BATCH_ROWS = (16, 48, 160, 32)


@pytest.mark.parametrize("name", ["default", "no_2d"])
def test_compile_equals_eager_without_recompiles(name):
    """fullgraph, dynamic batch: one graph for every batch (a multiple of 16 rows), each step bitwise equal to
    eager for the same torch.manual_seed (the SR seeds are drawn alike)."""
    r = VARIANTS[name]
    x, w, b, dy = _data(rows=160)
    eager = _layer(r, w, b)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_layer, backend=counter, fullgraph=True, dynamic=True)
    for rows in BATCH_ROWS:
        eager.zero_grad()
        compiled_layer.zero_grad()
        for a, e, what in zip(_run(compiled, x[:rows], dy[:rows]), _run(eager, x[:rows], dy[:rows]),
                              ("out", "dx", "dw", "db")):
            assert_bitwise_equal(a, e, f"{what} rows={rows}")
    assert counter.frame_count == 1


def test_inductor_draws_the_same_sr_seeds_as_eager():
    """Under inductor (which replaces traced random ops with its own generator) the SR seeds still come
    from torch's default generator: a compiled training step equals the eager one for the same seed."""
    r = VARIANTS["default"]
    x, w, b, dy = _data(rows=32)
    eager = _layer(r, w, b)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, fullgraph=True)
    got, expected = _run(compiled, x, dy), _run(eager, x, dy)
    for a, e, what in zip(got[:3], expected[:3], ("out", "dx", "dw")):
        assert_bitwise_equal(a, e, what)
    # The bias gradient is a plain column sum, which inductor generates code for (its own summation order).
    torch.testing.assert_close(got[3], expected[3])
    # And another seed gives another gradient: the seed is really drawn.
    compiled_layer.zero_grad()
    xs = x.detach().clone().requires_grad_()
    out = compiled(xs)
    torch.manual_seed(SEED + 1)
    out.backward(dy)
    assert not torch.equal(xs.grad, expected[1])


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_export_dynamic_batch_save_load(grad, tmp_path):
    """torch.export with a dynamic batch (whole 16-row sequences), saved, loaded, bitwise equal to eager."""
    r = VARIANTS["default"]
    x, w, b, _ = _data(rows=160)
    layer = _layer(r, w, b)
    example = x[:64].reshape(4, 16, -1)
    with torch.set_grad_enabled(grad):
        program = torch.export.export(layer, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = tmp_path / "linear.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for batch in (1, 3, 10):
        xs = x[: batch * 16].reshape(batch, 16, -1)
        with torch.no_grad():
            assert_bitwise_equal(loaded(xs), layer(xs), f"batch={batch}")


class _CalledTwice(torch.nn.Module):
    """The export seed's case: one submodule called twice, here at NVFP4's 16-multiple sizes."""

    def __init__(self, r):
        super().__init__()
        self.inner = tl.Linear(64, 64, recipe=r)
        self.head = tl.Linear(64, 32, recipe=r)

    def forward(self, x):
        return self.head(self.inner(torch.relu(self.inner(x)) + 1.0))


def test_export_unflatten_of_a_layer_called_twice():
    """torch.export.unflatten keeps the twice-called NVFP4 layer a submodule, bitwise equal to eager."""
    torch.manual_seed(0)
    model = _CalledTwice(VARIANTS["default"])
    x = torch.randn(4, 16, 64)  # a dynamic batch of whole 16-row sequences, as NVFP4's copies need
    program = torch.export.export(model, (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch")},))
    unflat = torch.export.unflatten(program)
    assert any(fqn.startswith("inner") for fqn, _ in unflat.named_modules())
    for batch in (1, 3, 4):
        with torch.no_grad():
            assert_bitwise_equal(unflat(x[:batch]), model(x[:batch]), f"batch={batch}")


def test_state_dict_round_trip():
    r = VARIANTS["default"]
    x, w, b, dy = _data()
    trained = _layer(r, w, b)
    _run(trained, x, dy)
    with torch.no_grad():
        trained.weight.sub_(0.1 * trained.weight.grad)
    restored = tl.Linear(w.shape[1], w.shape[0], recipe=r)
    restored.load_state_dict(trained.state_dict())
    trained.zero_grad()
    for a, e, what in zip(_run(restored, x, dy), _run(trained, x, dy), ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


# --- stochastic rounding ---


@pytest.mark.parametrize("name", ["no_rht", "default"])
def test_stochastic_rounding_removes_the_bias_of_a_long_sum(name):
    """dW sums grad_output over 4096 rows. Each 16-row block of a grad_output column holds one 1.0 and
    fifteen 0.1, which its block scale maps to 6 and 0.6: nearest rounding makes every 0.6 a 0.5, so the
    sum comes out ~10% low; stochastic rounding is unbiased and lands within 1% (without RHT; with it the
    values of a block are mixed before rounding and both end close)."""
    rows, features = 4096, 16
    g = torch.full((rows, features), 0.1)
    g[::16] = 1.0
    x = torch.ones(rows, features)
    exact = g.t() @ x
    gaps = {}
    for sr in (False, True):
        r = recipe.NVFP4BlockScaling(disable_rht=name == "no_rht", disable_stochastic_rounding=not sr)
        layer = tl.Linear(features, features, bias=False, recipe=r)
        torch.manual_seed(SEED)
        layer(x).backward(g)
        gaps[sr] = float(((layer.weight.grad - exact) / exact).mean())
    if name == "no_rht":
        assert gaps[False] < -0.09, gaps  # round to nearest: the 0.6s all became 0.5
    assert abs(gaps[True]) < 0.01, gaps


# --- shapes the format cannot take ---


@pytest.mark.parametrize(
    "in_features, out_features, rows, match",
    [
        (24, 16, 16, "the columns of 'x' \\(24\\) must be a multiple of 16"),  # the input's rowwise copy
        (16, 24, 16, "the columns of 'x' \\(24\\) must be a multiple of 16"),  # grad_output's rowwise copy (dgrad)
    ],
)
def test_bad_shapes_raise_a_clear_error(in_features, out_features, rows, match):
    """Features not a multiple of 16 (the token count is free: tests/test_token_counts.py)."""
    layer = tl.Linear(in_features, out_features, recipe=VARIANTS["default"])
    x = torch.randn(rows, in_features, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        layer(x).sum().backward()


def test_inference_takes_any_row_count():
    """Without gradients only rowwise copies are made: any number of rows (K still a multiple of 16)."""
    x, w, b, _ = _data(rows=7)
    layer = _layer(VARIANTS["default"], w, b)
    with torch.no_grad():
        out = layer(x)
    qx = ref.quantize_nvfp4(x, nvfp4_amax(x))
    qw = ref.quantize_nvfp4(w, nvfp4_amax(w), scaling_2d=True)
    expected = ref.nvfp4_gemm(qx.data, qx.scale, qx.global_scale, qw.data, qw.scale, qw.global_scale, bias=b)
    assert_bitwise_equal(out, expected, "out")


# --- opcheck: the Linear's ops and the NVFP4 ops it runs ---


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("name", ["default", "no_2d"])
@pytest.mark.parametrize("cached", [False, True])
def test_opcheck_linear_fwd(name, cached):
    r = VARIANTS[name]
    x, w, b, _ = _data(rows=32)
    layer = _layer(r, w, b)
    if cached:
        layer(x, is_first_microbatch=True)
    args = layer._fwd_args(x.requires_grad_(), r, False if cached else None)
    assert (args.cached_weight is not None) == cached
    flat = linear_ops.linear_fwd.flatten(args)
    op = linear_ops.linear_fwd.op
    torch.library.opcheck(op, flat, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    detached = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in flat)
    torch.library.opcheck(op, detached, test_utils="test_aot_dispatch_dynamic")


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_opcheck_linear_dgrad_and_wgrad(name):
    """The backward ops on what the backward hands them (SR seeds drawn before, as tensors) agree with their
    fake implementations."""
    r = VARIANTS[name]
    x, w, b, dy = _data(rows=32)
    spec = tl.recipe.quantization.quantization_spec(r)
    qx = spec.input.quantize_flat(x, rowwise=False, columnwise=True)
    qw = spec.weight.quantize(w, rowwise=False, columnwise=True)
    qg = spec.grad_output.quantize_flat(dy, rowwise=True, columnwise=True)
    args = linear_ops.LinearBwdArgs(
        grad_output=qg.data, grad_output_t=qg.data_t, grad_output_scale_inv=qg.scale_inv,
        grad_output_t_scale_inv=qg.scale_inv_t, inp=qx.data_t, inp_scale_inv=qx.scale_inv_t, weight=qw.data_t,
        weight_scale_inv=qw.scale_inv_t, input_shape=list(x.shape), dgrad_dtype=torch.float32,
        wgrad_dtype=torch.float32, quantization=spec,
    )
    for op in (linear_ops.linear_dgrad, linear_ops.linear_wgrad):
        torch.library.opcheck(op.op, op.flatten(args))


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("rows", [0, 16, 48, 17])
@pytest.mark.parametrize("scaling_2d, rht, sr", [(False, False, False), (True, False, False), (False, True, True)])
def test_opcheck_packed_nvfp4_ops(rows, scaling_2d, rht, sr):
    x = torch.randn(rows, 64)
    seed = torch.tensor(7, dtype=torch.int64)
    torch.library.opcheck(torch.ops.transformer_linear.quantize_nvfp4_packed.default,
                          (x, True, True, scaling_2d, rht, sr, seed))
    data, scales, data_t, scales_t = nvfp4_ops.quantize_nvfp4_packed(x, True, True, scaling_2d, rht, sr, seed)
    w = nvfp4_ops.quantize_nvfp4_packed(torch.randn(32, 64))
    torch.library.opcheck(torch.ops.transformer_linear.nvfp4_gemm_packed.default,
                          (data, scales, w[0], w[1], torch.float32, None))


@pytest.mark.parametrize("rows", [0, 16, 48])
@pytest.mark.parametrize("scaling_2d, columnwise", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_quantize_takes_a_global_amax(rows, scaling_2d, columnwise, dtype):
    """quantize_nvfp4_packed(amax=...) (a shard quantized with its whole tensor's amax, FSDP2's NVFP4 gather):
    the reference's copies with that amax, bitwise, for the rowwise and a non-RHT columnwise copy."""
    x = (torch.randn(rows, 64) * 3).to(dtype)
    amax = torch.tensor(25.0)  # above x's own: the global scale is not x's
    torch.library.opcheck(torch.ops.transformer_linear.quantize_nvfp4_packed.default,
                          (x, True, columnwise, scaling_2d, False, False, None, amax))
    data, scales, data_t, scales_t = nvfp4_ops.quantize_nvfp4_packed(
        x, True, columnwise, scaling_2d, amax=amax.reshape(1))
    q = ref.quantize_nvfp4(x, amax, rowwise=True, columnwise=columnwise, scaling_2d=scaling_2d)
    _assert_copy_equal(data, scales, q.data, q.scale, q.global_scale, "x")
    if columnwise:
        _assert_copy_equal(data_t, scales_t, q.data_t, q.scale_t, q.global_scale_t, "x (columnwise)")


def test_packed_quantize_rejects_a_bad_global_amax():
    x = torch.randn(16, 64)
    for amax, error, match in (
        (torch.tensor(1.0, dtype=torch.float64), TypeError, "'amax' must be a float32 tensor"),
        (torch.ones(2), ValueError, "'amax' must be a one-element tensor"),
        (torch.tensor(-1.0), ValueError, "'amax' must be finite and non-negative"),
        (torch.tensor(float("nan")), ValueError, "'amax' must be finite and non-negative"),
        (torch.tensor(1.0, device="meta"), TypeError, "'amax' must be on cpu like 'x'"),
        ([1.0], TypeError, "'amax' must be a torch.Tensor"),
    ):
        with pytest.raises(error, match=match):
            nvfp4_ops.quantize_nvfp4_packed(x, amax=amax)
    with pytest.raises(ValueError, match="'amax' cannot be given with an RHT columnwise copy"):
        nvfp4_ops.quantize_nvfp4_packed(x, True, True, False, True, amax=torch.tensor(1.0))
    # The op itself (callable through torch.ops) checks the tensor too.
    with pytest.raises(TypeError, match="'amax' must be a float32 tensor"):
        torch.ops.transformer_linear.quantize_nvfp4_packed(x, True, False, False, False, False, None,
                                                           torch.ones(1).double())


def test_sr_seed_follows_the_default_generator():
    """Not opchecked (each call draws a new seed, which is its job): the same torch.manual_seed gives the same
    seeds, in eager and compiled code alike (test_inductor_draws_the_same_sr_seeds_as_eager)."""
    like = torch.randn(16, 16)
    torch.manual_seed(5)
    first = [int(nvfp4_ops.sr_seed(like)) for _ in range(3)]
    torch.manual_seed(5)
    assert [int(nvfp4_ops.sr_seed(like)) for _ in range(3)] == first and len(set(first)) == 3


@pytest.mark.parametrize("rows, cols", [(16, 64), (48, 32), (0, 16)])
def test_packed_scales_hold_the_reference_copies(rows, cols):
    """quantize_nvfp4_packed is quantize_nvfp4 with its amaxes and the global scale packed in front of the
    block scales; nvfp4_gemm_packed is nvfp4_gemm of the unpacked operands, bitwise."""
    x, w = torch.randn(rows, cols), torch.randn(32, cols)
    data, scales, _, _ = nvfp4_ops.quantize_nvfp4_packed(x)
    q = ref.quantize_nvfp4(x, nvfp4_amax(x) if rows else torch.tensor(0.0))
    _assert_copy_equal(data, scales, q.data, q.scale, q.global_scale, "x")
    assert scales.shape == (nvfp4_ops.packed_scale_numel(rows, cols),)
    qw = nvfp4_ops.quantize_nvfp4_packed(w)
    rw = ref.quantize_nvfp4(w, nvfp4_amax(w))
    expected = ref.nvfp4_gemm(q.data, q.scale, q.global_scale, rw.data, rw.scale, rw.global_scale)
    assert_bitwise_equal(nvfp4_ops.nvfp4_gemm_packed(data, scales, qw[0], qw[1]), expected, "gemm")


@pytest.mark.parametrize("rows", [1, 8, 17])
@pytest.mark.parametrize("scaling_2d, rht, sr", [(False, False, False), (True, False, False), (False, True, True)])
def test_packed_columnwise_copy_pads_the_tokens(rows, scaling_2d, rht, sr):
    """Any row count: the copies are the reference's of x with zero rows up to a multiple of 16, bitwise; the
    rowwise one keeps x's rows (the padded copy's first rows)."""
    x = torch.randn(rows, 64)
    padded = torch.cat([x, x.new_zeros((-rows % 16, 64))])
    seed = torch.tensor(7, dtype=torch.int64)
    data, scales, data_t, scales_t = nvfp4_ops.quantize_nvfp4_packed(x, True, True, scaling_2d, rht, sr, seed)
    q = ref.quantize_nvfp4(padded, nvfp4_amax(padded), nvfp4_amax(padded, rht), rowwise=True, columnwise=True,
                           scaling_2d=scaling_2d, rht=rht, stochastic_rounding=sr, seed=7)
    _assert_copy_equal(data, scales, q.data[:rows], q.scale[:rows], q.global_scale, "rowwise")
    _assert_copy_equal(data_t, scales_t, q.data_t, q.scale_t, q.global_scale_t, "columnwise (padded tokens)")


def test_packed_ops_reject_bad_arguments():
    data, scales, _, _ = nvfp4_ops.quantize_nvfp4_packed(torch.randn(16, 64))
    with pytest.raises(ValueError, match="'stochastic_rounding' needs 'seed'"):
        nvfp4_ops.quantize_nvfp4_packed(torch.randn(16, 64), stochastic_rounding=True)
    with pytest.raises(TypeError, match="'b' must be 2-D uint8"):
        nvfp4_ops.nvfp4_gemm_packed(data, scales, data.float(), scales)
    with pytest.raises(TypeError, match="'a_scale_inv' must be 1-D float8_e4m3fn"):
        nvfp4_ops.nvfp4_gemm_packed(data, scales.view(torch.uint8), data, scales)
    with pytest.raises(ValueError, match="'b_scale_inv' must have 72 elements"):
        nvfp4_ops.nvfp4_gemm_packed(data, scales, data, scales[:-1])
    with pytest.raises(ValueError, match="the K dimensions"):
        nvfp4_ops.nvfp4_gemm_packed(data, scales, data[:, :16], scales[:40])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_tensor_raises(bad):
    """NVFP4's global scale comes from the tensor's amax, which the kernels refuse non-finite: a NaN or inf in
    a quantized tensor raises (the FP8 recipes pass it through, see tests/test_nonfinite_inputs.py)."""
    layer = tl.Linear(32, 16, recipe=VARIANTS["default"])
    x = torch.randn(16, 32)
    x[3, 5] = bad
    with pytest.raises(ValueError, match="argument 'amax' must be finite"):
        layer(x)


def test_custom_recipe_of_nvfp4_quantizers_equals_the_built_in_one():
    """The recipe is its quantizers: a CustomRecipe returning them runs the same Linear, bitwise."""
    spec = tl.recipe.quantization.quantization_spec(VARIANTS["default"])
    quantizers = dict(zip(recipe.CUSTOM_RECIPE_ROLES, (spec.input, spec.weight, spec.grad_output)))
    custom = recipe.CustomRecipe(quantizers.__getitem__)
    x, w, b, dy = _data()
    for a, e, what in zip(_run(_layer(custom, w, b), x, dy), _run(_layer(VARIANTS["default"], w, b), x, dy),
                          ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


def test_numerics_range_stats_and_labels():
    """numerics asks the quantizer: NVFP4 range statistics come from reference/nvfp4; labels name the
    format and the features turned off."""
    x = torch.randn(32, 64)
    x[0, :16] = 0.0001  # flushed to zero within a block whose amax is 1
    x[0, 0] = 1.0
    spec = tl.recipe.quantization.quantization_spec(VARIANTS["default"])
    stats = quantizer_range_stats(x, spec.input, None)
    codes = ref.unpack_e2m1(ref.quantize_nvfp4(x, nvfp4_amax(x)).data)
    assert stats["underflow"] == float(((codes & 7) == 0).sum()) / x.numel() > 0
    assert stats["amax"] == float(x.abs().max()) and stats["saturation"] == 0.0
    assert recipe_label(VARIANTS["default"]) == "NVFP4BlockScaling(E2M1)"
    assert recipe_label(VARIANTS["no_rht"]) == "NVFP4BlockScaling(E2M1, disable_rht)"
    assert recipe_label(recipe.MXFP8BlockScaling()) == "MXFP8BlockScaling(E4M3)"
    overridden = recipe.Float8CurrentScaling(backward_override="dequantized")
    assert recipe_label(overridden) == "CurrentScaling(HYBRID, backward_override=dequantized)"


# --- the weight cache and the wgrad options ---


def test_cached_weight_is_first_microbatch():
    """is_first_microbatch=False reuses the NVFP4 weight (both copies): the same results as requantizing."""
    r = VARIANTS["default"]
    x, w, b, dy = _data(rows=16)
    layer = _layer(r, w, b)
    first = _run(layer, x, dy, is_first_microbatch=True)
    with torch.no_grad():
        layer.weight.mul_(2)  # not seen: the cached weight is used
    layer.zero_grad()
    for a, e, what in zip(_run(layer, x, dy, is_first_microbatch=False), first, ("out", "dx", "dw", "db")):
        assert_bitwise_equal(a, e, what)


@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16])
def test_delay_wgrad_compute_and_fused_accumulation(main_grad_dtype):
    """backward_dw() and fuse_wgrad_accumulation (ops.fp8_gemm_accumulate_'s NVFP4 path): the weight gradient
    of the plain backward, added once into main_grad."""
    r = VARIANTS["default"]
    x, w, b, dy = _data(rows=32)
    expected = _run(_layer(r, w, b), x, dy)
    delayed = tl.Linear(w.shape[1], w.shape[0], recipe=r, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        delayed.weight.copy_(w)
        delayed.bias.copy_(b)
    delayed.weight.main_grad = torch.full_like(w, 0.5, dtype=main_grad_dtype)
    out, dx, dw, db = _run(delayed, x, dy)
    assert dw is None and db is None
    delayed.backward_dw()
    assert_bitwise_equal(out, expected[0], "out")
    assert_bitwise_equal(dx, expected[1], "dx")
    assert_bitwise_equal(delayed.weight.main_grad, (0.5 + expected[2]).to(main_grad_dtype), "main_grad")
    assert_bitwise_equal(delayed.bias.grad, expected[3], "dbias")
