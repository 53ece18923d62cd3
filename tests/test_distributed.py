"""tl.Linear under torch.distributed on 2 gloo ranks (CPU): amax reduction,
DDP, FSDP2, distributed checkpointing, tensor parallelism, torch.compile of
each, and the harness's handling of failing and hanging ranks.

Every rank builds the same model from the same seed, trains on its half of
each global batch, and also trains a single-process reference on the whole
batch, so comparisons happen inside the ranks; cross-rank identity is checked
by all-gathering. The loss is a sum over rows and the reference divides its
gradients by the world size (exact: a power of two), which is what DDP's and
FSDP2's gradient averaging computes: every rank's grad_output rows are then
bitwise the reference's rows, and with delayed scaling and amax reduction so
are all FP8 scales. What is left is fp32 reduction order (a wgrad GEMM over
half the rows plus an all-reduce instead of one GEMM over all rows).
"""

import functools
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from recipe_tables import BLOCK_NAMES
from tolerances import assert_bitwise_equal, relative_error
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.hf_experts import ExpertsFP8State
from transformer_linear.recipe.amax_reduction import NO_GROUP

WORLD = 2
TIMEOUT = 120.0
STEPS = 3
# Relative error of parameters after STEPS steps against the single-process run.
# No FP8 and FP8 with delayed scaling see identical operands on both sides and
# differ only by fp32 summation order (a few ulp, relative 1e-7); 1e-5 leaves
# room for that to flip an occasional FP8 rounding of a later step's operand.
FP32_ORDER_TOL = 1e-5
# Current scaling quantizes each rank's half-batch with its own scale (by
# design, see distributed.py), so a rank's FP8 input differs from the
# reference's by up to one FP8 rounding (e4m3: 2^-4 relative per element).
CURRENT_SCALING_TOL = 2e-2

RECIPES = {
    "none": None,
    "delayed": recipe.from_name("delayed", amax_history_len=4),
    "current": recipe.from_name("current"),
}
# Block-scaled recipes: stateless like current scaling, with their own tests below.
BLOCK_RECIPES = {name: recipe.from_name(name) for name in BLOCK_NAMES}
# NVFP4: E4M3 block scales (not powers of two) from each rank's own global amax (by design, as current
# scaling), and stochastic rounding of the gradients whose bits follow each element's index in the tensor a
# rank quantizes. A rank's FP4 operands then differ from the single process's by up to one FP4 rounding
# (2^-2 relative per element), the size of NVFP4's own error (3 steps: 4e-2 relative from fp32 on the first
# weight), so the whole-batch reference would prove little. Data parallelism is held instead to the single
# process running each rank's shard in turn, with each rank's generator state (the same SR seeds), its
# gradients averaged: the same FP4 operands, FP32_ORDER_TOL. Tensor parallelism quantizes weight shards and
# grad_output slices with their own amaxes and rounding bits, which no unsharded run reproduces: it is held
# to be as accurate as the unsharded NVFP4 run, its parameters' error from the fp32 run at most
# NVFP4_TP_ERROR_RATIO times the unsharded run's (measured over 3 steps: 0.145 against 0.150; a run whose
# shards were not combined right would be off by the size of the updates).
NVFP4_RECIPES = {"nvfp4": recipe.from_name("nvfp4")}
_ALL_RECIPES = {**RECIPES, **BLOCK_RECIPES, **NVFP4_RECIPES}
NVFP4_TP_ERROR_RATIO = 1.25
# A rank's rows quantize as in the single process for the forward and dgrad (blocks along a row), but
# the columnwise copies wgrad reads (xᵀ, grad_outputᵀ) have blocks along the rows, which on a rank hold
# its half of the batch; tensor parallelism's weight blocks cover a shard. A block's scale can then
# differ from the single process's, but these recipes' scales are powers of two (E8M0 for MXFP8), so
# a different scale shifts exponents exactly: only an element in or out of the FP8 subnormal range
# rounds differently, and what is left is fp32 summation order. Measured over the three recipes,
# 3 steps: 2.2e-8 (DDP, FSDP2), 0 (TP); 1e-4 leaves room for an occasional subnormal rounding.
BLOCK_SCALING_TOL = 1e-4


