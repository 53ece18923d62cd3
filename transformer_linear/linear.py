"""``tl.Linear``: a drop-in ``nn.Linear`` that runs its GEMMs in FP8.

Same parameters, default initialization and ``state_dict`` keys as
``nn.Linear``. Without a recipe (its own or an active ``tl.autocast``) it is
``F.linear``: outputs and gradients are bitwise ``nn.Linear``'s. With one, the
forward and backward go through the custom ops of linear_ops.py.

Delayed scaling keeps its state in float32 buffers that every layer owns
from construction: the forward state ``fp8_amax_history`` (rows, 2) and
``fp8_scale`` (2,), columns [input, weight], which only forward updates, and
the backward state ``fp8_grad_amax_history`` (rows, 1) and
``fp8_grad_scale`` (1,), grad_output's, which only backward updates (forward
reads it). Nothing is created on first use, so a cold ``torch.compile`` or
``torch.export`` sees them as real buffers and records their updates; and as
no buffer is updated by both forward and backward, AOT autograd can place
every update in its own graph, whatever backend settings compile it.
``rows`` is the layer's own recipe's ``amax_history_len``, else
``DelayedScaling``'s default (1024); a recipe with a shorter history uses the
leading rows. They are saved in ``state_dict`` (a checkpoint in the earlier
layout, one (rows, 3) history and (3,) scale, loads too), and a
``state_dict`` without them (an ``nn.Linear``'s) loads with ``strict=True``
and starts the state fresh.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_linear import amax_reduction, tensor_parallel
from transformer_linear._checks import check_linear_devices
from transformer_linear.autocast import get_fp8_recipe
from transformer_linear.linear_args import LinearFwdArgs
from transformer_linear.linear_ops import WGRAD_QUEUES, compute_wgrad, linear_fwd
from transformer_linear.quantization import NO_QUANTIZATION, quantization_spec
from transformer_linear.recipe import DelayedScaling, Recipe
from transformer_linear.scaling import (
    FP8_STATE_COLUMNS,
    FP8_STATES,
    checked_fp8_state,
    delayed_scaling_flush,
    delayed_scaling_update,
)

__all__ = ["Linear"]

_HISTORIES = tuple(state.history_key for state in FP8_STATES.values())
_FP8_STATE = (*_HISTORIES, *(state.scale_key for state in FP8_STATES.values()))
_FWD_SCALE = "fp8_fwd_scale"
_DEFAULT_HISTORY_LEN = DelayedScaling().amax_history_len
_FWD_COLUMN = FP8_STATE_COLUMNS["input"]


def _run_by_backward() -> bool:
    """Whether autograd is running a backward (a forward now is a recompute), in eager mode."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _finish_amax_reductions_hook(module: "Linear", prefix: str, keep_vars: bool) -> None:
    module.finish_amax_reductions()  # module level, so a Linear pickles


