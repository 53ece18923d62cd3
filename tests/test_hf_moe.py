"""tl.convert_to_fp8 on transformers mixture-of-experts models (tiny random-init Mixtral and Qwen3-MoE): the
experts run as FP8 grouped GEMMs (ExpertsFP8State + the transformer_linear experts implementation) beside the
tl.Linear projections. Training from the same init against the unconverted model, torch.compile of the experts
without graph breaks, generate(), save_pretrained / from_pretrained, and the recipes the grouped GEMMs refuse."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from grouped_cases import recipe_without_grouped_gemms
from torch import nn

import transformer_linear as tl
from transformer_linear.modules.convert import conversion_plan
from transformer_linear.modules.hf_experts import DEFAULT_EXPERTS_IMPLEMENTATION, ExpertsFP8State
from transformer_linear.numerics.model import GPTConfig, SyntheticText

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 32, 4
STEPS = 30
# The FP8 model's loss over the last steps of a 30-step AdamW run, relative to the unconverted model's.
MAX_LOSS_GAP = 0.01
LOSS_WINDOW = 5
# The logits' SQNR against the unconverted model (fp32, one forward), in dB: every projection in FP8 (measured
# 26.0 Mixtral, 23.7 Qwen3-MoE), and the experts alone in FP8 (44.2, 52.2).
MIN_SQNR_DB = {"model": 20.0, "experts": 35.0}


def _mixtral(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


MODELS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe}
RECIPES = {"current": tl.recipe.Float8CurrentScaling, "delayed": tl.recipe.DelayedScaling}


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _batches() -> list[torch.Tensor]:
    data = SyntheticText(GPTConfig(vocab_size=VOCAB, seq_len=SEQ), seed=0)
    return [data.batch(BATCH) for _ in range(STEPS)]


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("arch", MODELS)
def test_convert_selects_fp8_experts_and_keeps_the_weights(arch):
    model = MODELS[arch]()
    weights = {n: p for n, p in model.named_parameters()}
    plan = conversion_plan(model)
    assert plan.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not any("experts" in n for n in plan.high_precision), plan.high_precision
    assert any(n.endswith("mlp.gate.weight") for n in plan.high_precision)  # the router stays in high precision
    tl.convert_to_fp8(model, recipe=tl.recipe.Float8CurrentScaling())
    assert model.config._experts_implementation == DEFAULT_EXPERTS_IMPLEMENTATION
    for experts in _experts(model):
        states = [m for m in experts.children() if isinstance(m, ExpertsFP8State)]
        assert len(states) == 2 and all(isinstance(s.recipe, tl.recipe.Float8CurrentScaling) for s in states)
    # Same Parameter objects: an optimizer built before the conversion keeps working.
    assert all(p is weights[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("recipe_name", ["current", "block", "mxfp8", "rowwise"])
@pytest.mark.parametrize("arch", MODELS)
def test_fp8_experts_forward_is_close_to_the_unconverted_model(arch, recipe_name):
    model = MODELS[arch]()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(ids).logits.detach()
    tl.convert_to_fp8(model, recipe=tl.recipe.from_name(recipe_name))
    assert sum(isinstance(m, ExpertsFP8State) for m in model.modules()) > 0
    got = model(ids).logits.detach()
    assert tl.numerics.sqnr(got, expected) >= MIN_SQNR_DB["model"]
    # The experts themselves on the grouped GEMMs: the same model with every tl.Linear in high precision
    # differs from the unconverted one by the experts alone.
    for m in model.modules():
        if isinstance(m, tl.Linear):
            m.recipe = None
    experts_only = model(ids).logits.detach()
    assert MIN_SQNR_DB["experts"] <= tl.numerics.sqnr(experts_only, expected) < float("inf")


@functools.cache
def _reference_losses(arch: str) -> tuple[float, ...]:
    """The unconverted model's training losses (shared by the recipes' tests)."""
    return tuple(_train(MODELS[arch](), _batches()))


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("arch", MODELS)
def test_training_loss_within_one_percent(arch, recipe_name):
    batches = _batches()
    reference = _reference_losses(arch)
    fp8 = _train(tl.convert_to_fp8(MODELS[arch](), recipe=RECIPES[recipe_name]()), batches)
    ref_loss = sum(reference[-LOSS_WINDOW:]) / LOSS_WINDOW
    fp8_loss = sum(fp8[-LOSS_WINDOW:]) / LOSS_WINDOW
    gap = (fp8_loss - ref_loss) / ref_loss
    print(f"{arch} {recipe_name}: loss {reference[0]:.4f} -> reference {ref_loss:.4f}, FP8 {fp8_loss:.4f}, "
          f"gap {100 * gap:+.3f}%")
    assert reference[-1] < 0.9 * reference[0]  # the run learns something
    assert abs(gap) < MAX_LOSS_GAP, f"{arch} {recipe_name}: loss gap {100 * gap:+.3f}%"


class _GraphCounter:
    """A torch.compile backend that counts the graphs it is given (a graph break makes one more)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("arch", MODELS)
