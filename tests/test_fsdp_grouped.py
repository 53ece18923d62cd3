"""tl.GroupedLinear under FSDP2 (``tl.distributed.fully_shard``) on 2 gloo ranks (CPU), beyond what
tests/test_distributed_grouped.py holds: a layer built under ``tl.quantized_model_init`` and the FP8 all-gather
of the experts' weights (``fp8_all_gather=True``).

quantized_model_init: fully_shard makes the experts' FP8 weight the high-precision master first (the
preserved initial weight, else the dequantized one), which FSDP2 shards along the experts; with the preserved
initial weight, training is bitwise the same model sharded without quantized_model_init, and within the
single-process tolerances (tests/test_distributed.py) of the unsharded quantized model stepped through
tl.optim.MasterWeights.

FP8 all-gather: FSDP2 shards dim 0, the experts; with the experts a multiple of the ranks each rank holds
whole experts, which it quantizes with the layer's weight quantizer (each expert its own scales), so the
gathered weight is bitwise the whole weight quantized and training is bitwise that of the high-precision
gather.
"""


import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from test_distributed import CURRENT_SCALING_TOL, FP32_ORDER_TOL, STEPS, TIMEOUT, _full, _sgd
from test_distributed_grouped import EXPERTS, RECIPES, TOLERANCES, _batches, _Experts, _sorted_by_expert
from test_fsdp_fp8_all_gather import _GatherCounter
from tolerances import assert_bitwise_equal, relative_error
from torch import nn

import transformer_linear as tl
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.modules.fp8_all_gather import GatheredFP8Weight
from transformer_linear.modules.fsdp_gather_grouped import GroupedFP8AllGatherWeight
from transformer_linear.modules.fsdp_gather_usages import BOTH, COLUMNWISE, ROWWISE
from transformer_linear.modules.quantized_init import QuantizedWeight
from transformer_linear.recipe.kind_nvfp4 import FP4_STORAGE_DTYPE

QUANTIZED_INIT_RECIPES = ["current", "delayed", "block", "mxfp8"]


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(model, **kwargs):
    mesh = _mesh()
    for layer in (model.up, model.down):
        tl.distributed.fully_shard(layer, mesh=mesh, **kwargs)
    return tl.distributed.fully_shard(model, mesh=mesh, **kwargs)


def _quantized_experts(name, preserve=True):
    r = RECIPES[name]
    with tl.quantized_model_init(recipe=r, preserve_high_precision_init_val=preserve):
        model = _Experts(r)
    assert isinstance(model.up.weight, QuantizedWeight)
    return model


