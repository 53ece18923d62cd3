"""tl.GroupedLinear under torch.distributed on 2 gloo ranks (CPU): DDP and FSDP2 (fully_shard, which shards
the (num_experts, out, in) weight along the experts) against the single process, as tests/test_distributed.py
holds tl.Linear.

The model is two GroupedLinear layers (an experts MLP) with a fixed routing: each token's expert is part of
the batch. A rank runs its half of each global batch, its tokens sorted by expert, with ``m_splits`` a tensor;
the single process runs the whole batch sorted by expert. The loss is a sum over tokens (invariant under the
sort) and the reference divides its gradients by the world size, as DDP's and FSDP2's averaging computes.
What is left is fp32 summation order (each expert's wgrad over a rank's tokens plus an all-reduce), and for
current and block scaling each rank's own scales (tests/test_distributed.py explains the tolerances)."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from test_distributed import (
    BLOCK_SCALING_TOL,
    CURRENT_SCALING_TOL,
    FP32_ORDER_TOL,
    STEPS,
    TIMEOUT,
    _assert_same_on_all_ranks,
    _fp8_state,
    _full,
    _sgd,
)
from tolerances import assert_bitwise_equal, relative_error
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe

EXPERTS, HIDDEN, FFN, ROWS = 4, 16, 32, 16
RECIPES = {name: recipe.from_name(name) for name in ("current", "block", "mxfp8", "rowwise")}
RECIPES = {"none": None, "delayed": recipe.from_name("delayed", amax_history_len=4), **RECIPES}
TOLERANCES = {"current": CURRENT_SCALING_TOL, **dict.fromkeys(("block", "mxfp8", "rowwise"), BLOCK_SCALING_TOL)}


class _Experts(nn.Module):
    """An experts MLP: up projection, ReLU, down projection, each expert on its tokens."""

    def __init__(self, fp8_recipe, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = tl.GroupedLinear(EXPERTS, HIDDEN, FFN, recipe=fp8_recipe)
        self.down = tl.GroupedLinear(EXPERTS, FFN, HIDDEN, recipe=fp8_recipe)

    def forward(self, x, m_splits):
        return self.down(torch.relu(self.up(x, m_splits)), m_splits)


def _batches(steps):
    """The global batches (tokens, their experts, targets), the same on every rank; expert 3 gets no token
    of the first batch."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for step in range(steps):
        experts = torch.randint(0, EXPERTS - (step == 0), (ROWS,), generator=g)
        batches.append((torch.randn(ROWS, HIDDEN, generator=g) * 3, experts, torch.randn(ROWS, HIDDEN, generator=g)))
    return batches


def _sorted_by_expert(x, experts, target):
    """The tokens sorted by expert (stable) and the tokens per expert, as a tensor (no host read)."""
    order = torch.sort(experts, stable=True).indices
    return x[order], torch.bincount(experts, minlength=EXPERTS), target[order]


def _step(model, opt, x, experts, target, grad_div=1):
    x, m_splits, target = _sorted_by_expert(x, experts, target)
    opt.zero_grad()
    ((model(x, m_splits) - target) ** 2).sum().backward()
    if grad_div != 1:
        for p in model.parameters():
            p.grad.div_(grad_div)
    opt.step()


def _train(model, batches, rank, world):
    opt = _sgd(model)
    for batch in batches:
        _step(model, opt, *(t.chunk(world)[rank] for t in batch))


