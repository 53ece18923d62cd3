"""Delayed scaling: the amax-history roll and scale update (TE's rule), in plain
torch, and the mutating custom ops that run it: ``delayed_scaling_update``
(after forward and in backward) and ``delayed_scaling_flush`` (applies the
background amax reductions), so eager and compiled runs execute exactly these
operations. ``register_autograd`` refuses ops that mutate, so these are ops
of their own, called by the Linear around its forward and backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from transformer_linear import amax_reduction
from transformer_linear.reference import compute_scale, fp8_max

__all__ = [
    "AMAX_ALGOS",
    "FP8_STATE_COLUMNS",
    "checked_fp8_state",
    "delayed_scaling_flush",
    "delayed_scaling_update",
    "no_amax_yet",
    "update_delayed_scaling_",
]

# Columns of the (history_len, 3) amax history and the (3,) scale.
FP8_STATE_COLUMNS = {"input": 0, "weight": 1, "grad_output": 2}
AMAX_ALGOS = ("max", "most_recent")


def no_amax_yet(history: Tensor, scale: Tensor) -> Tensor:
    """Per column (a bool tensor): no amax has produced a scale yet (an empty history and the initial scale 1).

    Where this holds, ``DelayedScaling(first_step_just_in_time=True)``
    quantizes with a just-in-time scale from the tensor's own amax.

    The history alone cannot tell: an update clears the slot it just used, so
    a one-row history is empty again after every step, while the scale that
    step produced stays.
    """
    return history.eq(0).all(0) & scale.eq(1)


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


# ---------------------------------------------------------------------------
# delayed-scaling state update (mutating)
# ---------------------------------------------------------------------------


@torch.library.custom_op("transformer_linear::delayed_scaling_update", mutates_args=("amax_history", "scale"))
def _delayed_scaling_update_op(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    first: int,
    fp8_max: float,
    margin: int,
    amax_compute_algo: str,
    group: int = amax_reduction.NO_GROUP,
    layer_key: int = -1,
) -> None:
    update = (first, fp8_max, margin, amax_compute_algo)
    # The flush gets the whole buffer: it applies the update to the rows this one used.
    rows = amax_history.shape[0]
    if layer_key != -1 and amax_reduction.launch_amax_reduction(amax, group, layer_key, rows, *update):
        return  # applied by delayed_scaling_flush before the layer next reads its scales
    update_delayed_scaling_(amax_history, scale, amax_reduction.all_reduce_amax(amax, group), *update)


@_delayed_scaling_update_op.register_fake
def _(amax_history, scale, amax, first, fp8_max, margin, amax_compute_algo, group=amax_reduction.NO_GROUP, layer_key=-1):
    return None


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    first: int,
    dtype: torch.dtype,
    margin: int,
    algo: str,
    group: int = amax_reduction.NO_GROUP,
    layer_key: int = -1,
) -> None:
    """Record ``amax`` for columns ``first...`` and update their scales (scaling.py), in place.

    ``group`` (a amax_reduction.py key) all-reduces ``amax`` with MAX across ranks
    first: blocking when ``layer_key`` is -1, else launched asynchronously and
    applied by :func:`delayed_scaling_flush` with the same ``layer_key``.
    """
    _delayed_scaling_update_op(amax_history, scale, amax, first, fp8_max(dtype), margin, algo, group, layer_key)


@torch.library.custom_op("transformer_linear::delayed_scaling_flush", mutates_args=("amax_history", "scale"))
def _delayed_scaling_flush_op(amax_history: Tensor, scale: Tensor, layer_key: int) -> None:
    for amax, rows, *update in amax_reduction.pop_amax_reductions(layer_key):
        update_delayed_scaling_(amax_history[:rows], scale, amax, *update)


@_delayed_scaling_flush_op.register_fake
def _(amax_history, scale, layer_key):
    return None


def delayed_scaling_flush(amax_history: Tensor, scale: Tensor, layer_key: int) -> None:
    """Wait for the layer's launched amax reductions and apply their updates, in launch order, in place.

    ``amax_history`` is the layer's whole buffer; each update applies to the
    leading rows its recipe used.
    """
    _delayed_scaling_flush_op(amax_history, scale, layer_key)



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
