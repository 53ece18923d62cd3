"""FP8 primary weights: ``tl.quantized_model_init`` (Transformer Engine's name; ``fp8_model_init`` too).

A ``tl.Linear`` built (or converted by ``convert_to_fp8``) inside the context keeps its weight in the
recipe's quantized form: data and scales in both usages the weight's quantizer produces (rowwise for the
forward GEMM, columnwise for dgrad), a :class:`CachedWeight` the forward hands to the GEMM as it is
(the ``is_first_microbatch=False`` path, every step). Nothing here branches on the recipe: the weight's
quantizer says what is stored.

Optimizer design: the ``weight`` Parameter stays the high-precision master, the tensor a stock
``torch.optim.AdamW`` updates in place and that backward gives its gradient to. After each step the
quantized copy is rebuilt from it (:func:`requantize_weights`, or :func:`register_requantize_hook` on the
optimizer). Transformer Engine instead makes the Parameter an FP8 tensor subclass and keeps the fp32
master inside its optimizer; here the master is the Parameter, so no tensor subclass is needed and
``torch.compile(fullgraph=True)`` sees plain tensors. What that costs: one quantize pass per layer per
optimizer step (instead of one per forward), and the weight is rounded to the recipe's format after
every step, exactly what the forward of the high-precision-weight Linear does too.

Under FSDP2 with ``fully_shard(fp8_all_gather=True)`` the stored copy is dropped: the weight exists
unsharded only in the quantized form FSDP2 gathers (quantized from the updated shard at each all-gather),
which the forward reads in its place; the layer's recipe is then this context's. A weight FSDP2
shards otherwise (gathered in high precision, or on a 1-rank mesh) keeps no stored copy either
(``tl.distributed.fully_shard`` sets ``layer.fsdp_sharded``): the forward quantizes the weight it gets.

A layer's weight scale is computed from the weight itself when it is quantized (current scaling), also
under delayed scaling, whose history still records the weight's amax.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from transformer_linear.modules.fp8_all_gather import is_fp8_all_gathered
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe import DelayedScaling, Recipe
from transformer_linear.recipe.quantization import TensorQuantizer, check_recipe, quantization_spec

__all__ = [
    "QuantizedInitConfig",
    "clear_high_precision_init_val",
    "fp8_model_init",
    "get_high_precision_init_val",
    "is_quantized_weight",
    "quantized_model_init",
    "quantized_weight_bytes",
    "register_requantize_hook",
    "requantize_weights",
]


@dataclasses.dataclass(frozen=True)
class QuantizedInitConfig:
    """How a layer built under :func:`quantized_model_init` keeps its weight.

    Attributes:
        recipe: the recipe whose weight quantizer makes the stored weight.
        preserve_high_precision_init_val: keep a CPU copy of the initial weight
            (:func:`get_high_precision_init_val`).
    """

    recipe: Recipe
    preserve_high_precision_init_val: bool = False

    def __post_init__(self) -> None:
        if self.recipe is None:
            raise TypeError("quantized_model_init: 'recipe' must be a recipe, got None")
        check_recipe("quantized_model_init", self.recipe)
        if not isinstance(self.preserve_high_precision_init_val, bool):
            raise TypeError(
                "quantized_model_init: 'preserve_high_precision_init_val' must be a bool, "
                f"got {self.preserve_high_precision_init_val!r}"
            )

    @property
    def weight_quantizer(self) -> TensorQuantizer:
        """The quantizer the stored weight is made by."""
        return quantization_spec(self.recipe).weight


# The config of the innermost active context (None: off); a one-slot list so nesting restores it.
_ACTIVE: list[Optional[QuantizedInitConfig]] = [None]


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    preserve_high_precision_init_val: bool = False,
) -> Iterator[None]:
    """Layers built inside keep their weight only in the recipe's quantized form.

    Args:
        enabled: False leaves layers built inside as usual (an enclosing context is switched off).
        recipe: whose weight quantizer makes the stored weight; None: ``DelayedScaling()``, as in
            Transformer Engine. The forward must run under a recipe with the same weight quantizer.
        preserve_high_precision_init_val: keep a CPU copy of each initial weight, for
            :func:`get_high_precision_init_val` (e.g. to initialize an external master copy).

    Raises:
        TypeError: ``enabled`` or ``preserve_high_precision_init_val`` not a bool, or an unknown recipe.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"quantized_model_init: 'enabled' must be a bool, got {enabled!r}")
    config = QuantizedInitConfig(recipe if recipe is not None else DelayedScaling(), preserve_high_precision_init_val)
    previous = _ACTIVE[0]
    _ACTIVE[0] = config if enabled else None
    try:
        yield
    finally:
        _ACTIVE[0] = previous


fp8_model_init = quantized_model_init
"""Transformer Engine's earlier name of :func:`quantized_model_init`."""


def active_config() -> Optional[QuantizedInitConfig]:
    """The config of the innermost active :func:`quantized_model_init` (None outside)."""
    return _ACTIVE[0]


