"""The numerics tool on mixture-of-experts models: one row per experts projection with one ExpertStats per expert
(SQNR of its output rows, dX rows and dW; its tokens; the too-few-tokens flag), in tl.numerics.compare, in the
markdown and JSON reports, in train_compare's worst-over-steps summary and in ``transformer-linear compare --hf``
on a tiny Mixtral."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

import transformer_linear as tl
from transformer_linear import cli
from transformer_linear.modules.hf_experts import ExpertsFP8State
from transformer_linear.numerics import experts
from transformer_linear.numerics.report import MIN_EXPERT_TOKENS, CompareReport, ExpertStats, LayerStats, worst_experts
from transformer_linear.numerics.risk import keep_high_precision

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
BATCH, SEQ, TOP_K, EXPERTS, LAYERS = 2, 32, 2, 8, 2
PROJECTIONS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in ("gate_up_proj", "down_proj")]
# An FP8 (E4M3 forward, E5M2 gradients) expert's own error on this model, in dB (measured 26-29 for the output,
# 24-26 dX, 25-29 dW): the bounds each judged expert must reach.
MIN_EXPERT_SQNR_DB = {"output_sqnr": 22.0, "dgrad_sqnr": 18.0, "wgrad_sqnr": 18.0}


def _model():
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(DATA / "tiny_mixtral")
    return transformers.AutoModelForCausalLM.from_config(config)


def _ids():
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _loss(output, ids):
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.fixture(scope="module")
def report():
    return tl.numerics.compare(_model(), (_ids(),), loss_fn=_loss, recipes=("current", "delayed", "mxfp8", "nvfp4"))


def _projection_rows(report, recipe):
    return {s.name: s for s in report.for_recipe(recipe) if s.experts}


@pytest.mark.parametrize("recipe", ["CurrentScaling(HYBRID)", "DelayedScaling(HYBRID)"])
def test_compare_reports_each_expert(report, recipe):
    rows = _projection_rows(report, recipe)
    assert list(rows) == PROJECTIONS
    for name, row in rows.items():
        assert [e.expert for e in row.experts] == list(range(EXPERTS))
        # Delayed scaling's projections are replayed with fresh scales too: the dB its history's scales cost.
        stale = {"output", "dgrad", "wgrad"} if recipe.startswith("Delayed") else set()
        assert set(row.stale_loss_db) == stale and all(math.isfinite(v) for v in row.stale_loss_db.values())
        # Every token's top-k choices land on some expert.
        assert sum(e.tokens for e in row.experts) == BATCH * SEQ * TOP_K, name
        for e in row.experts:
            assert e.too_few_tokens == (e.tokens < MIN_EXPERT_TOKENS), (name, e)
            if e.tokens == 0:
                assert all(math.isnan(getattr(e, f)) for f in ExpertStats.SQNR_FIELDS)
            elif not e.too_few_tokens:
                for field, least in MIN_EXPERT_SQNR_DB.items():
                    assert least <= getattr(e, field) < 60, (name, e)
        # The grouped row's figures are those of all the experts' rows together: between the best and worst
        # expert (an SQNR over the union of rows is a weighted mean of the experts' noise and signal).
        judged = [e.output_sqnr for e in row.experts if e.tokens]
        assert min(judged) - 1e-9 <= row.output_sqnr <= max(judged) + 1e-9
    # The down projection sees the same routing as the gate_up projection of its layer.
    for i in range(LAYERS):
        up, down = rows[PROJECTIONS[2 * i]], rows[PROJECTIONS[2 * i + 1]]
        assert [e.tokens for e in up.experts] == [e.tokens for e in down.experts]
    # This batch leaves some experts with too few tokens and gives others enough.
    flags = {e.too_few_tokens for row in rows.values() for e in row.experts}
    assert flags == {True, False}


def test_block_and_nvfp4_recipes_report_the_experts(report):
    """The grouped GEMMs take the block recipes and NVFP4 (ops.grouped_nvfp4): their experts have rows,
    next to the other layers."""
    assert set(_projection_rows(report, "MXFP8BlockScaling(E4M3)")) == set(PROJECTIONS)
    nvfp4 = next(name for name in report.recipes if name.startswith("NVFP4"))
    assert set(_projection_rows(report, nvfp4)) == set(PROJECTIONS)
    assert any(s.name == "lm_head" for s in report.for_recipe(nvfp4))


def test_markdown_table_and_json(report):
    text = report.markdown()
    assert "| recipe | projection | expert | tokens | out dB | dX dB | dW dB | judged |" in text
    assert f"no: < {MIN_EXPERT_TOKENS} tokens" in text and "| model.layers.1.mlp.experts.down_proj | 7 |" in text
    assert "projection" in report.table()
    data = json.loads(report.to_json())
    assert data["min_expert_tokens"] == MIN_EXPERT_TOKENS
    rows = [s for s in data["layers"] if s["experts"]]
    assert len(rows) == 4 * len(PROJECTIONS)  # current, delayed, mxfp8 and nvfp4
    assert set(rows[0]["experts"][0]) == {"expert", "tokens", "output_sqnr", "dgrad_sqnr", "wgrad_sqnr",
                                          "too_few_tokens", "steps", "judged_steps"}


def test_min_expert_tokens_is_the_threshold():
    got = tl.numerics.compare(_model(), (_ids(),), loss_fn=_loss, recipes=("current",), min_expert_tokens=0)
    assert not any(e.too_few_tokens for s in got.layers for e in s.experts)
    got = tl.numerics.compare(_model(), (_ids(),), loss_fn=_loss, recipes=("current",), min_expert_tokens=10**6)
    assert all(e.too_few_tokens for s in got.layers for e in s.experts)
    assert "no: < 1000000 tokens" in got.markdown()
    with pytest.raises(ValueError, match="min_expert_tokens"):
        tl.numerics.compare(_model(), (_ids(),), loss_fn=_loss, min_expert_tokens=-1)


def test_each_expert_is_measured_on_its_own_rows():
    """Expert 1's weight is zero: its output rows and dX rows are exactly 0 in FP8 too (inf dB), while expert 0's
    and expert 2's are FP8-rounded (finite); expert 3 has no tokens."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 24, 16, generator=gen)
    weight[1] = 0
    offs = torch.tensor([5, 12, 30, 30], dtype=torch.int32)
    call = experts.GroupedCall(input=torch.randn(30, 16, generator=gen), weight=weight, offs=offs,
                               grad_output=torch.randn(30, 24, generator=gen))
    state = ExpertsFP8State()
    rows = experts.observe_experts({"m.experts.fp8_down_proj": state}, tl.recipe.Float8CurrentScaling(), "current",
                                   {"m.experts.fp8_down_proj": call}, None, None, min_expert_tokens=6)
    (row,) = rows
    assert row.name == "m.experts.down_proj" and math.isnan(row.e2e_output_sqnr)
    e0, e1, e2, e3 = row.experts
    assert [e.tokens for e in row.experts] == [5, 7, 18, 0]
    assert [e.too_few_tokens for e in row.experts] == [True, False, False, True]
    assert e1.output_sqnr == math.inf and e1.dgrad_sqnr == math.inf and 15 < e1.wgrad_sqnr < 60
    for e in (e0, e2):
        assert all(15 < getattr(e, f) < 60 for f in ExpertStats.SQNR_FIELDS), e
    assert all(math.isnan(getattr(e3, f)) for f in ExpertStats.SQNR_FIELDS)
    assert state.recipe is None  # the replay put the module's own recipe back


