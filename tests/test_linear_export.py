"""tl.Linear under torch.export: dynamic batch, save/load, and unflatten of a model that
calls the same Linear twice (each call's graph specialized, the state shared)."""

import copy
import io

import pytest
import torch
from torch import nn
from recipe_tables import TENSORWISE, built
from tolerances import assert_bitwise_equal
from torch.export import Dim

import transformer_linear as tl

RECIPES = {"none": None, **built(TENSORWISE)}


class TwiceCalled(nn.Module):
    """The export seed's case: one submodule called twice with different inputs."""

    def __init__(self, r):
        super().__init__()
        self.inner = tl.Linear(16, 16, recipe=r)
        self.head = tl.Linear(16, 4, recipe=r)

    def forward(self, x):
        h = torch.relu(self.inner(x))
        h = self.inner(h + 1.0)
        return self.head(h)


def _inputs(*batches):
    return [torch.randn(b, 16, generator=torch.Generator().manual_seed(b)) for b in batches]


def _export(model, x):
    return torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=1024)},))


def _check_same(eager, exported_callable, state_of, batches=(3, 7, 1)):
    """Run both on each batch size; outputs and scaling state must match bit for bit."""
    for x in _inputs(*batches):
        assert_bitwise_equal(exported_callable(x), eager(x), f"batch {x.shape[0]}")
    for key, value in eager.state_dict().items():
        assert_bitwise_equal(state_of()[key], value, key)


@pytest.mark.parametrize("name", list(RECIPES))
def test_export_dynamic_batch_and_save_load(name):
    model = TwiceCalled(RECIPES[name])
    x = _inputs(5)[0]
    ep = _export(copy.deepcopy(model), x)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for program in (ep, loaded):
        module = program.module()
        eager = copy.deepcopy(model)
        _check_same(eager, module, module.state_dict)


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_unflatten_same_linear_called_twice(name):
    model = TwiceCalled(RECIPES[name])
    ep = _export(copy.deepcopy(model), _inputs(5)[0])
    unflat = torch.export.unflatten(ep)
    assert any(fqn.startswith("inner") for fqn, _ in unflat.named_modules())
    _check_same(copy.deepcopy(model), unflat, unflat.state_dict)