# ---------------------------------------------------------------------------
# helpers (module level: they run in spawned ranks)
# ---------------------------------------------------------------------------


def _out_features(fp8_recipe):
    """NVFP4 blocks every GEMM operand along K in 16s: the output width is the dgrad's K, so 16 there."""
    return 16 if isinstance(fp8_recipe, recipe.NVFP4BlockScaling) else 8


def _mlp(fp8_recipe, seed=0, out_features=None, **kwargs):
    torch.manual_seed(seed)
    out = out_features or _out_features(fp8_recipe)
    return nn.Sequential(
        tl.Linear(16, 32, recipe=fp8_recipe, **kwargs), nn.ReLU(), tl.Linear(32, out, recipe=fp8_recipe, **kwargs)
    )


def _batches(steps, name=None):
    """The global batches, the same on every rank. NVFP4's wgrad takes the tokens as K (blocks of 16): 64 rows,
    32 on each of two ranks."""
    fp8_recipe = _ALL_RECIPES.get(name)
    rows = 64 if isinstance(fp8_recipe, recipe.NVFP4BlockScaling) else 8
    out = _out_features(fp8_recipe)
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g) * 3, torch.randn(rows, out, generator=g)) for _ in range(steps)]


def _shard(batch, rank, world):
    return tuple(t.chunk(world)[rank] for t in batch)


def _step(model, opt, batch, grad_div=1):
    x, target = batch
    opt.zero_grad()
    ((model(x) - target) ** 2).sum().backward()
    if grad_div != 1:
        for p in model.parameters():
            p.grad.div_(grad_div)
    opt.step()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(model, batches, rank, world, min_graphs=0):
    """SGD steps on this rank's shard of each batch; ``min_graphs``: how many graphs torch.compile must have built."""
    opt = _sgd(model)
    torch._dynamo.utils.counters.clear()
    for batch in batches:
        _step(model, opt, _shard(batch, rank, world))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= min_graphs, f"torch.compile built {graphs} graphs, expected at least {min_graphs}"


def _reference(fp8_recipe, batches, world, out_features=None):
    """The single-process run on the whole batches (no amax reduction: one process)."""
    model = tl.distributed.set_amax_reduction_group(_mlp(fp8_recipe, out_features=out_features), None)
    opt = _sgd(model)
    for batch in batches:
        _step(model, opt, batch, grad_div=world)
    return model


def _reference_per_shard(fp8_recipe, batches, world):
    """The single process running each data-parallel rank's shard in turn from the same generator state (a
    rank's stochastic-rounding seeds), gradients summed and divided by ``world`` as DDP / FSDP2 average them."""
    model = tl.distributed.set_amax_reduction_group(_mlp(fp8_recipe), None)
    opt = _sgd(model)
    for batch in batches:
        opt.zero_grad()
        state = torch.get_rng_state()
        for rank in range(world):
            torch.set_rng_state(state)
            x, target = _shard(batch, rank, world)
            ((model(x) - target) ** 2).sum().backward()
        for p in model.parameters():
            p.grad.div_(world)
        opt.step()
    return model


def _gathered(t):
    """``t`` from every rank."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _full(t):
    """The whole tensor of a DTensor (sharded by FSDP2 or tensor parallelism); ``t`` otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same_on_all_ranks(model, what):
    for name, t in model.state_dict().items():
        first, *others = _gathered(_full(t).detach())
        for other in others:
            assert_bitwise_equal(other, first, f"{what} {name} across ranks")


