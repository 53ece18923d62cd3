"""``tl.GroupedLinear``: the experts of a mixture-of-experts layer, one FP8 grouped GEMM per direction.

Transformer Engine's call convention (``transformer_engine.pytorch.GroupedLinear(num_gemms,
in_features, out_features, bias=True, ...)``, ``forward(inp, m_splits)``). The weights are one 3-D
Parameter ``weight`` of shape (num_gemms, out_features, in_features) and ``bias`` (num_gemms,
out_features), the layout of ``torch._grouped_mm`` and of Hugging Face transformers' experts; a
checkpoint in Transformer Engine's layout (``weight0`` ... ``weight{G-1}``, ``bias0`` ...) loads too.

Delayed scaling keeps one amax history per role for the whole module (input, weight over all
experts, grad_output), in the buffers and state a ``tl.Linear`` has (delayed_scaling.py); every
expert's weight is then quantized with the one weight scale. Current scaling gives each expert's
weight a scale of its own.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from transformer_linear._handles import NO_HANDLE
from transformer_linear.modules import fp8_all_gather, quantized_init
from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.delayed_scaling_module import DelayedScalingModule
from transformer_linear.modules.grouped_linear_functional import (
    HighPrecisionGroupedLinear,
    check_grouped_linear_args,
    high_precision_grouped_linear,
    run_grouped_linear,
)
from transformer_linear.modules.grouped_linear_ops import compute_grouped_wgrad
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.modules.linear_ops import WgradQueue
from transformer_linear.recipe import Recipe

__all__ = ["GroupedLinear"]


class GroupedLinear(DelayedScalingModule):
    """``num_gemms`` Linear layers (experts) applied to consecutive row groups of one input.

    Args:
        num_gemms: the number of experts (groups).
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias per expert.
        recipe: this module's recipe; ``None`` follows ``tl.autocast`` (no recipe: high precision).
            DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling,
            Float8RowwiseScaling, NVFP4BlockScaling (ops.grouped_nvfp4), or a CustomRecipe whose quantizers
            fit (check_grouped_quantization).
        device: where to allocate the parameters.
        dtype: the parameters' dtype (float32, bfloat16 or float16).
        delay_wgrad_compute: backward computes only the input gradient; :meth:`backward_dw` computes the
            weight and bias gradients (Transformer Engine's option, as ``tl.Linear``'s).
        fuse_wgrad_accumulation: add the weight gradient, in fp32, to ``weight.main_grad`` (a
            (num_gemms, out_features, in_features) float32 tensor, created as zeros if absent) instead of
            writing ``weight.grad``.

    Built under ``tl.quantized_model_init`` the weight is kept only quantized, each expert with its own
    scales (quantized_init.QuantizedWeight; ``tl.optim.MasterWeights`` steps its masters). The recipe's
    ``backward_override`` runs dgrad and wgrad in high precision (grouped_linear_ops).

    Raises:
        ValueError: ``num_gemms`` below 1 or negative feature counts.
        NotImplementedError: a recipe the grouped GEMMs do not support.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Optional[Recipe] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        for name, value, least in (("num_gemms", num_gemms, 1), ("in_features", in_features, 0),
                                   ("out_features", out_features, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"GroupedLinear: '{name}' must be an integer >= {least}, got {value!r}")
        if recipe is not None:
            check_grouped_quantization("GroupedLinear", recipe)
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.delay_wgrad_compute = delay_wgrad_compute
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((num_gemms, out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty((num_gemms, out_features), **factory))
        else:
            self.register_parameter("bias", None)
        # Not a state: the experts' FP8 weights of the current microbatch group.
        self._weight_cache: Optional[CachedWeight] = None
        self._wgrad_queue = WgradQueue()  # delay_wgrad_compute: what backward_dw() computes
        self.reset_parameters()
        self._init_delayed_scaling()  # one history per role for every expert
        # Under tl.quantized_model_init the experts' weights are kept quantized (quantized_init.py).
        quantized_init.init_layer(self)
        if self.quantized_init is not None:
            self.register_load_state_dict_post_hook(quantized_init.load_state_dict_post_hook)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, expert by expert: the random numbers of ``num_gemms`` nn.Linear layers
        built one after the other."""
        with torch.no_grad():
            # A weight kept quantized (quantized_model_init) is initialized whole, then quantized into place.
            kept_quantized = isinstance(self.weight, quantized_init.QuantizedWeight)
            weight = torch.empty_like(self.weight) if kept_quantized else self.weight
            for g in range(self.num_gemms):
                nn.init.kaiming_uniform_(weight[g], a=math.sqrt(5))
                if self.bias is not None:
                    bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                    nn.init.uniform_(self.bias[g], -bound, bound)
            if weight is not self.weight:
                self.weight.copy_(weight)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self.recipe}"
        )

    # ------------------------------------------------------------------
    # delayed-scaling state and checkpoints
    # ------------------------------------------------------------------

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        _stack_per_expert_keys(state_dict, prefix, self.num_gemms)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._weight_cache = None
        return self

    # ------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------

    def forward(
        self, inp: Tensor, m_splits: Union[Sequence[int], Tensor], is_first_microbatch: Optional[bool] = None
    ) -> Tensor:
        """Apply expert g to rows ``sum(m_splits[:g]):sum(m_splits[:g+1])`` of ``inp``.

        Args:
            inp: (..., in_features), the tokens sorted by expert (leading dims flattened, as
                Transformer Engine does).
            m_splits: the tokens of each expert: a list of ``num_gemms`` ints summing to total_tokens, or an
                integer tensor of ``num_gemms`` entries on inp's device. A tensor's values are never read on
                the host (with a recipe): no device sync, and under ``torch.compile`` a routing change
                does not recompile; its sum is then not checked, and rows past it come out as 0.
            is_first_microbatch: True quantizes the experts' weights and caches the FP8 copies; False reuses
                them (the weights have not changed within a gradient-accumulation group); None caches nothing.

        Returns:
            (..., out_features).

        Raises:
            TypeError: a wrong dtype or device of ``inp`` or ``m_splits``.
            ValueError: a wrong shape of ``inp``, a wrong length of ``m_splits``, or (a list) a wrong sum.
        """
        if not isinstance(inp, Tensor):
            raise TypeError(f"GroupedLinear: argument 'inp' must be a torch.Tensor, got {type(inp).__name__}")
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear: argument 'inp' must have shape (..., {self.in_features}), "
                             f"got {list(inp.shape)}")
        x2d = inp.reshape(-1, self.in_features) if inp.dim() != 2 else inp
        out = self._forward(x2d, self._offs(x2d, m_splits), is_first_microbatch)
        if inp.dim() == 2:
            return out
        return torch.ops.aten._unsafe_view.default(out, [*inp.shape[:-1], self.out_features])

    def _forward(self, inp: Tensor, offs: Tensor, is_first_microbatch: Optional[bool]) -> Tensor:
        """The forward on 2-D tokens."""
        check_grouped_linear_args("GroupedLinear", inp, self.weight, offs, self.bias)
        if self.delay_wgrad_compute and torch.compiler.is_compiling():
            raise RuntimeError("GroupedLinear: delay_wgrad_compute runs eagerly only (backward_dw drains a Python "
                               "queue)")
        if self.fuse_wgrad_accumulation and torch.compiler.is_compiling():
            # AOT autograd takes no in-place update of a graph input in the backward graph.
            raise RuntimeError("GroupedLinear: fuse_wgrad_accumulation runs eagerly only (backward adds to "
                               "weight.main_grad in place)")
        recipe = layer_recipe(self.recipe)
        main_grad = self._main_grad()
        wgrad_queue = self._wgrad_queue.handle if self.delay_wgrad_compute else NO_HANDLE
        if recipe is None:
            if main_grad is None and wgrad_queue == NO_HANDLE:
                return high_precision_grouped_linear(inp, self.weight, offs, self.bias)
            return HighPrecisionGroupedLinear.apply(inp, self.weight, self.bias, offs, main_grad, wgrad_queue)
        spec = check_grouped_quantization("GroupedLinear", recipe)
        kept_quantized = fp8_all_gather.gathered_weight(self.weight)
        if kept_quantized is not None:
            # quantized_model_init: the stored experts' weights are the GEMM operands, the gradient goes to them.
            if spec.backward_operands == "high_precision":
                raise ValueError("GroupedLinear: backward_override='high_precision' reads the high-precision weight, "
                                 "which tl.quantized_model_init does not keep; use backward_override='dequantized'")
            cached = fp8_all_gather.checked_cached_weight(kept_quantized, spec.weight)
            weight = fp8_all_gather.weight_for_op(kept_quantized)
            return run_grouped_linear(self, inp, weight, offs, self.bias, spec, cached, main_grad, wgrad_queue).out
        cached = self._weight_cache if is_first_microbatch is False else None
        if (cached is not None and cached.weight_fp8_t is None and torch.is_grad_enabled() and inp.requires_grad
                and spec.backward_operands == "quantized"):
            cached = None  # cached without the columnwise copy a quantized dgrad reads: quantize again
        o = run_grouped_linear(self, inp, self.weight, offs, self.bias, spec, cached, main_grad, wgrad_queue)
        if is_first_microbatch and cached is None:
            self._weight_cache = CachedWeight(
                weight_fp8=o.weight_fp8.detach(),
                weight_fp8_t=o.weight_fp8_t.detach() if o.weight_fp8_t.numel() else None,
                weight_scale_inv=o.weight_scale_inv.detach(),
                weight_scale_inv_t=o.weight_scale_inv_t.detach() if o.weight_scale_inv_t.numel() else None,
                weight_amax=o.amax[1].detach() if o.amax.numel() else None,  # block scaling records no amax
            )
        return o.out

    def _main_grad(self) -> Optional[Tensor]:
        """fuse_wgrad_accumulation: ``weight.main_grad`` (made as fp32 zeros if absent) where the weight
        gets a gradient, else None."""
        if not (self.fuse_wgrad_accumulation and torch.is_grad_enabled() and self.weight.requires_grad):
            return None
        if getattr(self.weight, "main_grad", None) is None:
            self.weight.main_grad = torch.zeros_like(self.weight, dtype=torch.float32)
        return self.weight.main_grad

    def backward_dw(self) -> None:
        """Compute the weight and bias gradients queued by backward (delay_wgrad_compute=True).

        Each queued backward adds its gradient to ``weight.grad`` / ``bias.grad`` (or to
        ``weight.main_grad`` with fuse_wgrad_accumulation).
        """
        if not self.delay_wgrad_compute:
            return
        self._wgrad_queue.apply(self.weight, self.bias, self.fuse_wgrad_accumulation, compute_grouped_wgrad)

    def _offs(self, inp: Tensor, m_splits: Union[Sequence[int], Tensor]) -> Tensor:
        """The (num_gemms,) int32 cumulative row ends of ``m_splits``, made on inp's device."""
        where = "GroupedLinear"
        if isinstance(m_splits, Tensor):
            if m_splits.dtype not in (torch.int32, torch.int64) or m_splits.dim() != 1:
                raise TypeError(f"{where}: argument 'm_splits' must be a 1-D int32 or int64 tensor (or a list of "
                                f"ints), got shape {list(m_splits.shape)} {m_splits.dtype}")
            if m_splits.device != inp.device:
                raise TypeError(f"{where}: argument 'm_splits' is on {m_splits.device}, expected {inp.device}")
            if m_splits.shape[0] != self.num_gemms:
                raise ValueError(f"{where}: argument 'm_splits' must have {self.num_gemms} entries (num_gemms), "
                                 f"got {m_splits.shape[0]}")
            return torch.cumsum(m_splits, 0, dtype=torch.int32)
        if not isinstance(m_splits, (list, tuple)) or not all(
            isinstance(m, int) and not isinstance(m, bool) for m in m_splits
        ):
            raise TypeError(f"{where}: argument 'm_splits' must be a list of ints or an integer tensor, "
                            f"got {m_splits!r}")
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"{where}: argument 'm_splits' must have {self.num_gemms} entries (num_gemms), "
                             f"got {len(m_splits)}")
        if any(m < 0 for m in m_splits) or sum(m_splits) != inp.shape[0]:
            raise ValueError(f"{where}: argument 'm_splits' must be non-negative and sum to the {inp.shape[0]} "
                             f"tokens of 'inp', got {list(m_splits)}")
        ends, total = [], 0
        for m in m_splits:
            total += m
            ends.append(total)
        return torch.tensor(ends, dtype=torch.int32, device=inp.device)


def _stack_per_expert_keys(state_dict: dict, prefix: str, num_gemms: int) -> None:
    """Transformer Engine's layout (``weight0`` ... , ``bias0`` ...) stacked into ``weight`` / ``bias``, in
    place in load_state_dict's own copy of the state dict."""
    for name in ("weight", "bias"):
        keys = [f"{prefix}{name}{g}" for g in range(num_gemms)]
        if prefix + name in state_dict or not all(k in state_dict for k in keys):
            continue
        state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])
