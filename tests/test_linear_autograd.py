"""tl.Linear's FP8 forward and backward against transformer_linear.reference, and the
autograd features: retain_graph, weight caching, delayed and fused wgrad."""

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_close_to_reference
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_linear as tl
from transformer_linear import recipe, reference

RECIPES = {
    "current_hybrid": recipe.from_name("current"),
    "current_e4m3": recipe.from_name("current-e4m3"),
    "delayed_hybrid": recipe.from_name("delayed", amax_history_len=4),
    "delayed_e4m3": recipe.from_name("delayed-e4m3", amax_compute_algo="most_recent", margin=1),
}
SHAPES = [(5, 24, 10), (2, 3, 17, 33), (0, 16, 8), (1, 1, 1), (7, 1, 5), (7, 5, 1)]  # (*batch, in_features, out_features)


def _run(layer, x, grad):
    """Forward + backward with a given output gradient; returns (y, dx)."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y, x.grad


def _fp32_baseline(x, w, grad, r, scale):
    """Plain fp32 PyTorch on the dequantized FP8 operands: sets the error budget (tolerances.py)."""
    fmt, m = r.fp8_format, r.margin

    def dq(t, dtype, i):
        t2d = t.reshape(-1, t.shape[-1])
        q, scale_inv = reference.quantize_for_linear(t2d, dtype, None if scale is None else scale[i : i + 1], m)
        return reference.dequantize(q, scale_inv, torch.float32)

    x32, w32, g32 = dq(x, fmt.fwd_dtype, 0), dq(w, fmt.fwd_dtype, 1), dq(grad, fmt.bwd_dtype, 2)
    return x32 @ w32.t(), g32 @ w32, g32.t() @ x32


def _scales(layer):
    """The delayed scales of [input, weight, grad_output]: the forward state's, then the backward state's."""
    return torch.cat([layer.fp8_scale, layer.fp8_grad_scale])


class TestAgainstReference:
    @pytest.mark.parametrize("name", list(RECIPES))
    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_forward_and_backward(self, name, shape, dtype):
        r = RECIPES[name]
        *batch, k, n = shape
        torch.manual_seed(2)
        layer = tl.Linear(k, n, bias=False, recipe=r, dtype=dtype)
        x = torch.randn(*batch, k, dtype=dtype)
        grad = torch.randn(*batch, n, dtype=dtype)
        scale = None
        if isinstance(r, recipe.DelayedScaling):  # a step first, so the scales are not all 1
            _run(layer, x * 3, grad / 5)
            layer.weight.grad = None
            scale = _scales(layer)
        y, dx = _run(layer, x, grad)

        fmt, m, w, f64 = r.fp8_format, r.margin, layer.weight.detach(), torch.float64
        s = (lambda i: None) if scale is None else (lambda i: scale[i : i + 1])
        expected = (
            reference.linear_fwd(x, w, None, fmt.fwd_dtype, s(0), s(1), m, f64),
            reference.linear_dgrad(grad, w, fmt.bwd_dtype, fmt.fwd_dtype, s(2), s(1), m, f64),
            reference.linear_wgrad(grad, x, fmt.bwd_dtype, fmt.fwd_dtype, s(2), s(0), m, f64),
        )
        baselines = _fp32_baseline(x, w, grad, r, scale)
        for what, actual, ref, base in zip(("output", "input grad", "weight grad"), (y, dx, layer.weight.grad), expected, baselines):
            assert_close_to_reference(actual, ref, base.reshape(ref.shape).to(actual.dtype), what)

    def test_bias_gradient_fused_into_grad_quantize(self):
        layer = tl.Linear(24, 10, recipe=recipe.CurrentScaling())
        grad = torch.randn(3, 7, 10)
        _run(layer, torch.randn(3, 7, 24), grad)
        expected = grad.double().reshape(-1, 10).sum(0)
        assert_close_to_reference(layer.bias.grad, expected, grad.reshape(-1, 10).sum(0), "bias grad")

    def test_delayed_scaling_update_follows_te_rule(self):
        r = recipe.DelayedScaling(amax_history_len=3, margin=1)
        layer = tl.Linear(16, 8, recipe=r)
        amaxes = []
        for step in range(5):
            x = torch.randn(4, 16) * (step + 1)
            grad = torch.randn(4, 8) / (step + 1)
            _run(layer, x, grad)
            amaxes.append(torch.stack([reference.amax(x), reference.amax(layer.weight), reference.amax(grad)]))
        window = torch.stack(amaxes[-3:])  # the current amax and history_len - 1 earlier ones
        fp8_max = torch.tensor([448.0, 448.0, 57344.0])
        expected = torch.div(fp8_max, window.amax(0)) * 0.5  # margin 1
        assert_bitwise_equal(_scales(layer), expected, "scale")
        assert_bitwise_equal(layer.fp8_amax_history[0], torch.zeros(2), "cleared forward slot")
        assert_bitwise_equal(layer.fp8_grad_amax_history[0], torch.zeros(1), "cleared backward slot")


class TestFirstStep:
    """Delayed scaling's first step quantizes with just-in-time scales (first_step_just_in_time)."""

    @staticmethod
    def _mlp(r):
        torch.manual_seed(3)
        return torch.nn.Sequential(tl.Linear(16, 32, recipe=r), torch.nn.ReLU(), tl.Linear(32, 8, recipe=r))

    @pytest.mark.parametrize("just_in_time", [True, False])
    def test_first_forward_uses_own_amax(self, just_in_time):
        r = recipe.DelayedScaling(amax_history_len=4, margin=1, first_step_just_in_time=just_in_time)
        layer = tl.Linear(16, 8, recipe=r)
        x, grad = torch.randn(4, 16) * 1e-3, torch.randn(4, 8) * 1e-6
        _, dx = _run(layer, x, grad)
        used = layer.fp8_fwd_scale
        if not just_in_time:  # TransformerEngine's first step: the initial scale 1
            assert_bitwise_equal(used, torch.ones(3), "first-step scales")
            return
        fp8_max = torch.tensor([448.0, 448.0, 57344.0])
        amax = torch.stack([reference.amax(x), reference.amax(layer.weight), reference.amax(grad)])
        assert_bitwise_equal(used[:2], reference.compute_scale(amax, 448.0, 1)[:2], "just-in-time forward scales")
        # The history update computes the same scales from the recorded amaxes.
        assert_bitwise_equal(_scales(layer), torch.div(fp8_max, amax) * 0.5, "scales after the step")
        w = layer.weight.detach()
        s = torch.cat([reference.compute_scale(amax[i : i + 1], float(m), 1) for i, m in enumerate(fp8_max)])
        expected = reference.linear_dgrad(grad, w, torch.float8_e5m2, torch.float8_e4m3fn, s[2:], s[1:2], 1, torch.float64)
        assert_close_to_reference(dx, expected, what="input grad with a just-in-time grad_output scale")

    def test_only_the_first_step_is_just_in_time_with_a_one_row_history(self):
        """An update clears the slot it used, so a one-row history is empty after every step;
        the second step still quantizes with the first step's scales (delayed), not its own amax."""
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling(amax_history_len=1))
        x1, x2 = torch.randn(4, 16), torch.randn(4, 16) * 100
        _run(layer, x1, torch.randn(4, 8))
        after_first = layer.fp8_scale.clone()
        _run(layer, x2, torch.randn(4, 8))
        assert_bitwise_equal(layer.fp8_fwd_scale[:2], after_first[:2], "second-step forward scales")

    @pytest.mark.parametrize("just_in_time", [True, False])
    def test_gradients_scale_with_the_loss_from_the_first_step(self, just_in_time):
        """Loss x 2^k gives gradients exactly 2^k times the unscaled ones at every step
        (both runs step with the unscaled gradients); TE's first step (scale 1) does not."""
        r = recipe.DelayedScaling(amax_history_len=4, first_step_just_in_time=just_in_time)
        g = torch.Generator().manual_seed(4)
        batches = [torch.randn(2, 3, 16, generator=g) for _ in range(3)]
        exact = {}
        for k in range(-8, 9):
            models = [self._mlp(r), self._mlp(r)]
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
            exact[k] = []
            for x in batches:
                grads = []
                for model, opt, factor in zip(models, opts, (1.0, 2.0**k)):
                    opt.zero_grad()
                    xi = x.clone().requires_grad_()
                    (model(xi).square().mean() * factor).backward()
                    grads.append([xi.grad] + [p.grad.clone() for p in model.parameters()])
                    for p in model.parameters():
                        p.grad.div_(factor)  # exact: a power of two
                    opt.step()
                exact[k].append(all(torch.equal(a * 2.0**k, b) for a, b in zip(*grads)))
        if just_in_time:
            assert all(all(steps) for steps in exact.values()), f"steps with inexact 2^k gradients: {exact}"
        else:
            assert not all(exact[-8]), "TE's first step should depend on the loss's scale"


