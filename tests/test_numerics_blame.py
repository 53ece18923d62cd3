"""Per-recipe layer statistics from the training run, per-layer blame in isolation, the verdict's noise floor."""

import math

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.numerics import blame, compare, train_compare, verdict
from transformer_linear.numerics.compare import with_recipe
from transformer_linear.numerics.report import TrainReport


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _data(steps, growth=1.0):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(16, 32, generator=gen) * growth**i for i in range(steps)]


def test_delayed_and_current_scaling_rows_differ_and_delayed_uses_its_history():
    # Inputs that grow 30% a step: delayed scaling quantizes with the amax of earlier steps, current with this one's.
    data = _data(12, growth=1.3)
    report = train_compare(_mlp(), data.__getitem__, lambda y, x: y.square().mean(), steps=12,
                           recipes=["delayed", "current"], lr=1e-3, noise_floor="none")
    rows = {(s.recipe.split("(")[0], s.name): s for s in report.final.layers}
    assert all(rows[("DelayedScaling", n)].steps == [2, 4, 7, 9, 11] for n in ("0", "2", "4"))
    delayed, current = rows[("DelayedScaling", "0")], rows[("CurrentScaling", "0")]
    assert delayed.input["saturation"] > 0.0 == current.input["saturation"]
    assert delayed.output_sqnr != current.output_sqnr
    # The scale the last observed delayed step used comes from the history of its own run (not the step's amax).
    last = [s for s in report.observations["DelayedScaling(HYBRID)"] if s.name == "0" and s.steps == [11]][0]
    own = 448.0 / last.input["amax"]
    assert last.input["scale"] > own * 1.2


def test_the_summary_describes_training_and_shows_where_stale_scales_bite():
    """Step 0 (the random init; delayed scaling's just-in-time scales, equal to current scaling's) is observed but
    left out of the summary; each SQNR has its median and worst over the training steps; delayed scaling's rows
    say how many dB stale scales cost against the scales the same tensors' own amaxes give."""
    data = _data(12, growth=1.3)
    report = train_compare(_mlp(), data.__getitem__, lambda y, x: y.square().mean(), steps=12,
                           recipes=["delayed", "current"], lr=1e-3, noise_floor="none")
    observed = {s.steps[0] for s in report.observations["DelayedScaling(HYBRID)"]}
    assert observed == {0, 2, 4, 7, 9, 11}
    rows = {(s.recipe.split("(")[0], s.name): s for s in report.final.layers}
    delayed, current = rows[("DelayedScaling", "0")], rows[("CurrentScaling", "0")]
    assert 0 not in delayed.steps and 0 not in current.steps
    for row in (delayed, current):
        assert set(row.median) == set(row.SQNR_FIELDS)
        assert row.median["output_sqnr"] >= row.output_sqnr
    # Inputs grow 30% a step: the history's amax is a step old, so the input saturates; fresh scales do not.
    assert delayed.stale_loss_db["output"] > 3.0 and delayed.stale_step in delayed.steps
    assert current.stale_loss_db == {} and current.stale_step is None
    lines = report.final.table().splitlines()
    assert " stale dB " in lines[0]
    cells = {line.split()[0].split("(")[0]: line.split() for line in lines[2:] if line.split()[1:2] == ["0"]}
    worst = max(delayed.stale_loss_db.values())
    assert cells["DelayedScaling"][8] == f"{worst:.1f}"
    assert cells["DelayedScaling"][9].endswith(f"@{delayed.stale_step}") and cells["CurrentScaling"][8] == "-"


def test_replayed_fp8_layer_reproduces_what_the_run_computed():
    model = with_recipe(_mlp(), recipe.DelayedScaling())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, tl.Linear)}
    outputs = {}
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out.detach())) for n, m in layers.items()]
    x = torch.randn(16, 32)
    for _ in range(3):  # a delayed-scaling history to replay from
        model(x).square().mean().backward()
    with blame.Recorder(layers, state=True) as rec:
        model(x * 2).square().mean().backward()
    for h in hooks:
        h.remove()
    before = {n: m.fp8_scale.clone() for n, m in layers.items()}
    for name, layer in layers.items():
        replay = blame._replay_fp8(layer, layer.recipe, rec.calls[name])
        torch.testing.assert_close(replay.output, outputs[name], rtol=0, atol=0)
        assert torch.equal(layer.fp8_scale, before[name])  # the layer's own state is untouched


