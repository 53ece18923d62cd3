"""Delayed scaling's state: a Linear's :class:`DelayedScalingState` and the
custom ops that read and update it.

Buffers
-------
Every ``tl.Linear`` holds one state from construction, whatever its recipe:
the forward state ``fp8_amax_history`` (rows, 2) and ``fp8_scale`` (2,),
columns [input, weight], which only forward updates, and the backward state
``fp8_grad_amax_history`` (rows, 1) and ``fp8_grad_scale`` (1,),
grad_output's, which only backward updates (forward reads it). They are
float32 buffers registered on the layer, so ``state_dict`` keys are the
layer's own; the state object creates, grows, moves and loads them. Nothing
is created on first use, so a cold ``torch.compile`` or ``torch.export`` sees
them as real buffers and records their updates; and as no buffer is updated
by both forward and backward, AOT autograd can place every update in its own
graph, whatever backend settings compile it. ``rows`` is the layer's own
recipe's ``amax_history_len``, else ``DelayedScaling``'s default (1024); a
recipe with a shorter history uses the leading rows. A checkpoint in the
earlier layout (one (rows, 3) history and (3,) scale) loads too, and a
``state_dict`` without them (an ``nn.Linear``'s) loads with ``strict=True``
and starts the state fresh.

Use
---
The Linear calls the state once per direction: :meth:`DelayedScalingState.forward`
around ``linear_fwd`` (apply the reductions still in flight, run, record the
amaxes and update the scales), and the backward calls
:func:`quantize_and_record_grad_output`. The first step's just-in-time scales
(:func:`forward_scales`) are decided inside ``linear_fwd``, where the state
can be read.

Across ranks the amaxes are all-reduced in the background (amax_reduction.py);
the state keeps a launched reduction until the next update of the same
direction applies it. The ops reach the state through its handle
(_handles.py), an int their schema can carry; the table holds the state
weakly, so it goes with its layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, TypeVar

import torch
from torch import Tensor, nn

from transformer_linear import ops
from transformer_linear._handles import NO_HANDLE, HandleTable
from transformer_linear.formats.checks import check_same_device
from transformer_linear.ops import library
from transformer_linear.recipe import HistoryConfig, amax_reduction, quantization
from transformer_linear.recipe.scaling import (
    FP8_STATE_COLUMNS,
    FP8_STATES,
    checked_fp8_state,
    no_amax_yet,
    update_delayed_scaling_,
)
from transformer_linear.reference import compute_scale, fp8_max


__all__ = [
    "FWD_SCALE_KEY",
    "STATE_KEYS",
    "DelayedForwardArgs",
    "DelayedForwardOutputs",
    "DelayedScalingArgs",
    "DelayedScalingState",
    "ForwardScales",
    "PendingReduction",
    "delayed_scaling_flush",
    "delayed_scaling_update",
    "flushed_state",
    "forward_scales",
    "quantize_and_record_grad_output",
]

HISTORY_KEYS = tuple(state.history_key for state in FP8_STATES.values())
STATE_KEYS = (*HISTORY_KEYS, *(state.scale_key for state in FP8_STATES.values()))
"""The state's buffers, as saved in ``state_dict``."""
FWD_SCALE_KEY = "fp8_fwd_scale"
"""Not state (not saved): what the last forward quantized with (activation checkpointing's recompute reads it)."""
DEFAULT_HISTORY_LEN = HistoryConfig().amax_history_len

_STATES: HandleTable["DelayedScalingState"] = HandleTable()


