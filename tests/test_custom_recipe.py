"""A recipe defined outside the package, through its public API only (``transformer_linear.recipe.CustomRecipe``
and ``transformer_linear.TensorQuantizer``), runs everywhere a built-in one does: training, the reference
numerics, torch.compile without recompiles, torch.export with save / load, checkpoints, ``tl.autocast``,
``convert_to_fp8`` and the numerics monitor. A subclass of a built-in recipe class is its base recipe.

The recipe mixes scalings across roles: 128x128 block-scaled weights, tensorwise current-scaled activations
and rowwise-scaled gradients, so every GEMM of the Linear pairs two different ScalingTypes.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import torch._dynamo.testing
from linear_emulation import ROW, EmulatedRecipe, RoleQuantizer, assert_bias_grad, emulate_linear
from tolerances import assert_bitwise_equal, assert_close_to_reference
from torch import nn

import transformer_linear as tl
from transformer_linear import TensorQuantizer, reference
from transformer_linear.recipe import CustomRecipe, DelayedScaling, Float8BlockScaling, Format, HistoryConfig

E4M3, E5M2, F32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32


def mixed_quantizers(role: str) -> TensorQuantizer:
    """128x128 block-scaled weights, tensorwise current-scaled activations, rowwise-scaled gradients."""
    if role == "linear_input":
        return TensorQuantizer(E4M3, [], F32, power_2_scale=False)
    if role == "linear_weight":
        return TensorQuantizer(E4M3, [128, 128], F32, power_2_scale=True)
    if role == "linear_grad_output":
        return TensorQuantizer(E5M2, [1, 0], F32, power_2_scale=True)
    raise ValueError(f"no quantizer for role {role!r}")


MIXED = CustomRecipe(mixed_quantizers)


# ---------------------------------------------------------------------------
# the recipe value
# ---------------------------------------------------------------------------


def test_recipe_is_a_frozen_value_compared_by_its_factory():
    assert CustomRecipe(mixed_quantizers) == MIXED and hash(CustomRecipe(mixed_quantizers)) == hash(MIXED)
    assert CustomRecipe(lambda role: mixed_quantizers(role)) != MIXED
    assert CustomRecipe(mixed_quantizers, HistoryConfig(16)) != MIXED
    with pytest.raises(dataclasses.FrozenInstanceError):
        MIXED.qfactory = None
    with pytest.raises(TypeError, match="'qfactory' must be callable"):
        CustomRecipe("linear_input")
    with pytest.raises(TypeError, match="'history' must be a recipe.HistoryConfig"):
        CustomRecipe(mixed_quantizers, history=16)
    with pytest.raises(ValueError, match="'amax_compute_algo' must be 'max' or 'most_recent'"):
        HistoryConfig(amax_compute_algo="mean")


def test_factory_errors_name_the_role():
    def no_grad_quantizer(role):
        return None if role == "linear_grad_output" else mixed_quantizers(role)

    must_return = "qfactory\\('linear_grad_output'\\) must return a transformer_linear.TensorQuantizer"
    with pytest.raises(TypeError, match=must_return):
        tl.Linear(8, 8, recipe=CustomRecipe(no_grad_quantizer))

    def history_for_weight_only(role):
        return TensorQuantizer(E4M3, [], F32, False, scale_from_history=role == "linear_weight")

    with pytest.raises(ValueError, match="'scale_from_history' must be the same for every role"):
        tl.Linear(8, 8, recipe=CustomRecipe(history_for_weight_only))
    def history_with_e5m2_weight(role):
        dtype = E5M2 if role == "linear_weight" else E4M3
        return TensorQuantizer(dtype, [], F32, False, scale_from_history=True)

    with pytest.raises(ValueError, match="input and weight must have the same dtype and margin"):
        tl.Linear(8, 8, recipe=CustomRecipe(history_with_e5m2_weight))
    with pytest.raises(TypeError, match="'recipe' must be one of .*CustomRecipe"):
        tl.Linear(8, 8, recipe=mixed_quantizers)
    with pytest.raises(TypeError, match="autocast: 'recipe' must be one of"):
        with tl.autocast(recipe=mixed_quantizers):
            pass


# ---------------------------------------------------------------------------
# numerics: the Linear against a pure-reference emulation of the same quantizers
# ---------------------------------------------------------------------------


# MIXED as the reference quantizes it (linear_emulation.py): x with one current scale, W in 128x128 blocks,
# grad_output with a scale per row (of itself for dgrad, of its transpose for wgrad).
MIXED_EMULATED = EmulatedRecipe(
    RoleQuantizer(E4M3, None), RoleQuantizer(E4M3, (128, 128), power_2_scale=True),
    RoleQuantizer(E5M2, ROW, power_2_scale=True),
)


def _data(rows, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    dy = torch.randn(rows, n, generator=gen) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=gen).float())
    return x, w, b, dy


# (rows, in, out): several 128x128 weight blocks and K-blocks; one block; one row.
@pytest.mark.parametrize("shape", [(70, 256, 192), (300, 200, 130), (5, 64, 32), (1, 40, 8)])
def test_eager_matches_reference_emulation(shape):
    x, w, b, dy = _data(*shape)
    layer = tl.Linear(shape[1], shape[2], recipe=MIXED)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xr = x.clone().requires_grad_()
    out = layer(xr)
    out.backward(dy)
    e_out, e_dx, e_dw = emulate_linear(MIXED_EMULATED, x, w, b, dy)
    assert_close_to_reference(out.detach(), *e_out, what="out")
    assert_close_to_reference(xr.grad, *e_dx, what="dx")
    assert_close_to_reference(layer.weight.grad, *e_dw, what="dw")
    assert_bias_grad(layer.bias.grad, dy)


# ---------------------------------------------------------------------------
# training, and the three ways to give a model the recipe
# ---------------------------------------------------------------------------

IN, HIDDEN, OUT = 160, 192, 24


def _mlp(recipe=None, linear=tl.Linear) -> nn.Sequential:
    torch.manual_seed(0)
    kwargs = {"recipe": recipe} if linear is tl.Linear else {}
    return nn.Sequential(linear(IN, HIDDEN, **kwargs), nn.GELU(), linear(HIDDEN, OUT, **kwargs))


def _batches(sizes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN, OUT, generator=gen) / IN**0.5
    for rows in sizes:
        x = torch.randn(rows, IN, generator=gen)
        yield x, torch.tanh(x @ teacher)


def _train(model, sizes, recipe_context=None, opt=None, batches=None):
    """Adam steps (of ``opt``, default a new one) on a regression to a fixed teacher, on ``batches``
    (default: _batches(sizes)); the losses and the model's gradients of each step."""
    opt = opt or torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for x, target in batches if batches is not None else _batches(sizes):
        opt.zero_grad()
        if recipe_context is not None:
            with tl.autocast(recipe=recipe_context):
                out = model(x)
        else:
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads


def test_training_loss_decreases_and_every_way_of_giving_the_recipe_agrees():
    sizes = [64] * 40
    losses, grads = _train(_mlp(MIXED), sizes)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss {float(first):.4f} -> {float(last):.4f}"
    assert all(torch.isfinite(loss) for loss in losses)
    # tl.autocast(recipe=...) around recipe-less layers, and convert_to_fp8 of an nn.Linear model: the same run.
    ways = {
        "autocast": _train(_mlp(None), sizes[:6], recipe_context=MIXED),
        "convert_to_fp8": _train(tl.convert_to_fp8(_mlp(linear=nn.Linear), recipe=MIXED), sizes[:6]),
    }
    for way, (way_losses, way_grads) in ways.items():
        for step in range(6):
            assert_bitwise_equal(way_losses[step], losses[step], f"{way} loss step {step}")
            for got, expected in zip(way_grads[step], grads[step]):
                assert_bitwise_equal(got, expected, f"{way} gradient step {step}")


# ---------------------------------------------------------------------------
# torch.compile, torch.export, checkpoints
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["recipe", "autocast"])
def test_compile_fullgraph_without_recompiles(how):
    """One dynamic graph for every batch size of 2 rows or more (several row blocks or one), bitwise eager."""
    own = MIXED if how == "recipe" else None
    eager, compiled_model = _mlp(own), _mlp(own)
    torch._dynamo.reset()  # graphs of earlier tests count towards the recompile limit
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True, dynamic=True)
    context = MIXED if how == "autocast" else None
    sizes = [3, 130, 40, 257]
    expected_losses, expected_grads = _train(eager, sizes, context)
    opt, batches = torch.optim.Adam(compiled.parameters(), lr=3e-3), list(_batches(sizes))
    losses, grads = _train(compiled, None, context, opt, batches[:1])
    with torch.compiler.set_stance("fail_on_recompile"):
        more_losses, more_grads = _train(compiled, None, context, opt, batches[1:])
    losses, grads = losses + more_losses, grads + more_grads
    assert counter.frame_count == 1
    for step, rows in enumerate(sizes):
        assert_bitwise_equal(losses[step], expected_losses[step], f"loss rows={rows}")
        for got, expected in zip(grads[step], expected_grads[step]):
            assert_bitwise_equal(got, expected, f"gradient rows={rows}")