def _assert_matches_reference(model, name, batches, world, what):
    """``model`` (trained) against the single-process run: parameters within the
    recipe's tolerance; delayed-scaling state bitwise (the amaxes reduced across
    ranks are the whole batch's / whole tensor's)."""
    if name in NVFP4_RECIPES:  # data parallel: see NVFP4_RECIPES
        ref = _reference_per_shard(_ALL_RECIPES[name], batches, world)
    else:
        ref = _reference(_ALL_RECIPES[name], batches, world)
    tol = {"current": CURRENT_SCALING_TOL, **dict.fromkeys(BLOCK_RECIPES, BLOCK_SCALING_TOL)}.get(name, FP32_ORDER_TOL)
    for (pname, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        err = relative_error(_full(p).detach(), p_ref.detach())
        assert err <= tol, f"{what} {pname}: relative error {err:.3e} vs single process exceeds {tol:.0e}"
    for (h, s), (h_ref, s_ref) in zip(_fp8_state(model), _fp8_state(ref)):
        assert_bitwise_equal(s, s_ref, f"{what} delayed scales vs single process")
        assert_bitwise_equal(h, h_ref, f"{what} amax history vs single process")


def _fp8_state(model):
    tl.distributed.finish_amax_reductions(model)
    return [
        (torch.cat([m.fp8_amax_history, m.fp8_grad_amax_history], 1), torch.cat([m.fp8_scale, m.fp8_grad_scale]))
        for m in model.modules()
        if hasattr(m, "fp8_scale")
    ]


# ---------------------------------------------------------------------------
# amax reduction
# ---------------------------------------------------------------------------


def _amax_reduction_rank(rank, world, reduce):
    layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=4))
    if not reduce:
        tl.distributed.set_amax_reduction_group(layer, None)
    torch.manual_seed(10 + rank)  # different data per rank
    x = (torch.randn(4, 16) * (rank + 1)).requires_grad_()
    for _ in range(2):  # the second forward applies the first step's reductions
        layer(x).square().sum().backward()
    # Launched in forward and backward; applied by the next forward or state_dict().
    assert len(layer.delayed_scaling_state.pending_reductions) == (2 if reduce else 0)
    history, scale = layer.state_dict()["fp8_amax_history"], layer.fp8_scale
    assert not layer.delayed_scaling_state.pending_reductions
    local = torch.stack([x.detach().abs().max(), layer.weight.detach().abs().max()])
    # The latest step's amaxes have rolled into the last row.
    expected = torch.stack(_gathered(local)).amax(0) if reduce else local
    assert_bitwise_equal(history[-1], expected, "recorded forward amaxes")
    return [s.tolist() for s in _gathered(scale)] + [[t.tolist() for t in _gathered(history)]]


class TestAmaxReduction:
    def test_delayed_scaling_scales_are_identical_across_ranks(self):
        scales0, scales1, histories = run_ranks(_amax_reduction_rank, True, timeout=TIMEOUT)[0]
        assert scales0 == scales1 and histories[0] == histories[1]

    def test_reduction_off_keeps_scales_per_rank(self):
        scales0, scales1, _ = run_ranks(_amax_reduction_rank, False, timeout=TIMEOUT)[0]
        assert scales0 != scales1

    def test_knob_reaches_every_delayed_scaling_state(self):
        """The group (and finish_amax_reductions) reach every module that keeps a delayed-scaling state: a
        GroupedLinear and a converted transformers model's experts' ExpertsFP8State as well as tl.Linear."""
        delayed = recipe.DelayedScaling()
        model = nn.ModuleDict(
            {
                "linear": tl.Linear(8, 8, recipe=delayed),
                "grouped": tl.GroupedLinear(2, 8, 8, recipe=delayed),
                "experts": ExpertsFP8State(delayed),
            }
        )
        assert tl.distributed.set_amax_reduction_group(model, None) is model
        assert {name: m.amax_reduction_group for name, m in model.items()} == dict.fromkeys(model, NO_GROUP)
        assert tl.distributed.finish_amax_reductions(model) is model

    def test_knob_rejects_non_groups(self):
        with pytest.raises(TypeError, match="'group' must be a ProcessGroup or None"):
            tl.distributed.set_amax_reduction_group(tl.Linear(4, 4), "world")

    @pytest.mark.parametrize("drop", ["reset_fp8_state", "load_state_dict", "del"])
    def test_pending_reductions_go_with_the_state_they_update(self, drop):
        """Reset, load_state_dict and the layer's end drop its pending reductions (kept by its state)."""
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling())
        state = layer.delayed_scaling_state
        state._pending.append(("work", "reduced amax"))  # a stand-in: it must be dropped, never applied
        if drop == "reset_fp8_state":
            layer.reset_fp8_state()
        elif drop == "load_state_dict":
            layer.load_state_dict(tl.Linear(16, 8, recipe=layer.recipe).state_dict())
        else:
            state = weakref.ref(state)
            del layer
            gc.collect()
            assert state() is None, "the state outlived its layer"
            return
        assert not state.pending_reductions

    def test_without_process_group_is_single_process(self):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=4))
        ref = tl.distributed.set_amax_reduction_group(tl.Linear(16, 8, recipe=layer.recipe), None)
        ref.load_state_dict(layer.state_dict())
        x = torch.randn(4, 16)
        assert_bitwise_equal(layer(x), ref(x))
        assert_bitwise_equal(layer.fp8_scale, ref.fp8_scale)


