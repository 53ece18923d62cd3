"""FSDP2 all-gathering tl.Linear weights in FP8 (``tl.distributed.fully_shard(fp8_all_gather=...)``), on 2
gloo ranks (CPU): the bytes FSDP2 all-gathers against its fp32 / bf16 all-gather, that what is gathered is
FP8 (NVFP4: uint8 FP4 data and E4M3 block scales) and what the forward reads is the gathered FP8 weight,
which copies each gather carries (MXFP8: the rowwise one in forward and the columnwise one in backward
under reshard_after_forward, both otherwise), bitwise parity of losses, gradients and weights with the
same recipe gathered in high precision (an MLP, and the built-in GPT for MXFP8 and NVFP4), the saved
state, and the errors.

The weights have 256 rows, so each rank holds 128: whole 128x128 blocks (Float8BlockScaling), 1x32
blocks in either direction (MXFP8) and 16x16 tiles (NVFP4); the uneven model (255 rows) checks FSDP2's
padding of per-tensor scaled shards.
"""

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from recipe_tables import SEPARATE_WEIGHT_COPY
from tolerances import assert_bitwise_equal
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import transformer_linear as tl
from transformer_linear import ops, recipe
from transformer_linear._handles import NO_HANDLE
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.modules.fp8_all_gather import (
    BOTH,
    COLUMNWISE,
    ROWWISE,
    FP8AllGatherWeight,
    GatheredFP8Weight,
    check_shardable,
    is_fp8_all_gathered,
    whole_weight_of_gathered,
)
from transformer_linear.modules.fsdp_gather_usages import rowwise_copies, rowwise_copy
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss
from transformer_linear.recipe.quantization import quantization_spec

WORLD = 2
TIMEOUT = 180.0
STEPS = 5
IN, HIDDEN, OUT = 128, 256, 256

RECIPES = {
    "current": recipe.from_name("current"),
    "delayed": recipe.from_name("delayed", amax_history_len=4),
    "block": recipe.from_name("block"),
    "mxfp8": recipe.from_name("mxfp8"),
    "nvfp4": recipe.from_name("nvfp4"),
}
# The bounds on the bytes gathered against FSDP2's bf16 / fp32 all-gather: FP8 data is 1 byte an element
# against 2 and 4; scales and the (high-precision) biases take the rest. MXFP8's 1x32 blocks are not
# square, so its columnwise copy (what dgrad reads) is not the rowwise one transposed: under
# reshard_after_forward the forward gathers the rowwise copy and backward the columnwise one (measured:
# 0.52x bf16, 0.26x fp32); without it one gather serves both passes and carries both copies, 2 bytes an
# element plus E8M0 scales, about what bf16 gathers (measured: 1.03x bf16, 0.52x fp32).
MAX_RATIO_VS_BF16 = 0.55
MAX_RATIO_VS_FP32 = 0.3
# NVFP4: FP4 data (half a byte an element) and one E4M3 scale per 16 elements, the 16x16 columnwise copy
# made after the gather: 0.5625 bytes an element (measured: 0.28x bf16, 0.14x fp32). FP8 data would
# exceed these bounds.
MAX_RATIO_NVFP4_VS_BF16 = 0.3
MAX_RATIO_NVFP4_VS_FP32 = 0.15
MAX_RATIO_BOTH_COPIES_VS_BF16 = 1.05
MAX_RATIO_BOTH_COPIES_VS_FP32 = 0.55
SEPARATE_COLUMNWISE = set(SEPARATE_WEIGHT_COPY)  # recipes whose weight's columnwise copy has its own blocks


# ---------------------------------------------------------------------------
# helpers (module level: they run in spawned ranks)
# ---------------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _mlp(layer_recipe, hidden=HIDDEN, out=OUT, bias=True):
    torch.manual_seed(0)
    return nn.Sequential(
        tl.Linear(IN, hidden, bias=bias, recipe=layer_recipe), nn.ReLU(),
        tl.Linear(hidden, out, bias=bias, recipe=layer_recipe),
    )


