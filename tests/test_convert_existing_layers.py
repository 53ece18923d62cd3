"""``convert_to_fp8(model, recipe=r)`` on a model that already holds ``tl.Linear`` / ``tl.GroupedLinear``
layers: those without a recipe take ``r`` (outside ``tl.autocast`` they run in FP8, as the converted
``nn.Linear`` layers do), those with another recipe keep theirs with a warning naming them, and
``module_filter_fn`` leaves the ones it rejects alone."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.hf_experts import ExpertsFP8State


def _model():
    torch.manual_seed(0)
    return nn.Sequential(tl.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), tl.Linear(32, 16))


@pytest.mark.parametrize("name", recipe.available_names())
def test_recipe_less_layers_take_the_recipe(name):
    r = recipe.from_name(name)
    model = _model()
    x = torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tl.convert_to_fp8(model, recipe=r)
    assert [m.recipe for m in (model[0], model[2], model[3])] == [r, r, r]
    with tl.autocast(recipe=r):
        want = model(x)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0, msg=f"{name}: outside tl.autocast")


def test_layers_with_a_recipe_of_their_own_keep_it_and_are_named():
    model = _model()
    own = recipe.from_name("block")
    model[3].recipe = own
    with pytest.warns(UserWarning, match=r"keep the recipe of their own.*3 \(Float8BlockScaling"):
        tl.convert_to_fp8(model, recipe=recipe.from_name("current"))
    assert model[0].recipe == recipe.from_name("current") and model[3].recipe is own


def test_module_filter_and_the_root_layer():
    model = _model()
    tl.convert_to_fp8(model, recipe=recipe.from_name("current"), module_filter_fn=lambda m, fqn: fqn != "0")
    assert model[0].recipe is None and model[3].recipe == recipe.from_name("current")
    root = tl.Linear(8, 8)
    assert tl.convert_to_fp8(root, recipe=recipe.from_name("mxfp8")) is root
    assert root.recipe == recipe.from_name("mxfp8")


def test_delayed_scaling_history_follows_the_recipe():
    model = _model()
    tl.convert_to_fp8(model, recipe=recipe.from_name("delayed", amax_history_len=4))
    assert model[0].fp8_amax_history.shape[0] == 4


def test_grouped_linear_takes_the_recipe():
    torch.manual_seed(0)
    model = nn.ModuleDict({"experts": tl.GroupedLinear(2, 32, 16)})
    tl.convert_to_fp8(model, recipe=recipe.from_name("mxfp8"))
    assert model["experts"].recipe == recipe.from_name("mxfp8")


def test_experts_converted_without_a_recipe_take_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
    torch.manual_seed(0)
    model = tl.convert_to_fp8(transformers.MixtralForCausalLM(config))
    states = [m for m in model.modules() if isinstance(m, ExpertsFP8State)]
    assert states and all(m.recipe is None for m in states)
    tl.convert_to_fp8(model, recipe=recipe.from_name("current"))
    assert all(m.recipe == recipe.from_name("current") for m in states)
