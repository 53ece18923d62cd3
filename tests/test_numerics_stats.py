"""The numerics report's statistics on cases with known answers."""

import math

import pytest
import torch

from transformer_linear import reference
from transformer_linear.numerics import max_relative_error, range_stats, sqnr
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_identical_tensors_have_infinite_sqnr_and_zero_error():
    x = torch.randn(64, 32)
    assert sqnr(x, x.clone()) == math.inf
    assert max_relative_error(x, x.clone()) == 0.0


def test_sqnr_of_known_noise():
    x = torch.ones(1000)
    # noise norm is 1% of the signal norm: exactly 40 dB
    assert sqnr(x * 1.01, x) == pytest.approx(40.0, abs=1e-3)
    assert max_relative_error(x * 1.01, x) == pytest.approx(0.01, rel=1e-4)


def test_non_finite_values_give_nan_sqnr():
    x = torch.randn(8)
    y = x.clone()
    y[3] = float("nan")
    assert math.isnan(sqnr(y, x))


@pytest.mark.parametrize("dtype", FORMATS)
def test_values_beyond_fp8_max_report_saturation(dtype):
    limit = reference.fp8_max(dtype)
    x = torch.full((100,), limit / 2)
    x[:25] = limit * 4  # a quarter of the elements overflow at scale 1
    stats = range_stats(x, dtype, 1.0)
    assert stats["saturation"] == pytest.approx(0.25)
    assert stats["underflow"] == 0.0
    assert stats["amax"] == pytest.approx(limit * 4)


@pytest.mark.parametrize("dtype", FORMATS)
def test_tiny_values_report_underflow(dtype):
    tiny = float(torch.finfo(dtype).smallest_normal) * 2.0**-6  # below the subnormal range
    x = torch.ones(100)
    x[:10] = tiny
    x[10:20] = 0.0  # exact zeros are not underflow
    stats = range_stats(x, dtype, 1.0)
    assert stats["underflow"] == pytest.approx(0.10)
    assert stats["saturation"] == 0.0


def test_empty_tensor_stats():
    stats = range_stats(torch.empty(0), torch.float8_e4m3fn, 1.0)
    assert stats == {"amax": 0.0, "scale": 1.0, "underflow": 0.0, "saturation": 0.0}


def test_builtin_model_and_data_are_deterministic():
    cfg = GPTConfig.named("tiny")
    a, b = SyntheticText(cfg, seed=3).batch(4), SyntheticText(cfg, seed=3).batch(4)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    loss = lm_loss(TinyGPT(cfg)(a), a)
    assert math.isfinite(loss.item()) and loss.item() > 0


@pytest.mark.parametrize("bad", [dict(d_model=30, n_heads=4), dict(n_layers=0), dict(vocab_size=2.5)])
def test_bad_model_config_is_a_value_error(bad):
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**bad)


def test_unknown_model_size_is_a_value_error():
    with pytest.raises(ValueError, match="unknown model size"):
        GPTConfig.named("huge")
