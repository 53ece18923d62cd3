"""Every way to turn FP8 on, cold or warmed, under eager, torch.compile and torch.export.

The matrix: how FP8 is enabled {a per-module recipe, ``convert_to_fp8(recipe=)``,
``tl.autocast`` around the call, ``tl.autocast`` inside ``forward``} x {cold,
warmed by one eager step} x {eager, aot_eager, inductor, torch.export + save/load,
unflatten} x {DelayedScaling, CurrentScaling, Float8BlockScaling, MXFP8BlockScaling} x
{input requires grad or not}.
Each compiled or exported run is compared with an eager copy of the same model
over several calls: outputs, gradients and the delayed-scaling state.
``aot_eager`` and export are bitwise; inductor is bitwise too on these shapes
(its fusions of the few ops around the custom ops keep their float32 math),
held to :data:`INDUCTOR_RTOL` so a reassociation would not fail it spuriously.
"""

import copy
import io

import pytest
import torch
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe
from tolerances import assert_bitwise_equal

RECIPES = {
    # A short history: the layers built without a recipe (default-sized
    # history) use its leading rows, the others are built with it.
    "delayed": recipe.from_name("delayed", amax_history_len=4),
    **{name: recipe.from_name(name) for name in ("current", "block", "mxfp8")},
}
ENABLES = ("module_recipe", "convert", "autocast_around", "autocast_inside")
STEPS = 3
# Inductor's documented tolerance for tl.Linear results (README "The FP8 Linear").
INDUCTOR_RTOL = 1e-5


class _Model(nn.Module):
    """Two layers; ``inner_recipe`` makes forward enter tl.autocast itself."""

    def __init__(self, layers: nn.Module, inner_recipe=None):
        super().__init__()
        self.layers = layers
        self.inner_recipe = inner_recipe

    def forward(self, x):
        if self.inner_recipe is None:
            return self.layers(x)
        with tl.autocast(recipe=self.inner_recipe):
            return self.layers(x)


def _build(enable: str, r) -> _Model:
    torch.manual_seed(0)
    if enable == "convert":
        layers = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 8))
        return _Model(tl.convert_to_fp8(layers, recipe=r))
    own = r if enable == "module_recipe" else None
    layers = nn.Sequential(tl.Linear(16, 12, recipe=own), nn.ReLU(), tl.Linear(12, 8, recipe=own))
    return _Model(layers, inner_recipe=r if enable == "autocast_inside" else None)


def _call(model, x, enable, r):
    if enable == "autocast_around":
        with tl.autocast(recipe=r):
            return model(x)
    return model(x)


def _inputs(requires_grad, steps=STEPS):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 16, generator=g) * (i + 1)).requires_grad_(requires_grad) for i in range(steps)]


def _step(model, x, enable, r, backward):
    """One call (and backward); returns the output and, with backward, the input's gradient."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = _call(model, x, enable, r)
    if not backward:
        return [y.detach()]
    (y * y).sum().backward()
    return [y.detach()] + ([x.grad] if x.requires_grad else [])


def _compare(actual, expected, what, rtol=0.0):
    if rtol == 0.0:
        assert_bitwise_equal(actual, expected, what)
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")


def _state_of(module):
    return {k: v for k, v in module.state_dict().items()}


def _assert_same_state(actual_state, eager, what, rtol=0.0):
    for key, value in eager.state_dict().items():
        if key.startswith("inner_recipe"):
            continue
        _compare(actual_state[key], value, f"{what} {key}", rtol)


def _setup(enable, name, warm, requires_grad):
    r = RECIPES[name]
    model = _build(enable, r)
    if warm:
        _step(model, _inputs(requires_grad, 1)[0] * 0.5, enable, r, backward=True)
        model.zero_grad(set_to_none=True)
    return r, model, copy.deepcopy(model)


MATRIX = pytest.mark.parametrize(
    "enable, warm, name, requires_grad",
    [(e, w, n, g) for e in ENABLES for w in ("cold", "warm") for n in RECIPES for g in (True, False)],
)


@MATRIX
@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compile_equals_eager(backend, enable, warm, name, requires_grad):
    r, model, eager = _setup(enable, name, warm == "warm", requires_grad)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    torch._dynamo.reset()
    run = model if backend == "eager" else torch.compile(model, backend=backend, fullgraph=True)
    rtol = INDUCTOR_RTOL if backend == "inductor" else 0.0
    for i, x in enumerate(_inputs(requires_grad)):
        for a, e in zip(_step(run, x, enable, r, True), _step(eager, x, enable, r, True), strict=True):
            _compare(a, e, f"{backend} step {i}", rtol)
        _assert_same_state(_state_of(model), eager, f"{backend} step {i}", rtol)
        for (pname, p), p_eager in zip(model.named_parameters(), eager.parameters()):
            _compare(p.grad, p_eager.grad, f"{backend} step {i} {pname}.grad", rtol)
    # The state existed, with its final shapes, before the first call.
    assert {k: v.shape for k, v in model.state_dict().items()} == keys


def _export(model, x, enable, r):
    if enable == "autocast_around":
        # Export records what forward does: the autocast must be inside the
        # exported call, so wrap the model (as a user would).
        model = _Model(model, inner_recipe=r)
    return torch.export.export(model, (x,))


def _saved_and_loaded(ep):
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


@MATRIX
def test_export_equals_eager(enable, warm, name, requires_grad):
    """One export per case, run as ep.module() after save/load and as its unflattened module."""
    r, model, eager = _setup(enable, name, warm == "warm", requires_grad)
    xs = _inputs(requires_grad)
    ep = _export(model, xs[0], enable, r)
    prefix = "layers.layers." if enable == "autocast_around" else "layers."
    if name == "delayed":
        mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
        for i in (0, 2):
            for buf in ("fp8_amax_history", "fp8_scale"):
                assert f"{prefix}{i}.{buf}" in mutated, f"{prefix}{i}.{buf} not among mutated buffers {mutated}"
    runs = {"save/load": _saved_and_loaded(ep).module(), "unflatten": torch.export.unflatten(ep)}
    eagers = {how: copy.deepcopy(eager) for how in runs}
    for i, x in enumerate(xs):
        for how, module in runs.items():
            with torch.no_grad():
                expected = _call(eagers[how], x, enable, r)
                actual = module(x)
            assert_bitwise_equal(actual, expected, f"export ({how}) call {i}")
            state = module.state_dict()
            for key, value in eagers[how].state_dict().items():
                actual_value = state[prefix + key.removeprefix("layers.")]
                assert_bitwise_equal(actual_value, value, f"export ({how}) call {i} {key}")
