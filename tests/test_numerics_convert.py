"""convert_to_fp8 on shared, foreign and already-converted layers; compare on converted models."""

import math

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.convert import conversion_plan
from transformer_linear.numerics import compare, sqnr


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: y = x @ W + b with W of shape (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


def test_a_linear_used_twice_is_converted_once_and_stays_shared():
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    tl.convert_to_fp8(model, recipe=recipe.CurrentScaling())
    assert isinstance(model[0], tl.Linear)
    assert model[0] is model[2]
    assert model[0].weight is lin.weight


@pytest.mark.parametrize("bad", [42, "model", None])
def test_convert_rejects_a_non_module(bad):
    with pytest.raises(TypeError, match="convert_to_fp8: 'model' must be a torch.nn.Module"):
        tl.convert_to_fp8(bad)


def test_conv1d_becomes_a_linear_on_the_same_weight_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(6, 4), nn.ReLU(), nn.Linear(6, 3))
    weight = model[0].weight
    x = torch.randn(5, 4)
    expected = model(x)
    plan = conversion_plan(model)
    assert plan.converted == ["0", "2"] and plan.skipped == {}
    tl.convert_to_fp8(model)  # no recipe, no autocast: F.linear
    assert isinstance(model[0], tl.Linear) and model[0].weight is weight and weight.shape == (4, 6)
    torch.testing.assert_close(model(x), expected)
    with tl.autocast(recipe=recipe.CurrentScaling()):
        assert 20 < sqnr(model(x), expected) < 60


def test_plan_lists_skipped_layers_with_their_reason():
    mha = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"attn": mha, "fc": nn.Linear(8, 8), "head": nn.Linear(8, 2)})
    plan = conversion_plan(model, module_filter_fn=lambda m, fqn: fqn != "head")
    assert plan.converted == ["fc"]
    assert set(plan.skipped) == {"attn.out_proj", "head"}
    assert "subclass" in plan.skipped["attn.out_proj"]
    assert "module_filter_fn" in plan.skipped["head"]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


@pytest.mark.parametrize(
    "carried", [recipe.DelayedScaling(), recipe.CurrentScaling(fp8_format=recipe.Format.E4M3), None], ids=str
)
def test_compare_on_a_converted_model_applies_the_requested_recipe(carried):
    plain = _mlp()
    x = torch.randn(8, 32)
    expected = compare(plain, x, recipes=["current"])
    converted = tl.convert_to_fp8(_mlp(), recipe=carried)
    report = compare(converted, x, recipes=["current"])
    for got, want in zip(report.layers, expected.layers):
        assert math.isfinite(got.output_sqnr) and got.output_sqnr < 60
        assert got.output_sqnr == pytest.approx(want.output_sqnr, abs=1e-6)
    assert report.reference_loss == pytest.approx(expected.reference_loss)
    # The model's own layers keep their recipe.
    assert converted[0].recipe is carried


def test_compare_ignores_an_enclosing_autocast_for_the_reference():
    model = tl.convert_to_fp8(_mlp())
    x = torch.randn(8, 32)
    expected = compare(_mlp(), x, recipes=["delayed"])
    with tl.autocast(recipe=recipe.CurrentScaling()):
        report = compare(model, x, recipes=["delayed"])
    assert report.reference_loss == pytest.approx(expected.reference_loss)
    assert report.layers[0].output_sqnr == pytest.approx(expected.layers[0].output_sqnr, abs=1e-6)


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, y.sum()


def test_compare_takes_the_first_element_of_a_tuple_output():
    report = compare(_TupleOut(), torch.randn(4, 8), recipes=["current"])
    assert 15 < report.layers[0].output_sqnr < 60


def test_compare_rejects_a_loss_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got float"):
        compare(_mlp(), torch.randn(8, 32), loss_fn=lambda out, x: float(out.detach().sum()))
