"""tl.quantized_model_init under tensor parallelism: ColwiseParallel / RowwiseParallel shard the layer's
master (the preserved initial weight), so training is bitwise the tensor-parallel training of the same
model built without quantized_model_init (2 gloo ranks)."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from tolerances import assert_bitwise_equal
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.quantized_init import QuantizedWeight

WORLD = 2
STEPS = 3


def _tp_mlp(name, quantized):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    r = recipe.from_name(name)
    torch.manual_seed(0)
    with tl.quantized_model_init(enabled=quantized, recipe=r, preserve_high_precision_init_val=True):
        model = nn.Sequential(tl.Linear(64, 128, recipe=r), nn.ReLU(), tl.Linear(128, 64, recipe=r))
    assert isinstance(model[0].weight, QuantizedWeight) == quantized
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"0": tl.distributed.ColwiseParallel(), "2": tl.distributed.RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _tp_rank(rank, world, name):
    on, off = _tp_mlp(name, True), _tp_mlp(name, False)
    assert type(on[0].weight.to_local()) is torch.Tensor  # the master's shard
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 64, generator=g) for _ in range(STEPS)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (on, off)]
    for step, x in enumerate(batches):
        losses = []
        for model, opt in zip((on, off), opts):
            loss = model(x).square().mean()  # RowwiseParallel's output: replicated, a local tensor
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert_bitwise_equal(losses[0], losses[1], f"{name}: tensor-parallel loss of step {step}")
    for (pname, a), b in zip(on.named_parameters(), off.parameters()):
        assert_bitwise_equal(a.full_tensor(), b.full_tensor(), f"{name}: {pname} after {STEPS} steps")


class TestTensorParallel:
    @pytest.mark.parametrize("name", ["current", "block"])
    def test_shards_the_master(self, name):
        run_ranks(_tp_rank, name, world_size=WORLD, timeout=180.0)
