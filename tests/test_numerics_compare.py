"""tl.numerics.compare / train_compare and the ``compare`` command line."""

import json
import math

import pytest
import torch
from torch import nn

from transformer_linear import cli, recipe
from transformer_linear.numerics import CompareReport, compare, train_compare


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def test_compare_reports_every_layer_for_every_recipe(tmp_path):
    model = _mlp()
    report = compare(model, torch.randn(8, 32))
    assert isinstance(report, CompareReport)
    assert [s.name for s in report.layers] == ["0", "2", "0", "2"]
    assert report.recipes == ["DelayedScaling(HYBRID)", "CurrentScaling(HYBRID)"]
    for s in report.layers:
        for value in (s.output_sqnr, s.dgrad_sqnr, s.wgrad_sqnr):
            assert 15.0 < value < 60.0, s
        assert 0.0 < s.output_max_rel < 0.2
        assert set(s.input) == {"amax", "scale", "underflow", "saturation"}
    # The model itself is left with its nn.Linear layers.
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    parsed = json.loads(report.to_json(tmp_path / "r.json"))
    assert len(parsed["layers"]) == 4 and (tmp_path / "r.json").exists()
    assert "loss of one step on the same weights and batch: high precision" in str(report)
    png = report.plot(tmp_path / "sqnr.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_values_beyond_fp8_max_show_as_saturation():
    # TE's delayed scaling's first step uses scale 1, so inputs above 448 saturate.
    model = nn.Sequential(nn.Linear(10, 4))
    x = torch.randn(20, 10)
    x[:, 0] = 1000.0  # 10% of the elements
    te_first_step = recipe.DelayedScaling(first_step_just_in_time=False)
    report = compare(model, x, recipes=[te_first_step], calibration_steps=0)
    (layer,) = report.layers
    assert layer.input["saturation"] == pytest.approx(0.10)
    assert layer.input["scale"] == 1.0


def test_tiny_values_show_as_underflow():
    model = nn.Sequential(nn.Linear(10, 4))
    x = torch.randn(20, 10)
    x[:, 1] = 1e-12  # far below e4m3's smallest subnormal at the scale the large values set
    report = compare(model, x, recipes=["current"])
    assert report.layers[0].input["underflow"] == pytest.approx(0.10)


def test_train_compare_records_curves_and_history():
    model = _mlp()
    data = [torch.randn(8, 32) for _ in range(6)]
    report = train_compare(
        model, lambda i: data[i], lambda y, x: y.float().square().mean(), steps=6, recipes=["current"], stats_every=3,
        noise_floor="none",
    )
    assert list(report.loss_curves) == ["reference", "CurrentScaling(HYBRID)"]
    assert all(len(c) == 6 for c in report.loss_curves.values())
    assert [h["step"] for h in report.layer_history["CurrentScaling(HYBRID)"]] == [0, 3, 5]
    assert math.isfinite(report.loss_gap()["CurrentScaling(HYBRID)"])
    assert report.final is not None and len(report.final.layers) == 2


def test_model_without_linear_layers_is_a_value_error():
    with pytest.raises(ValueError, match="no nn.Linear layers"):
        compare(nn.Sequential(nn.ReLU()), torch.randn(2, 3))


def test_wrong_input_shape_is_a_value_error():
    with pytest.raises(ValueError, match="failed on example_inputs"):
        compare(_mlp(), torch.randn(8, 31))


def test_unknown_recipe_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        compare(_mlp(), torch.randn(8, 32), recipes=["fp4"])


def test_recipe_objects_are_accepted():
    report = compare(_mlp(), torch.randn(8, 32), recipes=[recipe.CurrentScaling(fp8_format=recipe.Format.E4M3)])
    assert report.recipes == ["CurrentScaling(E4M3)"]


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["compare", "--size", "tiny", "--steps", "4", "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gap vs reference" in printed and "wrote" in printed
    data = json.loads((out / "report.json").read_text())
    assert {"reference", "DelayedScaling(HYBRID)", "CurrentScaling(HYBRID)"} <= set(data["final_loss"])
    assert "## Per-layer comparison" in (out / "report.md").read_text()
    for png in ("loss_curves.png", "layer_sqnr.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_an_unknown_recipe(tmp_path, capsys):
    assert cli.main(["compare", "--size", "tiny", "--steps", "2", "--recipes", "bogus", "--out", str(tmp_path)]) == 2
    assert "error: --recipes: unknown recipe bogus" in capsys.readouterr().err


@pytest.mark.parametrize("just_in_time", [True, False])
def test_delayed_first_step_stats_use_the_scales_the_step_quantizes_with(just_in_time):
    # A fresh delayed-scaling state quantizes its first step with just-in-time
    # scales from each tensor's own amax (current scaling's), unless turned off.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16) * 300  # amax far from the state's initial scale 1
    delayed = recipe.DelayedScaling(first_step_just_in_time=just_in_time)
    report = compare(model, (x,), recipes=(delayed, recipe.CurrentScaling()), calibration_steps=0)
    by_recipe = {}
    for row in report.layers:
        by_recipe.setdefault(row.recipe.split("(")[0], {})[row.name] = row
    assert len(by_recipe["DelayedScaling"]) == 2
    for name, row in by_recipe["DelayedScaling"].items():
        current = by_recipe["CurrentScaling"][name]
        same = row.input["scale"] == current.input["scale"]
        assert same == just_in_time, (name, row.input["scale"], current.input["scale"])
