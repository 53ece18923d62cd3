"""Layers whose weight any FSDP2 ``fully_shard`` call all-gathers quantized: the weight made an
:class:`~transformer_linear.modules.fp8_all_gather.FP8AllGatherWeight` (a GroupedLinear's a
:class:`~transformer_linear.modules.fsdp_gather_grouped.GroupedFP8AllGatherWeight`) before sharding.

FSDP2 finds ``fsdp_pre_all_gather`` on a parameter's local shard whoever calls ``fully_shard``: torchtitan,
accelerate, Lightning or a user's own loop. So a weight wrapped here (``convert_to_fp8(...,
fp8_all_gather=True)``, or ``tl.distributed.fully_shard(..., fp8_all_gather=...)``, which wraps then calls
``torch.distributed.fsdp.fully_shard``) gathers in its recipe's form under plain ``fully_shard`` too. What
depends on the shard group (blocks straddling shards, experts per rank) is checked at the gather; a
one-rank group gathers the high-precision weight and quantizes it after (fp8_all_gather.gather_on_one_rank).
``state_dict`` saves the plain high-precision master.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from transformer_linear.modules import quantized_init
from transformer_linear.modules.fp8_all_gather import is_fp8_all_gathered
from transformer_linear.modules.fp8_all_gather_shard import fp8_all_gather_type, register_plain_weight_hook
from transformer_linear.modules.fsdp_gather_usages import BACKWARD_READS_COLUMNWISE
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import QuantizationSpec, quantization_spec

__all__ = ["gather_spec", "make_fp8_all_gathered"]


def gather_spec(layer: nn.Module, recipe: Optional[Recipe], where: str, fqn: str, hint: str) -> QuantizationSpec:
    """The quantizers with which ``layer``'s weight is all-gathered: ``recipe``'s (a GroupedLinear's checked to be
    ones the grouped GEMMs take).

    Raises:
        ValueError: ``recipe`` is None (the message names the layer, then ``hint``).
        NotImplementedError: a GroupedLinear's recipe the grouped GEMMs do not take.
    """
    if recipe is None:
        raise ValueError(
            f"{where}: fp8_all_gather=True needs tl.{type(layer).__name__} {fqn or '<root>'!r} to have a recipe "
            f"(it has none); {hint}"
        )
    return check_grouped_quantization(where, recipe) if layer.weight.dim() == 3 else quantization_spec(recipe)


def make_fp8_all_gathered(layer: nn.Module, spec: QuantizationSpec, where: str,
                          world_size: Optional[int] = None) -> bool:
    """Make ``layer``'s (a ``tl.Linear``'s or ``tl.GroupedLinear``'s) weight one that FSDP2 all-gathers
    quantized by ``spec.weight``; returns whether it did.

    A weight kept quantized by ``tl.quantized_model_init`` becomes its high-precision master first (the
    preserved initial weight, else the dequantized one), which FSDP2 then shards. A weight in another layout
    than (out, in) (a ``Conv1DLinear``'s (in, out)) is left as it is: it gathers in high precision.

    Args:
        world_size: the shard group's size where known (``tl.distributed.fully_shard``): what depends on it is
            checked now rather than at the first gather.

    Raises:
        ValueError: the weight cannot be gathered quantized (check_shardable, check_grouped_gatherable).
    """
    weight = layer.weight
    grouped = weight.dim() == 3
    expected = (weight.shape[0], layer.out_features, layer.in_features) if grouped else (
        layer.out_features, layer.in_features)
    if tuple(weight.shape) != expected or is_fp8_all_gathered(weight):
        return False
    wrapper = fp8_all_gather_type(spec, tuple(weight.shape), world_size, where)
    if isinstance(weight, quantized_init.QuantizedWeight):
        master = quantized_init.high_precision_weight(layer)
    else:
        master = weight.detach()
    # Whether backward's gather may carry the columnwise copy alone (a quantized dgrad reads only it).
    setattr(layer, BACKWARD_READS_COLUMNWISE, spec.backward_operands == "quantized")
    layer.weight = nn.Parameter(wrapper(master, spec.weight, spec.history), requires_grad=weight.requires_grad)
    register_plain_weight_hook(layer)
    quantized_init.requantize(layer)  # a quantized_model_init layer drops its stored copy
    return True
