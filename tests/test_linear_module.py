"""tl.Linear as a module: recipes, drop-in compatibility with nn.Linear, state, conversions."""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from tolerances import assert_bitwise_equal
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules import linear, linear_ops
from transformer_linear.modules.autocast import get_fp8_recipe
from transformer_linear.recipe import delayed_scaling

RECIPES = {
    "current_hybrid": recipe.from_name("current"),
    "current_e4m3": recipe.from_name("current-e4m3"),
    "delayed_hybrid": recipe.from_name("delayed", amax_history_len=4),
    "delayed_e4m3": recipe.from_name("delayed-e4m3", amax_compute_algo="most_recent"),
}


def _pair(in_f=24, out_f=10, bias=True, dtype=torch.float32, **kwargs):
    """An nn.Linear and a tl.Linear with the same parameters."""
    torch.manual_seed(1)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    torch.manual_seed(1)
    layer = tl.Linear(in_f, out_f, bias=bias, dtype=dtype, **kwargs)
    return ref, layer


def _fwd_bwd(module, x):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y, x.grad


class TestRecipes:
    @pytest.mark.parametrize(
        "make, message",
        [
            (lambda: recipe.DelayedScaling(margin=-1), "margin"),
            (lambda: recipe.DelayedScaling(amax_history_len=0), "amax_history_len"),
            (lambda: recipe.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
            (lambda: recipe.DelayedScaling(fp8_format="E4M3"), "fp8_format"),
            (lambda: recipe.CurrentScaling(margin=1.5), "margin"),
            (lambda: recipe.MXFP8BlockScaling(e8m0_rounding="up"), "'e8m0_rounding' must be 'ceil' or 'floor'"),
        ],
    )
    def test_bad_values_raise_at_construction(self, make, message):
        with pytest.raises((ValueError, TypeError), match=message):
            make()

    def test_frozen_and_formats(self):
        r = recipe.DelayedScaling()
        with pytest.raises(AttributeError):
            r.margin = 1
        assert recipe.Format.HYBRID.bwd_dtype == torch.float8_e5m2
        assert recipe.Format.E4M3.bwd_dtype == torch.float8_e4m3fn
        assert r.amax_history_len == 1024 and r.fp8_format is recipe.Format.HYBRID

    def test_autocast_validates_and_nests(self):
        with pytest.raises(TypeError, match="recipe"):
            with tl.autocast(recipe="delayed"):
                pass
        assert tl.fp8_autocast is tl.autocast
        with tl.autocast(recipe=recipe.CurrentScaling()):
            with tl.autocast(enabled=False):
                assert get_fp8_recipe() is None
            assert get_fp8_recipe() == recipe.CurrentScaling()
        assert get_fp8_recipe() is None
        with tl.autocast():
            assert get_fp8_recipe() == recipe.DelayedScaling()


FP8_KEYS = ("fp8_amax_history", "fp8_scale", "fp8_grad_amax_history", "fp8_grad_scale")
"""A tl.Linear's delayed-scaling state_dict keys: the forward state, then the backward state."""


def _assert_fresh(layer, rows):
    assert_bitwise_equal(layer.fp8_amax_history, torch.zeros(rows, 2), "fresh forward history")
    assert_bitwise_equal(layer.fp8_scale, torch.ones(2), "fresh forward scales")
    assert_bitwise_equal(layer.fp8_grad_amax_history, torch.zeros(rows, 1), "fresh backward history")
    assert_bitwise_equal(layer.fp8_grad_scale, torch.ones(1), "fresh backward scale")


class TestDropIn:
    def test_same_init_names_and_state_dict_keys(self):
        ref, layer = _pair()
        assert_bitwise_equal(layer.weight.detach(), ref.weight.detach(), "weight")
        assert_bitwise_equal(layer.bias.detach(), ref.bias.detach(), "bias")
        # nn.Linear's keys, then the delayed-scaling state every layer owns.
        assert list(layer.state_dict()) == [*ref.state_dict(), *FP8_KEYS]

    @pytest.mark.parametrize("bias", [True, False])
    def test_state_dict_loads_both_ways(self, bias):
        ref = nn.Linear(8, 4, bias=bias)
        layer = tl.Linear(8, 4, bias=bias)
        layer.load_state_dict(ref.state_dict(), strict=True)
        result = nn.Linear(8, 4, bias=bias).load_state_dict(layer.state_dict(), strict=False)
        assert result.unexpected_keys == list(FP8_KEYS) and not result.missing_keys
        assert_bitwise_equal(layer.weight.detach(), ref.weight.detach())

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("shape", [(7, 24), (2, 3, 24), (0, 24), (24,)])
    def test_without_fp8_bitwise_equal_to_nn_linear(self, dtype, shape):
        ref, layer = _pair(dtype=dtype)
        x = torch.randn(shape, dtype=dtype)
        y_ref, dx_ref = _fwd_bwd(ref, x)
        y, dx = _fwd_bwd(layer, x)
        assert_bitwise_equal(y, y_ref, "output")
        assert_bitwise_equal(dx, dx_ref, "input grad")
        assert_bitwise_equal(layer.weight.grad, ref.weight.grad, "weight grad")
        assert_bitwise_equal(layer.bias.grad, ref.bias.grad, "bias grad")

    def test_convert_to_fp8_and_from_linear(self):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        weights = [p for p in model.parameters()]
        tl.convert_to_fp8(model, recipe=recipe.CurrentScaling(), module_filter_fn=lambda m, fqn: fqn != "2")
        assert type(model[0]) is tl.Linear and type(model[2]) is nn.Linear
        assert model[0].weight is weights[0] and model[0].recipe == recipe.CurrentScaling()
        layer = tl.Linear.from_linear(nn.Linear(8, 4), recipe=recipe.DelayedScaling(amax_history_len=2))
        assert layer.fp8_amax_history.device.type == "cpu" and layer.fp8_amax_history.shape == (2, 2)
        assert layer.fp8_grad_amax_history.shape == (2, 1)
        with pytest.raises(TypeError, match="nn.Linear"):
            tl.Linear.from_linear(nn.Conv1d(1, 1, 1))


class TestFP8State:
    def test_delayed_state_in_state_dict_and_resume(self):
        r = recipe.DelayedScaling(amax_history_len=3)
        layer = tl.Linear(16, 8, recipe=r)
        for _ in range(2):
            _fwd_bwd(layer, torch.randn(5, 16))
        state = layer.state_dict()
        assert set(state) == {"weight", "bias", *FP8_KEYS}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        resumed = tl.Linear(16, 8, recipe=r)
        resumed.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
        x = torch.randn(5, 16)
        for module in (layer, resumed):
            _fwd_bwd(module, x)
        for key in FP8_KEYS:
            assert_bitwise_equal(getattr(resumed, key), getattr(layer, key), f"{key} after resume")

    def test_state_dict_without_state_starts_fresh(self):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3))
        _fwd_bwd(layer, torch.randn(5, 16))
        layer.load_state_dict(nn.Linear(16, 8).state_dict(), strict=True)
        _assert_fresh(layer, rows=3)

    def test_to_deepcopy_pickle_keep_fp32_state(self):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3))
        _fwd_bwd(layer, torch.randn(5, 16))
        scale = layer.fp8_scale.clone()
        for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert_bitwise_equal(clone.fp8_scale, scale)
        layer.to(torch.bfloat16)
        assert layer.weight.dtype == torch.bfloat16 and layer.fp8_scale.dtype == torch.float32
        assert_bitwise_equal(layer.fp8_scale, scale, "scale after .to(bfloat16)")
        layer.to("cpu")
        y, _ = _fwd_bwd(layer, torch.randn(5, 16, dtype=torch.bfloat16))
        assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("r", [None, recipe.DelayedScaling(amax_history_len=4)])
