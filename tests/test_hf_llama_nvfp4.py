"""A tiny random-init transformers Llama trained in NVFP4 through tl.convert_to_fp8, against fp32 from the same init.

Every projection (q/k/v/o, gate/up/down, lm_head) becomes a tl.Linear with NVFP4BlockScaling; the final loss
(mean of the last LOSS_WINDOW steps of a STEPS-step AdamW run) must be within 3% of the unconverted model's, for
TE's default recipe and with each of RHT, stochastic rounding and 2D weight scaling turned off. Measured gaps
(fp32 final loss 3.4133): default +0.60%, disable_rht +0.44%, disable_stochastic_rounding +0.24%,
disable_2d_quantization +1.11%; see README "NVFP4".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear.numerics.model import GPTConfig, SyntheticText

transformers = pytest.importorskip("transformers")

# Every Linear dimension (hidden 64, kv 32, intermediate 128, vocab 128) and the tokens per batch (4 * 32) are
# multiples of 16, as NVFP4 training needs.
VOCAB, SEQ, BATCH = 128, 32, 4
STEPS, LR, LOSS_WINDOW = 30, 5e-3, 5
MAX_LOSS_GAP = 0.03
VARIANTS = {
    "default": {},
    "no_rht": {"disable_rht": True},
    "no_sr": {"disable_stochastic_rounding": True},
    "no_2d": {"disable_2d_quantization": True},
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

pytestmark = pytest.mark.slow  # ~10 s a run on an idle 2-core machine, five runs


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg)


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    torch.manual_seed(1)  # the stochastic-rounding seeds come from torch's default generator
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _final(losses: list[float]) -> float:
    return sum(losses[-LOSS_WINDOW:]) / LOSS_WINDOW


@pytest.fixture(scope="module")
def fp32_run():
    """(batches, fp32 loss curve), shared by the variants."""
    data = SyntheticText(GPTConfig(vocab_size=VOCAB, seq_len=SEQ), seed=0)
    batches = [data.batch(BATCH) for _ in range(STEPS)]
    losses = _train(_llama(), batches)
    assert _final(losses) < 0.8 * losses[0], losses  # the comparison means something only if fp32 learned
    return batches, losses


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_nvfp4_final_loss_within_3_percent_of_fp32(variant, fp32_run):
    batches, fp32 = fp32_run
    recipe = tl.recipe.NVFP4BlockScaling(**VARIANTS[variant])
    model = tl.convert_to_fp8(_llama(), recipe=recipe)
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, tl.Linear)}
    assert linears == {*PROJECTIONS, "lm_head"}
    assert all(m.recipe == recipe for m in model.modules() if isinstance(m, tl.Linear))
    nvfp4 = _train(model, batches)
    gap = (_final(nvfp4) - _final(fp32)) / _final(fp32)
    assert abs(gap) <= MAX_LOSS_GAP, f"{variant}: final {_final(nvfp4):.4f} vs fp32 {_final(fp32):.4f} ({gap:+.2%})"