# ---------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------


def _ddp_rank(rank, world, name, compile_backend=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    fp8_recipe = _ALL_RECIPES[name]
    batches = _batches(STEPS, name)
    model = DDP(_mlp(fp8_recipe))
    if compile_backend is not None:
        # The module DDP runs, compiled whole: fullgraph fails on any graph
        # break. (Compiling the DDP object itself also works, but DDP's own
        # forward wrapper breaks the graph by design, hiding ours.)
        model.module.compile(backend=compile_backend, fullgraph=True)
    _train(model, batches, rank, world, min_graphs=1 if compile_backend else 0)
    _assert_same_on_all_ranks(model.module, f"DDP[{name}]")
    _assert_matches_reference(model.module, name, batches, world, f"DDP[{name}]")


class TestDDP:
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_matches_single_process_on_concatenated_batch(self, name):
        run_ranks(_ddp_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["delayed", "current"])
    def test_compiled_ddp_model(self, name):
        run_ranks(_ddp_rank, name, "aot_eager", timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(BLOCK_RECIPES))
    def test_block_recipe_matches_single_process(self, name):
        run_ranks(_ddp_rank, name, timeout=TIMEOUT)

    # One block recipe: they share the ops (tests/test_linear_block_recipes.py compiles each).
    @pytest.mark.parametrize("name", ["block"])
    def test_compiled_ddp_model_block_recipe(self, name):
        run_ranks(_ddp_rank, name, "aot_eager", timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(NVFP4_RECIPES))
    def test_nvfp4_matches_single_process(self, name):
        run_ranks(_ddp_rank, name, timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# FSDP2 and distributed checkpointing
# ---------------------------------------------------------------------------


def _fully_shard_mlp(fp8_recipe, mp_policy=None, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _mlp(fp8_recipe, **kwargs)
    shard_kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for layer in (model[0], model[2]):
        tl.distributed.fully_shard(layer, **shard_kwargs)
    return tl.distributed.fully_shard(model, **shard_kwargs)


def _fsdp_rank(rank, world, name, compile_backend=None):
    from torch.distributed.tensor import DTensor

    fp8_recipe = _ALL_RECIPES[name]
    batches = _batches(STEPS, name)
    model = _fully_shard_mlp(fp8_recipe)
    assert isinstance(model[0].weight, DTensor) and model[0].weight.to_local().shape == (32 // world, 16)
    if compile_backend is not None:
        # Per layer, as FSDP2 models are compiled (TorchTitan's pattern): FSDP2's
        # hooks run outside the graphs, fullgraph fails on a break in ours.
        for layer in (model[0], model[2]):
            layer.compile(backend=compile_backend, fullgraph=True)
    _train(model, batches, rank, world, min_graphs=2 if compile_backend else 0)
    _assert_same_on_all_ranks(model, f"FSDP2[{name}]")
    _assert_matches_reference(model, name, batches, world, f"FSDP2[{name}]")


class _Checkpointed(nn.Module):
    """``inner`` under activation checkpointing (non-reentrant): recomputed in backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _fsdp_checkpointing_rank(rank, world, name):
    """FSDP2 over activation-checkpointed layers (TorchTitan's layout): the
    recompute re-gathers the weights and must quantize as the forward did."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batches = _batches(STEPS)
    model = _mlp(RECIPES[name])
    for i in (0, 2):
        model[i] = tl.distributed.fully_shard(_Checkpointed(model[i]), mesh=mesh)
    tl.distributed.fully_shard(model, mesh=mesh)
    _train(model, batches, rank, world)
    _assert_same_on_all_ranks(model, f"FSDP2+AC[{name}]")
    _assert_matches_reference(model, name, batches, world, f"FSDP2+AC[{name}]")


def _fsdp_mixed_precision_rank(rank, world, name):
    """FSDP2 computing in bf16 (gathered bf16 weights) with fp32 master weights and reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = _batches(STEPS)
    model = _fully_shard_mlp(RECIPES[name], mp_policy=policy)
    start = [_full(p).detach().clone() for p in model.parameters()]
    opt = _sgd(model)
    for batch in batches:
        x, target = _shard(batch, rank, world)
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.bfloat16, f"FSDP2 bf16 compute returned {out.dtype}"
        ((out.float() - target) ** 2).sum().backward()
        opt.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for h, s in _fp8_state(model) for t in (h, s)), "FP8 state left fp32"
    _assert_same_on_all_ranks(model, f"FSDP2 bf16[{name}]")
    # The updates (not the parameters, which barely move) against the fp32
    # single-process run. bf16 operands alone move them by ~0.4%; with FP8 a
    # bf16 rounding also flips some FP8 roundings (an e5m2 step is 25%), up to
    # ~16% seen on these 8-row batches. A lost or unaveraged gradient
    # reduction would be off by 50% or more.
    tol = 2e-2 if name == "none" else 0.3
    ref = _reference(RECIPES[name], batches, world)
    for (pname, p), p_ref, p0 in zip(model.named_parameters(), ref.parameters(), start):
        err = relative_error(_full(p).detach() - p0, p_ref.detach() - p0)
        assert err <= tol, f"FSDP2 bf16[{name}] {pname}: update off by {err:.3f} (relative) vs fp32 single process"


def _fsdp_rejects_rank(rank, world, option):
    with pytest.raises(ValueError, match=f"{option}=True, which FSDP2 does not support"):
        _fully_shard_mlp(RECIPES["delayed"], **{option: True})


def _checkpoint_rank(rank, world, path):
    import torch.distributed.checkpoint as dcp

    fp8_recipe = RECIPES["delayed"]
    batches = _batches(STEPS)
    model = _fully_shard_mlp(fp8_recipe)
    opt = _sgd(model)
    for batch in batches[:-1]:
        _step(model, opt, _shard(batch, rank, world))
    dcp.save(model.state_dict(), checkpoint_id=path)
    _step(model, opt, _shard(batches[-1], rank, world))

    resumed = _fully_shard_mlp(fp8_recipe, seed=123)  # different weights until loaded
    state = resumed.state_dict()
    assert "0.fp8_amax_history" in state and "2.fp8_scale" in state
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state)
    _step(resumed, _sgd(resumed), _shard(batches[-1], rank, world))
    for (name, t), t_resumed in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert_bitwise_equal(_full(t_resumed), _full(t), f"resumed {name}")


def _fsdp_view_warning_rank(rank, world, name):
    """A model whose last layer is a tl.Linear on 3-D input: FSDP2 warns about no view output."""
    import warnings

    model = _fully_shard_mlp(RECIPES[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 3, 16)).sum().backward()
    messages = [str(w.message) for w in caught]
    assert not any("returned a view tensor" in m for m in messages), messages


class TestFSDP2:
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_matches_single_process(self, name):
        run_ranks(_fsdp_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_bf16_mixed_precision_policy(self, name):
        run_ranks(_fsdp_mixed_precision_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["delayed", "current"])
    def test_activation_checkpointing(self, name):
        run_ranks(_fsdp_checkpointing_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["delayed", "current"])
    def test_compiled_fsdp2_model(self, name):
        run_ranks(_fsdp_rank, name, "aot_eager", timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(BLOCK_RECIPES))
    def test_block_recipe_matches_single_process(self, name):
        run_ranks(_fsdp_rank, name, timeout=TIMEOUT)

    # One block recipe: they share the ops (tests/test_linear_block_recipes.py compiles each).
    @pytest.mark.parametrize("name", ["block"])
    def test_compiled_fsdp2_model_block_recipe(self, name):
        run_ranks(_fsdp_rank, name, "aot_eager", timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(NVFP4_RECIPES))
    def test_nvfp4_matches_single_process(self, name):
        run_ranks(_fsdp_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("option", ["delay_wgrad_compute", "fuse_wgrad_accumulation"])
    def test_unsupported_wgrad_options_raise_at_wrap_time(self, option):
        run_ranks(_fsdp_rejects_rank, option, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["current", "delayed"])
    def test_3d_output_is_not_a_view(self, name):
        run_ranks(_fsdp_view_warning_rank, name, timeout=TIMEOUT)

    def test_checkpoint_resume_gives_identical_next_step(self, tmp_path):
        run_ranks(_checkpoint_rank, str(tmp_path / "ckpt"), timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# the plain mean loss: delayed scaling's first step does not depend on magnitude
# ---------------------------------------------------------------------------

# Each rank's mean loss gives grad_output rows twice the whole-batch mean's.
# With just-in-time first-step scales (and the amax reduction) every FP8
# operand is the single process's times a power of two, so what is left is
# fp32 summation order. TE's first step (scale 1) ended 1.6% away here.
MEAN_LOSS_TOL = 1e-4


def _mean_loss_rank(rank, world, engine):
    from torch.nn.parallel import DistributedDataParallel as DDP

    fp8_recipe = RECIPES["delayed"]
    batches = _batches(STEPS)
    model = DDP(_mlp(fp8_recipe)) if engine == "ddp" else _fully_shard_mlp(fp8_recipe)
    ref = tl.distributed.set_amax_reduction_group(_mlp(fp8_recipe), None)
    for m, shard in ((model, True), (ref, False)):
        opt = _sgd(m)
        for batch in batches:
            x, target = _shard(batch, rank, world) if shard else batch
            opt.zero_grad()
            ((m(x) - target) ** 2).mean().backward()
            opt.step()
    for (pname, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        err = relative_error(_full(p).detach(), p_ref.detach())
        assert err <= MEAN_LOSS_TOL, f"{engine} {pname}: relative error {err:.3e} vs single process"


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_plain_mean_loss_matches_single_process(engine):
    run_ranks(_mean_loss_rank, engine, timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------


def _tp_mlp(fp8_recipe, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"0": tl.distributed.ColwiseParallel(), "2": tl.distributed.RowwiseParallel()}
    return parallelize_module(_mlp(fp8_recipe, **kwargs), mesh, styles)


def _tp_rank(rank, world, name, compile_backend=None):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fp8_recipe = _ALL_RECIPES[name]
    batches = _batches(STEPS, name)
    model = _tp_mlp(fp8_recipe)
    assert model[0].weight.placements == (Shard(0),) and model[2].weight.placements == (Shard(1),)
    assert model[2].bias.placements == (Replicate(),) and isinstance(model[0].bias, DTensor)
    if compile_backend is not None:
        model.compile(backend=compile_backend, fullgraph=True)
    # Tensor parallelism: every rank sees the whole batch (its shard of one).
    _train(model, batches, 0, 1, min_graphs=1 if compile_backend else 0)
    _assert_same_on_all_ranks(model, f"TP[{name}]")
    if name in NVFP4_RECIPES:
        _assert_nvfp4_tp_as_accurate(model, name, batches)
    else:
        _assert_matches_reference(model, name, batches, 1, f"TP[{name}]")


def _flat_params(model):
    return torch.cat([_full(p).detach().flatten() for p in model.parameters()])


def _assert_nvfp4_tp_as_accurate(model, name, batches):
    """Tensor parallelism under NVFP4 against the fp32 run, no further from it than the unsharded NVFP4 run
    (see NVFP4_RECIPES)."""
    fp8_recipe = _ALL_RECIPES[name]
    exact = _flat_params(_reference(None, batches, 1, out_features=_out_features(fp8_recipe)))
    unsharded_err = relative_error(_flat_params(_reference(fp8_recipe, batches, 1)), exact)
    tp_err = relative_error(_flat_params(model), exact)
    assert tp_err <= NVFP4_TP_ERROR_RATIO * unsharded_err, (
        f"TP[{name}]: parameters' relative error from fp32 {tp_err:.3e}, the unsharded run's {unsharded_err:.3e}"
    )


def _tp_fsdp2_rank(rank, world, name):
    """TorchTitan's 2-D layout on a (dp=2, tp=2) mesh: tensor parallelism inside, FSDP2 across."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = _mlp(RECIPES[name])
    styles = {"0": tl.distributed.ColwiseParallel(), "2": tl.distributed.RowwiseParallel()}
    parallelize_module(model, mesh["tp"], styles)
    for layer in (model[0], model[2]):
        tl.distributed.fully_shard(layer, mesh=mesh["dp"])
    tl.distributed.fully_shard(model, mesh=mesh["dp"])
    batches = _batches(STEPS)
    _train(model, batches, mesh["dp"].get_local_rank(), 2)
    _assert_matches_reference(model, name, batches, 2, f"TP+FSDP2[{name}]")


def _tp_rejects_rank(rank, world, option):
    with pytest.raises(ValueError, match=f"{option}=True, which tensor parallelism does not support"):
        _tp_mlp(RECIPES["delayed"], **{option: True})


class TestTensorParallel:
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_colwise_rowwise_mlp_matches_unsharded(self, name):
        run_ranks(_tp_rank, name, timeout=TIMEOUT)

    def test_compiled_tensor_parallel_mlp(self):
        run_ranks(_tp_rank, "delayed", "aot_eager", timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(BLOCK_RECIPES))
    def test_block_recipe_matches_unsharded(self, name):
        run_ranks(_tp_rank, name, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(NVFP4_RECIPES))
    def test_nvfp4_matches_unsharded(self, name):
        run_ranks(_tp_rank, name, timeout=TIMEOUT)

    def test_with_fsdp2_on_a_2d_mesh(self):
        run_ranks(_tp_fsdp2_rank, "delayed", world_size=4, timeout=TIMEOUT)

    def test_unsupported_wgrad_option_raises_at_wrap_time(self):
        run_ranks(_tp_rejects_rank, "fuse_wgrad_accumulation", timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# the harness: a failing or hanging rank fails the test, fast
# ---------------------------------------------------------------------------


def _failing_rank(rank, world):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits on a peer that is gone


def _hanging_rank(rank, world):
    if rank == 1:
        import time

        time.sleep(3600)
    return rank


class TestHarness:
    def test_rank_exception_fails_with_its_message(self):
        with pytest.raises(AssertionError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 gives up"):
            run_ranks(_failing_rank, timeout=TIMEOUT)

    def test_hanging_rank_times_out(self):
        # Rank 1 never finishes (rank 0 does, unless the machine is too slow to start it in time).
        with pytest.raises(AssertionError, match=r"timed out after 15s; ranks finished: (\[\]|\[0\])$"):
            run_ranks(_hanging_rank, timeout=15.0)
