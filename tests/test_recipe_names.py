"""recipe.from_name / recipe.available_names: the one table of built-in recipes by name."""

from __future__ import annotations

import typing

import pytest

from transformer_linear import cli, recipe
from transformer_linear.numerics import RECIPE_NAMES
from transformer_linear.recipe.quantization import quantization_spec

# What each name means, written out independently of the recipe package's table.
EXPECTED = {
    "delayed": recipe.DelayedScaling(),
    "current": recipe.CurrentScaling(),
    "delayed-e4m3": recipe.DelayedScaling(fp8_format=recipe.Format.E4M3),
    "current-e4m3": recipe.CurrentScaling(fp8_format=recipe.Format.E4M3),
    "block": recipe.Float8BlockScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "rowwise": recipe.Float8RowwiseScaling(),
    "nvfp4": recipe.NVFP4BlockScaling(),
}


def test_available_names_are_every_built_in_recipe():
    assert recipe.available_names() == tuple(EXPECTED)
    built = {type(recipe.from_name(name)) for name in recipe.available_names()}
    # A CustomRecipe is made of the caller's quantizer factory: there is no default one to name.
    configured = set(typing.get_args(recipe.Recipe)) - {recipe.CustomRecipe}
    assert built == configured, "a built-in recipe class without a name"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_name_round_trips(name):
    """Each listed name builds its recipe, a fresh equal one on every call; any spelling case and
    surrounding spaces name the same recipe, and the Linear's quantization accepts it."""
    r = recipe.from_name(name)
    assert r == EXPECTED[name] and type(r) is type(EXPECTED[name])
    assert recipe.from_name(f"  {name.upper()} ") == r
    assert quantization_spec(r) == quantization_spec(EXPECTED[name])


def test_options_replace_the_defaults_and_are_validated():
    assert recipe.from_name("delayed", amax_history_len=4) == recipe.DelayedScaling(amax_history_len=4)
    assert recipe.from_name("delayed-e4m3", margin=1) == recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, margin=1)
    assert recipe.from_name("block", x_block_scaling_dim=2) == recipe.Float8BlockScaling(x_block_scaling_dim=2)
    assert recipe.from_name("mxfp8", e8m0_rounding="floor") == recipe.MXFP8BlockScaling(e8m0_rounding="floor")
    with pytest.raises(ValueError, match="e8m0_rounding"):
        recipe.from_name("mxfp8", e8m0_rounding="nearest")
    with pytest.raises(TypeError, match="margin"):
        recipe.from_name("mxfp8", margin=1)
    assert recipe.from_name("nvfp4", disable_rht=True) == recipe.NVFP4BlockScaling(disable_rht=True)
    with pytest.raises(TypeError, match="disable_stochastic_rounding"):
        recipe.from_name("nvfp4", disable_stochastic_rounding=1)
    with pytest.raises(ValueError, match="fp4_format"):
        recipe.from_name("nvfp4", fp4_format=recipe.Format.E4M3)
    with pytest.raises(ValueError, match="fp8_format"):
        recipe.from_name("current", fp8_format=recipe.Format.E2M1)


@pytest.mark.parametrize("name", ["", "mxfp4", "delayed_e4m3", "Float8BlockScaling"])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(ValueError, match=f"unknown recipe {name!r}; expected one of {', '.join(EXPECTED)}"):
        recipe.from_name(name)


@pytest.mark.parametrize("name", [None, 1, recipe.DelayedScaling()])
def test_a_name_must_be_a_string(name):
    with pytest.raises(TypeError, match="recipe name must be a str"):
        recipe.from_name(name)


def test_cli_and_numerics_list_the_same_names():
    assert RECIPE_NAMES == recipe.available_names()
    _, subcommands = cli._parser()
    help_text = subcommands["compare"].format_help()
    assert ", ".join(recipe.available_names()) in " ".join(help_text.split())