def _sharded(layer_recipe, fp8_all_gather, param_dtype=None, hidden=HIDDEN, out=OUT, reshard_after_forward=True,
             bias=True):
    """The MLP with each Linear and the root sharded (FSDP2's usual nesting; the root keeps its gathered
    parameters through backward, as FSDP2 makes it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _mlp(layer_recipe, hidden, out, bias)
    kwargs = {"mesh": _mesh(), "fp8_all_gather": fp8_all_gather}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        tl.distributed.fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    return tl.distributed.fully_shard(model, **kwargs)


def _batches(rank, world, steps=STEPS, name=None):
    # NVFP4 quantizes the input's columnwise copy in 16-row blocks: 16 rows a rank.
    rows = 16 * world if name == "nvfp4" else 8
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, IN, generator=g) * 3).chunk(world)[rank] for _ in range(steps)]


def _square_sum(model, x):
    return model(x).square().sum()


def _train(model, batches, autocast_recipe=None, loss_fn=_square_sum):
    """AdamW steps; the losses and the local gradient shards of each step."""
    torch.manual_seed(2)  # NVFP4 rounds grad_output stochastically, with seeds drawn from the default generator
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for x in batches:
        opt.zero_grad()
        with tl.autocast(recipe=autocast_recipe) if autocast_recipe is not None else contextlib.nullcontext():
            loss = loss_fn(model, x)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
    return losses, grads


class _GatherCounter:
    """Counts the bytes FSDP2 all-gathers (every call of its all-gather collective) and records the dtypes
    of what ``weight_class.fsdp_pre_all_gather`` returns and the copies each of its gathers carries.

    Args:
        weight_class: the sharded weight's class (FP8AllGatherWeight, or a subclass with its own gather).
    """

    def __init__(self, weight_class: type = FP8AllGatherWeight):
        self.weight_class = weight_class

    def __enter__(self):
        self.bytes, self.fp8_gathers, self.data_dtypes, self.usages = 0, 0, [], []
        self.gathered = []  # per gather: (dtype, numel) of each gathered tensor, and the shard's numel
        self._all_gather, self._pre = dist.all_gather_single, self.weight_class.fsdp_pre_all_gather

        def all_gather(output_tensor, input_tensor, *args, **kwargs):
            self.bytes += input_tensor.numel() * input_tensor.element_size()
            return self._all_gather(output_tensor, input_tensor, *args, **kwargs)

        @functools.wraps(self._pre)  # FSDP2 reads its signature
        def pre_all_gather(weight, *args, **kwargs):
            gathered, metadata = self._pre(weight, *args, **kwargs)
            self.fp8_gathers += 1
            self.data_dtypes.append(gathered[0].dtype)
            self.usages.append(metadata.usages)
            self.gathered.append(([(t.dtype, t.numel()) for t in gathered], weight._tensor.numel()))
            return gathered, metadata

        dist.all_gather_single, self.weight_class.fsdp_pre_all_gather = all_gather, pre_all_gather
        return self

    def __exit__(self, *exc):
        dist.all_gather_single, self.weight_class.fsdp_pre_all_gather = self._all_gather, self._pre


def _gathered_bytes(name, fp8_all_gather, param_dtype=None, reshard_after_forward=True):
    """Bytes all-gathered by one training step (forward and backward), and the counter."""
    model = _sharded(RECIPES[name], fp8_all_gather, param_dtype, reshard_after_forward=reshard_after_forward)
    seen = []
    for layer in (model[0], model[2]):
        layer.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    (x,) = _batches(dist.get_rank(), dist.get_world_size(), steps=1, name=name)
    with _GatherCounter() as counter:
        model(x).square().sum().backward()
    return counter, seen


def _gathered_data_dtypes(name):
    """The dtypes of the weight data ``fsdp_pre_all_gather`` returns: NVFP4's packed FP4 and per-tensor scaled
    FP8 data (gathered alone, as its bytes) as uint8, block-scaled FP8 data (beside its scales) as FP8."""
    if name == "nvfp4" or not quantization_spec(RECIPES[name]).weight.blockwise:
        return {torch.uint8}
    return FP8_DTYPES


def _bytes_rank(rank, world, name, reshard_after_forward):
    rf = reshard_after_forward
    fp8, seen = _gathered_bytes(name, True, reshard_after_forward=rf)
    fp8_bf16, _ = _gathered_bytes(name, True, torch.bfloat16, reshard_after_forward=rf)
    fp32, seen_off = _gathered_bytes(name, False, reshard_after_forward=rf)
    bf16, _ = _gathered_bytes(name, False, torch.bfloat16, reshard_after_forward=rf)
    # The forward gathers each of the 2 weights (the root holds no parameter of its own), and backward
    # again where they are resharded after forward.
    gathers = 4 if rf else 2
    assert fp8.fp8_gathers == gathers, f"{fp8.fp8_gathers} FP8 all-gathers, expected {gathers}"
    if name == "nvfp4":
        # FP4: uint8 data of half a byte an element, one E4M3 scale per 16 elements.
        for gathered, numel in fp8.gathered + fp8_bf16.gathered:
            expected = [(torch.uint8, numel // 2), (torch.float8_e4m3fn, numel // 16)]
            assert gathered == expected, f"fsdp_pre_all_gather returned {gathered}, expected FP4 {expected}"
    else:
        expected_dtypes = _gathered_data_dtypes(name)
        bad = [d for d in fp8.data_dtypes + fp8_bf16.data_dtypes if d not in expected_dtypes]
        assert not bad, f"fsdp_pre_all_gather returned {bad} data, expected FP8 ({expected_dtypes})"
    assert fp32.fp8_gathers == 0 and bf16.fp8_gathers == 0
    assert seen == [GatheredFP8Weight] * 2, f"the forward read {seen}, expected the gathered FP8 weight"
    assert GatheredFP8Weight not in seen_off
    # A columnwise copy of its own: one copy per pass where backward gathers again, else both each time.
    if name not in SEPARATE_COLUMNWISE:
        expected_usages = [ROWWISE] * gathers
    else:
        expected_usages = [ROWWISE] * 2 + [COLUMNWISE] * 2 if rf else [BOTH] * 2
    for counter in (fp8, fp8_bf16):
        assert counter.usages == expected_usages, f"the gathers carried {counter.usages}, expected {expected_usages}"
    ratio_bf16, ratio_fp32 = fp8_bf16.bytes / bf16.bytes, fp8.bytes / fp32.bytes
    both_copies = name in SEPARATE_COLUMNWISE and not rf
    max_bf16 = MAX_RATIO_BOTH_COPIES_VS_BF16 if both_copies else MAX_RATIO_VS_BF16
    max_fp32 = MAX_RATIO_BOTH_COPIES_VS_FP32 if both_copies else MAX_RATIO_VS_FP32
    if name == "nvfp4":
        max_bf16, max_fp32 = MAX_RATIO_NVFP4_VS_BF16, MAX_RATIO_NVFP4_VS_FP32
    assert ratio_bf16 <= max_bf16, f"FP8 all-gather {fp8_bf16.bytes} B vs bf16 {bf16.bytes} B: {ratio_bf16:.3f}"
    assert ratio_fp32 <= max_fp32, f"FP8 all-gather {fp8.bytes} B vs fp32 {fp32.bytes} B: {ratio_fp32:.3f}"
    return fp32.bytes, bf16.bytes, fp8.bytes, fp8_bf16.bytes


def _assert_same_training(rank, world, on, off, what, autocast_recipe=None, batches=None, loss_fn=_square_sum):
    batches = _batches(rank, world) if batches is None else batches
    losses_on, grads_on = _train(on, batches, autocast_recipe, loss_fn)
    losses_off, grads_off = _train(off, batches, autocast_recipe, loss_fn)
    for step, (l_on, l_off, g_on, g_off) in enumerate(zip(losses_on, losses_off, grads_on, grads_off)):
        assert_bitwise_equal(l_on, l_off, f"{what}: loss of step {step}")
        for (pname, _), a, b in zip(on.named_parameters(), g_on, g_off):
            assert_bitwise_equal(a, b, f"{what}: gradient of {pname}, step {step}")
    for (pname, p_on), p_off in zip(on.named_parameters(), off.parameters()):
        assert_bitwise_equal(p_on.full_tensor(), p_off.full_tensor(), f"{what}: {pname} after {STEPS} steps")


def _parity_rank(rank, world, name, param_dtype, out, compile_backend=None, bias=True):
    r = RECIPES[name]
    on = _sharded(r, True, param_dtype, out=out, bias=bias)
    assert isinstance(on[0].weight.to_local(), FP8AllGatherWeight)
    if compile_backend is not None:
        # Per layer, as FSDP2 models are compiled: its hooks (and the all-gathers) run outside the graphs,
        # which take the gathered FP8 weight as a traceable tensor subclass.
        torch._dynamo.utils.counters.clear()
        for layer in (on[0], on[2]):
            layer.compile(backend=compile_backend, fullgraph=True)
    off = _sharded(r, False, param_dtype, out=out, bias=bias)
    _assert_same_training(rank, world, on, off,
                          f"{name}, param_dtype={param_dtype}, out={out}, {compile_backend}, bias={bias}",
                          batches=_batches(rank, world, name=name))
    if compile_backend is not None:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs >= 2, f"torch.compile built {graphs} graphs, expected one per layer at least"
    # The checkpoint holds the high-precision master, as a plain tensor.
    for key, t in on.state_dict().items():
        if key.endswith("weight"):
            assert type(t.to_local()) is torch.Tensor, f"{key}: the saved shard is a {type(t.to_local()).__name__}"
            full = t.full_tensor()
            assert type(full) is torch.Tensor and full.dtype == torch.float32, f"{key}: {type(full)} {full.dtype}"
            assert_bitwise_equal(full, off.state_dict()[key].full_tensor(), f"saved {key}")


class _Checkpointed(nn.Module):
    """``inner`` under activation checkpointing (non-reentrant): recomputed in backward, where FSDP2 gathers
    the weight again."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _checkpointed_rank(rank, world, name, compile_backend=None, compile_region=False):
    """``compile_region``: each checkpointed block is compiled whole (as torchtitan compiles its blocks), so
    the compiled backward graph recomputes the forward from the forward's inputs, the gathered weight's
    tensors among them, which backward's gather has refilled with the columnwise copy; else the Linears are
    compiled and checkpointing recomputes them eagerly."""
    torch._dynamo.utils.counters.clear()

    def build(fp8_all_gather):
        first, _, last = _mlp(RECIPES[name])
        # The first Linear is recomputed with a GELU, which saves the recomputed output for its backward:
        # a recompute reading another weight than the forward's changes the gradients.
        model = nn.Sequential(_Checkpointed(nn.Sequential(first, nn.GELU())), _Checkpointed(last))
        mesh = _mesh()
        for block in model:
            tl.distributed.fully_shard(block, mesh=mesh, fp8_all_gather=fp8_all_gather)
            if compile_backend is not None:
                for compiled in [block] if compile_region else (first, last):
                    compiled.compile(backend=compile_backend, fullgraph=True)
        return tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)

    _assert_same_training(
        rank, world, build(True), build(False),
        f"{name} under activation checkpointing, {compile_backend}, compile_region={compile_region}",
        batches=_batches(rank, world, name=name),
    )
    if compile_backend is not None and not compile_region:
        # Both layers share Linear.forward's code, whose graphs torch.compile specializes on the weight's shape
        # and type and the input's requires_grad: one graph per layer and model (FP8 and high-precision gather).
        # A pass whose gather carried other copies of the weight (MXFP8: the forward's rowwise copy, backward's
        # columnwise copy, which the recompute fills in) runs the same graph, within the default recompile limit.
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs == 4, f"torch.compile built {graphs} graphs of the two Linears of two models, expected 4"