def test_meta_init_then_to_empty_starts_the_state_fresh(r):
    """FSDP2's meta-device initialisation: the state every layer owns holds no data on meta."""
    with torch.device("meta"):
        layer = tl.Linear(16, 8, recipe=r)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    _assert_fresh(layer, rows=4 if r is not None else 1024)
    with tl.autocast(recipe=recipe.DelayedScaling(amax_history_len=4)):
        y, _ = _fwd_bwd(layer, torch.randn(5, 16))
    assert torch.isfinite(y).all()


ALL_RECIPES = [None, *(recipe.from_name(name) for name in ("delayed", "current", "block", "mxfp8", "rowwise"))]


@pytest.mark.parametrize("r", ALL_RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_forward_and_backward_propagate_shapes_like_nn_linear(r, dtype):
    """A layer on the meta device (deferred init) runs like nn.Linear there: meta outputs and gradients
    of nn.Linear's shapes and dtypes, under every recipe."""
    ref = nn.Linear(64, 32, device="meta", dtype=dtype)
    layer = tl.Linear(64, 32, device="meta", dtype=dtype, recipe=r)
    outs = []
    for module in (ref, layer):
        x = torch.empty(2, 3, 64, device="meta", dtype=dtype, requires_grad=True)
        y = module(x)
        y.sum().backward()
        outs.append([(t.device.type, t.shape, t.dtype) for t in (y, x.grad, module.weight.grad, module.bias.grad)])
    assert outs[1] == outs[0]


class TestLoadFP8State:
    """load_state_dict checks the FP8 state: float32, documented shapes, usable scales."""

    @staticmethod
    def _trained(rows=3):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=rows))
        _fwd_bwd(layer, torch.randn(5, 16))
        return layer

    @pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.bfloat16, torch.float64])
    def test_cast_to_float32(self, dtype):
        state = self._trained().state_dict()
        state["fp8_scale"] = torch.tensor([2, 4]).to(dtype)
        state["fp8_grad_scale"] = torch.tensor([8]).to(dtype)
        for key in ("fp8_amax_history", "fp8_grad_amax_history"):
            state[key] = state[key].to(dtype)
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3))
        layer.load_state_dict(state)
        assert all(getattr(layer, key).dtype == torch.float32 for key in FP8_KEYS)
        assert_bitwise_equal(layer.fp8_scale, torch.tensor([2.0, 4.0]))
        assert_bitwise_equal(layer.fp8_grad_scale, torch.tensor([8.0]))
        y, _ = _fwd_bwd(layer, torch.randn(5, 16))
        assert torch.isfinite(y).all()

    @pytest.mark.parametrize(
        "key, value, message",
        [
            ("fp8_scale", torch.ones(1), r"'fp8_scale' must have shape \(2,\)"),
            ("fp8_scale", torch.ones(1, 2), r"'fp8_scale' must have shape \(2,\)"),
            ("fp8_grad_scale", torch.ones(2), r"'fp8_grad_scale' must have shape \(1,\)"),
            ("fp8_amax_history", torch.zeros(3), r"'fp8_amax_history' must have shape \(history_len >= 1, 2\)"),
            ("fp8_amax_history", torch.zeros(4, 1), r"'fp8_amax_history' must have shape"),
            ("fp8_amax_history", torch.zeros(0, 2), r"'fp8_amax_history' must have shape"),
            ("fp8_grad_amax_history", torch.zeros(4, 2), r"'fp8_grad_amax_history' must have shape \(history_len"),
            ("fp8_scale", torch.tensor([1.0, float("nan")]), "'fp8_scale' must hold finite positive scales"),
            ("fp8_scale", torch.tensor([1.0, float("inf")]), "'fp8_scale' must hold finite positive scales"),
            ("fp8_scale", torch.tensor([0.0, 1.0]), "'fp8_scale' must hold finite positive scales"),
            ("fp8_grad_scale", torch.tensor([-2.0]), "'fp8_grad_scale' must hold finite positive scales"),
            ("fp8_scale", torch.tensor([1e5, 1.0], dtype=torch.float16), "finite positive"),  # inf in fp16
            ("fp8_scale", torch.ones(2, dtype=torch.bool), "'fp8_scale' must be a real tensor"),
            ("fp8_grad_amax_history", "history", "'fp8_grad_amax_history' must be a real tensor"),
        ],
    )
    def test_rejects_bad_state_naming_the_key(self, key, value, message):
        state = {f"block.{k}": v for k, v in self._trained().state_dict().items()}
        state[f"block.{key}"] = value
        model = nn.Sequential()
        model.add_module("block", tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3)))
        before = copy.deepcopy(model.block.state_dict())
        with pytest.raises(ValueError, match=message.replace("'fp8", "'block.fp8")):
            model.load_state_dict(state)
        for k, v in model.block.state_dict().items():
            assert_bitwise_equal(v, before[k], f"{k} after a rejected load")

    def test_other_history_length_loads(self):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3))
        layer.load_state_dict(self._trained(rows=5).state_dict())
        assert layer.fp8_amax_history.shape == (5, 2) and layer.fp8_grad_amax_history.shape == (5, 1)
        _fwd_bwd(layer, torch.randn(5, 16))  # uses the leading 3 rows

    def test_three_column_checkpoint_loads_split(self):
        """A checkpoint of the earlier layout, one (rows, 3) history and (3,) scale with columns
        [input, weight, grad_output], loads into the forward and backward states."""
        trained = self._trained()
        state = trained.state_dict()
        history = torch.cat([state.pop("fp8_amax_history"), state.pop("fp8_grad_amax_history")], dim=1)
        scale = torch.cat([state.pop("fp8_scale"), state.pop("fp8_grad_scale")])
        state["fp8_amax_history"], state["fp8_scale"] = history, scale
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=3))
        assert not layer.load_state_dict(state, strict=True).missing_keys
        for key in FP8_KEYS:
            assert_bitwise_equal(getattr(layer, key), getattr(trained, key), key)
        with pytest.raises(ValueError, match=r"'fp8_scale' must hold finite positive scales"):
            layer.load_state_dict({**state, "fp8_scale": torch.tensor([1.0, 1.0, 0.0])})