class Linear(nn.Module):
    """y = x Wᵀ + b, with FP8 GEMMs under a recipe.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        device: where to allocate the parameters.
        dtype: the parameters' dtype (float32, bfloat16 or float16).
        recipe: this module's recipe; ``None`` follows ``tl.autocast``.
        delay_wgrad_compute: backward computes only the input gradient;
            :meth:`backward_dw` computes the weight (and bias) gradient.
        fuse_wgrad_accumulation: accumulate the weight gradient in fp32 into
            ``weight.main_grad`` (created as zeros if absent) instead of
            ``weight.grad``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        recipe: Optional[Recipe] = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        if recipe is not None and not isinstance(recipe, Recipe.__args__):
            names = ", ".join(t.__name__ for t in Recipe.__args__)
            raise TypeError(f"Linear: 'recipe' must be one of {names} or None, got {recipe!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.delay_wgrad_compute = delay_wgrad_compute
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        # Delayed scaling's amax all-reduce group, as a amax_reduction.py key
        # (an int, so torch.compile guards on it cheaply): set it with
        # tl.amax_reduction.set_amax_reduction_group.
        self.amax_reduction_group = amax_reduction.DEFAULT_GROUP
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        # Not a state: the FP8 weight of the current microbatch group.
        # (weight_fp8, weight_fp8_t, weight_scale_inv, weight_scale_inv_t, weight_amax); the transposed
        # copy and its scales exist where the backward needs them (CUDA layout, block scaling).
        self._weight_cache: Optional[tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor], Optional[Tensor]]] = None
        self.reset_parameters()
        self.reset_fp8_state()
        # A checkpoint holds the scales as of the last step, not lagging behind
        # reductions still in flight (tl.distributed).
        self.register_state_dict_pre_hook(_finish_amax_reductions_hook)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, drawing the same random numbers."""
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            f", recipe={self.recipe}"
        )

    # ------------------------------------------------------------------
    # delayed-scaling state
    # ------------------------------------------------------------------

    def reset_fp8_state(self, amax_history_len: Optional[int] = None) -> None:
        """Start the delayed-scaling state fresh (empty history, scales 1), on the weight's device.

        Args:
            amax_history_len: rows of the new history; default: the layer's
                own recipe's ``amax_history_len``, else ``DelayedScaling``'s
                default. A ``tl.autocast`` recipe with a longer history than
                the layer holds needs this before ``torch.compile`` /
                ``torch.export`` (eagerly the history grows by itself).
        """
        if amax_history_len is None:
            own = self.recipe
            amax_history_len = own.amax_history_len if isinstance(own, DelayedScaling) else _DEFAULT_HISTORY_LEN
        rows = operator.index(amax_history_len)
        if rows < 1:
            raise ValueError(f"reset_fp8_state: 'amax_history_len' must be a positive integer, got {rows!r}")
        amax_reduction.discard_amax_reductions(id(self))
        device = self.weight.device
        # Normal tensors even under inference_mode: training updates them in place later.
        with torch.inference_mode(False):
            for state in FP8_STATES.values():
                width = len(state.columns)
                self.register_buffer(state.history_key, torch.zeros(rows, width, dtype=torch.float32, device=device))
                self.register_buffer(state.scale_key, torch.ones(width, dtype=torch.float32, device=device))
            # Not state: what the last forward quantized with (activation checkpointing's recompute reads it).
            columns = len(FP8_STATE_COLUMNS)
            self.register_buffer(_FWD_SCALE, torch.ones(columns, dtype=torch.float32, device=device), persistent=False)

    def _fp8_histories(self, recipe: DelayedScaling) -> tuple[Tensor, Tensor]:
        """The forward and backward histories the recipe uses: their leading ``amax_history_len`` rows."""
        wanted = recipe.amax_history_len
        rows = min(self._buffers[name].shape[0] for name in _HISTORIES)  # loaded ones may differ
        if wanted > rows:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"tl.Linear: the recipe's amax_history_len={wanted} exceeds the {rows} rows of this layer's "
                    f"delayed-scaling history, which cannot grow inside torch.compile / torch.export; give the "
                    f"layer that recipe (tl.Linear(..., recipe=...), tl.convert_to_fp8(model, recipe=...)), call "
                    f"layer.reset_fp8_state(amax_history_len={wanted}), or run one eager step first"
                )
            self._grow_histories(wanted)
        histories = (self._buffers[name] for name in _HISTORIES)
        return tuple(h[:wanted] if wanted < h.shape[0] else h for h in histories)

    def _grow_histories(self, rows: int) -> None:
        """Eagerly: histories of at least ``rows`` rows, keeping the recorded rows on top (pending
        reductions still apply)."""
        for name in _HISTORIES:
            old = self._buffers[name]
            if old.shape[0] >= rows:
                continue
            with torch.inference_mode(False):  # a normal tensor, as in reset_fp8_state
                history = old.new_zeros(rows, old.shape[1])
                history[: old.shape[0]].copy_(old)
            self.register_buffer(name, history)

    def __del__(self, _discard=amax_reduction.discard_amax_reductions) -> None:
        # Pending reductions are keyed by id(self): a later layer given the
        # same id must not inherit them. (_discard is bound early: module
        # globals may be gone when this runs at interpreter exit.)
        _discard(id(self))

    def finish_amax_reductions(self) -> None:
        """Apply the amax reductions still in flight to the delayed-scaling state (see tl.distributed)."""
        for direction, state in FP8_STATES.items():
            delayed_scaling_flush(self._buffers[state.history_key], self._buffers[state.scale_key], id(self), direction)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        amax_reduction.discard_amax_reductions(id(self))  # updates of the state being replaced
        # load_state_dict passes its own copy of the dict: the checked float32
        # tensors (split from the earlier layout) replace what was given.
        present = checked_fp8_state(state_dict, prefix)
        for name in _HISTORIES:
            history = state_dict.get(prefix + name)
            if history is not None:  # a history of any length loads: the buffer takes its shape
                with torch.inference_mode(False):
                    self._buffers[name] = torch.empty_like(history, device=self.weight.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if not present:
            # A state without the FP8 keys (an nn.Linear's) starts the state fresh.
            for name in _FP8_STATE:
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)
            self.reset_fp8_state()

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() must not round the FP8 scales: move them as float32.
        state = {name: self._buffers.pop(name) for name in (*_FP8_STATE, _FWD_SCALE) if name in self._buffers}
        super()._apply(fn, recurse)
        device = self.weight.device
        for name, t in state.items():
            if t.is_meta and device.type != "meta":
                # to_empty() after meta-device init: a meta state holds no data, start it fresh.
                fresh = torch.zeros if name in _HISTORIES else torch.ones
                self._buffers[name] = fresh(t.shape, dtype=torch.float32, device=device)
            else:
                self._buffers[name] = t.to(device=device)
        self._weight_cache = None
        return self

    # ------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------

    def forward(self, inp: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        """Apply the layer to ``inp`` of shape (..., in_features).

        Args:
            inp: the activation.
            is_first_microbatch: True quantizes the weight and caches the FP8
                copy; False reuses that copy (the weight has not changed within
                a gradient-accumulation group); None disables caching.
        """
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear: argument 'inp' must have shape (..., {self.in_features}), got {list(inp.shape)}"
            )
        if tensor_parallel.is_tensor_parallel(self.weight):
            # parallelize_module made the parameters DTensors: run on the local shards.
            return tensor_parallel.tensor_parallel_forward(self, inp, functools.partial(self._forward, is_first_microbatch))
        return self._forward(is_first_microbatch, inp, self.weight, self.bias)

    def _forward(self, is_first_microbatch: Optional[bool], inp: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """The forward with explicit (possibly local-shard) parameters."""
        recipe = self.recipe if self.recipe is not None else get_fp8_recipe()
        if recipe is None and not (self.delay_wgrad_compute or self.fuse_wgrad_accumulation):
            return F.linear(inp, weight, bias)
        check_linear_devices(inp, weight, bias, getattr(self.weight, "main_grad", None))
        if self.delay_wgrad_compute and torch.compiler.is_compiling():
            raise RuntimeError("Linear: delay_wgrad_compute runs eagerly only (backward_dw drains a Python queue)")
        args = self._fwd_args(inp, recipe, is_first_microbatch, weight, bias)
        delayed = isinstance(recipe, DelayedScaling)
        # A forward run by backward is activation checkpointing's recompute:
        # it quantizes with fwd_scale as the original forward left it and
        # records no amax a second time.
        recompute = delayed and _run_by_backward()
        if delayed and not recompute:
            if args.amax_reduction_layer_key != -1:
                delayed_scaling_flush(self.fp8_amax_history, args.scale, args.amax_reduction_layer_key)
            args.fwd_scale = None  # a forward quantizes with the current scales
        o = linear_fwd(args)
        if delayed and not recompute:
            getattr(self, _FWD_SCALE).copy_(o.fwd_scales)  # just-in-time ones included
            delayed_scaling_update(
                args.amax_history,
                args.scale,
                o.amax,
                _FWD_COLUMN,
                args.fwd_dtype,
                recipe.margin,
                recipe.amax_compute_algo,
                args.amax_reduction_group,
                args.amax_reduction_layer_key,
            )
        if recipe is not None and is_first_microbatch and args.weight_fp8 is None:
            t = o.weight_fp8_t.detach() if o.weight_fp8_t.numel() else None
            t_scale_inv = o.weight_scale_inv_t.detach() if o.weight_scale_inv_t.numel() else None
            amax = o.amax[1].detach() if o.amax.numel() else None  # block scaling records no amax
            self._weight_cache = (o.weight_fp8.detach(), t, o.weight_scale_inv.detach(), t_scale_inv, amax)
        # The op's output is 2-D. Other inputs get it in their leading dims through
        # _unsafe_view, as nn.Linear does: not a view to autograd, so in-place
        # ops on it work and FSDP2 sees no view returned.
        if inp.dim() == 2:
            return o.out
        return torch.ops.aten._unsafe_view.default(o.out, [*inp.shape[:-1], o.out.shape[-1]])

    def _fwd_args(
        self,
        inp: Tensor,
        recipe: Optional[Recipe],
        is_first_microbatch: Optional[bool],
        weight: Optional[Tensor] = None,
        bias: Optional[Tensor] = None,
    ) -> LinearFwdArgs:
        if weight is None:
            weight, bias = self.weight, self.bias
        grad = torch.is_grad_enabled()
        device_type = inp.device.type
        # A meta input (deferred init) has no autocast state to ask.
        autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else inp.dtype
        fp8 = recipe is not None
        fmt = recipe.fp8_format if fp8 else None
        delayed = isinstance(recipe, DelayedScaling)
        history, grad_history = self._fp8_histories(recipe) if delayed else (None, None)
        # Across ranks, amax reductions run in the background until the next forward.
        layer_key = id(self) if delayed and amax_reduction.reduces_amax(self.amax_reduction_group) else -1
        cache = self._weight_cache if fp8 and is_first_microbatch is False else None
        main_grad = None
        if self.fuse_wgrad_accumulation and grad and weight.requires_grad:
            if getattr(self.weight, "main_grad", None) is None:
                self.weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
            main_grad = self.weight.main_grad
        return LinearFwdArgs(
            # tensors
            inp=inp,
            weight=weight,
            bias=bias,
            # cached FP8 weight
            weight_fp8=cache[0] if cache else None,
            weight_fp8_t=cache[1] if cache else None,
            weight_scale_inv=cache[2] if cache else None,
            weight_scale_inv_t=cache[3] if cache else None,
            weight_amax=cache[4] if cache else None,
            # requires-grad flags
            input_requires_grad=grad and inp.requires_grad,
            weight_requires_grad=grad and weight.requires_grad,
            bias_requires_grad=grad and bias is not None and bias.requires_grad,
            # FP8 formats and scaling state
            fp8=fp8,
            quantization=quantization_spec(recipe) if fp8 else NO_QUANTIZATION,
            fwd_dtype=fmt.fwd_dtype if fp8 else torch.float8_e4m3fn,
            bwd_dtype=fmt.bwd_dtype if fp8 else torch.float8_e5m2,
            margin=getattr(recipe, "margin", 0),  # block recipes have no margin: their scales are per block
            scale=self.fp8_scale if delayed else None,
            fwd_scale=getattr(self, _FWD_SCALE) if delayed else None,
            amax_history=history,
            grad_scale=self.fp8_grad_scale if delayed else None,
            grad_amax_history=grad_history,
            amax_compute_algo=recipe.amax_compute_algo if delayed else "max",
            amax_reduction_group=self.amax_reduction_group if delayed else amax_reduction.NO_GROUP,
            amax_reduction_layer_key=layer_key,
            just_in_time=delayed and recipe.first_step_just_in_time,
            # options
            out_dtype=out_dtype,
            main_grad=main_grad,
            wgrad_queue=id(self) if self.delay_wgrad_compute else -1,
        )

    # ------------------------------------------------------------------
    # delayed weight gradient
    # ------------------------------------------------------------------

    def backward_dw(self) -> None:
        """Compute the weight and bias gradients queued by backward (delay_wgrad_compute=True).

        Each queued backward adds its gradient to ``weight.grad`` / ``bias.grad``
        (or to ``weight.main_grad`` with fuse_wgrad_accumulation).
        """
        if not self.delay_wgrad_compute:
            return
        for bwd, dbias in WGRAD_QUEUES.pop(id(self), []):
            if bwd is not None:
                main_grad = self.weight.main_grad if self.fuse_wgrad_accumulation else None
                _accumulate_grad(self.weight, compute_wgrad(bwd, main_grad))
            if dbias is not None:
                _accumulate_grad(self.bias, dbias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> "Linear":
        """A ``tl.Linear`` sharing ``linear``'s parameters (no copy).

        Args:
            linear: the ``nn.Linear`` to convert.
            **kwargs: keyword options of :class:`Linear` (recipe, delay_wgrad_compute, ...).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear: 'linear' must be a torch.nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
        # Sharing the Parameters keeps optimizer state and ties pointing at them valid.
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new.reset_fp8_state()
        return new


def _accumulate_grad(param: Tensor, grad: Optional[Tensor]) -> None:
    if grad is None:
        return
    grad = grad.detach()
    param.grad = grad if param.grad is None else param.grad + grad