def _deferred_init_rank(rank, world):
    """Built on the meta device, sharded, then materialized (FSDP2's deferred init): the shards stay
    FP8AllGatherWeight through to_empty, and training matches the high-precision gather bitwise."""
    r = RECIPES["current"]

    def build(fp8_all_gather):
        with torch.device("meta"):
            model = nn.Sequential(tl.Linear(IN, HIDDEN, recipe=r), nn.ReLU(), tl.Linear(HIDDEN, OUT, recipe=r))
        mesh = _mesh()
        for layer in (model[0], model[2]):
            tl.distributed.fully_shard(layer, mesh=mesh, fp8_all_gather=fp8_all_gather)
        tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in (model[0], model[2]):
            layer.reset_parameters()
            layer.reset_fp8_state()
        return model

    on = build(True)
    assert isinstance(on[2].weight.to_local(), FP8AllGatherWeight)
    _assert_same_training(rank, world, on, build(False), "deferred init")


def _autocast_rank(rank, world, name):
    r = RECIPES[name]
    on, off = _sharded(None, r), _sharded(None, False)
    _assert_same_training(rank, world, on, off, f"{name} under tl.autocast", autocast_recipe=r)


def _gpt_rank(rank, world, name):
    """The built-in GPT (each block and the root sharded) with FP8 all-gather against the high-precision
    gather, under the same recipe: bitwise the same losses, gradients and weights over 5 AdamW steps, with
    the blocks resharded after forward (each gather carries one copy of a separate columnwise copy; the
    head, in the root, both) and without (both copies, one gather). A columnwise copy made from the gathered
    rowwise one (NVFP4's 16x16 blocks) is gathered with the rowwise copy, by each gather."""
    cfg = GPTConfig()
    data = SyntheticText(cfg, seed=0)
    batches = [data.batch(4).chunk(world)[rank] for _ in range(STEPS)]

    def loss_fn(model, tokens):
        return lm_loss(model(tokens), tokens)

    def build(fp8_all_gather, reshard_after_forward):
        torch.manual_seed(0)
        model = tl.convert_to_fp8(TinyGPT(cfg), recipe=RECIPES[name])
        mesh = _mesh()
        for block in model.blocks:
            tl.distributed.fully_shard(
                block, mesh=mesh, fp8_all_gather=fp8_all_gather, reshard_after_forward=reshard_after_forward
            )
        return tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)

    for reshard_after_forward in (True, False):
        on = build(True, reshard_after_forward)
        with _GatherCounter() as counter:
            _assert_same_training(
                rank, world, on, build(False, reshard_after_forward),
                f"GPT {name}, reshard_after_forward={reshard_after_forward}", batches=batches, loss_fn=loss_fn,
            )
        # Per step: the blocks' 4 weights each, gathered per pass or once with both copies, and the head (in
        # the root, which FSDP2 does not reshard after forward) once with both.
        weights = 4 * cfg.n_layers * STEPS
        if name not in SEPARATE_COLUMNWISE:
            expected = {ROWWISE: 2 * weights + STEPS if reshard_after_forward else weights + STEPS}
        elif reshard_after_forward:
            expected = {ROWWISE: weights, COLUMNWISE: weights, BOTH: STEPS}
        else:
            expected = {BOTH: weights + STEPS}
        seen = {u: counter.usages.count(u) for u in set(counter.usages)}
        assert seen == expected, f"reshard_after_forward={reshard_after_forward}: gathers {seen}, expected {expected}"