class TestInferenceMode:
    """A first forward under inference_mode leaves a state training can update. Under
    inference_mode (as under no_grad) the delayed state updates like in any forward."""

    @pytest.mark.parametrize("history_len", [4, 2048])  # 2048: the history grows in that forward
    def test_first_forward_in_inference_mode_then_training(self, history_len):
        r = recipe.DelayedScaling(amax_history_len=history_len)
        layers = [tl.Linear(16, 8), tl.Linear(16, 8)]
        layers[1].load_state_dict(layers[0].state_dict())
        x = torch.randn(5, 16)
        for layer, context in zip(layers, (torch.inference_mode, torch.no_grad)):
            with tl.autocast(recipe=r):
                with context():
                    layer(x)
                for _ in range(2):
                    _fwd_bwd(layer, x)
        for key, value in layers[1].state_dict().items():
            assert_bitwise_equal(layers[0].state_dict()[key], value, key)
        assert not any(t.is_inference() for t in layers[0].buffers())

    def test_state_updates_under_inference_mode(self):
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=4))
        x = torch.randn(5, 16)
        with torch.inference_mode():
            layer(x)
        assert_bitwise_equal(layer.fp8_amax_history[-1, 0], x.abs().max(), "input amax recorded")


class TestErrors:
    @pytest.mark.parametrize("name", [None, "current_hybrid"])
    def test_wrong_input_shape_names_the_argument(self, name):
        layer = tl.Linear(24, 10, recipe=RECIPES.get(name))
        with pytest.raises(ValueError, match=r"'inp' must have shape \(\.\.\., 24\)"):
            layer(torch.randn(3, 23))

    def test_bad_recipe_type(self):
        with pytest.raises(TypeError, match="recipe"):
            tl.Linear(4, 4, recipe="delayed")

    def test_unsupported_input_dtype_under_fp8(self):
        layer = tl.Linear(24, 10, recipe=RECIPES["current_hybrid"], dtype=torch.float64)
        with pytest.raises(TypeError, match="input"):
            layer(torch.randn(3, 24, dtype=torch.float64))