@dataclasses.dataclass(frozen=True)
class DelayedScalingArgs:
    """What the ops need of a layer's delayed-scaling state: its buffers and the
    recipe's knobs. None in the args of every other recipe."""

    scale: Tensor
    """(2,) float32 scales of [input, weight], updated after forward."""
    fwd_scale: Optional[Tensor]
    """(3,) what forward quantizes [input, weight, grad_output] with; None in a forward (``scale`` and
    ``grad_scale`` as they are); in activation checkpointing's recompute (during backward, when the scales
    have moved on) the copy of the scales the original forward used, which the state records from
    linear_fwd's last output."""
    amax_history: Tensor
    """(history_len, 2), the forward state's history."""
    grad_scale: Tensor
    """(1,) grad_output's scale; only backward updates it (forward reads it)."""
    grad_amax_history: Tensor
    """(history_len, 1); backward records grad_output's amax in it."""
    amax_compute_algo: str
    amax_reduction_group: int
    """amax_reduction.py key of the group amaxes are all-reduced over (-1: none)."""
    reduction_handle: int
    """Across ranks: the handle (_handles.py) of the layer's state, which keeps the reductions launched in
    the background until they are applied; -1: reductions block (or there are none)."""
    just_in_time: bool
    """A tensor whose history column holds no amax yet is quantized with a scale from its own amax
    (reduced over ``amax_reduction_group``); its grad_output scale is returned negated to say so."""


def _run_by_backward() -> bool:
    """Whether autograd is running a backward (a forward now is a recompute), in eager mode."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class PendingReduction(NamedTuple):
    """An amax all-reduce launched in the background, and the update to apply once it is done."""

    work: Any
    """The collective's work handle."""
    amax: Tensor
    """The amaxes being reduced (in place)."""
    direction: str
    """Which state it updates: ``"forward"`` or ``"backward"``."""
    rows: int
    """The leading history rows the update's recipe uses."""
    first: int
    fp8_max: float
    margin: int
    amax_compute_algo: str


class DelayedForwardArgs(Protocol):
    """What :meth:`DelayedScalingState.forward` reads of a layer's forward arguments (``LinearFwdArgs``,
    ``GroupedLinearFwdArgs``): the state as the op takes it, and the quantizers."""

    delayed: Optional[DelayedScalingArgs]
    quantization: quantization.QuantizationSpec


class DelayedForwardOutputs(Protocol):
    """What :meth:`DelayedScalingState.forward` reads of a forward's outputs: the scales it quantized with
    and the amaxes it recorded."""

    fwd_scales: Tensor
    amax: Tensor


_FwdArgs = TypeVar("_FwdArgs", bound=DelayedForwardArgs)
_FwdOutputs = TypeVar("_FwdOutputs", bound=DelayedForwardOutputs)


