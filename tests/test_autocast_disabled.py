"""``tl.autocast(enabled=False)`` runs every layer in high precision, those with a recipe of their own
included (what ``convert_to_fp8(model, recipe=...)`` makes): bitwise ``F.linear`` / the high-precision
grouped GEMMs, forward and backward, no delayed-scaling state updated; eagerly, under
``torch.compile(fullgraph=True)`` (toggling compiles each state once, then reuses its graph) and under
``torch.export``. ``outside_autocast`` restores the default (each layer under its own recipe)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from grouped_cases import offsets
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.autocast import get_fp8_recipe, layer_recipe, outside_autocast

RECIPES = recipe.available_names()


def _linear(name, bias=True):
    torch.manual_seed(0)
    return tl.Linear(64, 32, bias=bias, recipe=recipe.from_name(name))


def _grads(layer, x, run):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = run(x)
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


def _expected(layer, x):
    return _grads(layer, x, lambda x: F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("name", RECIPES)
def test_linear_with_its_own_recipe_runs_in_high_precision(name):
    layer = _linear(name)
    x = torch.randn(16, 64)
    fp8 = _grads(layer, x, layer)
    state = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("fp8_")}
    with tl.autocast(enabled=False):
        got = _grads(layer, x, layer)
    for what, a, b in zip(("out", "dgrad", "wgrad", "dbias"), got, _expected(layer, x)):
        assert_bitwise_equal(a, b, f"{name}: {what} under autocast(enabled=False)")
    assert not torch.equal(fp8[0], got[0]), f"{name}: the layer ran in high precision outside autocast too"
    for key, before in state.items():
        assert_bitwise_equal(layer.state_dict()[key], before, f"{name}: {key} changed under autocast(enabled=False)")
    # Nesting restores the outer state; an inner enabled=True turns the layer's own recipe back on.
    with tl.autocast(enabled=False):
        with tl.autocast(recipe=recipe.from_name("current")):
            assert layer_recipe(layer.recipe) == layer.recipe
        assert layer_recipe(layer.recipe) is None
    assert layer_recipe(layer.recipe) == layer.recipe


def test_outside_autocast_restores_each_layers_own_recipe():
    own, autocast_recipe = recipe.from_name("block"), recipe.from_name("current")
    for outer in (tl.autocast(enabled=False), tl.autocast(recipe=autocast_recipe)):
        with outer, outside_autocast():
            assert layer_recipe(own) == own and layer_recipe(None) is None and get_fp8_recipe() is None


@pytest.fixture
def fresh_dynamo():
    # Graphs of other tests count towards the recompile limit of Linear.forward's code object.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8", "nvfp4"])
def test_compiled_toggle_compiles_each_state_once(name, fresh_dynamo):
    layer = _linear(name, bias=False)
    x = torch.randn(16, 64)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad():
        for step in range(6):
            with tl.autocast(enabled=False):
                assert_bitwise_equal(compiled(x), F.linear(x, layer.weight), f"{name}: compiled, step {step}")
            compiled(x)
    assert counter.frame_count == 2, f"{name}: {counter.frame_count} compilations over 6 toggles, expected 2"


@pytest.mark.parametrize("name", ["current", "block", "nvfp4"])
def test_export_under_autocast_disabled_is_the_high_precision_graph(name):
    model = torch.nn.Sequential(_linear(name), torch.nn.ReLU(), tl.Linear(32, 16, recipe=recipe.from_name(name)))
    model.eval()
    x = torch.randn(8, 64)
    with tl.autocast(enabled=False):
        ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("transformer_linear" in t for t in targets), f"{name}: FP8 ops in the exported graph: {targets}"
    with torch.no_grad():
        want = F.linear(torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
        assert_bitwise_equal(ep.module()(x), want, f"{name}: the exported program")


@pytest.mark.parametrize("name", RECIPES)
def test_grouped_linear_with_its_own_recipe_runs_in_high_precision(name):
    torch.manual_seed(0)
    layer = tl.GroupedLinear(3, 64, 32, recipe=recipe.from_name(name))
    x, sizes = torch.randn(48, 64), [16, 0, 32]
    with tl.autocast(enabled=False):
        got = _grads(layer, x, lambda x: layer(x, sizes))
    with outside_autocast():
        fp8 = _grads(layer, x, lambda x: layer(x, sizes))
    want = _grads(layer, x, lambda x: tl.grouped_linear(x, layer.weight, offsets(sizes), layer.bias))
    for what, a, b in zip(("out", "dgrad", "wgrad", "dbias"), got, want):
        assert_bitwise_equal(a, b, f"{name}: grouped {what} under autocast(enabled=False)")
    assert not torch.equal(fp8[0], got[0]), f"{name}: the grouped layer ran in high precision outside autocast too"