def test_worst_over_steps_judges_experts_only_where_they_had_enough_tokens():
    step0 = [ExpertStats(0, 40, 30.0, 25.0, 26.0), ExpertStats(1, 3, 10.0, 5.0, 4.0, too_few_tokens=True)]
    step1 = [ExpertStats(0, 20, 28.0, 27.0, 24.0), ExpertStats(1, 30, 29.0, 26.0, 25.0)]
    step2 = [ExpertStats(0, 2, 1.0, 1.0, 1.0, too_few_tokens=True), ExpertStats(1, 5, 9.0, 9.0, 9.0, too_few_tokens=True)]
    worst = worst_experts([step0, step1, step2])
    # tokens: the median per step, not the fewest (2 and 3 would sit beside figures from steps with 20-40).
    assert worst == [ExpertStats(0, 20, 28.0, 25.0, 24.0, False, steps=3, judged_steps=2),
                     ExpertStats(1, 5, 29.0, 26.0, 25.0, False, steps=3, judged_steps=1)]
    only_few = worst_experts([[ExpertStats(0, 3, 10.0, 5.0, 4.0, True)], [ExpertStats(0, 0, math.nan, math.nan,
                                                                                       math.nan, True)]])
    assert only_few == [ExpertStats(0, 0, 10.0, 5.0, 4.0, True, steps=2, judged_steps=0)]


