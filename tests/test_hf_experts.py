"""tl.register_hf_experts: transformers' mixture-of-experts layers (ExpertsInterface) on tl.grouped_linear,
against transformers' own eager experts forward on a tiny Mixtral."""

from __future__ import annotations

import pytest
import torch
from grouped_cases import recipe_without_grouped_gemms
from tolerances import sqnr

import transformer_linear as tl

transformers = pytest.importorskip("transformers")
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

# FP8 (E4M3 forward, E5M2 gradients) experts in a 2-layer fp32 model: the SQNR the logits and the experts'
# weight gradients must reach against the eager experts, in dB.
MIN_SQNR_DB = {"logits": 35.0, "grad": 17.0}


@pytest.fixture
def registered():
    """Names registered by a test, taken out of transformers' global mapping afterwards."""
    names = []
    yield names
    for name in names:
        ExpertsInterface._global_mapping.pop(name, None)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(cfg)


def _step(model, implementation, ids):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    experts = model.model.layers[0].mlp.experts
    return out.logits.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


def test_high_precision_matches_eager(registered):
    model = _model()
    ids = torch.randint(0, 128, (2, 16))
    registered.append(tl.register_hf_experts("tl_test_hp"))
    expected = _step(model, "eager", ids)
    got = _step(model, "tl_test_hp", ids)
    for a, b, what in zip(got, expected, ("logits", "gate_up_proj grad", "down_proj grad")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)


def test_fp8_close_to_eager_forward_and_backward(registered):
    model = _model()
    ids = torch.randint(0, 128, (2, 16))
    registered.append(tl.register_hf_experts("tl_test_fp8", recipe=tl.recipe.Float8CurrentScaling()))
    expected = _step(model, "eager", ids)
    got = _step(model, "tl_test_fp8", ids)
    assert sqnr(got[0], expected[0]) >= MIN_SQNR_DB["logits"]
    for a, b in zip(got[1:], expected[1:]):
        assert sqnr(a, b) >= MIN_SQNR_DB["grad"]
    # Without a registered recipe, tl.autocast's turns FP8 on.
    registered.append(tl.register_hf_experts("tl_test_autocast"))
    model.set_experts_implementation("tl_test_autocast")
    with tl.autocast(recipe=tl.recipe.Float8CurrentScaling()):
        logits = model(ids).logits.detach()
    assert torch.equal(logits, got[0])


@pytest.mark.parametrize("recipe", [tl.recipe.DelayedScaling(), recipe_without_grouped_gemms()],
                         ids=["DelayedScaling", "CustomRecipe"])
def test_unsupported_recipes_raise_at_registration(recipe, registered):
    with pytest.raises(NotImplementedError, match=type(recipe).__name__):
        registered.append(tl.register_hf_experts("tl_test_bad", recipe=recipe))
    assert "tl_test_bad" not in ExpertsInterface._global_mapping
