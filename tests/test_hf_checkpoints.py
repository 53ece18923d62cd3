"""Converted ``transformers`` models save checkpoints that vanilla ``from_pretrained`` loads, and back."""

import pytest
import torch

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.convert import Conv1DLinear, conversion_plan

transformers = pytest.importorskip("transformers")


def _config(kind):
    if kind == "gpt2":  # c_attn (64, 192), c_fc (64, 256), mlp.c_proj (256, 64): non-square; attn.c_proj square
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=32)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "llama-tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    return transformers.Qwen2Config(**common)


def _trained_fp8_model(kind):
    """A model converted to FP8 (delayed scaling) and trained 3 steps, so weights and FP8 state are not the init's."""
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_config(_config(kind))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the conversion, on purpose
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tl.convert_to_fp8(model, recipe=recipe.DelayedScaling())
    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    return model.eval(), ids, changed


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied", "qwen2"])
def test_save_pretrained_round_trips_through_vanilla_from_pretrained(tmp_path, kind):
    model, ids, changed = _trained_fp8_model(kind)
    # The optimizer built before the conversion updated every weight (Conv1D's too).
    assert changed == {n for n, _ in model.named_parameters()}
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert not any(isinstance(m, tl.Linear) for m in loaded.modules())
    params = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        assert params[name].shape == p.shape, name
        assert torch.equal(params[name], p.detach()), f"{name} differs after the round trip"
    if kind == "llama-tied":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # The vanilla model computes what the converted one computes in high precision.
    with torch.no_grad(), tl.autocast(enabled=False):
        for m in model.modules():
            if isinstance(m, tl.Linear):
                m.recipe = None
        want = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_convert_after_from_pretrained_restores_the_fp8_state(tmp_path, kind):
    model, ids, _ = _trained_fp8_model(kind)
    model.save_pretrained(tmp_path)
    loaded = tl.convert_to_fp8(type(model).from_pretrained(tmp_path), recipe=recipe.DelayedScaling()).eval()
    saved = {k: v for k, v in model.state_dict().items() if ".fp8_" in k}
    state = loaded.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("fp8_amax_history"))
    # The next FP8 step of both is bitwise the same.
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    fresh = tl.convert_to_fp8(type(model).from_pretrained(tmp_path), fp8_state=None)
    assert all(fresh.state_dict()[k].abs().sum() == 0 for k in saved if k.endswith("fp8_amax_history"))


def test_gpt2_conv1d_layers_keep_their_parameter_and_orientation():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config("gpt2"))
    attn = model.transformer.h[0].attn
    weights = {"c_attn": attn.c_attn.weight, "c_proj": attn.c_proj.weight}
    tl.convert_to_fp8(model)
    for name, w in weights.items():
        layer = getattr(attn, name)
        assert isinstance(layer, Conv1DLinear) and layer.weight is w
    assert attn.c_attn.weight.shape == (64, 192) and attn.c_proj.weight.shape == (64, 64)


def test_load_fp8_state_rejects_a_missing_path(tmp_path):
    model = tl.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="fp8_state: no such checkpoint file or directory"):
        tl.load_fp8_state(model, tmp_path / "nope")


def test_plan_reports_what_stays_in_high_precision():
    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Parameter(torch.randn(8, 8))
            self.gain = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return (x @ self.proj) * self.gain

    model = torch.nn.ModuleDict({"mha": torch.nn.MultiheadAttention(8, 2), "custom": Custom(), "fc": torch.nn.Linear(8, 8)})
    plan = conversion_plan(model)
    assert plan.converted == ["fc"]
    assert set(plan.high_precision) == {"mha.in_proj_weight", "custom.proj"}
    assert "fused" in plan.high_precision["mha.in_proj_weight"] or "q/k/v" in plan.high_precision["mha.in_proj_weight"]
    assert set(plan.left_in_high_precision()) == {"mha.out_proj", "mha.in_proj_weight", "custom.proj"}
