"""Sharded checkpoints of FSDP2 models with FP8 weights (``torch.distributed.checkpoint``), resharded.

A model sharded over 2 gloo ranks, its ``tl.Linear`` weights all-gathered in FP8
(``tl.distributed.fully_shard(fp8_all_gather=True)``), optionally built under ``tl.quantized_model_init``,
trains two AdamW steps and is saved with ``dcp.save`` of ``get_state_dict(model, optimizer)``. The checkpoint
holds the high-precision master weights (plain fp32 DTensor shards), the biases, AdamW's state (sharded as
the parameters) and each layer's delayed-scaling state (amax histories and scales: plain tensors, identical
on all ranks, which DCP saves once and every rank loads whole). It is loaded on 1, 2 and 4 ranks and:

* the master weights, the optimizer state and the delayed-scaling state come back bitwise;
* the next training step (every rank feeds the same global batch, so that the step's arithmetic does not
  depend on how the batch is split) gives bitwise the loss and the updated weights of the 2-rank run that
  was not resharded, on 1 and 2 ranks. On 4 ranks the loss is bitwise (the forward reads bitwise the same
  gathered FP8 weight) but the update may differ in the last bit: FSDP2 averages the 4 ranks' gradients
  with a sum whose partial sums (3x) round, where 2 equal gradients sum exactly; it is checked to
  1 ulp-scale tolerance there;
* a model with another recipe, and models with FP8 off (``nn.Linear``; ``tl.Linear`` without a recipe,
  sharded with a high-precision gather) load the same master weights exactly.

512-row weights shard over 4 ranks in whole blocks for every recipe. On 1 rank FSDP2 gathers nothing, and the
weights stay plain (``tl.distributed.fully_shard``); the forward quantizes the whole weight itself.
"""

import io

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from tolerances import assert_bitwise_equal
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules.fp8_all_gather import FP8AllGatherWeight

TIMEOUT = 240.0
SAVED_WORLD = 2
IN, HIDDEN, OUT = 128, 512, 512
ROWS = 8  # the global batch, fed whole to every rank

RECIPES = {
    "current": recipe.from_name("current"),
    "delayed": recipe.from_name("delayed", amax_history_len=4),
    "block": recipe.from_name("block"),
    "mxfp8": recipe.from_name("mxfp8"),
}
STATE_KEYS = ("fp8_amax_history", "fp8_scale")  # the delayed-scaling buffers' names end so


# ---------------------------------------------------------------------------
# helpers (module level: they run in spawned ranks)
# ---------------------------------------------------------------------------


def _portable(obj):
    """``obj``'s tensors as bytes: a tensor a rank returns through the harness's queue would be shared memory
    of a process that exits before the test reads it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data):
    return torch.load(io.BytesIO(data))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _build(name, quantized_init, seed, fp8_all_gather=True):
    """The MLP, each Linear and the root sharded over all ranks; ``name`` None: tl.Linear without recipe."""
    r = RECIPES[name] if name is not None else None
    torch.manual_seed(seed)
    with tl.quantized_model_init(enabled=quantized_init, recipe=r):
        model = nn.Sequential(tl.Linear(IN, HIDDEN, recipe=r), nn.ReLU(), tl.Linear(HIDDEN, OUT, recipe=r))
    mesh = _mesh()
    for layer in (model[0], model[2]):
        tl.distributed.fully_shard(layer, mesh=mesh, fp8_all_gather=fp8_all_gather)
    return tl.distributed.fully_shard(model, mesh=mesh, fp8_all_gather=fp8_all_gather)


def _batch(step):
    return torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(100 + step)) * 3


def _step(model, opt, step):
    opt.zero_grad()
    loss = model(_batch(step)).square().mean()
    loss.backward()
    opt.step()
    return loss.detach().clone()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, opt):
    """Every tensor of the training state, whole, on this rank: parameters, AdamW's state, buffers."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    out = {f"model.{k}": _full(v).clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = _full(v).clone()
    return out


def _assert_replicated_state(model):
    """The delayed-scaling buffers are the same on every rank (what DCP's saving them once assumes)."""
    for key, t in model.state_dict().items():
        if key.endswith(STATE_KEYS):
            gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, t.contiguous())
            for r, g in enumerate(gathered):
                assert_bitwise_equal(g, t, f"{key} on rank {r} vs rank {dist.get_rank()}")


