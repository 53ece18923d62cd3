"""``tl.Linear`` with torch.distributed, the user-facing API: the amax
reduction group, the tensor-parallel styles, and the checks that keep FSDP2 /
tensor parallelism from going silently wrong. The plumbing below the Linear
is in amax_reduction.py and tensor_parallel.py.

What is reduced across ranks
----------------------------
* **DelayedScaling**: every amax recorded in the history (input and weight in
  forward, grad_output in backward) is all-reduced with MAX over the amax
  reduction group *before* the scale update, so every rank holds the same
  history and uses bitwise the same scales. Without it each rank would scale
  its own data-parallel shard differently and the replicas' FP8 numerics (not
  just their data) would drift apart.
* **CurrentScaling**: nothing. The weight amax is identical on all ranks by
  construction (DDP keeps replicas equal; FSDP2 all-gathers the full weight
  before forward). Input and grad_output amaxes are per-rank by design: each
  rank quantizes its own activations with its own scale, like any per-tensor
  scale computed "just in time"; reducing them would add a collective per
  GEMM and buy nothing, since gradients are reduced in high precision.

FP8 all-gather (``fully_shard(fp8_all_gather=True)``, modules/fp8_all_gather.py)
adds one reduction: a per-tensor-scaled weight's shard amax is all-reduced
(MAX) over the FSDP2 shard group before each forward all-gather, so every
rank quantizes its shard with the whole weight's scale.

The group is a per-module knob (:func:`set_amax_reduction_group`); by default
it is the default process group when one is initialised with more than one
rank, and nothing otherwise. How and when the reduction runs (in the
background, applied at the layer's next forward) is told in amax_reduction.py.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from transformer_linear.modules import quantized_init
from transformer_linear.modules.fp8_all_gather import FP8AllGatherWeight
from transformer_linear.modules.fp8_all_gather_params import gather_spec, make_fp8_all_gathered
from transformer_linear.modules.fsdp_gather_grouped import check_grouped_gatherable
from transformer_linear.modules.grouped_linear import GroupedLinear
from transformer_linear.modules.linear import Linear
from transformer_linear.modules.tensor_parallel import is_tensor_parallel
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.amax_reduction import DEFAULT_GROUP, NO_GROUP, all_reduce_amax, group_key
from transformer_linear.recipe.delayed_scaling import DelayedScalingState
from transformer_linear.recipe.quantization import check_recipe

__all__ = [
    "DEFAULT_GROUP",
    "NO_GROUP",
    "ColwiseParallel",
    "RowwiseParallel",
    "all_reduce_amax",
    "check_fsdp_compatible",
    "finish_amax_reductions",
    "fully_shard",
    "set_amax_reduction_group",
]


def _delayed_scaling_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that keep a delayed-scaling state: ``tl.Linear``, ``tl.GroupedLinear`` and
    the experts' ``ExpertsFP8State`` of a converted transformers model alike (selected by the state they
    hold, so that a module type added later is not silently left out of the reduction)."""
    return [m for m in model.modules() if isinstance(getattr(m, "delayed_scaling_state", None), DelayedScalingState)]


def finish_amax_reductions(model: nn.Module) -> nn.Module:
    """Apply every pending amax reduction of ``model``'s delayed-scaling states (``tl.Linear``,
    ``tl.GroupedLinear``, converted experts).

    Needed only to read ``fp8_amax_history`` / ``fp8_scale`` directly between
    steps; ``state_dict()`` and the next forward apply them anyway.

    Returns:
        ``model``.
    """
    for module in _delayed_scaling_modules(model):
        module.finish_amax_reductions()
    return model


def set_amax_reduction_group(model: nn.Module, group: Optional["dist.ProcessGroup"]) -> nn.Module:
    """Set the group every delayed-scaling state in ``model`` all-reduces its amaxes over (``tl.Linear``,
    ``tl.GroupedLinear`` and a converted transformers model's experts alike).

    Args:
        model: the model (or a single ``tl.Linear``).
        group: the data-parallel group; None turns the reduction off (each
            rank then keeps its own scales).

    Returns:
        ``model``.
    """
    key = group_key(group)
    for module in _delayed_scaling_modules(model):
        module.amax_reduction_group = key
    return model


def check_fsdp_compatible(model: nn.Module) -> None:
    """Raise if a ``tl.Linear`` in ``model`` uses an option FSDP2 cannot honour.

    FSDP2 reduce-scatters ``weight.grad`` in its post-backward hook, so a weight
    gradient written later (``delay_wgrad_compute``'s ``backward_dw``) or
    elsewhere (``fuse_wgrad_accumulation``'s ``main_grad``) would never be
    reduced: the optimizer would silently step on an unreduced or missing gradient.
    """
    _check_wgrad_options(model, "fully_shard", "FSDP2", "its gradient reduction only sees weight.grad")