def _quantized_init_rank(rank, world, name):
    """quantized_model_init layers gathered in FP8: the FP8 Parameter becomes the high-precision master
    (the preserved initial weight) that FSDP2 shards and gathers in FP8; training is bitwise the same
    recipe's without quantized_model_init."""
    r = RECIPES[name]
    with tl.quantized_model_init(recipe=r, preserve_high_precision_init_val=True):
        on = _sharded(None, True)
    for m in (on[0], on[2]):
        assert m.quantized_init is not None and is_fp8_all_gathered(m.weight)
        assert tl.get_high_precision_init_val(m) is None  # it became the master
    off = _sharded(None, False)
    _assert_same_training(rank, world, on, off, f"quantized_model_init, {name}", autocast_recipe=r,
                          batches=_batches(rank, world, name=name))


def _hsdp_rank(rank, world, name, quantized_init):
    """HSDP (a 2-D mesh: replicate x shard): FP8 all-gather over the shard dimension (the amax all-reduced
    there), gradients all-reduced over the replicas; bitwise the same training as the high-precision
    gather, and the gathered tensors FP8."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    r = RECIPES[name]

    def build(fp8_all_gather, quantized):
        with tl.quantized_model_init(enabled=quantized, recipe=r, preserve_high_precision_init_val=True):
            model = _mlp(r)
        for layer in (model[0], model[2]):
            tl.distributed.fully_shard(layer, mesh=mesh, fp8_all_gather=fp8_all_gather)
        return tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)

    on, off = build(True, quantized_init), build(False, False)
    assert on[0].weight.placements == (Replicate(), Shard(0))
    assert isinstance(on[0].weight.to_local(), FP8AllGatherWeight)
    batches = _batches(rank, world, name=name)
    with _GatherCounter() as counter:
        on(batches[0]).square().sum().backward()
    data_dtypes = _gathered_data_dtypes(name)
    assert counter.fp8_gathers > 0 and all(d in data_dtypes for d in counter.data_dtypes), counter.data_dtypes
    on.zero_grad(set_to_none=True)
    _assert_same_training(rank, world, on, off, f"HSDP {name}, quantized_model_init={quantized_init}",
                          batches=batches)


def _dequantized_backward_rank(rank, world):
    """MXFP8 with backward_override="dequantized": dgrad reads the forward's rowwise copy, so backward's gather
    carries it too (both copies in every gather, not the columnwise copy alone); bitwise the high-precision
    gather's training."""
    r = recipe.from_name("mxfp8", backward_override="dequantized")
    on = _sharded(r, True)
    with _GatherCounter() as counter:
        on(_batches(rank, world, steps=1)[0]).square().sum().backward()
    assert counter.usages == [BOTH] * 4, counter.usages
    _assert_same_training(rank, world, _sharded(r, True), _sharded(r, False), "MXFP8, dequantized backward")


