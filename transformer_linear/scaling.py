"""Delayed scaling: the amax-history roll and scale update (TE's rule), in plain torch.

Called by the ``transformer_linear::delayed_scaling_update`` custom op
(linear_ops.py) so eager and compiled runs execute exactly these operations.
"""

from __future__ import annotations

import torch

from transformer_linear.reference import compute_scale

__all__ = ["AMAX_ALGOS", "FP8_STATE_COLUMNS", "update_delayed_scaling_"]

# Columns of the (history_len, 3) amax history and the (3,) scale.
FP8_STATE_COLUMNS = {"input": 0, "weight": 1, "grad_output": 2}
AMAX_ALGOS = ("max", "most_recent")


def update_delayed_scaling_(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    first: int,
    fp8_max: float,
    margin: int,
    amax_compute_algo: str,
) -> None:
    """Record ``amax`` in the history, update the scales, roll the history. In place.

    Row 0 of the history is the current step's slot. The scale becomes
    ``compute_scale(max over the history (or row 0), fp8_max, margin)``,
    keeping the old scale where that amax is 0 or non-finite; then the
    history rolls by one and row 0 is cleared for the next step.

    Args:
        amax_history: (history_len, columns) float32.
        scale: (columns,) float32.
        amax: this step's amaxes of columns ``first, first + 1, ...``.
        first: the first column updated.
        fp8_max: the largest value of these columns' FP8 format.
        margin: the recipe's power-of-two head room.
        amax_compute_algo: ``"max"`` or ``"most_recent"``.
    """
    if amax_compute_algo not in AMAX_ALGOS:
        raise ValueError(f"delayed_scaling_update: 'amax_compute_algo' must be one of {AMAX_ALGOS}, got {amax_compute_algo!r}")
    n = amax.numel()
    history = amax_history[:, first : first + n]
    columns = scale[first : first + n]
    history[0].copy_(amax.reshape(n))
    reduced = history.amax(dim=0) if amax_compute_algo == "max" else history[0].clone()
    columns.copy_(compute_scale(reduced, fp8_max, margin, fallback=columns))
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()
