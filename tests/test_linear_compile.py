"""tl.Linear under torch.compile: opcheck, fullgraph with no recompiles on dynamic
dims, eager == compiled (delayed-scaling state included), and the traced graphs."""

import collections
import copy
import re

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from recipe_tables import TENSORWISE, built
from tolerances import assert_bitwise_equal
from torch._dynamo.backends.common import aot_autograd

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules import linear_ops
from transformer_linear.modules.linear_args import CachedWeight, LinearBwdArgs, LinearFwdArgs
from transformer_linear.recipe.delayed_scaling import DelayedScalingArgs

RECIPES = built(TENSORWISE)


def _fwd_args(layer, x, **overrides):
    """The LinearFwdArgs that tl.Linear builds for ``x`` (under its own recipe)."""
    args = layer._fwd_args(x, layer.recipe, None)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


# opcheck compares inputs before and after with torch.allclose, which has no FP8 kernel (conftest).
pytestmark = pytest.mark.usefixtures("allclose_on_fp8")


def _opcheck(op, args):
    torch.library.opcheck(op, args)


def _opcheck_fwd(args):
    """opcheck of linear_fwd. test_aot_dispatch_dynamic's gradient check sums every
    output, and sum has no FP8 kernel, so that check runs on detached inputs
    (forward only); fwd+bwd under AOT is test_compiled_equals_eager's job."""
    flat = linear_ops.linear_fwd.flatten(args)
    op = linear_ops.linear_fwd.op
    torch.library.opcheck(op, flat, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    detached = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in flat)
    torch.library.opcheck(op, detached, test_utils="test_aot_dispatch_dynamic")