def _checkpoint_rank(rank, world, path):
    import torch.distributed.checkpoint as dcp

    r = RECIPES["current"]
    batches = _batches(rank, world)
    model = _sharded(r, True)
    _train(model, batches[:2])
    dcp.save(model.state_dict(), checkpoint_id=path)
    resumed = _sharded(r, True)
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state)
    assert isinstance(resumed[0].weight.to_local(), FP8AllGatherWeight)
    losses, _ = _train(model, batches[2:])
    losses_resumed, _ = _train(resumed, batches[2:])
    for step, (a, b) in enumerate(zip(losses_resumed, losses)):
        assert_bitwise_equal(a, b, f"resumed loss, step {step}")


def _errors_rank(rank, world):
    with pytest.raises(ValueError, match=r"256 rows over 2 ranks with \[1, 0\] blocks"):
        _sharded(recipe.from_name("rowwise"), True)
    with pytest.raises(ValueError, match=r"64 rows over 2 ranks with \[128, 128\] blocks"):
        _sharded(RECIPES["block"], True, out=64)
    # NVFP4: 16x16 blocks whole in each shard, one copy gathered (the columnwise one its transpose).
    with pytest.raises(ValueError, match=r"48 rows over 2 ranks with \[16, 16\] blocks.*\(16\)"):
        _sharded(RECIPES["nvfp4"], True, out=48)
    with pytest.raises(ValueError, match=r"33 rows over 2 ranks with \[16, 16\] blocks"):
        _sharded(RECIPES["nvfp4"], True, out=33)
    with pytest.raises(ValueError, match=r"NVFP4 \[1, 16\] blocks: only 16x16 weight blocks are gathered in FP4"):
        _sharded(recipe.from_name("nvfp4", disable_2d_quantization=True), True)
    with pytest.raises(ValueError, match="fp8_all_gather=True needs tl.Linear '<root>' to have a recipe"):
        _sharded(None, True)
    with pytest.raises(TypeError, match="fully_shard: 'recipe' must be one of"):
        _sharded(None, "current")
    model = _sharded(RECIPES["current"], True)
    (x,) = _batches(rank, world, steps=1)
    model[0].recipe = None
    with pytest.raises(RuntimeError, match="holds only its quantized form"):
        model(x)
    model = _sharded(RECIPES["current"], True)
    model[0].recipe = RECIPES["block"]
    with pytest.raises(ValueError, match="the forward's recipe quantizes it as"):
        model(x)
    # A weight gathered one copy per pass has FSDP2 buffers of one copy: backward must gather again.
    model = _sharded(RECIPES["mxfp8"], True)
    model(x).sum().backward()
    model[0].set_reshard_after_forward(False)
    with pytest.raises(RuntimeError, match="reshard_after_forward is now off"):
        model(x)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


