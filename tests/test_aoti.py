"""AOTInductor packages of tl.Linear / tl.GroupedLinear models (docs/deploy.md).

An eval() model exported with a dynamic batch is packaged with ``torch._inductor.aoti_compile_and_package``,
loaded with ``aoti_load_package`` in a fresh process that imports transformer_linear (the ops are Python
custom ops: the package calls back into them), and run on several batch sizes; its outputs must equal
eager's within tolerances.assert_close_to_reference's floor, call by call (delayed scaling's state is
updated inside the package, as eager updates the model's).

Each package is one Inductor compile (about 30 s of CPU on a 2-core Zen 3, most of it the C++ compile of
the wrapper, whatever the model's size), so CI's short form is one package (CurrentScaling, the recipe the
issue reported) and the slow form packages one model holding a tl.Linear and a tl.GroupedLinear under
every recipe of the registry, with high-precision and with quantized_model_init weights (two packages).
Each test compiles into its own Inductor cache directory: a warm cache saves only a fifth to a quarter of
a package's compile (docs/deploy.md), and a shared one would let one test's artifacts stand in for
another's compile.
"""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import transformer_linear as tl
from transformer_linear import recipe
from tolerances import assert_close_to_reference

BATCHES = (3, 17, 1)
FEATURES = 32

# Loads the package in a fresh interpreter and runs it on the saved inputs; argv: package, inputs, outputs.
_RUNNER = """
import sys
import torch
import transformer_linear  # registers the custom ops the package calls
package = torch._inductor.aoti_load_package(sys.argv[1])
inputs = torch.load(sys.argv[2])
torch.save([package(*args) for args in inputs], sys.argv[3])
"""


class MLP(nn.Sequential):
    def __init__(self, r):
        super().__init__(tl.Linear(FEATURES, 64, recipe=r), nn.ReLU(), tl.Linear(64, FEATURES, recipe=r))


class EveryRecipe(nn.Module):
    """A tl.Linear and a tl.GroupedLinear under each recipe of the registry, one after the other: one
    package (one compile) covers them all. Returns every layer's output, so a mismatch names its layer."""

    NAMES = recipe.available_names()

    def __init__(self, quantized_weights=False):
        super().__init__()
        self.linear, self.grouped = nn.ModuleDict(), nn.ModuleDict()
        for name in self.NAMES:
            r = recipe.from_name(name)
            with tl.quantized_model_init(enabled=quantized_weights, recipe=r):
                self.linear[name] = tl.Linear(FEATURES, FEATURES, recipe=r)
                self.grouped[name] = tl.GroupedLinear(3, FEATURES, FEATURES, recipe=r)

    def forward(self, x, m_splits):
        outs = []
        for name in self.NAMES:
            x = torch.relu(self.linear[name](x))
            outs.append(x)
            x = self.grouped[name](x, m_splits)  # m_splits a tensor: the routing is an input, not a constant
            outs.append(x)
        return tuple(outs)

    @classmethod
    def labels(cls):
        return [f"{kind} {name}" for name in cls.NAMES for kind in ("Linear", "GroupedLinear")]


def _mlp_inputs(batch):
    # Scaled by the batch size: the batch of 17 leaves an amax in delayed scaling's history that the
    # batch of 1 after it is quantized with, so a package that did not update its state would differ.
    return (batch * torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(batch)),)


def _experts_inputs(batch):
    x = _mlp_inputs(batch)[0]
    first = batch // 3
    return x, torch.tensor([first, 0, batch - first], dtype=torch.int64)


def _package(model, example, dynamic_shapes, path):
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))


def _run_fresh(package, inputs, tmp_path):
    """The package's outputs on ``inputs`` (a list of argument tuples), from a fresh interpreter."""
    torch.save(inputs, tmp_path / "inputs.pt")
    # cwd: outside the source tree, whose transformer_linear/ would shadow an installed package.
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(package), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(tmp_path / "outputs.pt")


def _check_package(model, make_inputs, dynamic_shapes, tmp_path, monkeypatch, labels=None):
    """Package ``model``, run it fresh on BATCHES, compare with eager call by call; returns the package."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    model.eval()
    eager = copy.deepcopy(model)  # delayed scaling: the eager copy's state advances call by call, as the package's
    package = _package(model, make_inputs(5), dynamic_shapes, tmp_path / "model.pt2")
    inputs = [make_inputs(b) for b in BATCHES]
    outputs = _run_fresh(package, inputs, tmp_path)
    with torch.no_grad():
        for args, out in zip(inputs, outputs):
            expected = eager(*args)
            if isinstance(expected, torch.Tensor):
                out, expected = [out], [expected]
            for i, (actual, ref) in enumerate(zip(out, expected)):
                label = labels[i] if labels else "output"
                assert_close_to_reference(actual, ref, what=f"{label}, batch {args[0].shape[0]}")
    return package


_BATCH = {0: Dim("batch", min=1, max=1024)}


def test_current_scaling_mlp_packages_and_runs_in_fresh_process(tmp_path, monkeypatch):
    """The issue's case: CurrentScaling's tensorwise quantizers (empty block_shape) through a package.
    Without ``import transformer_linear`` the package does not load: its ops are Python custom ops."""
    torch.manual_seed(0)
    package = _check_package(MLP(recipe.from_name("current")), _mlp_inputs, (_BATCH,), tmp_path, monkeypatch)
    done = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])", str(package)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0 and "Could not find schema for transformer_linear::" in done.stderr, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["high_precision", "quantized_model_init"])
def test_every_recipe_linear_and_grouped_linear(weights, tmp_path, monkeypatch):
    """Every recipe of the registry, tl.Linear and tl.GroupedLinear, in one package; with
    quantized_model_init the package holds the FP8 weights (requires_grad_(False): torch unwraps a
    QuantizedWeight into parameters, and NVFP4's uint8 data cannot require grad)."""
    torch.manual_seed(0)
    model = EveryRecipe(quantized_weights=weights == "quantized_model_init")
    if weights == "quantized_model_init":
        model.requires_grad_(False)
    _check_package(model, _experts_inputs, (_BATCH, None), tmp_path, monkeypatch, labels=EveryRecipe.labels())


@pytest.mark.slow
def test_rowwise_only_mxfp8_weights_package(tmp_path, monkeypatch):
    """quantized_model_init(rowwise_only=True) under MXFP8: the package holds the rowwise copy alone, and a
    forward without autograd makes no columnwise copy (no E8M0 requantize in the graph)."""
    torch.manual_seed(0)
    with tl.quantized_model_init(recipe=recipe.from_name("mxfp8"), rowwise_only=True):
        model = MLP(recipe.from_name("mxfp8"))
    model.requires_grad_(False)
    _check_package(model, _mlp_inputs, (_BATCH,), tmp_path, monkeypatch)
