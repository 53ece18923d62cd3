"""tl.quantized_model_init on tl.GroupedLinear: the (num_gemms, out, in) weight Parameter holds only the
recipe's quantized form, each expert with its own scales (as the grouped forward quantizes it).

The forward and backward read it as they read a plain module's freshly quantized weights (bitwise the
same results); tl.optim.MasterWeights steps fp32 masters with a stock AdamW and requantizes, training bit
for bit as the plain module where the initial weight is preserved as the master (all recipes but delayed
scaling); state_dict saves the dequantized weight, which loads into a plain GroupedLinear, and loading
quantizes back into the same Parameter.
"""

import copy
import functools

import pytest
import torch
import torch._dynamo
from recipe_tables import ONE_PER_CLASS, SCALES_FROM_HISTORY
from torch import nn

import transformer_linear as tl
from transformer_linear.modules import quantized_init
from transformer_linear.modules.quantized_init import QuantizedWeight

G, K, N, T = 4, 128, 64, 96
SIZES = [40, 8, 0, 48]
NAMES = [name for name in ONE_PER_CLASS if name not in SCALES_FROM_HISTORY]
"""The recipes whose initial weight is preserved as the master (not delayed scaling's)."""
RECIPES = {name: functools.partial(tl.recipe.from_name, name) for name in ONE_PER_CLASS}


def _pair(name, preserve=True):
    """(plain module, module built under quantized_model_init) from the same random numbers."""
    rec = RECIPES[name]()
    torch.manual_seed(0)
    plain = tl.GroupedLinear(G, K, N, recipe=rec)
    torch.manual_seed(0)
    with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=preserve):
        quantized = tl.GroupedLinear(G, K, N, recipe=rec)
    return plain, quantized


def _bits(t):
    return t.view(torch.uint8)


def _step(module, x, g):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, SIZES)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("name", ONE_PER_CLASS)
def test_parameter_bytes(name):
    plain, quantized = _pair(name)
    assert isinstance(quantized.weight, QuantizedWeight) and quantized.weight.shape == (G, N, K)
    assert quantized.weight.dtype == torch.float32
    ratio = tl.quantized_weight_bytes(quantized) / tl.quantized_weight_bytes(plain)
    # One stored FP8 copy (tensorwise, 128x128 blocks) or FP4 with its columnwise copy; else both FP8 usages.
    assert ratio <= (0.3 if name in ("current", "delayed", "block", "nvfp4") else 0.55), ratio
    assert torch.equal(quantized.weight.dequantize(), quantized.weight.dequantize())


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_match_the_plain_module(name):
    plain, quantized = _pair(name)
    torch.manual_seed(1)
    x, g = torch.randn(T, K), torch.randn(T, N)
    torch.manual_seed(2)
    want = _step(plain, x, g)
    torch.manual_seed(2)
    got = _step(quantized, x, g)
    for what, a, b in zip(("out", "dgrad", "wgrad"), got, want):
        assert torch.equal(a, b), f"{name} {what}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("name", NAMES)
def test_stored_weight_is_each_experts_quantization(name):
    """Each expert's stored rowwise data is what its quantizer makes of that expert's weight alone."""
    plain, quantized = _pair(name)
    q = quantized.weight.quantizer
    for e in range(G):
        alone = q.quantize(plain.weight[e].detach().contiguous(), rowwise=True)
        assert torch.equal(_bits(quantized.weight.weight_fp8[e]), _bits(alone.data)), e
        expert_scale = quantized.weight.weight_scale_inv[e].reshape(alone.scale_inv.shape)
        assert torch.equal(expert_scale.float(), alone.scale_inv.float()), e