def _train(model, opt, batches, rank, world, grad_div=1):
    """SGD steps on this rank's part of each batch: the losses and the (local) gradients of each step."""
    losses, grads = [], []
    for batch in batches:
        x, experts, target = (t.chunk(world)[rank] for t in batch) if world > 1 else batch
        x, m_splits, target = _sorted_by_expert(x, experts, target)
        opt.zero_grad()
        loss = ((model(x, m_splits) - target) ** 2).sum()
        loss.backward()
        if grad_div != 1:
            for p in model.parameters():
                p.grad.div_(grad_div)
        losses.append(loss.detach().clone())
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def _quantized_init_rank(rank, world, name):
    """The quantized_model_init model sharded: plain shards of the preserved initial weights, bitwise the
    training of the plain model sharded; within tolerance of the unsharded quantized model."""
    batches = _batches(STEPS)
    on = _shard(_quantized_experts(name))
    for layer in (on.up, on.down):
        assert type(layer.weight.to_local()) is torch.Tensor, type(layer.weight.to_local())
        assert layer.weight.to_local().shape[0] == EXPERTS // world
        assert tl.get_high_precision_init_val(layer) is None  # it became the master
    off = _shard(_Experts(RECIPES[name]))
    losses_on, grads_on = _train(on, _sgd(on), batches, rank, world)
    losses_off, grads_off = _train(off, _sgd(off), batches, rank, world)
    for step, (l_on, l_off, g_on, g_off) in enumerate(zip(losses_on, losses_off, grads_on, grads_off)):
        assert_bitwise_equal(l_on, l_off, f"{name}: loss of step {step}")
        for (pname, _), a, b in zip(on.named_parameters(), g_on, g_off):
            assert_bitwise_equal(a, b, f"{name}: gradient of {pname}, step {step}")
    for (pname, a), b in zip(on.named_parameters(), off.parameters()):
        assert_bitwise_equal(a.full_tensor(), b.full_tensor(), f"{name}: {pname} after {STEPS} steps")

    # The unsharded quantized model, its masters stepped by SGD through MasterWeights on the whole batches.
    ref = tl.distributed.set_amax_reduction_group(_quantized_experts(name), None)
    masters = tl.optim.MasterWeights(ref)
    opt = torch.optim.SGD(masters.parameters(), lr=1e-3)  # the masters and the biases
    masters.attach(opt)
    _train(ref, opt, batches, 0, 1, grad_div=world)
    # Delayed scaling: the unsharded model's FP8 weights have each expert's own scale (quantized_model_init),
    # the sharded model's forward quantizes the master with the history's one scale: FP8 rounding apart,
    # as current scaling's per-rank scales are (measured: 3.3e-3).
    tol = CURRENT_SCALING_TOL if name == "delayed" else TOLERANCES.get(name, FP32_ORDER_TOL)
    ref_params = {"up.weight": masters.master_of(ref.up.weight), "down.weight": masters.master_of(ref.down.weight),
                  "up.bias": ref.up.bias, "down.bias": ref.down.bias}
    for pname, p in on.named_parameters():
        err = relative_error(_full(p).detach(), ref_params[pname].detach())
        assert err <= tol, f"{name} {pname}: relative error {err:.3e} vs the unsharded quantized model > {tol:.0e}"


def _dequantized_master_rank(rank, world):
    """Without the preserved initial weight the master is the dequantized FP8 weight; the model trains, and
    its state_dict (plain DTensors of the master's shards) round-trips through DCP into the plain model."""
    import torch.distributed.checkpoint as dcp

    model = _quantized_experts("current", preserve=False)
    dequantized = {n: m.weight.dequantize() for n, m in (("up", model.up), ("down", model.down))}
    model = _shard(model)
    for n, layer in (("up", model.up), ("down", model.down)):
        assert_bitwise_equal(layer.weight.full_tensor(), dequantized[n], f"{n}: the master is the dequantized weight")
    _train(model, _sgd(model), _batches(2), rank, world)
    state = model.state_dict()
    params = {k: t for k, t in state.items() if k.endswith(("weight", "bias"))}
    assert len(params) == 4 and all(type(t.to_local()) is torch.Tensor for t in params.values()), params
    path = [None]
    if rank == 0:
        import tempfile

        path[0] = tempfile.mkdtemp()
    dist.broadcast_object_list(path)
    dcp.save(state, checkpoint_id=path[0])
    plain = _shard(_Experts(RECIPES["current"], seed=5))
    loaded = plain.state_dict()
    dcp.load(loaded, checkpoint_id=path[0])
    plain.load_state_dict(loaded)
    for (pname, a), b in zip(model.named_parameters(), plain.parameters()):
        assert_bitwise_equal(b.full_tensor(), a.full_tensor(), f"{pname} loaded from the checkpoint")
    # And into the quantized_model_init model sharded again (its masters written).
    again = _shard(_quantized_experts("current", preserve=False))
    loaded = again.state_dict()
    dcp.load(loaded, checkpoint_id=path[0])
    again.load_state_dict(loaded)
    for (pname, a), b in zip(model.named_parameters(), again.parameters()):
        assert_bitwise_equal(b.full_tensor(), a.full_tensor(), f"{pname} loaded into the quantized_model_init model")
    assert not any(isinstance(p.to_local(), QuantizedWeight) for p in again.parameters())
    dist.barrier()


