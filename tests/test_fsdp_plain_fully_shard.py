"""FP8 all-gather under plain ``torch.distributed.fsdp.fully_shard``, as engines call it (torchtitan,
accelerate, Lightning): an ``nn.Linear`` model converted with ``convert_to_fp8(..., fp8_all_gather=True)``
and sharded by torch's own ``fully_shard`` gathers its weights in the recipe's form and trains bitwise as
the same model gathered in high precision, for every registry recipe, with and without bias. A one-rank
group (FSDP2 gathers nothing there) gathers the high-precision weight and quantizes it after. A model built
under ``tl.quantized_model_init`` gathers quantized with no conversion call, as the converted model does.

2 gloo ranks; 256-row weights (128 a rank: whole blocks of every recipe whose blocks span rows).
"""

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from recipe_tables import NAMES, weight_quantizer
from test_fsdp_fp8_all_gather import _GatherCounter
from tolerances import assert_bitwise_equal
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.fp8_all_gather import FP8AllGatherWeight, check_shardable
from transformer_linear.modules.fsdp_gather_grouped import GroupedFP8AllGatherWeight

IN, HIDDEN, OUT = 128, 256, 256
STEPS = 5
TIMEOUT = 240.0


def _gathers_quantized(name: str, world: int) -> bool:
    """Whether ``name``'s weight quantizer gathers a weight of HIDDEN / OUT rows over ``world`` ranks."""
    try:
        check_shardable(weight_quantizer(name), OUT, world)
    except ValueError:
        return False
    return True


def _model(name, fp8_all_gather, world):
    """Two layers, the first with a bias, the second without; converted, then sharded by torch's fully_shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT, bias=False))
    model = tl.convert_to_fp8(model, recipe=recipe.from_name(name), fp8_all_gather=fp8_all_gather, fp8_state=None)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batches(rank, world):
    rows = 16 * world  # NVFP4 quantizes the input's columnwise copy in 16-row blocks: 16 rows a rank
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, IN, generator=g) * 3).chunk(world)[rank] for _ in range(STEPS)]


def _train(model, rank, world):
    torch.manual_seed(2)  # NVFP4 rounds grad_output stochastically, with seeds from the default generator
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in _batches(rank, world):
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.full_tensor() for p in model.parameters()]


def _parity_rank(rank, world, name):
    on = _model(name, True, world)
    assert isinstance(on[0].weight.to_local(), FP8AllGatherWeight)
    if world > 1 and not _gathers_quantized(name, world):
        with pytest.raises(ValueError, match="fp8_all_gather cannot shard a weight"):
            on(_batches(rank, world)[0])
        return None
    with _GatherCounter() as counter:
        run = _train(on, rank, world)
    _assert_same_run(on, run, _train(_model(name, False, world), rank, world), f"{name}: FP8 vs high-precision gather")
    return _gathered_vs_fp32(counter, world) if world > 1 else None


def _assert_same_run(model, run, reference, what):
    """``run`` (losses, parameters) bitwise ``reference``'s, and ``model``'s state_dict holding plain shards."""
    (losses, params), (ref_losses, ref_params) = run, reference
    assert_bitwise_equal(losses, ref_losses, f"{what}: losses")
    for i, (a, b) in enumerate(zip(params, ref_params, strict=True)):
        assert_bitwise_equal(a, b, f"{what}: parameter {i} after {STEPS} steps")
    for key, t in model.state_dict().items():
        if key.endswith("weight"):
            assert type(t.to_local()) is torch.Tensor, f"{key}: the saved shard is a {type(t.to_local()).__name__}"


def _gathered_vs_fp32(counter, world):
    """The bytes a rank all-gathered against its fp32 weight shards' (one forward and one backward gather a step)."""
    weights = HIDDEN * IN + OUT * HIDDEN
    return counter.bytes / (weights * 4 / world * STEPS * 2)


@pytest.mark.parametrize("name", NAMES)
def test_plain_fully_shard_gathers_quantized(name):
    ratios = run_ranks(_parity_rank, name, world_size=2, timeout=TIMEOUT)
    if _gathers_quantized(name, 2):
        # FP8 data and scales (NVFP4: FP4) plus the biases, in place of fp32 weights.
        assert all(r is not None and r <= 0.3 for r in ratios), ratios


@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_one_rank_gathers_high_precision_and_quantizes_after(name):
    run_ranks(_parity_rank, name, world_size=1, timeout=TIMEOUT)