class DelayedScalingState:
    """A Linear's delayed-scaling state: its buffers' lifecycle and the reductions still in flight.

    The buffers are registered on the owning layer, which every method takes
    as ``owner`` (the state keeps no reference to it). A copy (``deepcopy``,
    ``pickle``) is a fresh state: reductions in flight update the original's
    buffers.
    """

    def __init__(self) -> None:
        self._pending: list[PendingReduction] = []
        self.handle = _STATES.add(self)
        """What the ops take to reach this state (_handles.py)."""

    def __reduce__(self) -> tuple:
        return (DelayedScalingState, ())

    @property
    def pending_reductions(self) -> tuple[PendingReduction, ...]:
        """The reductions launched and not yet applied, in launch order."""
        return tuple(self._pending)

    # ------------------------------------------------------------------
    # buffers
    # ------------------------------------------------------------------

    def reset(self, owner: nn.Module, amax_history_len: Optional[int] = None) -> None:
        """Start fresh (empty histories, scales 1, nothing in flight), on ``owner``'s weight's device.

        Args:
            owner: the layer.
            amax_history_len: rows of the new histories; default: the
                owner's own recipe's ``amax_history_len``, else
                ``DelayedScaling``'s default.
        """
        if amax_history_len is None:
            own = owner.recipe
            history = quantization.quantization_spec(own).history if own is not None else None
            amax_history_len = history.amax_history_len if history is not None else DEFAULT_HISTORY_LEN
        rows = operator.index(amax_history_len)
        if rows < 1:
            raise ValueError(f"reset_fp8_state: 'amax_history_len' must be a positive integer, got {rows!r}")
        self._pending.clear()
        device = owner.weight.device
        # Normal tensors even under inference_mode: training updates them in place later.
        with torch.inference_mode(False):
            for state in FP8_STATES.values():
                width = len(state.columns)
                owner.register_buffer(state.history_key, torch.zeros(rows, width, dtype=torch.float32, device=device))
                owner.register_buffer(state.scale_key, torch.ones(width, dtype=torch.float32, device=device))
            columns = len(FP8_STATE_COLUMNS)
            fwd_scale = torch.ones(columns, dtype=torch.float32, device=device)
            owner.register_buffer(FWD_SCALE_KEY, fwd_scale, persistent=False)

    def _histories(self, owner: nn.Module, history: HistoryConfig) -> tuple[Tensor, Tensor]:
        """The forward and backward histories the recipe uses: their leading ``amax_history_len`` rows."""
        wanted = history.amax_history_len
        rows = min(owner._buffers[name].shape[0] for name in HISTORY_KEYS)  # loaded ones may differ
        if wanted > rows:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"tl.Linear: the recipe's amax_history_len={wanted} exceeds the {rows} rows of this layer's "
                    f"delayed-scaling history, which cannot grow inside torch.compile / torch.export; give the "
                    f"layer that recipe (tl.Linear(..., recipe=...), tl.convert_to_fp8(model, recipe=...)), call "
                    f"layer.reset_fp8_state(amax_history_len={wanted}), or run one eager step first"
                )
            self._grow(owner, wanted)
        histories = (owner._buffers[name] for name in HISTORY_KEYS)
        return tuple(h[:wanted] if wanted < h.shape[0] else h for h in histories)

    def _grow(self, owner: nn.Module, rows: int) -> None:
        """Eagerly: histories of at least ``rows`` rows, keeping the recorded rows on top (pending
        reductions still apply)."""
        for name in HISTORY_KEYS:
            old = owner._buffers[name]
            if old.shape[0] >= rows:
                continue
            with torch.inference_mode(False):  # a normal tensor, as in reset
                history = old.new_zeros(rows, old.shape[1])
                history[: old.shape[0]].copy_(old)
            owner.register_buffer(name, history)

    @contextlib.contextmanager
    def float32_buffers(self, owner: nn.Module) -> Iterator[None]:
        """Around ``owner._apply``: ``.to(dtype)`` / ``.half()`` must not round the state, so its buffers
        sit out and follow the weight's device as float32."""
        saved = {name: owner._buffers.pop(name) for name in (*STATE_KEYS, FWD_SCALE_KEY) if name in owner._buffers}
        try:
            yield
        finally:
            device = owner.weight.device
            for name, t in saved.items():
                if t.is_meta and device.type != "meta":
                    # to_empty() after meta-device init: a meta state holds no data, start it fresh.
                    fresh = torch.zeros if name in HISTORY_KEYS else torch.ones
                    owner._buffers[name] = fresh(t.shape, dtype=torch.float32, device=device)
                else:
                    owner._buffers[name] = t.to(device=device)

    def load(
        self, owner: nn.Module, state_dict: dict, prefix: str, missing_keys: list[str], load_module: Callable[[], None]
    ) -> None:
        """``owner._load_from_state_dict``: check the state's keys, then ``load_module()`` loads everything.

        ``state_dict`` is load_state_dict's own copy: the checked float32
        tensors (split from the earlier layout) replace what was given. A
        history of any length loads (the buffer takes its shape); without
        any of the state's keys the state starts fresh.
        """
        self._pending.clear()  # updates of the state being replaced
        present = checked_fp8_state(state_dict, prefix)
        for name in HISTORY_KEYS:
            history = state_dict.get(prefix + name)
            if history is not None:
                with torch.inference_mode(False):
                    owner._buffers[name] = torch.empty_like(history, device=owner.weight.device)
        load_module()
        if not present:
            for name in STATE_KEYS:
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)
            self.reset(owner)

    # ------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------

    def op_args(self, owner: nn.Module, config: HistoryConfig) -> DelayedScalingArgs:
        """The state as ``linear_fwd`` takes it, under the recipe's history ``config``
        (``QuantizationSpec.history``; the histories grow to its length eagerly)."""
        history, grad_history = self._histories(owner, config)
        group = owner.amax_reduction_group
        return DelayedScalingArgs(
            scale=owner.fp8_scale,
            fwd_scale=getattr(owner, FWD_SCALE_KEY),
            amax_history=history,
            grad_scale=owner.fp8_grad_scale,
            grad_amax_history=grad_history,
            amax_compute_algo=config.amax_compute_algo,
            amax_reduction_group=group,
            # Across ranks, reductions run in the background until the next update of their state.
            reduction_handle=self.handle if amax_reduction.reduces_amax(group) else NO_HANDLE,
            just_in_time=config.first_step_just_in_time,
        )

    def forward(self, owner: nn.Module, args: _FwdArgs, run: Callable[[_FwdArgs], _FwdOutputs]) -> _FwdOutputs:
        """One forward of the layer: ``run(args)`` (linear_fwd), under delayed scaling (``args.delayed``
        given) with the state brought up to date first and updated after.

        The reductions the last forward launched are applied; the forward
        quantizes with the current scales, records its amaxes and updates
        the forward state. A forward run by backward is activation
        checkpointing's recompute: it quantizes with the scales the original
        forward used (``fp8_fwd_scale``) and records nothing a second time.
        """
        if args.delayed is None or _run_by_backward():
            return run(args)  # no amax history (current scaling, blocks), or a recompute
        d = args.delayed
        if d.reduction_handle != NO_HANDLE:
            delayed_scaling_flush(owner.fp8_amax_history, d.scale, d.reduction_handle)
        args.delayed = dataclasses.replace(d, fwd_scale=None)
        o = run(args)
        getattr(owner, FWD_SCALE_KEY).copy_(o.fwd_scales)  # just-in-time ones included
        delayed_scaling_update(
            d.amax_history,
            d.scale,
            o.amax,
            FP8_STATE_COLUMNS["input"],
            args.quantization.input.dtype,
            args.quantization.input.margin,
            d.amax_compute_algo,
            d.amax_reduction_group,
            d.reduction_handle,
        )
        return o

    def finish_reductions(self, owner: nn.Module) -> None:
        """Apply the reductions still in flight to ``owner``'s buffers."""
        for direction, state in FP8_STATES.items():
            history, scale = owner._buffers[state.history_key], owner._buffers[state.scale_key]
            delayed_scaling_flush(history, scale, self.handle, direction)

    # ------------------------------------------------------------------
    # reductions in flight (called by the ops)
    # ------------------------------------------------------------------

    def launch_reduction(self, amax: Tensor, group: int, direction: str, rows: int, update: tuple) -> bool:
        """Start the all-reduce of ``amax`` and keep it with ``update`` (first, fp8_max, margin, algo);
        False (nothing started) without a live group."""
        launched = amax_reduction.launch_amax_reduction(amax, group)
        if launched is None:
            return False
        self._pending.append(PendingReduction(*launched, direction, rows, *update))
        return True

    def peek_reductions(self, direction: str) -> list[PendingReduction]:
        """``direction``'s reductions, waited for, in launch order; they stay pending."""
        pending = [r for r in self._pending if r.direction == direction]
        for r in pending:
            r.work.wait()
        return pending

    def take_reductions(self, direction: str) -> list[PendingReduction]:
        """:meth:`peek_reductions`, and those reductions are no longer pending."""
        done = self.peek_reductions(direction)
        self._pending = [r for r in self._pending if r.direction != direction]
        return done


