"""Delayed scaling: the amax-history roll and scale update (TE's rule), in plain torch.

Called by the ``transformer_linear::delayed_scaling_update`` custom op
(linear_ops.py) so eager and compiled runs execute exactly these operations.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear.reference import compute_scale

__all__ = ["AMAX_ALGOS", "FP8_STATE_COLUMNS", "checked_fp8_state", "update_delayed_scaling_"]

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


def checked_fp8_state(
    history: Optional[torch.Tensor], scale: Optional[torch.Tensor], prefix: str = ""
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A loaded delayed-scaling state as float32, after checking it (absent parts stay None).

    Args:
        history: ``fp8_amax_history``: (history_len >= 1, 3), any real dtype.
        scale: ``fp8_scale``: (3,), every value finite and positive (a scale of
            0, inf or NaN would make every later output non-finite).
        prefix: the keys' prefix, for the error message.

    Raises:
        ValueError: a wrong shape or type, or a bad scale, naming the key.
    """
    names = {"fp8_amax_history": history, "fp8_scale": scale}
    for name, t in names.items():
        if t is not None and (not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool):
            raise ValueError(f"load_state_dict: '{prefix}{name}' must be a real tensor, got {_describe(t)}")
    if history is not None and (history.dim() != 2 or history.shape[0] < 1 or history.shape[1] != len(FP8_STATE_COLUMNS)):
        raise ValueError(
            f"load_state_dict: '{prefix}fp8_amax_history' must have shape (history_len >= 1, 3), "
            f"got {list(history.shape)}"
        )
    if scale is not None:
        if tuple(scale.shape) != (len(FP8_STATE_COLUMNS),):
            raise ValueError(f"load_state_dict: '{prefix}fp8_scale' must have shape (3,), got {list(scale.shape)}")
        scale = scale.to(torch.float32)
        if not bool(((scale > 0) & torch.isfinite(scale)).all()):
            raise ValueError(
                f"load_state_dict: '{prefix}fp8_scale' must hold finite positive scales, got {scale.tolist()}; "
                f"drop the '{prefix}fp8_amax_history' and '{prefix}fp8_scale' keys to start the FP8 state fresh"
            )
    return (history.to(torch.float32) if history is not None else None), scale


def _describe(t: object) -> str:
    return f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
