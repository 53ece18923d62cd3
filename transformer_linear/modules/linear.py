"""``tl.Linear``: a drop-in ``nn.Linear`` that runs its GEMMs in FP8.

Same parameters, default initialization and ``state_dict`` keys as
``nn.Linear``. Without a recipe (its own or an active ``tl.autocast``) it is
``F.linear``: outputs and gradients are bitwise ``nn.Linear``'s. With one, the
forward and backward go through the custom ops of linear_ops.py.

Delayed scaling keeps its state (amax histories and scales) in float32
buffers every layer holds from construction, saved in ``state_dict``; the
layer's ``DelayedScalingState`` (delayed_scaling.py) owns them and is what
forward and backward call.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_linear._handles import NO_HANDLE
from transformer_linear.formats.checks import check_linear_devices
from transformer_linear.modules import fp8_all_gather, quantized_init, tensor_parallel
from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.delayed_scaling_module import DelayedScalingModule
from transformer_linear.modules.linear_args import CachedWeight, LinearFwdArgs
from transformer_linear.modules.linear_ops import WgradQueue, compute_wgrad, linear_fwd
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import NO_QUANTIZATION, check_recipe, quantization_spec

__all__ = ["Linear"]


class Linear(DelayedScalingModule):
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
        check_recipe("Linear", recipe)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.delay_wgrad_compute = delay_wgrad_compute
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        # Not a state: the FP8 weight of the current microbatch group.
        self._weight_cache: Optional[CachedWeight] = None
        self._wgrad_queue = WgradQueue()  # delay_wgrad_compute: what backward_dw() computes
        self.reset_parameters()
        self._init_delayed_scaling()
        # Under tl.quantized_model_init the weight is kept quantized too (quantized_init.py).
        quantized_init.init_layer(self)
        if self.quantized_init is not None:
            self.register_load_state_dict_post_hook(quantized_init.load_state_dict_post_hook)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, drawing the same random numbers."""
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            f", recipe={self.recipe}"
        )

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._weight_cache = None
        quantized_init.requantize(self)
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
        recipe = layer_recipe(self.recipe)
        gathered = fp8_all_gather.gathered_weight(weight) if recipe is None else None
        if gathered is not None and not isinstance(gathered, quantized_init.QuantizedWeight):
            # A weight kept by quantized_model_init reads as its dequantized value (high precision, as
            # GroupedLinear and Transformer Engine run it); one FSDP2 gathered in FP8 has no other form.
            raise RuntimeError(
                f"Linear: the weight was {gathered.source} and holds only its quantized form; run the layer "
                f"under a recipe quantizing it as {gathered.quantizer}"
            )
        if recipe is None and not (self.delay_wgrad_compute or self.fuse_wgrad_accumulation):
            return F.linear(inp, weight, bias)
        check_linear_devices(inp, weight, bias, getattr(self.weight, "main_grad", None))
        if self.delay_wgrad_compute and torch.compiler.is_compiling():
            raise RuntimeError("Linear: delay_wgrad_compute runs eagerly only (backward_dw drains a Python queue)")
        if self.fuse_wgrad_accumulation and torch.compiler.is_compiling():
            # AOT autograd takes no in-place update of a graph input in the backward graph: without this
            # check the compiler fails inside its partitioner instead of naming the option.
            raise RuntimeError("Linear: fuse_wgrad_accumulation runs eagerly only (backward adds to "
                               "weight.main_grad in place)")
        args = self._fwd_args(inp, recipe, is_first_microbatch, weight, bias)
        o = self.delayed_scaling_state.forward(self, args, linear_fwd)
        if recipe is not None and is_first_microbatch and args.cached_weight is None:
            self._weight_cache = CachedWeight(
                weight_fp8=o.weight_fp8.detach(),
                weight_fp8_t=o.weight_fp8_t.detach() if o.weight_fp8_t.numel() else None,
                weight_scale_inv=o.weight_scale_inv.detach(),
                weight_scale_inv_t=o.weight_scale_inv_t.detach() if o.weight_scale_inv_t.numel() else None,
                weight_amax=o.amax[1].detach() if o.amax.numel() else None,  # block scaling records no amax
            )
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
        quantization = quantization_spec(recipe) if fp8 else NO_QUANTIZATION
        gathered = fp8_all_gather.gathered_weight(weight)
        if gathered is not None:
            # FSDP2 all-gathered the weight quantized, or it is kept quantized (quantized_init.QuantizedWeight):
            # its GEMM operands as they are, the gradient to it.
            cached_weight = fp8_all_gather.checked_cached_weight(gathered, quantization.weight)
            weight = fp8_all_gather.weight_for_op(gathered)
        else:
            cached_weight = self._weight_cache if fp8 and is_first_microbatch is False else None
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
            cached_weight=cached_weight,
            # requires-grad flags
            input_requires_grad=grad and inp.requires_grad,
            weight_requires_grad=grad and weight.requires_grad,
            bias_requires_grad=grad and bias is not None and bias.requires_grad,
            # quantizers and scaling state
            fp8=fp8,
            quantization=quantization,
            delayed=(
                self.delayed_scaling_state.op_args(self, quantization.history)
                if quantization.history is not None
                else None
            ),
            # options
            out_dtype=out_dtype,
            main_grad=main_grad,
            wgrad_queue=self._wgrad_queue.handle if self.delay_wgrad_compute else NO_HANDLE,
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
        self._wgrad_queue.apply(self.weight, self.bias, self.fuse_wgrad_accumulation, compute_wgrad)

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
        quantized_init.requantize(new)  # under tl.quantized_model_init: the weight kept quantized
        new.train(linear.training)
        new.reset_fp8_state()
        return new