def test_export_save_load_dynamic_batch():
    model = _mlp(MIXED)
    x = next(_batches([300]))[0]
    with torch.no_grad():
        program = torch.export.export(model, (x[:50],), dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for rows in (1, 7, 130, 300):
        with torch.no_grad():
            assert_bitwise_equal(loaded(x[:rows]), model(x[:rows]), f"rows={rows}")


def test_state_dict_round_trip():
    model = _mlp(MIXED)
    _train(model, [32] * 3)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored = _mlp(MIXED)
    restored.load_state_dict(torch.load(buffer), strict=True)
    assert model.state_dict().keys() == restored.state_dict().keys()
    # Training goes on identically from the checkpoint.
    for (losses_a, grads_a), (losses_b, grads_b) in [(_train(model, [48] * 2), _train(restored, [48] * 2))]:
        for a, b in zip(losses_a, losses_b):
            assert_bitwise_equal(a, b, "loss after the checkpoint")
        for step_a, step_b in zip(grads_a, grads_b):
            for a, b in zip(step_a, step_b):
                assert_bitwise_equal(a, b, "gradient after the checkpoint")


def test_numerics_monitor_reads_the_quantizers():
    model = _mlp(MIXED)
    with tl.numerics.monitor(model, every=1) as mon:
        x, target = next(_batches([64]))
        torch.nn.functional.mse_loss(model(x), target).backward()
        records = mon.step()
    assert len(records) == 2 and all(r["recipe"] == "CustomRecipe" for r in records)
    for r in records:
        assert r["output_sqnr_db"] > 20 and r["input_scale"] > 0, r


# ---------------------------------------------------------------------------
# delayed scaling from a CustomRecipe: the history config travels on the quantizers' spec
# ---------------------------------------------------------------------------


def _delayed_quantizers(role: str) -> TensorQuantizer:
    dtype = Format.HYBRID.bwd_dtype if role == "linear_grad_output" else Format.HYBRID.fwd_dtype
    return TensorQuantizer(dtype, [], F32, False, margin=1, scale_from_history=True)


def test_custom_delayed_scaling_is_delayed_scaling():
    history = HistoryConfig(amax_history_len=4, amax_compute_algo="most_recent")
    custom = CustomRecipe(_delayed_quantizers, history)
    built_in = DelayedScaling(margin=1, amax_history_len=4, amax_compute_algo="most_recent")
    a, b = _mlp(custom), _mlp(built_in)
    assert a[0].fp8_amax_history.shape[0] == 4, "the layer's history has the recipe's length"
    losses_a, grads_a = _train(a, [16, 40, 24, 33, 8, 50])
    losses_b, grads_b = _train(b, [16, 40, 24, 33, 8, 50])
    for step, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert_bitwise_equal(la, lb, f"loss step {step}")
        for ga, gb in zip(grads_a[step], grads_b[step]):
            assert_bitwise_equal(ga, gb, f"gradient step {step}")
    for key, value in b.state_dict().items():
        assert_bitwise_equal(a.state_dict()[key], value, key)


# ---------------------------------------------------------------------------
# a subclass of a built-in recipe class
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UnroundedBlockScaling(Float8BlockScaling):
    """A user's recipe class: Float8BlockScaling with its own default."""

    power_2_scale: bool = False


@dataclasses.dataclass(frozen=True)
class ShortHistoryScaling(DelayedScaling):
    """A user's recipe class: DelayedScaling with a short history by default."""

    amax_history_len: int = 8


@pytest.mark.parametrize(
    "subclassed, base",
    [
        (UnroundedBlockScaling(), Float8BlockScaling(power_2_scale=False)),
        (ShortHistoryScaling(), DelayedScaling(amax_history_len=8)),
    ],
    ids=["Float8BlockScaling", "DelayedScaling"],
)
def test_subclass_of_a_built_in_recipe_is_that_recipe(subclassed, base):
    sizes = [20, 64, 9]
    expected_losses, expected_grads = _train(_mlp(base), sizes)
    for way, (losses, grads) in {
        "recipe": _train(_mlp(subclassed), sizes),
        "autocast": _train(_mlp(None), sizes, recipe_context=subclassed),
    }.items():
        for step in range(len(sizes)):
            assert_bitwise_equal(losses[step], expected_losses[step], f"{way} loss step {step}")
            for got, expected in zip(grads[step], expected_grads[step]):
                assert_bitwise_equal(got, expected, f"{way} gradient step {step}")