@pytest.mark.parametrize("expert, judged", [
    (ExpertStats(0, 20, 28.0, 25.0, 24.0, False, steps=3, judged_steps=2), "yes: 2/3 steps"),
    (ExpertStats(0, 0, 10.0, 5.0, 4.0, True, steps=2, judged_steps=0), "no: < 16 tokens in every step"),
    (ExpertStats(0, 40, 30.0, 25.0, 26.0), "yes"),
])
def test_the_expert_table_says_on_how_many_steps_an_expert_was_judged(expert, judged):
    row = LayerStats("m.experts.down_proj", "R", 28.0, 0.1, 25.0, 0.1, 24.0, 0.1, experts=[expert])
    table = CompareReport(["R"], [row], 1.0, {"R": 1.0}).table()
    line = next(line for line in table.splitlines() if line.startswith("R ") and "down_proj" in line and
                line.rstrip().endswith(judged))
    assert f" {expert.tokens} " in line


def test_train_compare_summarises_the_experts():
    train = tl.numerics.train_compare(
        _model(), lambda step: (torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)),),
        loss_fn=_loss, steps=3, recipes=("current",), stats_every=1, noise_floor="none",
    )
    observed = [s for s in train.observations["CurrentScaling(HYBRID)"] if s.experts]
    assert len(observed) == 3 * len(PROJECTIONS)  # each projection at steps 0, 1, 2
    final = {s.name: s for s in train.final.layers if s.experts}
    assert list(final) == PROJECTIONS
    for name, row in final.items():
        steps = [s for s in observed if s.name == name and s.steps != [0]]  # step 0, the init, is not summarised
        assert row.steps == [1, 2]
        for e in row.experts:
            assert e.tokens == statistics.median_low(s.experts[e.expert].tokens for s in steps)
            assert e.steps == 2 and e.judged_steps == sum(not s.experts[e.expert].too_few_tokens for s in steps)


def test_suggested_filter_keeps_a_risky_projections_experts_module_in_high_precision():
    keep = keep_high_precision(["model.layers.1.mlp.experts.down_proj", "lm_head"])
    model = _model()
    assert not keep(model.model.layers[1].mlp.experts, "model.layers.1.mlp.experts")
    assert keep(model.model.layers[0].mlp.experts, "model.layers.0.mlp.experts")
    assert not keep(model.lm_head, "lm_head")
    plan = tl.modules.convert.conversion_plan(model, keep)
    assert plan.experts == ["model.layers.0.mlp.experts"] and "model.layers.1.mlp.experts" in plan.skipped


def test_cli_hf_mixtral_reports_the_experts(tmp_path, capsys):
    out = tmp_path / "report"
    code = cli.main(["compare", "--hf", str(DATA / "tiny_mixtral"), "--hf-random-init", "--input-shape", "2,32",
                     "--steps", "2", "--recipes", "current", "--no-plots", "--min-expert-tokens", "12",
                     "--out", str(out)])
    printed = capsys.readouterr().out
    assert code in (0, 1, 3), printed
    assert "; 9 layers and 2 experts modules (4 grouped projections) to FP8," in printed
    report = json.loads((out / "report.json").read_text())
    final = report["final_compare"]
    assert final["min_expert_tokens"] == 12
    rows = {s["name"]: s for s in final["layers"] if s["experts"]}
    assert list(rows) == PROJECTIONS
    for row in rows.values():
        assert len(row["experts"]) == EXPERTS
        for e in row["experts"]:
            # Worst over the observed steps: too few when the expert had too few tokens in every step.
            assert not e["too_few_tokens"] or e["tokens"] < 12
            assert e["too_few_tokens"] or all(
                isinstance(e[f], float) and e[f] > MIN_EXPERT_SQNR_DB[f] for f in MIN_EXPERT_SQNR_DB
            ), e
    md = (out / "report.md").read_text()
    assert "experts on the FP8 grouped GEMMs: 2 modules" in md
    assert "| recipe | projection | expert | tokens |" in md
    assert not any("experts" in name for name in report["high_precision"])
