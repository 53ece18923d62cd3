"""What a NaN or an inf in a quantized tensor does under each recipe (README, "Non-finite inputs").

Every recipe: a NaN element stays NaN, an inf saturates to the format's max. The unit that shares
its scale with the element (the tensor, a block, a row) quantizes at scale 1 (current and block
scaling), or keeps the previous scale (delayed scaling); every other unit is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear import ops, recipe, reference
from transformer_linear.recipe.quantization import quantization_spec

E4M3 = torch.float8_e4m3fn
NAN_AT, INF_AT = (5, 10), (200, 140)
# recipe -> the input's block (rows, cols); None: a whole row.
BLOCK_RECIPES = {
    "block_1x128": (recipe.from_name("block"), (1, 128)),
    "block_128x128": (recipe.from_name("block", x_block_scaling_dim=2), (128, 128)),
    "mxfp8": (recipe.from_name("mxfp8"), (1, 32)),
    "mxfp8_floor": (recipe.from_name("mxfp8", e8m0_rounding="floor"), (1, 32)),
    "rowwise": (recipe.from_name("rowwise"), None),
}


def _inputs(rows: int = 256, cols: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, with a NaN at NAN_AT and +inf at INF_AT); clean holds 0 there."""
    clean = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 1e-3
    clean[NAN_AT] = clean[INF_AT] = 0
    bad = clean.clone()
    bad[NAN_AT], bad[INF_AT] = float("nan"), float("inf")
    return clean, bad


def _scale_inv_float(scale_inv: torch.Tensor) -> torch.Tensor:
    return reference.e8m0_to_float(scale_inv) if scale_inv.dtype == torch.float8_e8m0fnu else scale_inv.float()


def _check_layout(data, scale_inv, clean_data, clean_scale_inv, x_bad, block, specials) -> None:
    """In one layout: the blocks holding a special quantize at scale 1, the others as without it."""
    bm, bk = block
    scale_inv_f, clean_f = _scale_inv_float(scale_inv), _scale_inv_float(clean_scale_inv)
    hit = torch.zeros_like(scale_inv_f, dtype=torch.bool)
    for r, c in specials:
        hit[r // bm, c // bk] = True
    assert (scale_inv_f[hit] == 1).all(), "a block holding a NaN or inf has scale 1"
    assert_bitwise_equal(scale_inv_f[~hit], clean_f[~hit], "the other blocks' scales")
    element_hit = hit.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: data.shape[0], : data.shape[1]]
    limit = reference.fp8_max(data.dtype)
    at_scale_1 = torch.clamp(x_bad, -limit, limit).to(data.dtype)  # NaN stays NaN, inf saturates
    assert_bitwise_equal(data[element_hit], at_scale_1[element_hit], "the hit blocks' data", any_nan=True)
    assert_bitwise_equal(data[~element_hit], clean_data[~element_hit], "the other blocks' data")


@pytest.mark.parametrize("name", list(BLOCK_RECIPES))
def test_block_recipes_quantize_the_block_of_a_nan_or_inf_at_scale_1(name):
    """Float8BlockScaling (1x128 / 128x128 blocks), MXFP8BlockScaling (1x32), Float8RowwiseScaling (rows),
    in both layouts the Linear reads (the columnwise copy: the transpose with its own blocks)."""
    r, block = BLOCK_RECIPES[name]
    clean, bad = _inputs()
    quantizer = quantization_spec(r).input
    got = quantizer.quantize(bad, rowwise=True, columnwise=True)
    expected = quantizer.quantize(clean, rowwise=True, columnwise=True)
    # Rowwise: whole rows of x and of its transpose; the others: the same block in both layouts.
    block, block_t = (block, block) if block else ((1, bad.shape[1]), (1, bad.shape[0]))
    _check_layout(got.data, got.scale_inv, expected.data, expected.scale_inv, bad, block, [NAN_AT, INF_AT])
    transposed = [(c, r) for r, c in (NAN_AT, INF_AT)]
    _check_layout(got.data_t, got.scale_inv_t, expected.data_t, expected.scale_inv_t, bad.t(), block_t, transposed)


def test_current_scaling_quantizes_the_tensor_at_scale_1():
    clean, bad = _inputs()
    q, scale_inv, amax = ops.quantize_current(bad, E4M3)
    assert amax.isnan() and scale_inv.item() == 1
    assert_bitwise_equal(q, torch.clamp(bad, -448, 448).to(E4M3), "data at scale 1", any_nan=True)


def test_delayed_scaling_keeps_the_scale_while_the_amax_window_holds_a_nan_or_inf():
    """The step quantizes with the scale it had; its NaN amax enters the history, and the scale stays
    as it was for amax_history_len updates (a non-finite window max keeps the old scale)."""
    history_len = 3
    layer = tl.Linear(256, 8, recipe=recipe.DelayedScaling(amax_history_len=history_len))
    clean, bad = _inputs()
    layer(clean)
    scale = layer.fp8_scale.clone()
    y = layer(bad)
    # The NaN's row of the output is NaN; the inf saturated, so its row stays finite.
    assert y[NAN_AT[0]].isnan().all() and torch.isfinite(y[torch.arange(len(y)) != NAN_AT[0]]).all()
    assert layer.fp8_amax_history[:, 0].isnan().any()
    assert_bitwise_equal(layer.fp8_scale, scale, "scale after the NaN step")
    for _ in range(history_len - 1):
        layer(clean * 2)
        assert_bitwise_equal(layer.fp8_scale, scale, "scale while the window holds the NaN")
    layer(clean * 2)
    assert_bitwise_equal(layer.fp8_scale[1:], scale[1:], "weight scale")
    assert layer.fp8_scale[0] != scale[0], "the window moved past the NaN: the input scale updates"