# ---------------------------------------------------------------------------
# FP8 all-gather
# ---------------------------------------------------------------------------

GATHER_EXPERTS, GATHER_HIDDEN, GATHER_FFN, GATHER_ROWS = 4, 64, 128, 32
GATHER_RECIPES = ["current", "block", "mxfp8", "rowwise", "nvfp4"]
GATHER_RECIPE_OBJECTS = {**RECIPES, "nvfp4": tl.recipe.from_name("nvfp4")}
SEPARATE_COLUMNWISE = {"rowwise"}  # both copies gathered: the columnwise copy has blocks of its own, of other numels
# FP8 data is 1 byte an element against fp32's 4; the per-expert scales and the fp32 biases take the rest
# (measured: 0.26 for current and block, 0.27 for MXFP8's forward gathering the rowwise copy and backward the
# columnwise one). Both copies: 2 bytes an element (measured: 0.53 for Float8RowwiseScaling).
MAX_RATIO_VS_FP32 = 0.3
MAX_RATIO_BOTH_COPIES_VS_FP32 = 0.55


class _GatherExperts(nn.Module):
    """The experts MLP, wider (the biases' share of the bytes small) and with whole 128x128 blocks per expert."""

    def __init__(self, fp8_recipe, experts=GATHER_EXPERTS, checkpointed=False, **kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.up = tl.GroupedLinear(experts, GATHER_HIDDEN, GATHER_FFN, recipe=fp8_recipe, **kwargs)
        self.down = tl.GroupedLinear(experts, GATHER_FFN, GATHER_HIDDEN, recipe=fp8_recipe, **kwargs)
        self.checkpointed = checkpointed

    def _up(self, x, m_splits):
        # A GELU saves the recomputed output for its backward: a recompute reading another weight than the
        # forward's changes the gradients.
        return nn.functional.gelu(self.up(x, m_splits))

    def forward(self, x, m_splits):
        if not self.checkpointed:
            return self.down(torch.relu(self.up(x, m_splits)), m_splits)
        # Activation checkpointing (non-reentrant): each layer recomputed in backward, after FSDP2's backward
        # gather (MXFP8: the columnwise copy only, so the recompute gathers the rowwise copy itself).
        checkpoint = torch.utils.checkpoint.checkpoint
        h = checkpoint(self._up, x, m_splits, use_reentrant=False)
        return checkpoint(self.down, h, m_splits, use_reentrant=False)


def _gather_batches(steps):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GATHER_ROWS, GATHER_HIDDEN, generator=g) * 3,
         torch.randint(0, GATHER_EXPERTS, (GATHER_ROWS,), generator=g),
         torch.randn(GATHER_ROWS, GATHER_HIDDEN, generator=g))
        for _ in range(steps)
    ]


def _gather_step_bytes(model, rank, world):
    x, experts, target = (t.chunk(world)[rank] for t in _gather_batches(1)[0])
    x, m_splits, target = _sorted_by_expert(x, experts, target)
    seen = []
    for layer in (model.up, model.down):
        layer.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    with _GatherCounter(GroupedFP8AllGatherWeight) as counter:
        ((model(x, m_splits) - target) ** 2).sum().backward()
    return counter, seen