def quantize_weight(quantizer: TensorQuantizer, weight: Tensor) -> CachedWeight:
    """``weight`` in both usages ``quantizer`` produces, as the forward reads a cached weight."""
    with torch.no_grad():
        q = quantizer.quantize(weight.detach().contiguous(), rowwise=True, columnwise=True)
    return CachedWeight(
        weight_fp8=q.data,
        weight_fp8_t=q.data_t if q.data_t.numel() else None,
        weight_scale_inv=q.scale_inv,
        weight_scale_inv_t=q.scale_inv_t if q.scale_inv_t.numel() else None,
        weight_amax=q.amax.reshape(()) if q.amax is not None else None,
    )


def requantize(layer: nn.Module) -> None:
    """Rebuild ``layer``'s quantized weight from its ``weight`` (no-op for a layer not built in the context).

    A weight on the meta device (deferred init) is left unquantized until the layer is materialized.
    """
    config: Optional[QuantizedInitConfig] = getattr(layer, "quantized_init", None)
    if config is None:
        return
    weight = layer.weight
    if is_fp8_all_gathered(weight) or getattr(layer, "fsdp_sharded", False):
        # FSDP2 gathers it quantized (fp8_all_gather.py), or in high precision for the forward to quantize;
        # a whole-weight copy kept here could not be rebuilt from the shard after a step.
        layer._quantized_weight = None
        return
    if weight.device.type == "meta":
        layer._quantized_weight = None
        return
    layer._quantized_weight = quantize_weight(config.weight_quantizer, weight)


def init_layer(layer: nn.Module) -> None:
    """Attach the active context's config to a newly built ``layer`` and quantize its weight."""
    config = active_config()
    layer.quantized_init = config
    layer._quantized_weight = None
    if config is None:
        return
    if config.preserve_high_precision_init_val and layer.weight.device.type != "meta":
        layer._high_precision_init_val = layer.weight.detach().to("cpu", copy=True)
    requantize(layer)


def stored_weight(layer: nn.Module, weight: Tensor, weight_quantizer: TensorQuantizer) -> Optional[CachedWeight]:
    """The quantized weight the forward reads in place of ``weight``, checked against the forward recipe's
    weight quantizer.

    Raises:
        ValueError: the forward's recipe quantizes the weight differently from the stored one, or
            ``weight`` is a shard (tensor parallel) of the whole weight that was stored.
    """
    stored: Optional[CachedWeight] = layer._quantized_weight
    if stored is None:
        return None
    expected = layer.quantized_init.weight_quantizer
    # The stored data's shape for the weight's (FP4 packs two values a byte: its quantizer says).
    if tuple(stored.weight_fp8.shape) != expected.data_shape(*weight.shape):
        raise ValueError(
            f"Linear: the weight is stored quantized with shape {list(stored.weight_fp8.shape)} but the forward "
            f"runs on a {list(weight.shape)} shard; quantized_model_init does not shard the stored weight"
        )
    if weight_quantizer != expected:
        raise ValueError(
            "Linear: the weight is stored quantized by quantized_model_init's recipe "
            f"({expected}); the forward's recipe quantizes it as {weight_quantizer}"
        )
    return stored


def is_quantized_weight(layer: nn.Module) -> bool:
    """Whether ``layer`` keeps its weight quantized (built under :func:`quantized_model_init`)."""
    return getattr(layer, "quantized_init", None) is not None


def quantized_weight_bytes(layer: nn.Module) -> int:
    """Bytes of ``layer``'s stored quantized weight: data and scales of every usage, and the amax."""
    stored: Optional[CachedWeight] = getattr(layer, "_quantized_weight", None)
    if stored is None:
        return 0
    tensors = [getattr(stored, f.name) for f in dataclasses.fields(stored)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def requantize_weights(model: nn.Module) -> None:
    """Rebuild the quantized weight of every layer of ``model`` built under :func:`quantized_model_init`
    from its (just updated) high-precision weight: call after each optimizer step."""
    for module in model.modules():
        if is_quantized_weight(module):
            requantize(module)


def register_requantize_hook(optimizer: torch.optim.Optimizer, model: nn.Module) -> Any:
    """Make ``optimizer.step()`` requantize ``model``'s weights after each step.

    Returns:
        The hook handle (``.remove()`` to stop).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"register_requantize_hook: 'optimizer' must be a torch.optim.Optimizer, got {optimizer!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"register_requantize_hook: 'model' must be an nn.Module, got {type(model).__name__}")

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        requantize_weights(model)

    return optimizer.register_step_post_hook(hook)


def get_high_precision_init_val(layer: nn.Module) -> Optional[Tensor]:
    """The CPU copy of ``layer``'s initial weight kept by ``preserve_high_precision_init_val=True`` (else None)."""
    return getattr(layer, "_high_precision_init_val", None)


def clear_high_precision_init_val(layer: nn.Module) -> None:
    """Free the copy :func:`get_high_precision_init_val` returns."""
    if hasattr(layer, "_high_precision_init_val"):
        del layer._high_precision_init_val


def load_state_dict_post_hook(layer: nn.Module, incompatible_keys: Any) -> None:
    """A loaded weight replaces the master: quantize it again."""
    requantize(layer)