# ---------------------------------------------------------------------------
# the mutating ops
# ---------------------------------------------------------------------------


@library.custom_op("transformer_linear::delayed_scaling_update", mutates_args=("amax_history", "scale"))
def _delayed_scaling_update_op(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    first: int,
    fp8_max: float,
    margin: int,
    amax_compute_algo: str,
    group: int = amax_reduction.NO_GROUP,
    state_handle: int = NO_HANDLE,
    direction: str = "forward",
) -> None:
    _check_update_devices(amax_history, scale, amax)
    update = (first, fp8_max, margin, amax_compute_algo)
    state = _STATES.get(state_handle)  # None: blocking (no handle, or its layer is gone)
    # The flush gets the whole buffer: it applies the update to the rows this one used.
    if state is not None and state.launch_reduction(amax, group, direction, amax_history.shape[0], update):
        return  # applied by delayed_scaling_flush before the state is next updated
    update_delayed_scaling_(amax_history, scale, amax_reduction.all_reduce_amax(amax, group), *update)


@_delayed_scaling_update_op.register_fake
def _(
    amax_history, scale, amax, first, fp8_max, margin, amax_compute_algo, group=-1, state_handle=-1, direction="forward"
):
    _check_update_devices(amax_history, scale, amax)


def _check_update_devices(amax_history: Tensor, scale: Tensor, amax: Optional[Tensor] = None) -> None:
    """One device for the state and the amax (the ops' fake implementations check it too: a meta argument
    among CPU tensors would route a call to them, a silent no-op)."""
    check_same_device("delayed_scaling_update" if amax is not None else "delayed_scaling_flush",
                      {"amax_history": amax_history, "scale": scale, "amax": amax}, optional=("amax",))


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    first: int,
    dtype: torch.dtype,
    margin: int,
    algo: str,
    group: int = amax_reduction.NO_GROUP,
    state_handle: int = NO_HANDLE,
    direction: str = "forward",
) -> None:
    """Record ``amax`` for columns ``first...`` and update their scales (scaling.py), in place.

    ``group`` (a amax_reduction.py key) all-reduces ``amax`` with MAX across
    ranks first: blocking when ``state_handle`` is -1, else launched in the
    background, kept by that state, and applied by :func:`delayed_scaling_flush`
    for the same ``direction`` (which of the layer's states, ``"forward"`` or
    ``"backward"``, this one is).
    """
    _delayed_scaling_update_op(
        amax_history, scale, amax, first, fp8_max(dtype), margin, algo, group, state_handle, direction
    )