def _gather_bytes_rank(rank, world, name):
    r = GATHER_RECIPE_OBJECTS[name]
    fp8, seen = _gather_step_bytes(_shard(_GatherExperts(r), fp8_all_gather=True), rank, world)
    fp32, seen_off = _gather_step_bytes(_shard(_GatherExperts(r)), rank, world)
    # Each layer's weight gathered in forward and again in backward (reshard_after_forward), in FP8.
    assert len(fp8.gathered) == 4 and not fp32.gathered, (fp8.gathered, fp32.gathered)
    for tensors, _ in fp8.gathered:
        dtypes = [dtype for dtype, _ in tensors]
        expected = (FP4_STORAGE_DTYPE,) if name == "nvfp4" else FP8_DTYPES  # FP4: two values a byte
        assert dtypes[0] in expected, f"{name}: the experts' data gathered as {dtypes[0]}, expected {expected}"
        if name in SEPARATE_COLUMNWISE:
            assert len(dtypes) == 4 and dtypes[2] in FP8_DTYPES, f"{name}: gathered {dtypes}, expected both copies"
    # MXFP8's columnwise copy (1x32 blocks down the rows) is gathered by backward's gather alone.
    backward = COLUMNWISE if name == "mxfp8" else ROWWISE
    expected = [BOTH] * 4 if name in SEPARATE_COLUMNWISE else [ROWWISE] * 2 + [backward] * 2
    assert fp8.usages == expected, f"{name}: the gathers carried {fp8.usages}, expected {expected}"
    assert seen == [GatheredFP8Weight] * 2, f"the forward read {seen}, expected the gathered FP8 weight"
    assert GatheredFP8Weight not in seen_off
    ratio = fp8.bytes / fp32.bytes
    bound = MAX_RATIO_BOTH_COPIES_VS_FP32 if name in SEPARATE_COLUMNWISE else MAX_RATIO_VS_FP32
    assert ratio <= bound, f"{name}: FP8 all-gather {fp8.bytes} B vs fp32 {fp32.bytes} B: {ratio:.3f} > {bound}"
    return fp8.bytes, fp32.bytes


def _assert_same_training(rank, world, on, off, what, opt_cls=torch.optim.AdamW):
    batches = _gather_batches(STEPS)
    torch.manual_seed(3)  # NVFP4 rounds grad_output stochastically, with seeds from the default generator
    losses_on, grads_on = _train(on, opt_cls(on.parameters(), lr=1e-2), batches, rank, world)
    torch.manual_seed(3)
    losses_off, grads_off = _train(off, opt_cls(off.parameters(), lr=1e-2), batches, rank, world)
    for step, (l_on, l_off, g_on, g_off) in enumerate(zip(losses_on, losses_off, grads_on, grads_off)):
        assert_bitwise_equal(l_on, l_off, f"{what}: loss of step {step}")
        for (pname, _), a, b in zip(on.named_parameters(), g_on, g_off):
            assert_bitwise_equal(a, b, f"{what}: gradient of {pname}, step {step}")
    for (pname, a), b in zip(on.named_parameters(), off.parameters()):
        assert_bitwise_equal(a.full_tensor(), b.full_tensor(), f"{what}: {pname} after {STEPS} steps")