class TestOpcheck:
    @pytest.mark.parametrize("name", [None, *RECIPES])
    @pytest.mark.parametrize("shape", [(2, 3, 16), (0, 16)])
    def test_linear_fwd(self, name, shape):
        layer = tl.Linear(16, 8, recipe=RECIPES.get(name), fuse_wgrad_accumulation=name is None)
        x = torch.randn(shape, requires_grad=True)
        _opcheck_fwd(_fwd_args(layer, x))

    def test_linear_fwd_with_cached_weight(self):
        layer = tl.Linear(16, 8, recipe=RECIPES["current"])
        x = torch.randn(4, 16)
        layer(x, is_first_microbatch=True)
        args = layer._fwd_args(x, layer.recipe, False)
        assert args.cached_weight is not None
        _opcheck_fwd(args)

    @pytest.mark.parametrize("fp8", [True, False])
    def test_linear_dgrad_and_wgrad(self, fp8):
        g, x, w = torch.randn(6, 8), torch.randn(6, 16), torch.randn(8, 16)
        if fp8:
            q = {name: tl.ops.quantize_current(t, torch.float8_e4m3fn)[:2] for name, t in (("g", g), ("x", x), ("w", w))}
        else:
            q = {"g": (g, None), "x": (x, None), "w": (w, None)}
        b = LinearBwdArgs(
            grad_output=q["g"][0],
            grad_output_t=q["g"][0],
            grad_output_scale_inv=q["g"][1],
            grad_output_t_scale_inv=q["g"][1],
            inp=q["x"][0],
            inp_scale_inv=q["x"][1],
            weight=q["w"][0],
            weight_scale_inv=q["w"][1],
            input_shape=[2, 3, 16],
            dgrad_dtype=torch.bfloat16,
            wgrad_dtype=torch.float32,
        )
        for op in (linear_ops.linear_dgrad, linear_ops.linear_wgrad):
            _opcheck(op.op, op.flatten(b))

    def test_delayed_scaling_update(self):
        args = (torch.rand(4, 3), torch.ones(3), torch.tensor([2.0, 3.0]), 0, 448.0, 1, "max")
        _opcheck(torch.ops.transformer_linear.delayed_scaling_update.default, args)

    @pytest.mark.parametrize("scale", [2.0, -1.0])
    def test_quantize_grad_output(self, scale):
        # A negative scale asks for a just-in-time one (the first step).
        args = (torch.randn(6, 8), torch.tensor([scale]), torch.float8_e5m2, 0, torch.float32, -1)
        _opcheck(torch.ops.transformer_linear.quantize_grad_output.default, args)

    def test_delayed_scaling_flush(self):
        # Without a process group nothing is pending: the op leaves the state as it is.
        _opcheck(torch.ops.transformer_linear.delayed_scaling_flush.default, (torch.rand(4, 3), torch.ones(3), 123))

    def test_schema_comes_from_the_dataclass(self):
        """A tensor field is a parameter, a config's tensors one list (its ints parameters of their own), and
        the plain values one string."""
        schema = linear_ops.linear_fwd.op._opoverload._schema
        types = {a.name: str(a.type) for a in schema.arguments}
        assert types == {
            "inp": "Tensor",
            "weight": "Tensor",
            "bias": "Optional[Tensor]",
            "cached_weight": "List[Optional[Tensor]]",
            "delayed": "List[Optional[Tensor]]",
            # A tensor config's ints (a layer's handles: symbolic where torch.compile traces them so).
            "delayed__amax_reduction_group": "Optional[int]",
            "delayed__reduction_handle": "Optional[int]",
            "main_grad": "Optional[Tensor]",
            "wgrad_queue": "int",  # SymInt in the schema
            "options": "str",
        }
        tensor_leaves = {
            "cached_weight": list(CachedWeight.__dataclass_fields__),
            "delayed": [f for f, t in DelayedScalingArgs.__annotations__.items() if "Tensor" in str(t)],
        }
        layer = tl.Linear(16, 8, recipe=recipe.DelayedScaling())
        x = torch.randn(4, 16)
        layer(x, is_first_microbatch=True)
        args = layer._fwd_args(x, layer.recipe, False)
        params = dict(zip((n for n, _ in linear_ops.linear_fwd.params), linear_ops.linear_fwd.flatten(args)))
        for config, leaves in tensor_leaves.items():
            assert [t is None for t in params[config]] == [getattr(getattr(args, config), f) is None for f in leaves]
        keys = [part.partition("=")[0] for part in params["options"].split(",")]
        plain_fields = [f for f in LinearFwdArgs.__dataclass_fields__ if f not in types and f != "quantization"]
        assert [k for k in keys if "." not in k] == plain_fields
        assert [k for k in keys if k.startswith("delayed.")] == [
            f"delayed.{f}" for f in DelayedScalingArgs.__dataclass_fields__
            if f not in tensor_leaves["delayed"] and f"delayed__{f}" not in types
        ]

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_the_options_name_every_quantization_leaf(self, name):
        """The options list each quantizer's leaves by path, the history's and the backward override."""
        quantizer_leaves = (
            "dtype", "block_shape", "scale_dtype", "power_2_scale", "e8m0_rounding", "margin", "scale_from_history",
            "rht", "stochastic_rounding", "kind",
        )
        layer = tl.Linear(16, 8, recipe=RECIPES[name])
        args = layer._fwd_args(torch.randn(4, 16), layer.recipe, None)
        options = linear_ops.linear_fwd.flatten(args)[-1]
        keys = [part.partition("=")[0] for part in options.split(",")]
        expected = [f"quantization.{t}.{f}" for t in ("input", "weight", "grad_output") for f in quantizer_leaves]
        expected += [f"quantization.history.{f}" for f in recipe.HistoryConfig.__dataclass_fields__]
        expected += ["quantization.backward_override"]
        assert [k for k in keys if k.startswith("quantization.")] == expected

    @pytest.mark.parametrize("name, block_shape", [("current", []), ("mxfp8", [1, 32])])
    def test_an_empty_block_shape_survives_the_op(self, name, block_shape):
        """AOTInductor's runtime passes an empty int list to an op as None (ops.args_op's module doc); a
        tensorwise quantizer's block_shape [] crosses inside the options string and comes back as []."""
        layer = tl.Linear(16, 8, recipe=recipe.from_name(name))
        x = torch.randn(4, 16)
        op = linear_ops.linear_fwd
        flat = op.flatten(layer._fwd_args(x, layer.recipe, None))
        params = dict(zip((n for n, _ in op.params), flat))
        assert f"quantization.input.block_shape={'x'.join(map(str, block_shape))}," in params["options"]
        assert op.unflatten(flat).quantization.input.block_shape == block_shape

    @pytest.mark.parametrize("name", [None, *RECIPES])
    @pytest.mark.parametrize("cached", [False, True])
    def test_args_round_trip_through_the_op_parameters(self, name, cached):
        layer = tl.Linear(16, 8, recipe=RECIPES.get(name) or recipe.CurrentScaling())
        x = torch.randn(4, 16)
        layer(x, is_first_microbatch=True)
        args = layer._fwd_args(x, layer.recipe, False if cached else None)
        assert (args.cached_weight is not None) == cached
        assert (args.delayed is not None) == (name == "delayed")
        op = linear_ops.linear_fwd
        flat = op.flatten(args)
        assert len(flat) == len(op.params)
        rebuilt = op.unflatten(flat)
        for field in LinearFwdArgs.__dataclass_fields__:
            assert type(getattr(rebuilt, field)) is type(getattr(args, field)), field
        assert rebuilt.quantization == args.quantization
        # Tensors come back as themselves; plain values equal and of the same type.
        for a, b in zip(op.flatten(rebuilt), flat, strict=True):
            assert a is b if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_configs_of_plain_values_are_rebuilt_once(self, name):
        """The quantization config is rebuilt from the options string once and then reused (it is frozen); a config
        holding tensors (the cached weight) is rebuilt on every call."""
        layer = tl.Linear(16, 8, recipe=RECIPES[name])
        x = torch.randn(4, 16)
        layer(x, is_first_microbatch=True)
        op = linear_ops.linear_fwd
        args = layer._fwd_args(x, layer.recipe, False)
        first, second = op.unflatten(op.flatten(args)), op.unflatten(op.flatten(args))
        assert first.quantization == args.quantization
        assert first.quantization is second.quantization
        assert first.cached_weight is not second.cached_weight
        assert first.cached_weight.weight_fp8 is args.cached_weight.weight_fp8

    @pytest.mark.parametrize(
        "edit, match",
        [
            (lambda s: s.replace("input.margin=1", "input.margin=True"), "leaf 'quantization.input.margin'"),
            (lambda s: s.replace("input.dtype=torch.float8_e4m3fn", "input.dtype=torch.nonsense"), ".input.dtype'"),
            (lambda s: s.replace("input.rht=False", "input.rht=0"), "leaf 'quantization.input.rht'"),
            (lambda s: s.replace(",quantization.backward_override=None", ""), "'options' must list"),
            (lambda s: "quantization.input.colour=red," + s, "'options' must list"),
        ],
    )
    def test_options_of_another_shape_are_refused(self, edit, match):
        """Options that are not this version's (the QuantizationSpec (an exported program of another version, a
        hand-edited graph) is refused naming the leaf, not parsed into another config."""
        layer = tl.Linear(16, 8, recipe=recipe.CurrentScaling(margin=1))
        x = torch.randn(4, 16)
        op = linear_ops.linear_fwd
        flat = op.flatten(layer._fwd_args(x, layer.recipe, None))
        at = [n for n, _ in op.params].index("options")
        op.unflatten(flat)
        edited = edit(flat[at])
        assert edited != flat[at]
        with pytest.raises(ValueError, match=re.escape(match)):
            op.unflatten(flat[:at] + (edited,) + flat[at + 1 :])


