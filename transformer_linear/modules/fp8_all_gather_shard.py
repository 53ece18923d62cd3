"""What a weight FSDP2 all-gathers quantized is made into before sharding, and its ``state_dict`` form.

Both ways to a quantized gather make the weight's shards one of the classes here: converting a layer
(``fp8_all_gather_params.make_fp8_all_gathered``) and FSDP2 sharding a weight kept quantized by
``quantized_model_init`` (``quantized_init.QuantizedWeight``'s sharding ops).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from transformer_linear.modules.fp8_all_gather import FP8AllGatherWeight, check_shardable
from transformer_linear.modules.fsdp_gather_grouped import GroupedFP8AllGatherWeight, check_grouped_gatherable
from transformer_linear.recipe.quantization import QuantizationSpec

__all__ = ["fp8_all_gather_type", "register_plain_weight_hook"]


def fp8_all_gather_type(
    spec: QuantizationSpec, shape: tuple[int, ...], world_size: Optional[int], where: str
) -> type[FP8AllGatherWeight]:
    """The FSDP2 weight class that all-gathers a weight of ``shape`` quantized by ``spec`` (a GroupedLinear's
    3-D experts: :class:`GroupedFP8AllGatherWeight`), after checking what depends on the shard group where
    ``world_size`` is known.

    Raises:
        ValueError: the weight cannot be gathered quantized over ``world_size`` ranks (check_shardable,
            check_grouped_gatherable).
    """
    if len(shape) == 3:
        check_grouped_gatherable(spec, shape[0], world_size or 1, where)
        return GroupedFP8AllGatherWeight
    if world_size is not None:
        check_shardable(spec.weight, shape[0], world_size, where)
    return FP8AllGatherWeight


def register_plain_weight_hook(layer: nn.Module) -> None:
    """Make ``layer``'s ``state_dict`` hold its weight as a plain tensor where it is an
    :class:`FP8AllGatherWeight` (a DTensor of plain shards under FSDP2), sharing its storage: checkpoints
    load without the class, and loading one in place writes the master. Once per layer."""
    if not getattr(layer, "_plain_weight_state_dict_hook", False):
        layer._register_state_dict_hook(_plain_weight_in_state_dict)
        layer._plain_weight_state_dict_hook = True


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is None:
        return
    local = weight._local_tensor if hasattr(weight, "_local_tensor") else weight
    if not isinstance(local, FP8AllGatherWeight):
        return
    if local is weight:
        state_dict[key] = local._tensor
        return
    with torch.no_grad():
        state_dict[key] = DTensor.from_local(
            local._tensor, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
            stride=weight.stride(),
        )
