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

The group is a per-module knob (:func:`set_amax_reduction_group`); by default
it is the default process group when one is initialised with more than one
rank, and nothing otherwise. How and when the reduction runs (in the
background, applied at the layer's next forward) is told in amax_reduction.py.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from transformer_linear.modules.linear import Linear
from transformer_linear.modules.tensor_parallel import is_tensor_parallel
from transformer_linear.recipe.amax_reduction import DEFAULT_GROUP, NO_GROUP, all_reduce_amax, group_key

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


def finish_amax_reductions(model: nn.Module) -> nn.Module:
    """Apply every ``tl.Linear``'s pending amax reductions to its delayed-scaling state.

    Needed only to read ``fp8_amax_history`` / ``fp8_scale`` directly between
    steps; ``state_dict()`` and the next forward apply them anyway.

    Returns:
        ``model``.
    """
    for module in model.modules():
        if isinstance(module, Linear):
            module.finish_amax_reductions()
    return model


def set_amax_reduction_group(model: nn.Module, group: Optional["dist.ProcessGroup"]) -> nn.Module:
    """Set the group every ``tl.Linear`` in ``model`` all-reduces its delayed-scaling amaxes over.

    Args:
        model: the model (or a single ``tl.Linear``).
        group: the data-parallel group; None turns the reduction off (each
            rank then keeps its own scales).

    Returns:
        ``model``.
    """
    key = group_key(group)
    for module in model.modules():
        if isinstance(module, Linear):
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
        if isinstance(module, Linear):
            for option in ("delay_wgrad_compute", "fuse_wgrad_accumulation"):
                if getattr(module, option):
                    raise ValueError(
                        f"{where}: tl.Linear {fqn or '<root>'!r} has {option}=True, which {engine} does not support "
                        f"({why}); build the layer with {option}=False"
                    )


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` after :func:`check_fsdp_compatible`.

    Args:
        module: the module to shard.
        **kwargs: passed to ``torch.distributed.fsdp.fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    check_fsdp_compatible(module)
    return torch_fully_shard(module, **kwargs)


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