class TestModes:
    @pytest.mark.parametrize("name", list(RECIPES))
    @pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
    def test_no_grad_and_inference_mode(self, name, context):
        layer = tl.Linear(24, 10, recipe=RECIPES[name])
        x = torch.randn(3, 24)
        with torch.no_grad():
            expected = layer(x)
        with context():
            y = layer(x)
        assert not y.requires_grad
        if name.startswith("current"):
            assert_bitwise_equal(y, expected)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_outer_torch_autocast_bfloat16(self, name):
        ref, layer = _pair(recipe=RECIPES[name])
        x = torch.randn(4, 24)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, dx = _fwd_bwd(layer, x)
            y_ref, _ = _fwd_bwd(ref, x)
        assert y.dtype == y_ref.dtype == torch.bfloat16
        assert dx.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32

    def test_autocast_turns_fp8_on(self):
        ref, layer = _pair()
        x = torch.randn(4, 24)
        with tl.autocast(recipe=recipe.CurrentScaling()):
            y = layer(x)
        assert not torch.equal(y, ref(x))
        assert_bitwise_equal(layer(x), ref(x), "outside autocast")


# ---------------------------------------------------------------------------
# who owns the delayed-scaling state and the delayed-wgrad queue
# ---------------------------------------------------------------------------


class TestStateOwnership:
    def test_state_and_wgrad_queue_are_freed_with_the_layer(self):
        layer = tl.Linear(16, 8, recipe=RECIPES["delayed_hybrid"], delay_wgrad_compute=True)
        x = torch.randn(4, 16, requires_grad=True)
        layer(x).sum().backward()  # leaves a weight gradient queued for backward_dw()
        y = layer(x)  # a graph still holding what the ops need
        state, queue = layer.delayed_scaling_state, layer._wgrad_queue
        handles = (state.handle, queue.handle)
        refs = (weakref.ref(state), weakref.ref(queue))
        del layer, state, queue
        gc.collect()
        assert [r() for r in refs] == [None, None], "a global table kept the layer's state or queue alive"
        assert delayed_scaling._STATES.get(handles[0]) is None
        assert linear_ops._WGRAD_QUEUES.get(handles[1]) is None
        y.sum().backward()  # the graph outlives its layer: its updates reach the buffers it holds
        assert x.grad is not None

    @pytest.mark.parametrize(
        "copy_fn", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"]
    )
    def test_a_copy_has_its_own_state_and_queue(self, copy_fn):
        layer = tl.Linear(16, 8, recipe=RECIPES["delayed_hybrid"], delay_wgrad_compute=True)
        x = torch.randn(4, 16, requires_grad=True)
        layer(x).sum().backward()
        layer.delayed_scaling_state._pending.append(("work", "reduced amax"))  # a stand-in, not copied
        twin = copy_fn(layer)
        assert twin.delayed_scaling_state.handle != layer.delayed_scaling_state.handle
        assert twin._wgrad_queue.handle != layer._wgrad_queue.handle
        assert twin.delayed_scaling_state.pending_reductions == ()
        twin.backward_dw()  # the copy's queue starts empty
        assert twin.weight.grad is None
        layer.backward_dw()
        assert layer.weight.grad is not None
        layer.delayed_scaling_state._pending.clear()

    def test_a_forward_and_a_backward_each_call_the_state_once(self, monkeypatch):
        """Forward: one call into the layer's state, inside which its buffers are updated once (after
        linear_fwd read them); backward: one call, likewise."""
        layer = tl.Linear(16, 8, recipe=RECIPES["delayed_hybrid"])
        events = []

        def spy(name, fn):
            def wrapper(*args, **kwargs):
                events.append(f"enter {name}")
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append(f"exit {name}")

            return wrapper

        state = layer.delayed_scaling_state
        monkeypatch.setattr(state, "forward", spy("forward", state.forward))
        backward = linear_ops.quantize_and_record_grad_output
        monkeypatch.setattr(linear_ops, "quantize_and_record_grad_output", spy("backward", backward))
        update = delayed_scaling.delayed_scaling_update
        monkeypatch.setattr(delayed_scaling, "delayed_scaling_update", spy("update", update))
        monkeypatch.setattr(linear, "linear_fwd", spy("linear_fwd", linear.linear_fwd))
        y = layer(torch.randn(4, 16, requires_grad=True))
        assert events == ["enter forward", "enter linear_fwd", "exit linear_fwd", "enter update", "exit update",
                          "exit forward"]
        events.clear()
        y.sum().backward()
        assert events == ["enter backward", "enter update", "exit update", "exit backward"]
        assert not bool(layer.fp8_grad_amax_history.eq(0).all()), "backward recorded no grad_output amax"