class TestAutogradFeatures:
    @pytest.mark.parametrize("name", [None, *RECIPES])
    def test_retain_graph_twice_gives_same_gradients(self, name):
        layer = tl.Linear(24, 10, recipe=RECIPES.get(name))
        x = torch.randn(6, 24, requires_grad=True)
        y = layer(x)
        grads = []
        for _ in range(2):
            x.grad = layer.weight.grad = layer.bias.grad = None
            y.backward(torch.ones_like(y) * 3, retain_graph=True)
            grads.append((x.grad, layer.weight.grad, layer.bias.grad))
        for first, second in zip(*grads):
            assert_bitwise_equal(second, first)

    @pytest.mark.parametrize("name", list(RECIPES))
    @pytest.mark.parametrize("shape", [(6, 24), (2, 3, 24), (2, 1, 3, 24)])
    def test_output_is_not_a_view(self, name, shape):
        """FSDP2 warns about a module returning a view; autograd restricts in-place ops on one."""
        layer = tl.Linear(24, 10, recipe=RECIPES.get(name))
        y = layer(torch.randn(*shape, requires_grad=True))
        assert y._base is None and not y._is_view() and y.shape == (*shape[:-1], 10)

    @pytest.mark.parametrize("name", [None, *RECIPES])
    @pytest.mark.parametrize("shape", [(6, 24), (2, 3, 24), (2, 1, 3, 24)])
    def test_output_modified_in_place(self, name, shape):
        """``y += residual`` works on the output, as on nn.Linear's, and gives the out-of-place gradients."""
        layer = tl.Linear(24, 10, recipe=RECIPES.get(name))
        x = torch.randn(*shape)
        residual = torch.randn(*shape[:-1], 10)
        grads = []
        for in_place in (False, True):
            xi = x.clone().requires_grad_()
            layer.weight.grad = None
            y = layer(xi)
            if in_place:
                y += residual
            else:
                y = y + residual
            y.square().sum().backward()
            grads.append((y.detach(), xi.grad, layer.weight.grad))
            if isinstance(layer.recipe, recipe.DelayedScaling):
                layer.fp8_scale.fill_(1.0)  # the second run quantizes like the first
                layer.fp8_amax_history.zero_()
        for out_of_place, in_place in zip(*grads):
            assert_bitwise_equal(in_place, out_of_place)

    @pytest.mark.parametrize("name", list(RECIPES))
    @pytest.mark.parametrize("mode", ["eager", "eager_reentrant", "eager_selective", "compiled_selective"])
    def test_activation_checkpointing_matches_plain_backward(self, name, mode):
        """The recompute quantizes with the original forward's delayed scales and records no amax twice."""
        from torch.utils.checkpoint import checkpoint

        def mlp():
            torch.manual_seed(0)
            r = RECIPES[name]
            return torch.nn.Sequential(tl.Linear(16, 32, recipe=r), torch.nn.ReLU(), tl.Linear(32, 8, recipe=r))

        plain, checkpointed = mlp(), mlp()
        kwargs = {"use_reentrant": mode == "eager_reentrant"}
        if mode.endswith("selective"):
            kwargs["context_fn"] = tl.selective_checkpoint_contexts

        def run(x):
            return checkpoint(checkpointed, x, **kwargs)

        if mode.startswith("compiled"):
            torch._dynamo.reset()
            run = torch.compile(run, backend="aot_eager", fullgraph=True)
        x = torch.randn(8, 16) * 3
        for step in range(3):  # the scales change every step
            x_plain, x_ckpt = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_plain, y_ckpt = plain(x_plain), run(x_ckpt)
            y_plain.square().sum().backward()
            y_ckpt.square().sum().backward()
            assert_bitwise_equal(y_ckpt, y_plain, f"step {step} output")
            assert_bitwise_equal(x_ckpt.grad, x_plain.grad, f"step {step} input grad")
            for (pname, p), p_plain in zip(checkpointed.named_parameters(), plain.parameters()):
                assert_bitwise_equal(p.grad, p_plain.grad, f"step {step} {pname}.grad")
                p.grad = p_plain.grad = None
        for key, t in checkpointed.state_dict().items():
            assert_bitwise_equal(t, plain.state_dict()[key], key)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_is_first_microbatch_caches_weight(self, name):
        layer = tl.Linear(24, 10, recipe=RECIPES[name])
        x = torch.randn(6, 24)
        with torch.no_grad():
            first = layer(x, is_first_microbatch=True)
            layer.weight.mul_(2)  # not seen by the cached FP8 weight
            cached = layer(x, is_first_microbatch=False)
            fresh = layer(x, is_first_microbatch=None)
        if name.startswith("current"):
            assert_bitwise_equal(cached, first)
        assert not torch.equal(fresh, cached)
        _, dx = _run(layer, x, torch.ones(6, 10))  # backward through the cached weight works too
        assert dx.shape == x.shape

    @pytest.mark.parametrize("name", [None, "current_hybrid", "delayed_hybrid"])
    @pytest.mark.parametrize("fuse", [False, True])
    def test_delay_wgrad_compute(self, name, fuse):
        torch.manual_seed(3)
        base = tl.Linear(24, 10, recipe=RECIPES.get(name), fuse_wgrad_accumulation=fuse)
        delayed = tl.Linear(24, 10, recipe=RECIPES.get(name), delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
        delayed.load_state_dict(base.state_dict())
        x, grad = torch.randn(6, 24), torch.randn(6, 10)
        for _ in range(2):  # two microbatches accumulate
            _, dx_base = _run(base, x, grad)
            _, dx = _run(delayed, x, grad)
            assert_bitwise_equal(dx, dx_base, "input grad")
        assert delayed.weight.grad is None and delayed.bias.grad is None
        delayed.backward_dw()
        weight_grads = (delayed.weight.main_grad, base.weight.main_grad) if fuse else (delayed.weight.grad, base.weight.grad)
        assert_bitwise_equal(*weight_grads, "weight grad")
        assert_bitwise_equal(delayed.bias.grad, base.bias.grad, "bias grad")

    @pytest.mark.parametrize("name", [None, "current_hybrid", "delayed_e4m3"])
    def test_fuse_wgrad_accumulation_into_main_grad(self, name):
        torch.manual_seed(4)
        base = tl.Linear(24, 10, recipe=RECIPES.get(name))
        fused = tl.Linear(24, 10, recipe=RECIPES.get(name), fuse_wgrad_accumulation=True)
        fused.load_state_dict(base.state_dict())
        fused.weight.main_grad = torch.full((10, 24), 0.5)
        x, grad = torch.randn(6, 24), torch.randn(6, 10)
        _run(base, x, grad)
        _run(fused, x, grad)
        assert fused.weight.grad is None
        expected = base.weight.grad.double() + 0.5
        assert_close_to_reference(fused.weight.main_grad, expected, base.weight.grad + 0.5, "main_grad")


@pytest.mark.parametrize("name", list(RECIPES))
def test_backward_keeps_fp8_copies_not_high_precision(name):
    """Autograd saves the FP8 input and weight (and 1-element scales), nothing in high precision."""
    layer = tl.Linear(24, 10, recipe=RECIPES[name])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(6, 24, requires_grad=True))
    big = sorted((tuple(t.shape), t.dtype) for t in saved if t.numel() > 1)
    assert big == sorted([((6, 24), torch.float8_e4m3fn), ((10, 24), torch.float8_e4m3fn)])
    assert all(t.dtype == torch.float32 for t in saved if t.numel() == 1)