def _train_steps(model, sizes, mark_dynamic):
    """fwd+bwd at each (batch, seq) size; returns outputs and gradients."""
    results = []
    for batch, seq in sizes:
        x = torch.randn(batch, seq, 16, generator=torch.Generator().manual_seed(batch * seq), requires_grad=True)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
        y = model(x)
        (y * y).sum().backward()
        results += [y.detach(), x.grad]
    return results


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_equals_eager_without_recompiles(backend, name):
    torch._dynamo.reset()
    eager = torch.nn.Sequential(tl.Linear(16, 12, recipe=RECIPES[name]), torch.nn.ReLU(), tl.Linear(12, 8, recipe=RECIPES[name]))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    sizes = [(2, 3), (5, 7), (3, 2)]
    expected = _train_steps(eager, sizes, mark_dynamic=False)
    actual = _train_steps(compiled, sizes[:1], mark_dynamic=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        actual += _train_steps(compiled, sizes[1:], mark_dynamic=True)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"step {i // 2} {'output' if i % 2 == 0 else 'input grad'}")
    for (key, e), a in zip(eager.state_dict().items(), compiled_model.state_dict().values()):
        assert_bitwise_equal(a, e, key)
    for e, a in zip(eager.parameters(), compiled_model.parameters()):
        assert_bitwise_equal(a.grad, e.grad, "parameter grad")