def _assert_matches_reference(model, name, batches, world, what):
    ref = tl.distributed.set_amax_reduction_group(_Experts(RECIPES[name]), None)
    opt = _sgd(ref)
    for batch in batches:
        _step(ref, opt, *batch, grad_div=world)
    tol = TOLERANCES.get(name, FP32_ORDER_TOL)
    for (pname, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        err = relative_error(_full(p).detach(), p_ref.detach())
        assert err <= tol, f"{what} {pname}: relative error {err:.3e} vs single process exceeds {tol:.0e}"
    states = _fp8_state(model)
    assert len(states) == 2, "each GroupedLinear keeps a delayed-scaling state"
    for (h, s), (h_ref, s_ref) in zip(states, _fp8_state(ref)):
        assert_bitwise_equal(s, s_ref, f"{what} delayed scales vs single process")
        assert_bitwise_equal(h, h_ref, f"{what} amax history vs single process")


def _ddp_rank(rank, world, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = _batches(STEPS)
    model = DDP(_Experts(RECIPES[name]))
    _train(model, batches, rank, world)
    _assert_same_on_all_ranks(model.module, f"DDP[{name}]")
    _assert_matches_reference(model.module, name, batches, world, f"DDP[{name}]")


def _fully_shard_experts(fp8_recipe, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _Experts(fp8_recipe)
    for layer in (model.up, model.down):
        tl.distributed.fully_shard(layer, mesh=mesh, **kwargs)
    return tl.distributed.fully_shard(model, mesh=mesh, **kwargs)


def _fsdp_rank(rank, world, name):
    from torch.distributed.tensor import DTensor

    batches = _batches(STEPS)
    model = _fully_shard_experts(RECIPES[name])
    # FSDP2 shards dim 0: each rank stores the weights of EXPERTS / world experts, gathered for compute.
    assert isinstance(model.up.weight, DTensor) and model.up.weight.to_local().shape == (EXPERTS // world, FFN, HIDDEN)
    _train(model, batches, rank, world)
    _assert_same_on_all_ranks(model, f"FSDP2[{name}]")
    _assert_matches_reference(model, name, batches, world, f"FSDP2[{name}]")


def _amax_reduction_rank(rank, world):
    """Delayed scaling reduces the GroupedLinear's amaxes over the ranks (set_amax_reduction_group applies to
    it as to tl.Linear): the same scales on every rank though each sees other tokens."""
    layer = tl.GroupedLinear(EXPERTS, HIDDEN, FFN, recipe=recipe.DelayedScaling(amax_history_len=4))
    torch.manual_seed(10 + rank)
    x = (torch.randn(ROWS, HIDDEN) * (rank + 1)).requires_grad_()
    for _ in range(2):
        layer(x, torch.tensor([4, 4, 4, 4])).square().sum().backward()
    history = layer.state_dict()["fp8_amax_history"]
    gathered = [torch.empty_like(history) for _ in range(world)]
    dist.all_gather(gathered, history)
    assert_bitwise_equal(gathered[0], gathered[1], "amax history across ranks")
    local = x.detach().abs().max().reshape(1)
    amaxes = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(amaxes, local)
    assert_bitwise_equal(history[-1, 0], torch.cat(amaxes).max(), "the input amax: the max over the ranks")


def _fsdp_rejects_rank(rank, world, option):
    with pytest.raises(ValueError, match=f"tl.GroupedLinear 'up' has {option}=True, which FSDP2 does not support"):
        from torch.distributed.device_mesh import init_device_mesh

        model = _Experts(RECIPES["current"])
        model.up = tl.GroupedLinear(EXPERTS, HIDDEN, FFN, recipe=RECIPES["current"], **{option: True})
        tl.distributed.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))


class TestGroupedDDP:
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_matches_single_process(self, name):
        run_ranks(_ddp_rank, name, timeout=TIMEOUT)


class TestGroupedFSDP2:
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_matches_single_process(self, name):
        run_ranks(_fsdp_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("option", ["delay_wgrad_compute", "fuse_wgrad_accumulation"])
    def test_unsupported_wgrad_options_raise_at_wrap_time(self, option):
        run_ranks(_fsdp_rejects_rank, option, timeout=TIMEOUT)


def test_delayed_scaling_amaxes_are_reduced_across_ranks():
    run_ranks(_amax_reduction_rank, timeout=TIMEOUT)