def _train(module, rec, batches, master_weights):
    if master_weights:
        masters = tl.optim.MasterWeights(module)
        opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
        masters.attach(opt)
    else:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(module(x, SIZES), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preserve", [True, False], ids=["preserved_init", "dequantized_init"])
@pytest.mark.parametrize("name", ONE_PER_CLASS)
def test_training_matches_the_plain_module(name, preserve):
    torch.manual_seed(3)
    batches = [(torch.randn(T, K), torch.randn(T, N)) for _ in range(4)]
    plain, quantized = _pair(name, preserve)
    rec = RECIPES[name]()
    torch.manual_seed(4)  # NVFP4's stochastic rounding seeds come from the generator
    want = _train(plain, rec, batches, master_weights=False)
    torch.manual_seed(4)
    got = _train(quantized, rec, batches, master_weights=True)
    assert isinstance(quantized.weight, QuantizedWeight)
    if preserve and name != "delayed":
        assert got == want  # the same quantizer on the same master weights
    else:
        # A master started from the dequantized weight (one FP8 / FP4 rounding away), or delayed scaling's
        # own-amax weight scale.
        torch.testing.assert_close(got, want, rtol=0.05 if name == "nvfp4" else 0.02, atol=0.0)
    assert got[-1] < got[0]


@pytest.mark.parametrize("name", ["current", "block", "nvfp4"])
def test_state_dict_round_trip_with_a_plain_module(name):
    _, quantized = _pair(name)
    sd = quantized.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    plain = tl.GroupedLinear(G, K, N, recipe=RECIPES[name]())
    plain.load_state_dict(sd)
    assert torch.equal(plain.weight, quantized.weight.dequantize())
    assert torch.equal(plain.bias, quantized.bias)
    # Back: new weights are quantized into the same Parameter.
    torch.manual_seed(5)
    fresh = tl.GroupedLinear(G, K, N)
    weight = quantized.weight
    quantized.load_state_dict(fresh.state_dict())
    assert quantized.weight is weight
    expected = quantized_init.quantize_weight(weight.quantizer, fresh.weight)
    assert torch.equal(_bits(weight.weight_fp8), _bits(expected.weight_fp8))


def test_reset_parameters_and_in_place_init_quantize():
    _, quantized = _pair("current")
    weight = quantized.weight
    torch.manual_seed(6)
    quantized.reset_parameters()
    torch.manual_seed(6)
    reference = tl.GroupedLinear(G, K, N)
    assert quantized.weight is weight
    assert torch.equal(weight.dequantize(), quantized_init.dequantize_weight(
        weight.quantizer, quantized_init.quantize_weight(weight.quantizer, reference.weight), torch.float32))
    nn.init.zeros_(quantized.weight)
    assert not weight.dequantize().any()


@pytest.fixture
def fresh_dynamo():
    """Each compiled module's graphs dropped afterwards: GroupedLinear.forward is one code object for every
    module, and dynamo's recompile limit counts its graphs across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["current", "block"])
def test_fullgraph(name):
    _, quantized = _pair(name)
    x = torch.randn(T, K, requires_grad=True)
    splits = torch.tensor(SIZES)
    compiled = torch.compile(quantized, fullgraph=True, backend="aot_eager")
    out = compiled(x, splits)
    out.sum().backward()
    grad_w, grad_x = quantized.weight.grad.clone(), x.grad.clone()
    quantized.weight.grad, x.grad = None, None
    eager = quantized(x, splits)
    eager.sum().backward()
    assert torch.equal(out, eager)
    assert torch.equal(grad_w, quantized.weight.grad) and torch.equal(grad_x, x.grad)


def test_deepcopy_keeps_the_quantized_weight():
    _, quantized = _pair("block")
    clone = copy.deepcopy(quantized)
    assert isinstance(clone.weight, QuantizedWeight) and clone.weight is not quantized.weight
    assert torch.equal(clone.weight.dequantize(), quantized.weight.dequantize())


def test_backward_override():
    """dequantized reads the stored weight; high_precision would need the weight it does not keep."""
    for mode, plain_out in (("dequantized", None), ("high_precision", None)):
        rec = tl.recipe.Float8CurrentScaling(backward_override=mode)
        torch.manual_seed(0)
        plain = tl.GroupedLinear(G, K, N, recipe=rec)
        torch.manual_seed(0)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
            quantized = tl.GroupedLinear(G, K, N, recipe=rec)
        x, g = torch.randn(T, K), torch.randn(T, N)
        if mode == "high_precision":
            with pytest.raises(ValueError, match="backward_override='high_precision'"):
                quantized(x, SIZES)
            continue
        want, got = _step(plain, x, g), _step(quantized, x, g)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_recipe_mismatch_raises():
    with tl.quantized_model_init(recipe=tl.recipe.Float8CurrentScaling()):
        quantized = tl.GroupedLinear(G, K, N, recipe=tl.recipe.Float8BlockScaling())
    with pytest.raises(ValueError, match="quantizes it as"):
        quantized(torch.randn(T, K), SIZES)