def _apply_reductions(amax_history: Tensor, scale: Tensor, reductions: list[PendingReduction]) -> None:
    for r in reductions:
        update = (r.first, r.fp8_max, r.margin, r.amax_compute_algo)
        update_delayed_scaling_(amax_history[: r.rows], scale, r.amax, *update)


@library.custom_op("transformer_linear::delayed_scaling_flush", mutates_args=("amax_history", "scale"))
def _delayed_scaling_flush_op(
    amax_history: Tensor, scale: Tensor, state_handle: int, direction: str = "forward"
) -> None:
    _check_update_devices(amax_history, scale)
    state = _STATES.get(state_handle)
    if state is not None:
        _apply_reductions(amax_history, scale, state.take_reductions(direction))


@_delayed_scaling_flush_op.register_fake
def _(amax_history, scale, state_handle, direction="forward"):
    _check_update_devices(amax_history, scale)


def delayed_scaling_flush(amax_history: Tensor, scale: Tensor, state_handle: int, direction: str = "forward") -> None:
    """Wait for the state's launched reductions of ``direction`` and apply their updates, in launch
    order, in place.

    ``amax_history`` is the layer's whole buffer; each update applies to the
    leading rows its recipe used.
    """
    _delayed_scaling_flush_op(amax_history, scale, state_handle, direction)


