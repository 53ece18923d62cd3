"""AOTInductor packages of tl.Linear / tl.GroupedLinear models (docs/deploy.md).

An eval() model exported with a dynamic batch is packaged with ``torch._inductor.aoti_compile_and_package``,
loaded with ``aoti_load_package`` in a fresh process that imports transformer_linear (the ops are Python
custom ops: the package calls back into them), and run on several batch sizes; its outputs must equal
eager's within tolerances.assert_close_to_reference's floor. Delayed scaling's state is updated inside the
package call after call, as eager updates the model's.

Each package is one Inductor compile (tens of seconds on a 2-core CPU), so CI runs the short form
(CurrentScaling, the recipe the issue reported); the slow form covers every recipe of the registry, a
GroupedLinear and a model built under quantized_model_init. Each test compiles into its own Inductor
cache directory: AOTInductor reuses little of a warm cache anyway (docs/deploy.md), and a shared one
would let one test's artifacts stand in for another's compile.
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


class Experts(nn.Module):
    """A GroupedLinear between two Linears; the routing is an input tensor (no recompile per routing)."""

    def __init__(self, r, num_gemms=3):
        super().__init__()
        self.up = tl.Linear(FEATURES, 64, recipe=r)
        self.experts = tl.GroupedLinear(num_gemms, 64, FEATURES, recipe=r)

    def forward(self, x, m_splits):
        return self.experts(torch.relu(self.up(x)), m_splits)


def _mlp_inputs(batch):
    return (torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(batch)),)


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


def _check_package(model, make_inputs, dynamic_shapes, tmp_path, monkeypatch):
    """Package ``model``, run it fresh on BATCHES, compare with eager call by call."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    model.eval()
    eager = copy.deepcopy(model)  # delayed scaling: the eager copy's state advances call by call, as the package's
    package = _package(model, make_inputs(5), dynamic_shapes, tmp_path / "model.pt2")
    inputs = [make_inputs(b) for b in BATCHES]
    outputs = _run_fresh(package, inputs, tmp_path)
    with torch.no_grad():
        for args, out in zip(inputs, outputs):
            assert_close_to_reference(out, eager(*args), what=f"batch {args[0].shape[0]}")


_BATCH = {0: Dim("batch", min=1, max=1024)}


def test_current_scaling_mlp_packages_and_runs_in_fresh_process(tmp_path, monkeypatch):
    """The issue's case: CurrentScaling's tensorwise quantizers (empty block_shape) through a package."""
    torch.manual_seed(0)
    _check_package(MLP(recipe.from_name("current")), _mlp_inputs, (_BATCH,), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", recipe.available_names())
def test_every_recipe_mlp(name, tmp_path, monkeypatch):
    torch.manual_seed(0)
    _check_package(MLP(recipe.from_name(name)), _mlp_inputs, (_BATCH,), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_grouped_linear(name, tmp_path, monkeypatch):
    torch.manual_seed(0)
    _check_package(Experts(recipe.from_name(name)), _experts_inputs, (_BATCH, None), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_quantized_model_init_weights(name, tmp_path, monkeypatch):
    """FP8 weights only (quantized_model_init): the package holds them as they are."""
    torch.manual_seed(0)
    r = recipe.from_name(name)
    with tl.quantized_model_init(recipe=r):
        model = MLP(r)
    _check_package(model, _mlp_inputs, (_BATCH,), tmp_path, monkeypatch)