class _Fills(TorchDispatchMode):
    """Records every tensor an op fills with a constant (zeros, fill_, zero_)."""

    FILLS = {
        torch.ops.aten.fill_.Scalar,
        torch.ops.aten.zero_.default,
        torch.ops.aten.zeros.default,
        torch.ops.aten.zeros_like.default,
        torch.ops.aten.new_zeros.default,
    }

    def __init__(self):
        super().__init__()
        self.filled = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FILLS:
            self.filled.append((str(func), tuple(out.shape)))
        return out


@pytest.mark.parametrize("name", ["current", "delayed", "block", "mxfp8", "rowwise", "nvfp4"])
@pytest.mark.parametrize("module", ["Linear", "GroupedLinear"])
def test_backward_fills_nothing(name, module):
    """The forward op's outputs besides ``out`` (the FP8 copies backward reads) take no gradient: autograd
    materialized a zero tensor of each one's shape every backward (an input- and a weight-sized fill)."""
    r = recipe.from_name(name)
    if module == "Linear":
        layer, args = tl.Linear(64, 32, bias=False, recipe=r), (torch.randn(48, 64, requires_grad=True),)
    else:
        layer = tl.GroupedLinear(4, 64, 32, bias=False, recipe=r)
        args = (torch.randn(64, 64, requires_grad=True), torch.tensor([16, 0, 32, 16]))
    y = layer(*args)
    with _Fills() as fills:
        y.sum().backward()
    assert fills.filled == []
    assert args[0].grad is not None and layer.weight.grad is not None