def _quantized_init_model(name, world, convert, shard=fully_shard):
    """The same two layers built under quantized_model_init (``convert``: then converted with
    fp8_all_gather=True, the explicit way), sharded by ``shard`` (torch's fully_shard)."""
    torch.manual_seed(0)
    with tl.quantized_model_init(recipe=recipe.from_name(name), preserve_high_precision_init_val=True):
        model = nn.Sequential(tl.Linear(IN, HIDDEN, recipe=recipe.from_name(name)), nn.GELU(),
                              tl.Linear(HIDDEN, OUT, bias=False, recipe=recipe.from_name(name)))
    if convert:
        model = tl.convert_to_fp8(model, recipe=recipe.from_name(name), fp8_all_gather=True, fp8_state=None)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh)
    return shard(model, mesh=mesh)


def _quantized_init_rank(rank, world, name):
    if not _gathers_quantized(name, world):
        # Gathered in high precision: as tl.distributed.fully_shard(fp8_all_gather=False) shards the same model.
        with pytest.warns(UserWarning, match="gathers in high precision"):
            model = _quantized_init_model(name, world, convert=False)
        assert type(model[0].weight.to_local()) is torch.Tensor
        reference = _train(_quantized_init_model(name, world, convert=False, shard=tl.distributed.fully_shard), rank,
                           world)
        _assert_same_run(model, _train(model, rank, world), reference, f"{name}: high-precision gather")
        return None
    model = _quantized_init_model(name, world, convert=False)
    assert isinstance(model[0].weight.to_local(), FP8AllGatherWeight)
    with _GatherCounter() as counter:
        run = _train(model, rank, world)
    assert counter.fp8_gathers > 0
    reference = _train(_quantized_init_model(name, world, convert=True), rank, world)
    _assert_same_run(model, run, reference, f"{name}: quantized_model_init vs converted")
    return _gathered_vs_fp32(counter, world)


@pytest.mark.parametrize("name", NAMES)
def test_quantized_model_init_gathers_quantized_with_no_conversion(name):
    """Weights kept quantized by quantized_model_init and sharded by torch's fully_shard (no convert_to_fp8,
    no tl.distributed): their shards are the masters, gathered in the recipe's form, training bitwise as the
    explicitly converted model; a recipe that cannot gather the shards quantized gathers them in high
    precision, with a warning."""
    ratios = run_ranks(_quantized_init_rank, name, world_size=2, timeout=TIMEOUT)
    if _gathers_quantized(name, 2):
        assert all(r is not None and r <= 0.3 for r in ratios), ratios


def test_grouped_linear_experts_under_plain_fully_shard():
    run_ranks(_grouped_rank, world_size=2, timeout=TIMEOUT)


def _grouped_rank(rank, world):
    def build(fp8_all_gather):
        torch.manual_seed(3)
        experts = tl.GroupedLinear(4, IN, OUT, recipe=recipe.from_name("mxfp8"))
        experts = tl.convert_to_fp8(experts, fp8_all_gather=fp8_all_gather, fp8_state=None)
        return fully_shard(experts, mesh=init_device_mesh("cpu", (world,)))

    runs = [_grouped_losses(build(fp8_all_gather), rank) for fp8_all_gather in (True, False)]
    assert_bitwise_equal(runs[0], runs[1], f"rank {rank}: GroupedLinear losses, FP8 vs high-precision gather")
    assert dist.get_world_size() == world


def _grouped_losses(model, rank):
    """The losses of 3 AdamW steps of a sharded GroupedLinear on this rank's tokens (an empty expert among them)."""
    sizes = [8, 0, 16, 8]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4 + rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(sum(sizes), IN, generator=g), sizes).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_quantized_model_init_experts_under_plain_fully_shard():
    run_ranks(_grouped_quantized_init_rank, world_size=2, timeout=TIMEOUT)


def _grouped_quantized_init_rank(rank, world):
    """A GroupedLinear built under quantized_model_init and sharded by torch's fully_shard gathers its experts
    in FP8 (each rank's whole experts), training bitwise as the same layer converted with fp8_all_gather."""

    def build(convert):
        torch.manual_seed(3)
        with tl.quantized_model_init(recipe=recipe.from_name("mxfp8"), preserve_high_precision_init_val=True):
            experts = tl.GroupedLinear(4, IN, OUT, recipe=recipe.from_name("mxfp8"))
        if convert:
            experts = tl.convert_to_fp8(experts, fp8_all_gather=True, fp8_state=None)
        return fully_shard(experts, mesh=init_device_mesh("cpu", (world,)))

    runs = []
    for convert in (False, True):
        model = build(convert)
        assert isinstance(model.weight.to_local(), GroupedFP8AllGatherWeight)
        runs.append(_grouped_losses(model, rank))
    assert_bitwise_equal(runs[0], runs[1], f"rank {rank}: GroupedLinear losses, quantized_model_init vs converted")
