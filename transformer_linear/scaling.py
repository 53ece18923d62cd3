"""Delayed scaling: the amax-history roll and scale update (TE's rule), in plain
torch, and the mutating custom ops that run it: ``delayed_scaling_update``
(after forward and in backward) and ``delayed_scaling_flush`` (applies the
background amax reductions), so eager and compiled runs execute exactly these
operations. ``register_autograd`` refuses ops that mutate, so these are ops
of their own, called by the Linear around its forward and backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from transformer_linear import amax_reduction
from transformer_linear.reference import compute_scale, fp8_max

__all__ = [
    "AMAX_ALGOS",
    "BACKWARD_STATE",
    "FORWARD_STATE",
    "FP8_STATES",
    "FP8_STATE_COLUMNS",
    "DelayedScalingState",
    "checked_fp8_state",
    "delayed_scaling_flush",
    "delayed_scaling_update",
    "flushed_state",
    "no_amax_yet",
    "update_delayed_scaling_",
]

# Columns of the scales a forward used, ``fp8_fwd_scale`` (3,); input and weight are also the
# columns of the forward state (FORWARD_STATE), grad_output the one column of the backward state.
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
    direction: str = "forward",
) -> None:
    update = (first, fp8_max, margin, amax_compute_algo)
    # The flush gets the whole buffer: it applies the update to the rows this one used.
    rows = amax_history.shape[0]
    if layer_key != -1 and amax_reduction.launch_amax_reduction(amax, group, layer_key, direction, rows, *update):
        return  # applied by delayed_scaling_flush before the state is next updated
    update_delayed_scaling_(amax_history, scale, amax_reduction.all_reduce_amax(amax, group), *update)


@_delayed_scaling_update_op.register_fake
def _(amax_history, scale, amax, first, fp8_max, margin, amax_compute_algo, group=-1, layer_key=-1, direction="forward"):
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
    direction: str = "forward",
) -> None:
    """Record ``amax`` for columns ``first...`` and update their scales (scaling.py), in place.

    ``group`` (a amax_reduction.py key) all-reduces ``amax`` with MAX across ranks
    first: blocking when ``layer_key`` is -1, else launched asynchronously and
    applied by :func:`delayed_scaling_flush` with the same ``layer_key`` and
    ``direction`` (which of the layer's states, ``"forward"`` or ``"backward"``,
    this one is).
    """
    _delayed_scaling_update_op(
        amax_history, scale, amax, first, fp8_max(dtype), margin, algo, group, layer_key, direction
    )


def _apply_reductions(amax_history: Tensor, scale: Tensor, reductions: list[tuple]) -> None:
    for amax, rows, *update in reductions:
        update_delayed_scaling_(amax_history[:rows], scale, amax, *update)


@torch.library.custom_op("transformer_linear::delayed_scaling_flush", mutates_args=("amax_history", "scale"))
def _delayed_scaling_flush_op(amax_history: Tensor, scale: Tensor, layer_key: int, direction: str = "forward") -> None:
    _apply_reductions(amax_history, scale, amax_reduction.pop_amax_reductions(layer_key, direction))


@_delayed_scaling_flush_op.register_fake
def _(amax_history, scale, layer_key, direction="forward"):
    return None


def delayed_scaling_flush(amax_history: Tensor, scale: Tensor, layer_key: int, direction: str = "forward") -> None:
    """Wait for the layer's launched amax reductions of ``direction``'s state and apply their updates,
    in launch order, in place.

    ``amax_history`` is the layer's whole buffer; each update applies to the
    leading rows its recipe used.
    """
    _delayed_scaling_flush_op(amax_history, scale, layer_key, direction)


def flushed_state(amax_history: Tensor, scale: Tensor, layer_key: int, direction: str) -> tuple[Tensor, Tensor]:
    """The state as :func:`delayed_scaling_flush` would leave it, without changing it: copies with the
    pending updates applied, or the tensors themselves when none are pending.

    For use inside an op: the forward reads the grad_output state, which only
    the backward may update (see linear.py).
    """
    reductions = amax_reduction.peek_amax_reductions(layer_key, direction) if layer_key != -1 else []
    if not reductions:
        return amax_history, scale
    amax_history, scale = amax_history.clone(), scale.clone()
    _apply_reductions(amax_history, scale, reductions)
    return amax_history, scale


# ---------------------------------------------------------------------------
# the state as saved in a checkpoint
# ---------------------------------------------------------------------------


class DelayedScalingState(NamedTuple):
    """One of a layer's two delayed-scaling states: buffer names and the tensors of its columns."""

    history_key: str
    scale_key: str
    columns: tuple[str, ...]


