"""tl.Linear's FP8 numerics against torch.nn.Linear (same init, same inputs), and a
short training run against the fp32 loss curve."""

import math

import pytest
import torch
from recipe_tables import BLOCK_NAMES
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from tolerances import sqnr

# The one threshold table: for each recipe and format, per compared tensor,
# (minimum SQNR in dB, maximum relative error = max|a - r| / max|r|) against
# nn.Linear in fp32. Input and weight are e4m3 (3 mantissa bits: ~31 dB each,
# ~28 dB for their product); gradients are e5m2 under HYBRID (2 bits: ~25 dB)
# and e4m3 under E4M3. The bias gradient is summed from the unquantized
# grad_output in fp32. Measured minima over 5 seeds at 128x256x128: output
# 28.6 dB / 0.046, HYBRID grads 24.5 dB / 0.069, E4M3 grads 28.5 dB / 0.040;
# the thresholds leave ~2.5 dB.
_E4M3_GRADS = {"output": (26.0, 0.08), "input grad": (26.0, 0.08), "weight grad": (26.0, 0.08), "bias grad": (100.0, 1e-5)}
_HYBRID_GRADS = {"output": (26.0, 0.08), "input grad": (22.0, 0.12), "weight grad": (22.0, 0.12), "bias grad": (100.0, 1e-5)}
THRESHOLDS = {
    ("current", recipe.Format.HYBRID): _HYBRID_GRADS,
    ("current", recipe.Format.E4M3): _E4M3_GRADS,
    ("delayed", recipe.Format.HYBRID): _HYBRID_GRADS,
    ("delayed", recipe.Format.E4M3): _E4M3_GRADS,
}
# The 3-layer MLP's FP8 loss may differ from fp32's by this fraction at any of its 50 steps.
MLP_LOSS_TOLERANCE = 0.03


# Block recipes (tests/test_linear_block_recipes.py has their own numerics tests); stateless like current.
_BLOCK_RECIPES = tuple(BLOCK_NAMES)


def _make_recipe(kind, fmt):
    history = {"amax_history_len": 16} if kind == "delayed" else {}
    return recipe.from_name(kind, fp8_format=fmt, **history)


def assert_fp8_close(actual, expected, thresholds, what):
    """SQNR and max relative error of ``actual`` vs the high-precision ``expected``."""
    min_db, max_rel = thresholds[what]
    db = sqnr(actual, expected)
    denom = expected.double().abs().max().item()
    rel = (actual.double() - expected.double()).abs().max().item() / denom if denom else 0.0
    assert db >= min_db and rel <= max_rel, (
        f"{what}: SQNR {db:.1f} dB (min {min_db}), max relative error {rel:.3g} (max {max_rel})"
    )


@pytest.mark.parametrize("kind, fmt", list(THRESHOLDS))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_nn_linear(kind, fmt, seed):
    torch.manual_seed(seed)
    ref = nn.Linear(256, 128)
    layer = tl.Linear(256, 128, recipe=_make_recipe(kind, fmt))
    layer.load_state_dict(ref.state_dict())
    x, grad = torch.randn(4, 32, 256), torch.randn(4, 32, 128)
    for _ in range(2):  # the second step runs delayed scaling on real scales
        results = []
        for module in (layer, ref):
            module.zero_grad()
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(grad)
            results.append((y, xi.grad, module.weight.grad, module.bias.grad))
    for what, actual, expected in zip(("output", "input grad", "weight grad", "bias grad"), *results):
        assert_fp8_close(actual, expected, THRESHOLDS[(kind, fmt)], what)


def _train_mlp(r, steps=50):
    """A Gaussian teacher-student regression with a 3-layer MLP; returns the loss curve."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 8, generator=gen) / math.sqrt(32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    if r is not None:
        tl.convert_to_fp8(model, recipe=r)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 32, generator=gen)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher * 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.fixture(scope="module")
def fp32_losses():
    return _train_mlp(None)


# DelayedScaling with E4M3 gradients is left out: its first backward quantizes
# with the initial scale 1, where small gradients underflow e4m3 (2^-9), so
# Adam's first step is lost and the run trails fp32 by a step (TE behaves the same).
@pytest.mark.parametrize(
    "kind, fmt",
    [
        ("current", recipe.Format.HYBRID),
        ("current", recipe.Format.E4M3),
        ("delayed", recipe.Format.HYBRID),
        *((kind, recipe.Format.E4M3) for kind in _BLOCK_RECIPES),
        ("block", recipe.Format.HYBRID),
    ],
)
def test_mlp_training_follows_fp32_loss_curve(kind, fmt, fp32_losses):
    fp32 = fp32_losses
    fp8 = _train_mlp(_make_recipe(kind, fmt))
    assert fp32[-1] < 0.5 * fp32[0], "the fp32 run must learn for the comparison to mean anything"
    deviation = ((fp8 - fp32).abs() / fp32).max().item()
    assert deviation <= MLP_LOSS_TOLERANCE, f"FP8 loss deviates by up to {deviation:.1%} from fp32's"
    final = abs(fp8[-1] - fp32[-1]).item() / fp32[-1].item()
    assert final <= 0.01, f"final FP8 loss deviates by {final:.2%} from fp32's"