class _Amplifier(nn.Module):
    """fc1 sees inputs whose first column is 1e6 times the rest, with a weight column 1e-6 times the rest: FP8
    flushes the other columns, which carry the output, to zero. fc2 is healthy."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        with torch.no_grad():
            self.fc1.weight[:, 0] *= 1e-6

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_blame_is_isolated_per_layer_and_end_to_end_is_a_separate_figure():
    x = torch.randn(64, 16)
    x[:, 0] *= 1e6
    report = compare(_Amplifier(), x, recipes=["current"])
    fc1, fc2 = report.layers
    assert fc1.output_sqnr < 20  # its own error
    # fc2's own error is that of a healthy layer, although its input carries fc1's error.
    assert fc2.output_sqnr > 25
    assert fc2.e2e_output_sqnr < 20
    assert fc1.e2e_output_sqnr == pytest.approx(fc1.output_sqnr)  # the first layer's input is the same in both
    risky = tl.numerics.risky_layers(report)
    assert list(risky) == ["fc1"]


def _train_report(gaps: dict, floor_runs=()):
    curves = {"reference": [1.0] * 10, **{n: [1.0 + g] * 10 for n, g in gaps.items()}}
    return TrainReport(10, curves, floor_runs=list(floor_runs))


def test_the_gate_judges_the_gap_against_the_noise_floor():
    gate = verdict.Gate(max_gap=0.01, noise_factor=2.0)
    noisy = _train_report({"bf16 autocast": 0.009, "R": 0.015}, ["bf16 autocast"])
    v = verdict.judge(noisy, ["R"], gate)
    assert v.floor == pytest.approx(0.009) and v.allowed == pytest.approx(0.018)
    assert v.recipes["R"].passed and v.exit_code == 0
    quiet = verdict.judge(_train_report({"bf16 autocast": 0.001, "R": 0.015}, ["bf16 autocast"]), ["R"], gate)
    assert not quiet.recipes["R"].passed and quiet.exit_code == 1 and quiet.allowed == pytest.approx(0.01)
    assert any("rule: |gap| <= max(--max-gap 1%, 2 x noise floor" in line for line in v.lines())


@pytest.mark.parametrize("filtered_gap, code, words", [(0.002, 3, "the filter helped"), (0.03, 1, "made it worse")])
def test_the_filter_run_is_part_of_the_verdict(filtered_gap, code, words):
    report = _train_report({"R": -0.02, "R" + verdict.FILTERED: filtered_gap})
    v = verdict.judge(report, ["R"], verdict.Gate())
    assert v.exit_code == code and v.filter_helped("R") is (code == 3)
    assert words in v.lines()[0]


def test_floor_runs_fall_back_to_a_perturbed_seed_where_bf16_is_slow(monkeypatch):
    monkeypatch.setattr(verdict, "bf16_is_fast", lambda device: False)
    runs, note = verdict.floor_runs("auto", 1, torch.device("cpu"))
    assert [r.label for r in runs] == ["fp32 init perturbed (seed 1)"] and "bf16 is slow" in note
    monkeypatch.setattr(verdict, "bf16_is_fast", lambda device: True)
    runs, note = verdict.floor_runs("auto", 3, torch.device("cpu"))
    assert [r.label for r in runs] == ["bf16 autocast", "fp32 init perturbed (seed 1)", "fp32 init perturbed (seed 2)"]
    assert verdict.floor_runs("none", 1, torch.device("cpu"))[0] == []
    with pytest.raises(ValueError, match="noise_floor: expected one of"):
        verdict.floor_runs("bogus", 1, torch.device("cpu"))


def test_train_compare_runs_the_floor_and_reports_after_each_run():
    data = _data(4)
    seen = []
    report = train_compare(_mlp(), data.__getitem__, lambda y, x: y.square().mean(), steps=4, recipes=["current"],
                           noise_floor="seeds", seeds=2, on_run=lambda r: seen.append(list(r.loss_curves)))
    assert seen == [["reference"], ["reference", "fp32 init perturbed (seed 1)"],
                    ["reference", "fp32 init perturbed (seed 1)", "CurrentScaling(HYBRID)"]]
    gap = report.loss_gap()["fp32 init perturbed (seed 1)"]
    assert gap != 0.0 and abs(gap) < 0.01 and math.isfinite(gap)