def _check_wgrad_options(model: nn.Module, where: str, engine: str, why: str) -> None:
    for fqn, module in model.named_modules():
        if isinstance(module, (Linear, GroupedLinear)):
            for option in ("delay_wgrad_compute", "fuse_wgrad_accumulation"):
                if getattr(module, option):
                    raise ValueError(
                        f"{where}: tl.{type(module).__name__} {fqn or '<root>'!r} has {option}=True, which {engine} "
                        "does not support "
                        f"({why}); build the layer with {option}=False"
                    )


def fully_shard(module: nn.Module, *, fp8_all_gather: Union[bool, Recipe] = False, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` after :func:`check_fsdp_compatible`, optionally gathering
    ``tl.Linear`` and ``tl.GroupedLinear`` weights in FP8.

    With ``fp8_all_gather``, each ``tl.Linear`` weight this call shards (not those an inner
    ``fully_shard`` call sharded already) is all-gathered quantized by its recipe's weight quantizer
    (modules/fp8_all_gather.py): FP8 data (1 byte per element; NVFP4: FP4, half a byte) and its scales
    instead of the fp32 / bf16 weight, and the forward's GEMMs read the gathered FP8 weight without
    casting again. One scale per tensor, and NVFP4's global scale, is the whole weight's (amax
    all-reduced over the shard group), so the gathered weight is bitwise the whole weight quantized, and
    training is bitwise what ``fp8_all_gather=False`` gives. A ``tl.GroupedLinear``'s experts are gathered
    the same way, each rank quantizing its whole experts with their own scales
    (modules/fsdp_gather_grouped.py).
    The optimizer, the gradient reduce-scatter and ``state_dict`` still see the high-precision weight.
    On a 1-rank mesh nothing is gathered and the weights stay as they are (the forward quantizes the
    whole weight, as the gather would have). Every ``tl.Linear`` and ``tl.GroupedLinear`` sharded here is
    marked ``fsdp_sharded``. A ``tl.quantized_model_init`` layer's FP8 Parameter (a GroupedLinear's: every
    expert's) becomes a high-precision one first (its preserved initial weight, else the dequantized
    one), which FSDP2 shards: the shards are the masters the optimizer steps (no
    ``tl.optim.MasterWeights`` needed), and with ``fp8_all_gather`` the weight exists unsharded only in FP8.

    Off by default: with it, a layer's weight exists unsharded only in its recipe's form, so the layer
    must run under that recipe in every forward (a high-precision forward, or one under another recipe,
    raises), and the recipe is fixed when the model is sharded. Turn it on for FP8 training, where it
    halves (vs bf16) or quarters (vs fp32) the all-gather traffic at no numerical cost.

    Args:
        module: the module to shard.
        fp8_all_gather: False: gather in high precision (FSDP2's default). True: gather each layer's
            weight in FP8 by the layer's own recipe (a layer without one raises). A recipe: the recipe for
            layers without their own (those that run under ``tl.autocast(recipe=...)``).
        **kwargs: passed to ``torch.distributed.fsdp.fully_shard``.

    Raises:
        ValueError: a layer to gather in FP8 has no recipe, or its block-scaled weight cannot be sharded
            without a block straddling two ranks (each rank's rows must be a whole number of the blocks'
            rows: a 128x128 block needs rows a multiple of 128 x world size, NVFP4's 16x16 tiles 16 x
            world size), or it is NVFP4 with 1x16 weight blocks or stochastic rounding of the weight
            (recipe/kind_nvfp4.py); or a GroupedLinear's experts cannot be gathered in FP8
            (num_gemms not a multiple of the ranks, delayed scaling, NVFP4, ``backward_override=
            "high_precision"``: :func:`check_grouped_gatherable`); shard that layer with
            ``fp8_all_gather=False`` first.
    """
    check_fsdp_compatible(module)
    for layer in module.modules():
        _master_weight_for_sharding(layer)
    if fp8_all_gather is not False:
        _wrap_for_fp8_all_gather(module, fp8_all_gather, kwargs.get("mesh"))
    sharded = torch_fully_shard(module, **kwargs)
    for layer in sharded.modules():
        if isinstance(layer, (Linear, GroupedLinear)):
            layer.fsdp_sharded = True
            quantized_init.requantize(layer)  # a quantized_model_init layer's whole-weight copy goes
    return sharded


def _master_weight_for_sharding(layer: nn.Module) -> None:
    """A ``tl.quantized_model_init`` layer's FP8 Parameter becomes the high-precision master the sharding
    (FSDP2, tensor parallelism) splits: its preserved initial weight, else the dequantized one."""
    if isinstance(layer, (Linear, GroupedLinear)) and isinstance(layer.weight, quantized_init.QuantizedWeight):
        # A GroupedLinear's (num_gemms, out, in) weight: each expert dequantized with its own scales.
        weight = layer.weight
        layer.weight = nn.Parameter(quantized_init.high_precision_weight(layer), requires_grad=weight.requires_grad)


def _wrap_for_fp8_all_gather(module: nn.Module, fp8_all_gather: Union[bool, Recipe], mesh: Any) -> None:
    """Make the weight of every ``tl.Linear`` and ``tl.GroupedLinear`` in ``module`` not sharded yet one that
    FSDP2 all-gathers quantized (modules/fp8_all_gather_params.py)."""
    if fp8_all_gather is not True:
        check_recipe("fully_shard", fp8_all_gather)
    default_recipe = None if fp8_all_gather is True else fp8_all_gather
    if mesh is not None:
        world_size = mesh.size(mesh.ndim - 1)
    else:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    # One rank gathers nothing: the weights stay plain, and the Linear's own forward quantizes the whole weight
    # bitwise as a gather would (a weight wrapped at conversion gathers it in high precision and quantizes
    # it after: fp8_all_gather.gather_on_one_rank).
    skip = world_size == 1
    for fqn, layer in module.named_modules():
        if not isinstance(layer, (Linear, GroupedLinear)) or isinstance(layer.weight, FP8AllGatherWeight):
            continue
        if is_tensor_parallel(layer.weight) or hasattr(layer.weight, "_local_tensor"):
            continue  # sharded already (an inner fully_shard call, or tensor parallelism)
        recipe = layer.recipe or default_recipe
        if recipe is None and layer.quantized_init is not None:
            recipe = layer.quantized_init.recipe
        spec = gather_spec(layer, recipe, "fully_shard", fqn, "pass the recipe it runs under as fp8_all_gather=recipe")
        grouped = isinstance(layer, GroupedLinear)
        where = f"fully_shard (tl.GroupedLinear {fqn or '<root>'!r})" if grouped else "fully_shard"
        if skip:
            if grouped:
                check_grouped_gatherable(spec, layer.num_gemms, 1, where)
            continue
        make_fp8_all_gathered(layer, spec, where, world_size)


def _styles() -> tuple[type, type]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel.style import distribute_module

    def apply(style: Any, base: type, module: nn.Module, device_mesh: Any) -> nn.Module:
        # torch's styles accept only nn.Linear / nn.Embedding by type; a
        # tl.Linear has the same parameters, so it is partitioned the same way.
        if not isinstance(module, Linear):
            return base._apply(style, module, device_mesh)
        _check_wgrad_options(
            module, "parallelize_module", "tensor parallelism", "gradients of sharded weights are DTensors"
        )
        if base is TorchRowwise:
            style.desired_input_layouts = (Shard(-1),)
        _master_weight_for_sharding(module)  # shards of the master, not of the dequantized FP8 weight
        module = distribute_module(
            module,
            device_mesh,
            style._partition_linear_fn,
            partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
        )
        # distribute_module replicates buffers as DTensors; the delayed-scaling
        # state stays a plain per-rank tensor (the custom ops take local
        # tensors), kept identical on all ranks by the amax reduction.
        for name, buf in module._buffers.items():
            if buf is not None and is_tensor_parallel(buf):
                module._buffers[name] = buf.to_local()
        return module

    class ColwiseParallel(TorchColwise):
        """``ColwiseParallel`` that also shards ``tl.Linear`` (weight and bias ``Shard(0)``)."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return apply(self, TorchColwise, module, device_mesh)

    class RowwiseParallel(TorchRowwise):
        """``RowwiseParallel`` that also shards ``tl.Linear`` (weight ``Shard(1)``, bias replicated)."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return apply(self, TorchRowwise, module, device_mesh)

    return ColwiseParallel, RowwiseParallel


def __getattr__(name: str) -> Any:
    # The styles subclass torch's, whose import is heavy: build them on first use.
    if name in ("ColwiseParallel", "RowwiseParallel"):
        colwise, rowwise = _styles()
        globals().update(ColwiseParallel=colwise, RowwiseParallel=rowwise)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