def _aot_graphs(layer, x):
    """The AOT forward and backward graphs of one fwd+bwd of ``layer`` (aot_eager's partitioner)."""
    graphs = {}

    def grab(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=grab("forward"),
        bw_compiler=grab("backward"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )
    torch._dynamo.reset()
    torch.compile(layer, backend=backend, fullgraph=True)(x).sum().backward()
    return graphs


def _node_counts(gm):
    names = (getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function")
    return dict(collections.Counter(name.split(".")[0] for name in names))


# Pinned node counts of one Linear's AOT graphs: the forward is one op (plus the
# delayed-scaling update), the backward one grad_output quantize (bias grad fused),
# dgrad and wgrad; no transposes, copies or detaches around them. The (unsafe)
# views fold the 3-D input's leading dims, as nn.Linear's do; under delayed scaling the
# forward records the scales it used in fwd_scale (the copy_s write buffers back),
# and backward's quantize may compute a just-in-time scale on the first step.
EXPECTED_GRAPHS = {
    "current": {
        "forward": {"linear_fwd": 1, "getitem": 5, "_unsafe_view": 1},
        "backward": {"view": 1, "quantize": 1, "getitem": 3, "linear_dgrad": 1, "linear_wgrad": 1},
    },
    "delayed": {
        "forward": {"linear_fwd": 1, "getitem": 10, "copy": 1, "auto_functionalized_v2": 1, "_unsafe_view": 1, "copy_": 3},
        "backward": {
            "view": 1,
            "quantize_grad_output": 1,
            "getitem": 6,
            "auto_functionalized_v2": 1,
            "linear_dgrad": 1,
            "linear_wgrad": 1,
            "copy_": 2,
        },
    },
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_aot_graph_node_counts(name):
    layer = tl.Linear(16, 8, recipe=RECIPES[name])
    graphs = _aot_graphs(layer, torch.randn(3, 5, 16, requires_grad=True))
    counts = {kind: _node_counts(gm) for kind, gm in graphs.items()}
    assert counts == EXPECTED_GRAPHS[name], "\n".join(gm.code for gm in graphs.values())


def test_autocast_state_is_guarded_under_compile():
    """Entering or leaving tl.autocast around a compiled module recompiles instead of reusing a graph."""
    torch._dynamo.reset()
    layer = tl.Linear(16, 8)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    plain = layer(x)
    with tl.autocast(recipe=recipe.CurrentScaling()):
        fp8_eager, fp8_compiled = layer(x), compiled(x)
    assert_bitwise_equal(fp8_compiled, fp8_eager, "inside autocast")
    assert_bitwise_equal(compiled(x), plain, "after autocast")
    assert not torch.equal(plain, fp8_eager)


@pytest.mark.parametrize("keep_mutations", [True, False])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_custom_aot_autograd_backend(keep_mutations, input_requires_grad):
    """A backend built on aot_autograd compiles delayed scaling with or without
    keep_inference_input_mutations: forward updates only the forward state and
    backward only the grad_output state, so AOT autograd never has to place one
    buffer's updates in both graphs (README "The FP8 Linear")."""
    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=keep_mutations)
    torch._dynamo.reset()
    layer = tl.Linear(16, 8, recipe=RECIPES["delayed"])
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    for step in range(3):
        x = torch.randn(4, 16, requires_grad=input_requires_grad)
        x_ref = x.detach().clone().requires_grad_(input_requires_grad)
        out, out_ref = compiled(x), eager(x_ref)
        assert_bitwise_equal(out, out_ref, f"step {step} output")
        out.square().sum().backward()
        out_ref.square().sum().backward()
        assert_bitwise_equal(layer.weight.grad, eager.weight.grad, f"step {step} weight grad")
        if input_requires_grad:
            assert_bitwise_equal(x.grad, x_ref.grad, f"step {step} input grad")
    for name, buf in eager.named_buffers():
        assert_bitwise_equal(getattr(layer, name), buf, name)
    assert not bool(layer.fp8_grad_amax_history.eq(0).all()), "backward recorded no grad_output amax"


def test_autocast_history_longer_than_the_layers():
    """A recipe-less layer holds 1024 rows; a longer autocast history cannot grow inside a trace."""
    torch._dynamo.reset()
    long = recipe.DelayedScaling(amax_history_len=2048)
    layer = tl.Linear(16, 8)
    x = torch.randn(4, 16)
    with tl.autocast(recipe=long):
        with pytest.raises(Exception, match=r"reset_fp8_state\(amax_history_len=2048\)"):
            torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
        layer.reset_fp8_state(amax_history_len=2048)  # the fix the error names
        eager = copy.deepcopy(layer)
        for _ in range(2):
            assert_bitwise_equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), eager(x))
    assert layer.fp8_amax_history.shape == (2048, 2) and layer.fp8_grad_amax_history.shape == (2048, 1)
    grown = tl.Linear(16, 8)
    with tl.autocast(recipe=long):
        grown(x)  # eagerly, the history grows
    assert grown.fp8_amax_history.shape == (2048, 2) and grown.fp8_grad_amax_history.shape == (2048, 1)


@pytest.mark.parametrize("name", [None, "current"])
@pytest.mark.parametrize("option", ["delay_wgrad_compute", "fuse_wgrad_accumulation"])
def test_eager_only_wgrad_options_raise_under_compile(option, name):
    """Options whose backward leaves the graph (a Python queue; an in-place update of weight.main_grad) name
    themselves under torch.compile instead of failing inside the compiler."""
    layer = tl.Linear(16, 8, recipe=RECIPES.get(name), **{option: True})
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=f"Linear: {option} runs eagerly only"):
        compiled(torch.randn(4, 16, requires_grad=True))