def test_compile_experts_without_graph_breaks(arch, recipe_name):
    model = tl.convert_to_fp8(MODELS[arch](), recipe=RECIPES[recipe_name]())
    experts = _experts(model)[0]
    hidden = torch.randn(24, model.config.hidden_size)
    top_k_index = torch.randint(0, experts.num_experts, (24, 2), generator=torch.Generator().manual_seed(0))
    top_k_weights = torch.rand(24, 2)
    explanation = torch._dynamo.explain(experts)(hidden, top_k_index, top_k_weights)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    eager = copy.deepcopy(experts)
    counter = _GraphCounter()
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    for step in range(2):  # delayed scaling: the second step quantizes with the first one's history
        x = hidden.clone().requires_grad_(True)
        x_eager = hidden.clone().requires_grad_(True)
        out = compiled(x, top_k_index, top_k_weights)
        expected = eager(x_eager, top_k_index, top_k_weights)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"step {step}")
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=0, atol=0, msg=f"step {step}")
    assert counter.graphs == 1
    for name, p in experts.named_parameters():
        torch.testing.assert_close(p.grad, dict(eager.named_parameters())[name].grad, rtol=0, atol=0)


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("arch", MODELS)
def test_compile_whole_model_fullgraph(arch, recipe_name):
    """The converted model (tl.Linear projections and FP8 experts) trains under torch.compile(fullgraph=True):
    no graph break anywhere (fullgraph=True raises at one), losses and gradients as eager's."""
    model = tl.convert_to_fp8(MODELS[arch](), recipe=RECIPES[recipe_name]())
    eager = copy.deepcopy(model)
    batches = _batches()[:2]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for ids in batches:
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        expected = eager(ids, labels=ids).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("arch", MODELS)
def test_export(arch, recipe_name):
    model = tl.convert_to_fp8(MODELS[arch](), recipe=RECIPES[recipe_name]()).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    program = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "transformer_linear.grouped_linear_fwd.default" in targets, sorted(targets)
    expected = model(ids, use_cache=False).logits
    assert torch.equal(program.module()(ids, use_cache=False).logits, expected)


@pytest.mark.parametrize("arch", MODELS)
def test_generate(arch):
    model = tl.convert_to_fp8(MODELS[arch](), recipe=tl.recipe.Float8CurrentScaling()).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14) and torch.equal(out[:, :8], ids)
    again = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, again)
    # The cache-free path computes the same greedy tokens' logits.
    logits = model(out[:, :-1], use_cache=False).logits
    assert torch.equal(logits[:, 7:].argmax(-1), out[:, 8:])