def flushed_state(amax_history: Tensor, scale: Tensor, state_handle: int, direction: str) -> tuple[Tensor, Tensor]:
    """The state as :func:`delayed_scaling_flush` would leave it, without changing it: copies with the
    pending updates applied, or the tensors themselves when none are pending.

    For use inside an op: the forward reads the grad_output state, which only
    the backward may update.
    """
    state = _STATES.get(state_handle)
    reductions = state.peek_reductions(direction) if state is not None else []
    if not reductions:
        return amax_history, scale
    amax_history, scale = amax_history.clone(), scale.clone()
    _apply_reductions(amax_history, scale, reductions)
    return amax_history, scale


# ---------------------------------------------------------------------------
# the scales a forward and a backward quantize with
# ---------------------------------------------------------------------------


class ForwardScales(NamedTuple):
    """The (1,) scales of one delayed-scaling forward."""

    input: Tensor
    weight: Tensor
    grad_output: Tensor
    """As the state holds it (the forward records it in ``fp8_fwd_scale``)."""
    grad_output_for_backward: Tensor
    """What backward quantizes grad_output with: ``grad_output``, negated when backward is to compute a
    just-in-time one."""


def reads_state_on_host(t: Tensor) -> bool:
    """Whether the just-in-time rule reads the delayed-scaling state of a layer on ``t``'s device on the host.

    On the CPU a host read is free, and the rule computes a tensor's own amax only on the steps that need it.
    Elsewhere (a GPU) a host read is a device sync, which stalls the launch queue on every call and breaks
    CUDA graph capture, so the rule computes the just-in-time scales on every call and selects them on the
    device (``torch.where``): one amax pass per quantized tensor instead of a sync. Both give bitwise the
    same scales.
    """
    return t.device.type == "cpu"


def _just_in_time_scale(x: Tensor, dtype: torch.dtype, margin: int, fallback: Tensor, group: int) -> Tensor:
    """Delayed scaling's first step: the scale of ``x``'s own amax, all-reduced over ``group`` first.

    Bitwise the scale the history update computes from that amax afterwards.
    Runs inside an op (eagerly, also under torch.compile): it reads the state.
    """
    amax = amax_reduction.all_reduce_amax(ops.amax(x).reshape(1), group)
    return compute_scale(amax, fp8_max(dtype), margin, fallback=fallback)


def forward_scales(
    d: Optional[DelayedScalingArgs], x2d: Tensor, weight: Optional[Tensor], dtype: torch.dtype, margin: int
) -> Optional[ForwardScales]:
    """The scales a forward quantizes with, read from the state inside ``linear_fwd``; None where the layer
    keeps no amax history (``d`` None: each quantizer computes its own).

    ``d.fwd_scale`` when given (a recompute), else the state's scales, the
    grad_output one as its pending updates will leave it. Under
    ``just_in_time``, a tensor whose column has seen no amax yet gets a scale
    from its own amax (``weight`` None: a cached FP8 weight, quantized
    already).
    """
    if d is None:
        return None
    # Only backward updates the grad_output state; this reads it as its pending updates will leave it.
    grad_history, grad_state_scale = flushed_state(d.grad_amax_history, d.grad_scale, d.reduction_handle, "backward")
    used = d.fwd_scale if d.fwd_scale is not None else torch.cat([d.scale, grad_state_scale])
    x_scale, w_scale, grad_scale = (used[i : i + 1] for i in FP8_STATE_COLUMNS.values())
    grad_scale_for_backward = grad_scale
    if d.just_in_time:
        empty = torch.cat(
            [no_amax_yet(d.amax_history, used[: d.scale.numel()]), no_amax_yet(grad_history, grad_scale)]
        )
        group = d.amax_reduction_group
        if reads_state_on_host(x2d):
            # One read of the state for all three tensors; amax passes only where a column is empty.
            x_empty, w_empty, g_empty = empty.tolist()
            if x_empty:
                x_scale = _just_in_time_scale(x2d, dtype, margin, x_scale, group)
            if w_empty and weight is not None:
                w_scale = _just_in_time_scale(weight, dtype, margin, w_scale, group)
            if g_empty:
                grad_scale_for_backward = grad_scale.neg()  # backward's quantize: just in time
        else:
            # Every rank computes (and all-reduces) the candidates on every call, so the collectives match.
            x_scale = torch.where(empty[0:1], _just_in_time_scale(x2d, dtype, margin, x_scale, group), x_scale)
            if weight is not None:
                w_scale = torch.where(empty[1:2], _just_in_time_scale(weight, dtype, margin, w_scale, group), w_scale)
            grad_scale_for_backward = torch.where(empty[2:3], grad_scale.neg(), grad_scale)
    return ForwardScales(x_scale, w_scale, grad_scale, grad_scale_for_backward)


