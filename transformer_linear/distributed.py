"""``tl.Linear`` with torch.distributed: amax reduction across ranks, the
tensor-parallel styles, and the checks that keep FSDP2 / tensor parallelism
from going silently wrong.

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
rank, and nothing otherwise. A ProcessGroup cannot be an op argument, so the
ops take an int key into :data:`_GROUPS`, resolved here.

When the reduction
------------------
The ``transformer_linear::delayed_scaling_update`` custom op launches the
all-reduce asynchronously and returns; ``delayed_scaling_flush`` applies it
(wait, record, update the scales) at the start of the layer's next forward,
the first point that reads the scales. The updated scales are the same as a
blocking reduction's, but no rank waits for the others in the middle of
forward or backward (on a GPU, the compute stream does not wait behind the
gradient collectives queued on the same group). Until then the layer's
``fp8_amax_history`` / ``fp8_scale`` lag by the pending updates:
``state_dict()`` applies them first, and so does
:func:`finish_amax_reductions`. Both ops are opaque to torch.compile, so
eager and compiled runs issue the same collectives.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

if dist.is_available():
    from torch.distributed.tensor import DTensor as _DTensor
else:  # builds without distributed support
    _DTensor = None

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

NO_GROUP = -1
"""Key: no amax reduction."""
DEFAULT_GROUP = 0
"""Key: the default process group, resolved when the op runs (nothing if uninitialised or one rank)."""

_GROUPS: dict[int, Any] = {}
_KEYS: dict[int, int] = {}  # id(group) -> key; _GROUPS keeps the group alive, so ids are not reused
_NEXT_KEY = itertools.count(1)


def group_key(group: Optional["dist.ProcessGroup"]) -> int:
    """The int key the custom op takes for ``group`` (None: no reduction)."""
    if group is None:
        return NO_GROUP
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"set_amax_reduction_group: 'group' must be a ProcessGroup or None, got {group!r}")
    key = _KEYS.get(id(group))
    if key is None:
        key = next(_NEXT_KEY)
        _KEYS[id(group)] = key
        _GROUPS[key] = group
    return key


def _resolve(key: int) -> Optional["dist.ProcessGroup"]:
    if key == NO_GROUP or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.group.WORLD if key == DEFAULT_GROUP else _GROUPS[key]
    return group if dist.get_world_size(group) > 1 else None


def all_reduce_amax(amax: Tensor, key: int) -> Tensor:
    """``amax`` all-reduced with MAX over the group of ``key``: a new tensor, or ``amax`` itself without a group."""
    group = _resolve(key)
    if group is None:
        return amax
    reduced = amax.detach().clone()  # ``amax`` may be saved or returned elsewhere
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced


def reduces_amax(key: int) -> bool:
    """Whether the group of ``key`` is live: initialised, more than one rank."""
    return _resolve(key) is not None


# A layer's launched, not yet applied reductions, in launch order:
# (work, amax being reduced, *the update's arguments after amax*).
_PENDING: dict[int, list[tuple[Any, ...]]] = {}


def launch_amax_reduction(amax: Tensor, key: int, layer_key: int, *update_args: Any) -> bool:
    """Start an async MAX all-reduce of a copy of ``amax``; False (nothing started) without a live group.

    ``update_args`` are kept for :func:`pop_amax_reductions`'s caller, which
    applies the update once the reduction is done.
    """
    group = _resolve(key)
    if group is None:
        return False
    reduced = amax.detach().clone()  # ``amax`` may be saved or returned elsewhere
    work = dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _PENDING.setdefault(layer_key, []).append((work, reduced, *update_args))
    return True


def pop_amax_reductions(layer_key: int) -> list[tuple[Any, ...]]:
    """The layer's launched reductions as (reduced amax, *update_args), waited for, in launch order."""
    pending = _PENDING.pop(layer_key, [])
    for work, *_ in pending:
        work.wait()
    return [tuple(rest) for _, *rest in pending]


def discard_amax_reductions(layer_key: int) -> None:
    """Forget the layer's launched reductions (its state is being replaced, or the layer is gone)."""
    _PENDING.pop(layer_key, None)


def finish_amax_reductions(model: nn.Module) -> nn.Module:
    """Apply every ``tl.Linear``'s pending amax reductions to its delayed-scaling state.

    Needed only to read ``fp8_amax_history`` / ``fp8_scale`` directly between
    steps; ``state_dict()`` and the next forward apply them anyway.

    Returns:
        ``model``.
    """
    from transformer_linear.linear import Linear

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
    from transformer_linear.linear import Linear

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
    from transformer_linear.linear import Linear

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


# ---------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------


def is_tensor_parallel(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (e.g. a parallelize_module-sharded parameter)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(inp: Tensor, placement: Any) -> Tensor:
    """The local shard of ``inp`` in ``placement`` (a plain tensor is taken to be that shard already)."""
    if is_tensor_parallel(inp):
        return inp.redistribute(placements=[placement]).to_local()
    return inp


def tensor_parallel_forward(module: nn.Module, inp: Tensor, run: Callable[..., Tensor]) -> Tensor:
    """A sharded ``tl.Linear``'s forward on local shards; returns a DTensor.

    The FP8 custom ops run on plain local tensors (quantize and GEMM see only
    this rank's shard), and DTensor does the communication around them:

    * column-parallel (weight ``Shard(0)``): replicated input, output sharded
      on its last dim, no communication;
    * row-parallel (weight ``Shard(1)``): input sharded on its last dim, partial
      outputs all-reduced, then the replicated bias added once.

    Under delayed scaling the amax all-reduce (default group) makes every
    shard's scales those of the whole tensor, as in the unsharded layer.

    Args:
        module: the ``tl.Linear`` whose parameters are DTensors on a 1-D mesh.
        inp: the input (DTensor, or a plain tensor already in the local layout).
        run: ``run(inp, weight, bias) -> out`` on local tensors.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    weight, bias = module.weight, module.bias
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if placements == (Shard(0),):
        out = run(_local(inp, Replicate()), weight.to_local(), bias.to_local() if bias is not None else None)
        return _DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
    if placements == (Shard(1),):
        out = run(_local(inp, Shard(inp.dim() - 1)), weight.to_local(), None)
        out = _DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return out if bias is None else out.redistribute(placements=[Replicate()]) + bias
    raise ValueError(
        f"tl.Linear: tensor parallelism needs the weight sharded Shard(0) (colwise) or Shard(1) (rowwise) "
        f"on a 1-D mesh, got placements {placements}"
    )


def _styles() -> tuple[type, type]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel.style import distribute_module

    from transformer_linear.linear import Linear

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