@pytest.mark.parametrize("arch", MODELS)
def test_save_pretrained_from_pretrained_round_trip(arch, tmp_path):
    model = tl.convert_to_fp8(MODELS[arch](), recipe=tl.recipe.DelayedScaling())
    _train(model, _batches()[:2])  # delayed scaling's state is recorded
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, saved[name]), name
    assert loaded.config._experts_implementation != DEFAULT_EXPERTS_IMPLEMENTATION  # a vanilla load
    tl.convert_to_fp8(loaded, recipe=tl.recipe.DelayedScaling())
    assert loaded.config._experts_implementation == DEFAULT_EXPERTS_IMPLEMENTATION
    states = {n: b for n, b in model.state_dict().items() if ".fp8_" in n and "experts" in n}
    assert states and any(b.abs().sum() > 0 for n, b in states.items() if "amax_history" in n)
    reloaded = loaded.state_dict()
    for name, b in states.items():  # the experts' delayed-scaling state came back from the checkpoint
        assert torch.equal(reloaded[name], b), name
    ids = _batches()[5]
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_recipe_the_grouped_gemms_lack_raises_clearly():
    """A recipe with no grouped GEMM: converting a model with experts raises before anything changes, and
    keeping the experts in high precision converts the rest."""
    recipe = recipe_without_grouped_gemms()
    model = _mixtral()
    with pytest.raises(NotImplementedError, match=r"CustomRecipe.*grouped.*module_filter_fn"):
        tl.convert_to_fp8(model, recipe=recipe)
    # Nothing changed.
    assert not any(isinstance(m, (tl.Linear, ExpertsFP8State)) for m in model.modules())
    assert model.config._experts_implementation != DEFAULT_EXPERTS_IMPLEMENTATION
    keep_experts = lambda module, fqn: not fqn.endswith("experts")  # noqa: E731
    plan = conversion_plan(model, keep_experts)
    assert plan.experts == [] and "model.layers.0.mlp.experts" in plan.skipped
    tl.convert_to_fp8(model, recipe=recipe, module_filter_fn=keep_experts)
    assert any(isinstance(m, tl.Linear) for m in model.modules())
    assert not any(isinstance(m, ExpertsFP8State) for m in model.modules())
    ids = torch.randint(0, VOCAB, (2, 16))
    assert torch.isfinite(model(ids).logits).all()


def test_a_recipe_from_autocast_the_grouped_gemms_lack_raises_in_the_forward():
    model = tl.convert_to_fp8(_mixtral())  # no recipe: follows tl.autocast
    ids = torch.randint(0, VOCAB, (2, 16))
    for name in ("current", "mxfp8"):
        with tl.autocast(recipe=tl.recipe.from_name(name)):
            assert torch.isfinite(model(ids).logits).all()
    with pytest.raises(NotImplementedError, match="CustomRecipe.*grouped"), \
            tl.autocast(recipe=recipe_without_grouped_gemms()):
        model(ids)


def test_nvfp4_experts_train():
    """NVFP4BlockScaling converts the experts too (ops.grouped_nvfp4): a training step is finite and moves
    every expert weight that got tokens."""
    model = tl.convert_to_fp8(_mixtral(), recipe=tl.recipe.NVFP4BlockScaling())
    assert any(isinstance(m, ExpertsFP8State) for m in model.modules())
    ids = torch.randint(0, VOCAB, (2, 16))
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    assert experts and all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts)


def test_experts_state_module_bad_input():
    with pytest.raises(NotImplementedError, match="CustomRecipe"):
        ExpertsFP8State(recipe_without_grouped_gemms())
    state = ExpertsFP8State(tl.recipe.Float8CurrentScaling())
    weight = torch.randn(2, 8, 16)
    offs = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="'inp'"):
        state(torch.randn(5, 15), weight, offs)
    with pytest.raises(ValueError, match="'offs'"):
        state(torch.randn(5, 16), weight, offs.long())
    assert state(torch.randn(0, 16), weight, torch.zeros(2, dtype=torch.int32)).shape == (0, 8)
