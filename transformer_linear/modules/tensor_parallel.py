"""Running a ``tl.Linear`` whose parameters are DTensors (``parallelize_module``) on local shards.

Below the Linear, which calls it; the user-facing styles that shard a
``tl.Linear`` are in distributed.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import Tensor, nn

if dist.is_available():
    from torch.distributed.tensor import DTensor as _DTensor
else:  # builds without distributed support
    _DTensor = None

__all__ = ["is_tensor_parallel", "tensor_parallel_forward"]


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