FORWARD_STATE = DelayedScalingState("fp8_amax_history", "fp8_scale", ("input", "weight"))
"""Updated by forward: the input's and weight's amax history (rows, 2) and scales (2,)."""
BACKWARD_STATE = DelayedScalingState("fp8_grad_amax_history", "fp8_grad_scale", ("grad_output",))
"""Updated by backward: grad_output's amax history (rows, 1) and scale (1,)."""
FP8_STATES = {"forward": FORWARD_STATE, "backward": BACKWARD_STATE}


def checked_fp8_state(state_dict: dict, prefix: str = "") -> bool:
    """Check a loaded delayed-scaling state and make it float32, in ``state_dict`` (which it may change).

    A state in the earlier layout, ``fp8_amax_history`` (rows, 3) and
    ``fp8_scale`` (3,) with columns [input, weight, grad_output] and no
    grad_output keys, is split into the two states first.

    Args:
        state_dict: the dict ``_load_from_state_dict`` got.
        prefix: the layer's key prefix.

    Returns:
        Whether any delayed-scaling key is present.

    Raises:
        ValueError: a wrong shape or type, or a bad scale (0, inf or NaN would
            make every later output non-finite), naming the key.
    """
    for state in FP8_STATES.values():
        for key in (state.history_key, state.scale_key):
            t = state_dict.get(prefix + key)
            if t is not None and (not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"load_state_dict: '{prefix}{key}' must be a real tensor, got {_describe(t)}")
    _split_three_column_state(state_dict, prefix)
    present = False
    for state in FP8_STATES.values():
        width = len(state.columns)
        history, scale = (state_dict.get(prefix + key) for key in (state.history_key, state.scale_key))
        if history is not None:
            if history.dim() != 2 or history.shape[0] < 1 or history.shape[1] != width:
                raise ValueError(
                    f"load_state_dict: '{prefix}{state.history_key}' must have shape (history_len >= 1, {width}), "
                    f"got {list(history.shape)}"
                )
            state_dict[prefix + state.history_key] = history.to(torch.float32)
        if scale is not None:
            if tuple(scale.shape) != (width,):
                raise ValueError(
                    f"load_state_dict: '{prefix}{state.scale_key}' must have shape ({width},), got {list(scale.shape)}"
                )
            state_dict[prefix + state.scale_key] = _usable_scale(scale, prefix, state)
        present = present or history is not None or scale is not None
    return present


def _split_three_column_state(state_dict: dict, prefix: str) -> None:
    fwd, bwd = FORWARD_STATE, BACKWARD_STATE
    if any(prefix + key in state_dict for key in (bwd.history_key, bwd.scale_key)):
        return
    history, scale = state_dict.get(prefix + fwd.history_key), state_dict.get(prefix + fwd.scale_key)
    three = len(fwd.columns) + len(bwd.columns)
    old_history = isinstance(history, torch.Tensor) and history.dim() == 2 and history.shape[1] == three
    old_scale = isinstance(scale, torch.Tensor) and tuple(scale.shape) == (three,)
    if not (old_history or old_scale):
        return
    split = len(fwd.columns)
    if old_scale:
        scale = _usable_scale(scale, prefix, fwd)  # the error names the key the checkpoint has
    if old_history:
        state_dict[prefix + fwd.history_key], state_dict[prefix + bwd.history_key] = history[:, :split], history[:, split:]
    if old_scale:
        state_dict[prefix + fwd.scale_key], state_dict[prefix + bwd.scale_key] = scale[:split], scale[split:]


def _usable_scale(scale: Tensor, prefix: str, state: DelayedScalingState) -> Tensor:
    """``scale`` as float32, if every value is finite and positive."""
    scale = scale.to(torch.float32)
    if not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError(
            f"load_state_dict: '{prefix}{state.scale_key}' must hold finite positive scales, got "
            f"{scale.tolist()}; drop the '{prefix}{state.history_key}' and '{prefix}{state.scale_key}' "
            f"keys to start the FP8 state fresh"
        )
    return scale


def _describe(t: object) -> str:
    return f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
