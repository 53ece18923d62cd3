"""The package's replacement of torch's ``fill_defaults`` (transformer_linear/_torch_fixes.py) is installed
and returns what torch's own helper returns, for every op of the package and for schemas with defaults
and keyword-only arguments."""

from __future__ import annotations

import pytest
import torch
import torch._library.utils

import transformer_linear  # noqa: F401  (installs the fix)
from transformer_linear import _torch_fixes

pytestmark = pytest.mark.skipif(_torch_fixes.TORCH_FILL_DEFAULTS is None, reason="this torch has no fill_defaults")

_LIB = torch.library.Library("tl_test_fill_defaults", "FRAGMENT")
_LIB.define("defaults(Tensor x, int a=3, float b=0.5, *, str mode='m', bool flag=False) -> Tensor")


def _package_schemas() -> list:
    ns = torch.ops.transformer_linear
    packets = [getattr(ns, name) for name in dir(ns) if not name.startswith("_")]
    return [packet.default._schema for packet in packets if hasattr(packet, "default")]


def test_installed():
    assert torch._library.utils.fill_defaults is _torch_fixes.fill_defaults


def test_every_package_op_gets_the_same_arguments():
    schemas = _package_schemas()
    assert len(schemas) >= 10, [s.name for s in schemas]
    for schema in schemas:
        positional = [a for a in schema.arguments if not a.kwarg_only]
        for given in range(len(positional) + 1):
            args = tuple(object() for _ in range(given))
            want = _torch_fixes.TORCH_FILL_DEFAULTS(schema, args, {})
            assert _torch_fixes.fill_defaults(schema, args, {}) == want, (schema.name, given)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1,), {}),
        ((1, 7), {}),
        ((1, 7, 2.0), {"mode": "x"}),
        ((1,), {"flag": True}),
        ((1, 7, 2.0), {"mode": "y", "flag": True}),
    ],
)
def test_defaults_and_keyword_only_arguments(args, kwargs):
    schema = torch.ops.tl_test_fill_defaults.defaults.default._schema
    assert _torch_fixes.fill_defaults(schema, args, kwargs) == _torch_fixes.TORCH_FILL_DEFAULTS(schema, args, kwargs)