def _save_rank(rank, world, path, name, quantized_init):
    """Train 2 steps, save; then the reference: one more step without resharding."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _build(name, quantized_init, seed=0)
    assert isinstance(model[0].weight.to_local(), FP8AllGatherWeight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
    _assert_replicated_state(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    for key, t in model_sd.items():
        if key.endswith("weight"):  # the master, in plain shards
            assert type(t.to_local()) is torch.Tensor and t.dtype == torch.float32, f"{key}: {type(t.to_local())}"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _snapshot(model, opt)
    loss = _step(model, opt, 2)
    return _portable((saved, loss, _snapshot(model, opt)))


def _load_into(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _load_rank(rank, world, path, name, quantized_init):
    """Build afresh (other initial weights) on ``world`` ranks, load, and take the next step."""
    model = _build(name, quantized_init, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _load_into(model, opt, path)
    # One rank gathers nothing: the weight stays plain (distributed.fully_shard).
    assert isinstance(model[2].weight.to_local(), FP8AllGatherWeight) == (world > 1)
    _assert_replicated_state(model)
    loaded = _snapshot(model, opt)
    loss = _step(model, opt, 2)
    return _portable((loaded, loss, _snapshot(model, opt)))


def _load_other_rank(rank, world, path, how):
    """Load the checkpoint's weights into a model that quantizes differently or not at all; one step runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if how == "nn.Linear":  # FP8 off, not sharded: the whole master weights
        model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    elif how == "tl.Linear":  # FP8 off, sharded, gathered in fp32
        model = _build(None, False, seed=1, fp8_all_gather=False)
    else:  # another recipe, gathered in FP8
        model = _build(how, False, seed=1)
    for layer in model.modules():
        if isinstance(layer, tl.Linear):
            # DCP loads into tensors of the saved shapes: the history as long as the saved one (4 rows).
            layer.reset_fp8_state(amax_history_len=RECIPES["delayed"].amax_history_len)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    loaded = {k: _full(v).clone() for k, v in get_model_state_dict(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = _step(model, opt, 2)
    assert torch.isfinite(loss)
    return _portable(loaded)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def _assert_snapshots(got, want, what, exact=True):
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for key in want:
        if exact or not key.startswith("model.") or not key.endswith(("weight", "bias")):
            assert_bitwise_equal(got[key], want[key], f"{what}: {key}")
        else:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-rank checkpoint per (recipe, quantized_model_init), saved on first use."""
    cache = {}

    def get(name, quantized_init):
        key = (name, quantized_init)
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"ckpt_{name}_{quantized_init}"))
            result = run_ranks(_save_rank, path, name, quantized_init, world_size=SAVED_WORLD, timeout=TIMEOUT)[0]
            cache[key] = (path, *_unpack(result))
        return cache[key]

    return get


def _check_reshard(saved, name, quantized_init, world):
    path, at_save, ref_loss, ref_after = saved(name, quantized_init)
    result = run_ranks(_load_rank, path, name, quantized_init, world_size=world, timeout=TIMEOUT)[0]
    loaded, loss, after = _unpack(result)
    what = f"{name}, quantized_model_init={quantized_init}, {SAVED_WORLD} -> {world} ranks"
    _assert_snapshots(loaded, at_save, f"{what}, loaded")
    assert_bitwise_equal(loss, ref_loss, f"{what}: next step's loss")
    # AdamW's state after the step: its moments are of the averaged gradient, bitwise only where that is.
    _assert_snapshots(after, ref_after, f"{what}, after the next step", exact=world <= SAVED_WORLD)


class TestReshardedCheckpoint:
    @pytest.mark.parametrize("quantized_init", [False, True], ids=["fp8_weights", "quantized_model_init"])
    @pytest.mark.parametrize("name", list(RECIPES))
    @pytest.mark.parametrize("world", [1, 2])
    def test_load_on_fewer_or_same_ranks(self, saved, name, quantized_init, world):
        _check_reshard(saved, name, quantized_init, world)

    @pytest.mark.slow
    @pytest.mark.parametrize("quantized_init", [False, True], ids=["fp8_weights", "quantized_model_init"])
    @pytest.mark.parametrize("name", list(RECIPES))
    def test_load_on_4_ranks(self, saved, name, quantized_init):
        _check_reshard(saved, name, quantized_init, 4)

    @pytest.mark.parametrize("how, world", [("block", 1), ("mxfp8", 2), ("nn.Linear", 1), ("tl.Linear", 2)])
    def test_load_with_other_recipe_or_fp8_off(self, saved, how, world):
        path, at_save, _, _ = saved("delayed", True)
        loaded = _unpack(run_ranks(_load_other_rank, path, how, world_size=world, timeout=TIMEOUT)[0])
        keys = [k for k in loaded if k.endswith(("weight", "bias"))]
        assert len(keys) == 4, keys
        for key in keys:
            assert_bitwise_equal(loaded[key], at_save[f"model.{key}"], f"{how} on {world} ranks: {key}")
        for key in (k for k in loaded if k.endswith(STATE_KEYS)):  # tl.Linear: the delayed-scaling state too
            assert_bitwise_equal(loaded[key], at_save[f"model.{key}"], f"{how} on {world} ranks: {key}")
