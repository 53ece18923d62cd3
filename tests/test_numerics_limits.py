"""Layers a recipe cannot run are found before training by trying each layer's shape (numerics/limits.py)."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear.numerics import limits
from transformer_linear.numerics.compare import with_recipe
from transformer_linear.recipe import available_names, from_name

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name", available_names())
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (100, 64), (64, 60)])
def test_a_layer_is_refused_exactly_where_the_recipe_fails_on_it(name, in_features, out_features):
    recipe = from_name(name)
    model = nn.Sequential(nn.Linear(in_features, out_features))
    refused = limits.refused_layers(tl.convert_to_fp8(copy.deepcopy(model)), recipe)
    # What a real forward and backward of the layer under the recipe does, on rows no block size refuses.
    layer = tl.Linear(in_features, out_features, recipe=recipe)
    try:
        layer(torch.randn(limits.PROBE_ROWS, in_features, requires_grad=True)).sum().backward()
        fails = False
    except ValueError:
        fails = True
    assert ("0" in refused) is fails
    assert (with_recipe(model, recipe)[0].recipe is None) is fails


def test_nvfp4_names_the_dimension_it_refuses():
    model = nn.Sequential(nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 60))
    refused = limits.refused_layers(tl.convert_to_fp8(copy.deepcopy(model)), from_name("nvfp4"))
    assert list(refused) == ["0", "4"]
    assert "(100) must be a multiple of 16" in refused["0"] and "(60) must be a multiple of 16" in refused["4"]


def test_probing_leaves_the_global_random_state_alone():
    limits._linear.cache_clear()
    model = tl.convert_to_fp8(nn.Sequential(nn.Linear(40, 24)))
    before = torch.get_rng_state()
    limits.refused_layers(model, from_name("current"))
    assert torch.equal(before, torch.get_rng_state())


def test_an_experts_projection_the_recipe_cannot_run_stays_in_high_precision():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(DATA / "tiny_mixtral")
    config.intermediate_size = 40  # gate_up_proj's out (80) is a multiple of 16, down_proj's in (40) is not
    model = transformers.AutoModelForCausalLM.from_config(config)
    refused = limits.refused_layers(tl.convert_to_fp8(copy.deepcopy(model)), from_name("nvfp4"))
    assert sorted(refused) == [f"model.layers.{i}.mlp.experts.down_proj" for i in range(config.num_hidden_layers)]
    run = with_recipe(model, from_name("nvfp4"))
    experts = run.model.layers[0].mlp.experts
    assert experts.fp8_down_proj.recipe is None and experts.fp8_gate_up_proj.recipe is not None
