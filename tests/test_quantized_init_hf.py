"""``tl.quantized_model_init`` around ``tl.convert_to_fp8`` of a ``transformers`` model: the output layer tied to
the embedding stays tied (a plain Parameter both hold, named in a warning), GPT-2's ``Conv1D`` layers keep FP8
weights (their forward reads the stored columnwise copy as the (out, in) weight's rowwise one), the logits are
bitwise those of the same model converted without it, and after training through ``tl.optim.MasterWeights``,
``save_pretrained`` writes one tied tensor a vanilla ``from_pretrained`` loads tied."""

from __future__ import annotations

import pytest
import torch

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.convert import Conv1DLinear
from transformer_linear.modules.quantized_init import QuantizedWeight

transformers = pytest.importorskip("transformers")

RECIPES = ["current", "delayed", "block", "mxfp8", "nvfp4"]


def _model(kind):
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    else:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=32, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config).eval()  # no dropout


def _output_and_embedding(model):
    return model.get_output_embeddings(), model.get_input_embeddings()


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_ties_kept_and_conv1d_quantized(kind, name):
    r = recipe.from_name(name)
    plain = tl.convert_to_fp8(_model(kind))
    model = _model(kind)
    params = len(list(model.parameters()))
    with tl.quantized_model_init(recipe=r), pytest.warns(UserWarning, match="tied.*lm_head"):
        tl.convert_to_fp8(model)
    lm_head, embedding = _output_and_embedding(model)
    assert lm_head.weight is embedding.weight, f"{kind}: the output layer's weight is no longer the embedding's"
    assert len(list(model.parameters())) == params
    assert type(lm_head.weight) is torch.nn.Parameter
    layers = [m for m in model.modules() if isinstance(m, tl.Linear) and m is not lm_head]
    assert layers and all(isinstance(m.weight, QuantizedWeight) for m in layers), f"{kind}: plain weights left"
    assert (kind == "gpt2") == any(isinstance(m, Conv1DLinear) for m in layers)
    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), tl.autocast(recipe=r):
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{kind}, {name}: logits with FP8 weights")


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_trained_fp8_weights_save_tied(tmp_path, kind):
    r = recipe.from_name("current")
    model = _model(kind)
    with tl.quantized_model_init(recipe=r), pytest.warns(UserWarning, match="tied"):
        tl.convert_to_fp8(model, recipe=r)
    masters = tl.optim.MasterWeights(model)
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
    masters.attach(opt)
    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    embedding_before = model.get_input_embeddings().weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    lm_head, embedding = _output_and_embedding(model)
    assert lm_head.weight is embedding.weight and not torch.equal(embedding.weight.detach(), embedding_before)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    loaded_head, loaded_embedding = _output_and_embedding(loaded)
    assert loaded_head.weight is loaded_embedding.weight
    assert torch.equal(loaded_embedding.weight, embedding.weight.detach())
    saved = dict(model.state_dict())
    for fqn, m in model.named_modules():
        if isinstance(m, Conv1DLinear):
            # Conv1D's (in, out) orientation, dequantized: what vanilla Conv1D loads.
            assert torch.equal(dict(loaded.named_parameters())[f"{fqn}.weight"], saved[f"{fqn}.weight"])