def stand_in_forward_scales(d: Optional[DelayedScalingArgs], like: Tensor) -> Optional[ForwardScales]:
    """What a fake implementation uses for :func:`forward_scales`: the state is read (a device sync) only
    where the op really runs, so stand-ins of its shapes; None where there is no state."""
    if d is None:
        return None
    return ForwardScales(*(like.new_empty(1, dtype=torch.float32) for _ in ForwardScales._fields))


@library.custom_op("transformer_linear::quantize_grad_output", mutates_args=())
def _quantize_grad_output_op(
    g: Tensor, scale: Tensor, dtype: torch.dtype, margin: int, dbias_dtype: Optional[torch.dtype], group: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_same_device("quantize_grad_output", {"g": g, "scale": scale})
    # A negative scale: linear_fwd saw no grad_output amax in the history yet, so just in time.
    if reads_state_on_host(g):
        if bool(scale.lt(0).item()):
            scale = _just_in_time_scale(g, dtype, margin, scale.neg(), group)
    else:
        scale = torch.where(scale.lt(0), _just_in_time_scale(g, dtype, margin, scale.abs(), group), scale)
    return tuple(quantization.quantize_tensorwise(g, dtype, scale, margin, dbias_dtype=dbias_dtype))


@_quantize_grad_output_op.register_fake
def _(g, scale, dtype, margin, dbias_dtype, group):
    check_same_device("quantize_grad_output", {"g": g, "scale": scale})
    return tuple(quantization.quantize_tensorwise(g, dtype, scale, margin, dbias_dtype=dbias_dtype))


def quantize_and_record_grad_output(
    d: Optional[DelayedScalingArgs],
    g: Tensor,
    scale: Tensor,
    quantizer: quantization.TensorQuantizer,
    dbias_dtype: Optional[torch.dtype],
) -> Optional[quantization.Quantized]:
    """One backward under delayed scaling: apply the reductions the layer's last backward launched,
    quantize grad_output ``g`` with ``quantizer`` and ``scale`` (linear_fwd's ``grad_output_scale``;
    negative asks for a just-in-time one), record its amax and update the backward state. None where the
    layer keeps no amax history (``d`` None): the quantizer then computes its own scales."""
    if d is None:
        return None
    dtype, margin = quantizer.dtype, quantizer.margin
    if d.reduction_handle != NO_HANDLE:
        delayed_scaling_flush(d.grad_amax_history, d.grad_scale, d.reduction_handle, "backward")
    if d.just_in_time:
        group = d.amax_reduction_group
        qg = ops.QuantizeOutput(*_quantize_grad_output_op(g, scale, dtype, margin, dbias_dtype, group))
    else:
        qg = quantization.quantize_tensorwise(g, dtype, scale, margin, dbias_dtype=dbias_dtype)
    delayed_scaling_update(
        d.grad_amax_history,
        d.grad_scale,
        qg.amax,
        0,  # the backward state's one column
        dtype,
        margin,
        d.amax_compute_algo,
        d.amax_reduction_group,
        d.reduction_handle,
        "backward",
    )
    return quantization.tensorwise_result(qg)