class TestFP8AllGather:
    @pytest.mark.parametrize(
        "name, reshard_after_forward", [(name, True) for name in RECIPES] + [("mxfp8", False)],
        ids=list(RECIPES) + ["mxfp8-no_reshard_after_forward"],
    )
    def test_gathers_fp8_bytes(self, name, reshard_after_forward):
        fp32, bf16, fp8, fp8_bf16 = run_ranks(
            _bytes_rank, name, reshard_after_forward, world_size=WORLD, timeout=TIMEOUT
        )[0]
        print(f"{name}, reshard_after_forward={reshard_after_forward}: fp32 {fp32} B, bf16 {bf16} B, FP8 {fp8} B "
              f"(bf16 params: {fp8_bf16} B)")

    @pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
    def test_gpt_training_bitwise(self, name):
        run_ranks(_gpt_rank, name, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_training_bitwise_matches_high_precision_gather(self, name):
        run_ranks(_parity_rank, name, None, OUT, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_layers_without_bias(self, name):
        # A per-tensor scaled weight gathers its FP8 data alone (no bias beside it in FSDP2's group): FSDP2 then
        # all-gathers in that one dtype, which gloo does not take, unless the data travels as bytes.
        run_ranks(_parity_rank, name, None, OUT, None, False, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["current", "delayed", "nvfp4"])
    def test_bf16_mixed_precision_policy(self, name):
        run_ranks(_parity_rank, name, torch.bfloat16, OUT, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["current", "delayed", "block", "mxfp8", "nvfp4"])
    @pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
    def test_compiled_layers(self, name, backend):
        run_ranks(_parity_rank, name, None, OUT, backend, world_size=WORLD, timeout=TIMEOUT)

    def test_uneven_shards(self):
        run_ranks(_parity_rank, "current", None, OUT - 1, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["current", "block"])
    def test_recipe_for_autocast_layers(self, name):
        run_ranks(_autocast_rank, name, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize(
        "name, compile_backend, compile_region",
        [("current", None, False), ("delayed", None, False), ("mxfp8", None, False), ("nvfp4", None, False),
         ("mxfp8", "aot_eager", False), ("mxfp8", "inductor", False), ("mxfp8", "inductor", True)],
        ids=["current", "delayed", "mxfp8", "nvfp4", "mxfp8-compiled", "mxfp8-inductor",
             "mxfp8-inductor-compiled_region"],
    )
    def test_activation_checkpointing(self, name, compile_backend, compile_region):
        run_ranks(_checkpointed_rank, name, compile_backend, compile_region, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.filterwarnings("ignore:DTensor random operators")
    def test_deferred_init_on_meta_device(self):
        run_ranks(_deferred_init_rank, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
    def test_composes_with_quantized_model_init(self, name):
        run_ranks(_quantized_init_rank, name, world_size=WORLD, timeout=TIMEOUT)

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "name, quantized_init", [("current", False), ("mxfp8", False), ("nvfp4", False), ("current", True)],
        ids=["current", "mxfp8", "nvfp4", "current-quantized_model_init"],
    )
    def test_hsdp_2d_mesh(self, name, quantized_init):
        run_ranks(_hsdp_rank, name, quantized_init, world_size=4, timeout=TIMEOUT)

    def test_dequantized_backward_gathers_the_rowwise_copy_in_backward(self):
        run_ranks(_dequantized_backward_rank, timeout=TIMEOUT)

    def test_checkpoint_resume(self, tmp_path):
        run_ranks(_checkpoint_rank, str(tmp_path / "ckpt"), world_size=WORLD, timeout=TIMEOUT)

    def test_errors(self):
        run_ranks(_errors_rank, world_size=WORLD, timeout=TIMEOUT)


# Whether a weight of `rows` rows shards over `world` ranks without a block straddling two (no ranks needed).
_SHARDABLE = [
    ("current", 255, 2, True),  # one scale per tensor: anywhere (uneven shards are padded)
    ("delayed", 7, 4, True),
    ("block", 256, 2, True),  # 128 rows a rank: whole 128x128 blocks
    ("block", 384, 2, False),  # 192 rows a rank
    ("block", 256, 1, True),  # nothing sharded
    ("block", 257, 2, False),  # uneven
    ("mxfp8", 64, 2, True),  # 32 rows a rank: whole 1x32 blocks of the columnwise copy
    ("mxfp8", 32, 2, False),
    ("rowwise", 256, 2, False),  # the columnwise copy scales whole columns
    ("nvfp4", 256, 2, True),  # 128 rows a rank: whole 16x16 blocks (the global scale all-reduced)
    ("nvfp4", 64, 4, True),
    ("nvfp4", 48, 2, False),  # 24 rows a rank
    ("nvfp4", 33, 2, False),  # uneven
    ("nvfp4", 256, 1, True),  # nothing sharded
    ("nvfp4-1x16", 256, 2, False),  # the columnwise copy has blocks of its own (and with RHT its own amax)
    ("nvfp4-sr", 256, 2, False),  # shards would round with other random bits than the whole weight
]


def _weight_quantizer(name):
    if name == "nvfp4-1x16":
        return quantization_spec(recipe.from_name("nvfp4", disable_2d_quantization=True)).weight
    if name == "nvfp4-sr":
        return dataclasses.replace(quantization_spec(recipe.from_name("nvfp4")).weight, stochastic_rounding=True)
    return quantization_spec(recipe.from_name(name)).weight


@pytest.mark.parametrize("name, rows, world, ok", _SHARDABLE)
def test_check_shardable(name, rows, world, ok):
    quantizer = _weight_quantizer(name)
    if ok:
        check_shardable(quantizer, rows, world)
    else:
        with pytest.raises(ValueError, match=f"a weight of {rows} rows over {world} ranks"):
            check_shardable(quantizer, rows, world)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols, world", [(64, 96, 2), (256, 128, 4), (32, 16, 2)])
def test_nvfp4_shards_gather_to_the_whole_weight(dtype, rows, cols, world):
    """NVFP4 shards quantized with the whole weight's amax (the MAX of theirs, as the all-reduce makes it),
    their data and block scales concatenated along rows, then packed, with the columnwise copy made from
    them: bitwise the quantizer's copies of the whole weight, both usages (what fp8_all_gather=False reads)."""
    quantizer = quantization_spec(RECIPES["nvfp4"]).weight
    weight = (torch.randn(rows, cols) * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype)
    shards = weight.chunk(world)
    amax = torch.stack([ops.nvfp4.nvfp4_amax(s) for s in shards]).amax()
    datas, block_scales, global_scales = [], [], set()
    for shard in shards:
        q = quantizer.quantize(shard, rowwise=True, columnwise=False, global_amax=amax)
        assert q.data.dtype == torch.uint8 and q.data.shape == (shard.shape[0], cols // 2)
        block_scale, global_scale = ops.nvfp4.unpack_scales(q.scale_inv, shard.shape[0], cols)
        datas.append(q.data)
        block_scales.append(block_scale)
        global_scales.add(float(global_scale))
    assert len(global_scales) == 1, f"the shards' global scales differ: {global_scales}"
    cached = whole_weight_of_gathered(quantizer, (torch.cat(datas), torch.cat(block_scales)), rows, global_scale)
    whole = quantizer.quantize(weight.contiguous(), rowwise=True, columnwise=True)
    for what, got, want in (("data", cached.weight_fp8, whole.data), ("data_t", cached.weight_fp8_t, whole.data_t),
                            ("scale_inv", cached.weight_scale_inv, whole.scale_inv),
                            ("scale_inv_t", cached.weight_scale_inv_t, whole.scale_inv_t)):
        assert_bitwise_equal(got.view(torch.uint8), want.view(torch.uint8), f"gathered {what}")


def test_nvfp4_global_amax_only_for_nvfp4():
    with pytest.raises(ValueError, match="'global_amax' applies to NVFP4 quantizers only"):
        quantization_spec(RECIPES["mxfp8"]).weight.quantize(torch.randn(32, 32), global_amax=torch.tensor(1.0))


def test_shard_is_the_plain_weight_to_other_ops():
    quantizer = quantization_spec(RECIPES["current"]).weight
    weight = torch.randn(4, 8)
    shard = FP8AllGatherWeight(weight.clone(), quantizer)
    # Views and copies (FSDP2's chunking and padding) keep the subclass; arithmetic reads the plain tensor.
    assert type(shard.view(-1)) is FP8AllGatherWeight and type(torch.chunk(shard, 2)[0]) is FP8AllGatherWeight
    doubled = shard * 2
    assert type(doubled) is torch.Tensor
    assert_bitwise_equal(doubled, weight * 2, "shard * 2")


@pytest.mark.parametrize("use", ["add", "radd", "sum", "matmul"])
def test_gathered_weight_raises_outside_the_linear(use):
    quantizer = quantization_spec(RECIPES["current"]).weight
    q = quantizer.quantize(torch.randn(4, 8))
    gathered = GatheredFP8Weight(CachedWeight(q.data, None, q.scale_inv, None, q.amax.reshape(())), quantizer, torch.float32)
    assert type(gathered.detach()) is GatheredFP8Weight  # what nn.Parameter does to it
    uses = {"add": lambda: gathered + 1, "radd": lambda: torch.ones(4, 8) + gathered, "sum": gathered.sum,
            "matmul": lambda: torch.ones(2, 8) @ gathered.t()}
    with pytest.raises(RuntimeError, match="holds only its quantized form"):
        uses[use]()


def test_rowwise_copy_op():
    """The recompute's rowwise gather is one functional op in every compiled forward: it copies the rowwise
    copy of a weight that holds it (its schema, fake and autograd registrations checked by opcheck; eager
    reads the held tensors, no copy), and refuses a handle whose shard is gone."""
    quantizer = quantization_spec(RECIPES["mxfp8"]).weight
    q = quantizer.quantize(torch.randn(64, 64), rowwise=True, columnwise=False)
    held = torch.full((), NO_HANDLE, dtype=torch.int64)
    # test_schema compares inputs with arithmetic that FP8 tensors lack: the op is checked on their bytes.
    torch.library.opcheck(rowwise_copy, (held, q.data.view(torch.uint8), q.scale_inv.view(torch.uint8)))
    data, scale_inv = rowwise_copy(held, q.data, q.scale_inv)
    assert data.data_ptr() != q.data.data_ptr() and scale_inv.data_ptr() != q.scale_inv.data_ptr()
    assert_bitwise_equal(data.view(torch.uint8), q.data.view(torch.uint8), "rowwise data copied")
    assert_bitwise_equal(scale_inv.view(torch.uint8), q.scale_inv.view(torch.uint8), "rowwise scales copied")
    data, scale_inv = rowwise_copies(held, q.data, q.scale_inv)
    assert data is q.data and scale_inv is q.scale_inv
    gone = torch.full((), 2**62, dtype=torch.int64)
    for call in (rowwise_copy, rowwise_copies):
        with pytest.raises(RuntimeError, match="its shard is gone"):
            call(gone, q.data, q.scale_inv)
    with pytest.raises(TypeError, match="missing_rowwise"):
        rowwise_copies(held.to("meta"), q.data, q.scale_inv)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.float32)):
        for call in (rowwise_copy, rowwise_copies):
            with pytest.raises(ValueError, match="'missing_rowwise' must be a 0-d int64 tensor"):
                call(bad, q.data, q.scale_inv)