def _gather_parity_rank(rank, world, name, variant):
    """``variant``: None, "quantized_model_init", "bf16" (a bf16 MixedPrecisionPolicy: the shards cast before
    they are quantized), "dequantized" (backward_override: dgrad reads the forward's gathered rowwise copy, so
    backward's gather carries it too), "no_reshard" (one gather serves forward and backward) or "checkpointed"
    (activation checkpointing: the forward recomputed after backward's gather) or "compiled" / "inductor"
    (each layer under torch.compile(fullgraph=True), aot_eager / Inductor)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    r = GATHER_RECIPE_OBJECTS[name]
    if variant == "dequantized":
        r = tl.recipe.from_name(name, backward_override="dequantized")
    kwargs = {}
    if variant == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant == "no_reshard":
        kwargs["reshard_after_forward"] = False
    quantized = variant == "quantized_model_init"
    checkpointed = variant == "checkpointed"
    with tl.quantized_model_init(enabled=quantized, recipe=r, preserve_high_precision_init_val=True):
        on = _shard(_GatherExperts(r, checkpointed=checkpointed), fp8_all_gather=True, **kwargs)
    assert isinstance(on.up.weight.to_local(), GroupedFP8AllGatherWeight)
    off = _shard(_GatherExperts(r, checkpointed=checkpointed), **kwargs)
    if variant in ("compiled", "inductor"):
        # Per layer, as FSDP2 models are compiled (its hooks and all-gathers outside the graphs).
        torch._dynamo.utils.counters.clear()
        for layer in (on.up, on.down, off.up, off.down):
            layer.compile(backend="aot_eager" if variant == "compiled" else "inductor", fullgraph=True)
    _assert_same_training(rank, world, on, off, f"fp8_all_gather {name}, {variant}")
    if variant in ("compiled", "inductor"):
        # One graph per layer and model (the layers' shapes differ); MXFP8's forward and backward gathers,
        # which carry different copies, run the same graph.
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs == 4, f"torch.compile built {graphs} graphs of the two GroupedLinears of two models, expected 4"
    # The saved state: plain tensors (the masters' shards).
    assert type(on.state_dict()["up.weight"].to_local()) is torch.Tensor


def _gather_errors_rank(rank, world):
    for name, match in (
        ("delayed", "delayed scaling quantizes every expert with the layer's one history scale"),
        ("nvfp4", r"NVFP4 \[1, 16\] weight blocks: only 16x16 ones are gathered in FP4"),
    ):
        options = {"disable_2d_quantization": True} if name == "nvfp4" else {}
        with pytest.raises(ValueError, match=match):
            _shard(_GatherExperts(tl.recipe.from_name(name, **options)), fp8_all_gather=True)
    with pytest.raises(ValueError, match=r"GroupedLinear '<root>'.*3 experts over 2 ranks: each rank must hold whole"):
        _shard(_GatherExperts(RECIPES["current"], experts=3), fp8_all_gather=True)
    with pytest.raises(ValueError, match="backward_override='high_precision' reads the high-precision weight"):
        _shard(_GatherExperts(tl.recipe.from_name("current", backward_override="high_precision")), fp8_all_gather=True)
    with pytest.raises(ValueError, match="needs tl.GroupedLinear '<root>' to have a recipe"):
        tl.distributed.fully_shard(tl.GroupedLinear(2, 8, 8), mesh=_mesh(), fp8_all_gather=True)
    # Gathered in FP8, the layer runs under its recipe only.
    model = _shard(_GatherExperts(RECIPES["current"]), fp8_all_gather=True)
    model.up.recipe = None
    x = torch.randn(4, GATHER_HIDDEN)
    with pytest.raises(RuntimeError, match="holds only its quantized form"):
        model(x, torch.tensor([1, 1, 1, 1]))


class TestFP8AllGather:
    @pytest.mark.parametrize("name", GATHER_RECIPES)
    def test_gathers_fp8_bytes(self, name):
        run_ranks(_gather_bytes_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize(
        "name, variant",
        [(name, None) for name in GATHER_RECIPES]
        + [("current", "quantized_model_init"), ("current", "bf16"), ("block", "dequantized")]
        + [("current", "compiled")]
        + [("mxfp8", variant) for variant in ("no_reshard", "dequantized", "checkpointed", "compiled", "inductor")]
        + [("nvfp4", variant) for variant in ("quantized_model_init", "checkpointed", "inductor")],
    )
    def test_training_bitwise_matches_high_precision_gather(self, name, variant):
        run_ranks(_gather_parity_rank, name, variant, timeout=TIMEOUT)

    def test_errors(self):
        run_ranks(_gather_errors_rank, timeout=TIMEOUT)


class TestQuantizedModelInit:
    @pytest.mark.parametrize("name", QUANTIZED_INIT_RECIPES)
    def test_trains_as_the_plain_model_sharded(self, name):
        run_ranks(_quantized_init_rank, name, timeout=TIMEOUT)

    def test_dequantized_master_and_checkpoint(self):
        run_ranks(_dequantized_master_rank, timeout=TIMEOUT)
