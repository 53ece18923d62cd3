"""Delayed scaling's rules, in plain torch: the amax-history roll and scale
update (TE's rule), the test for a column that has seen no amax yet, the
buffers of a layer's two states and the checks of a loaded checkpoint.

The layer's ``DelayedScalingState`` (delayed_scaling.py) applies them, through
custom ops where they mutate its buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from transformer_linear.recipe import AMAX_COMPUTE_ALGOS
from transformer_linear.reference import compute_scale, fp8_max

__all__ = [
    "BACKWARD_STATE",
    "FORWARD_STATE",
    "FP8_STATES",
    "FP8_STATE_COLUMNS",
    "Fp8StateBuffers",
    "checked_fp8_state",
    "no_amax_yet",
    "update_delayed_scaling_",
]

# Columns of the scales a forward used, ``fp8_fwd_scale`` (3,); input and weight are also the
# columns of the forward state (FORWARD_STATE), grad_output the one column of the backward state.
FP8_STATE_COLUMNS = {"input": 0, "weight": 1, "grad_output": 2}


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
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"delayed_scaling_update: 'amax_compute_algo' must be one of {AMAX_COMPUTE_ALGOS}, got {amax_compute_algo!r}")
    n = amax.numel()
    history = amax_history[:, first : first + n]
    columns = scale[first : first + n]
    history[0].copy_(amax.reshape(n))
    reduced = history.amax(dim=0) if amax_compute_algo == "max" else history[0].clone()
    columns.copy_(compute_scale(reduced, fp8_max, margin, fallback=columns))
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()


# ---------------------------------------------------------------------------
# the state as saved in a checkpoint
# ---------------------------------------------------------------------------


class Fp8StateBuffers(NamedTuple):
    """One of a layer's two delayed-scaling states: buffer names and the tensors of its columns."""

    history_key: str
    scale_key: str
    columns: tuple[str, ...]


FORWARD_STATE = Fp8StateBuffers("fp8_amax_history", "fp8_scale", ("input", "weight"))
"""Updated by forward: the input's and weight's amax history (rows, 2) and scales (2,)."""
BACKWARD_STATE = Fp8StateBuffers("fp8_grad_amax_history", "fp8_grad_scale", ("grad_output",))
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


def _usable_scale(scale: Tensor, prefix: str, state: Fp8StateBuffers) -> Tensor:
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
