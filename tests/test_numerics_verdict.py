"""The verdict's advice on the ``+filter`` runs: a filter is suggested only where it helped beyond the noise."""

import pytest

from transformer_linear.numerics import verdict
from transformer_linear.numerics.report import TrainReport

FLOOR = "fp32 init perturbed (seed 1)"


def _judge(gap: float, filtered_gap: float, floor: float, gate: verdict.Gate = verdict.Gate()) -> verdict.Verdict:
    curves = {"reference": [1.0] * 10, FLOOR: [1.0 + floor] * 10, "R": [1.0 + gap] * 10,
              "R" + verdict.FILTERED: [1.0 + filtered_gap] * 10}
    return verdict.judge(TrainReport(10, curves, floor_runs=[FLOOR]), ["R"], gate)


# Gaps measured by `transformer-linear compare` (relative: 0.01 is 1%), with the effect the filter had.
MEASURED = [
    # Qwen2 (issue 35): the filter took a passing gap to a failing one; the old rule still suggested it.
    pytest.param(0.0006, 0.0102, 0.0010, verdict.FilterEffect.HURT, 0, id="qwen2-filter-hurts"),
    # GPT-2 --compile (issue 35): -0.0147% -> -0.0054% against a floor of 0.0065%: a change the
    # comparison cannot resolve (it is within 2 x the floor), which the old rule called "helped".
    pytest.param(-0.000147, -0.000054, 0.000065, verdict.FilterEffect.WITHIN_NOISE, 0, id="gpt2-compile-noise"),
    # Qwen2 tiny config (seed 0, 40 steps): -0.99% -> -0.55% against a perturbed-init floor of 1.17%.
    pytest.param(-0.0099, -0.0055, 0.0117, verdict.FilterEffect.WITHIN_NOISE, 0, id="qwen2-40-steps-noise"),
    # Qwen3-MoE tiny config (seed 0, 40 steps), current scaling: +0.57% PASS -> +1.07% FAIL against a floor of
    # 0.09%; the old rule printed this filter as the suggested one.
    pytest.param(0.0057, 0.0107, 0.0009, verdict.FilterEffect.HURT, 0, id="qwen3-moe-filter-hurts"),
    # GPT-2 tiny config (seed 0, 40 steps), current scaling: +3.09% FAIL -> +0.23% PASS, floor 0.11%.
    pytest.param(0.0309, 0.0023, 0.0011, verdict.FilterEffect.HELPED, 3, id="gpt2-current-helped"),
    # A failing recipe that passes with the filter only by noise is not fixed by it: exit 1, not 3.
    pytest.param(0.0105, 0.0095, 0.0040, verdict.FilterEffect.WITHIN_NOISE, 1, id="pass-by-noise"),
]


@pytest.mark.parametrize("gap, filtered_gap, floor, effect, code", MEASURED)
def test_a_filter_is_suggested_only_where_it_helped_beyond_the_noise(gap, filtered_gap, floor, effect, code):
    v = _judge(gap, filtered_gap, floor)
    assert v.filter_effect("R") is effect
    assert v.filter_helped("R") is (effect is verdict.FilterEffect.HELPED)
    assert v.filter_suggested_for == (["R"] if effect is verdict.FilterEffect.HELPED else [])
    assert v.exit_code == code
    assert v.to_dict()["filtered"]["R"]["effect"] == effect.value
    words = {verdict.FilterEffect.HELPED: "the filter helped", verdict.FilterEffect.HURT: "the filter made it worse",
             verdict.FilterEffect.WITHIN_NOISE: "no measurable effect"}[effect]
    assert words in v.lines()[0]


@pytest.mark.parametrize("noise_factor, effect", [(1.0, verdict.FilterEffect.HELPED), (3.0, verdict.FilterEffect.WITHIN_NOISE)])
def test_the_resolution_is_the_gates_margin(noise_factor, effect):
    # |gap| shrinks by 0.5%: beyond 1 x a 0.2% floor, within 3 x it.
    v = _judge(0.008, 0.003, 0.002, verdict.Gate(noise_factor=noise_factor))
    assert v.resolution == pytest.approx(noise_factor * 0.002)
    assert v.filter_effect("R") is effect
