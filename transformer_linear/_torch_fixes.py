"""A fix of a torch helper that every call of the package's autograd ops pays for.

``torch._library.autograd`` calls ``torch._library.utils.fill_defaults`` in the
forward of each custom op registered with a ``setup_context`` (``linear_fwd``).
In torch 2.13 that helper reads ``schema.arguments`` inside its loop, and the
property converts the whole C++ argument list into a new Python list on each
read: quadratic in the op's arity. ``linear_fwd`` takes about fifty parameters (one per
leaf of ``LinearFwdArgs``), so the helper cost more CPU time per forward than
the FP8 kernels of a small layer. :func:`install` puts in its place a version
that reads the property once and returns the same values (tests/test_torch_fixes.py
compares the two on every op of the package); torch's own fix is pytorch/pytorch#195110.
"""

from __future__ import annotations

from typing import Any

import torch._library.autograd
import torch._library.utils

__all__ = ["fill_defaults", "install"]

TORCH_FILL_DEFAULTS = getattr(torch._library.utils, "fill_defaults", None)
"""torch's own helper, as it was before :func:`install` (None where this torch has none)."""


def fill_defaults(schema: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of the op ``schema`` describes, with every omitted argument's
    default filled in: torch's ``fill_defaults``, reading ``schema.arguments`` once."""
    new_args, new_kwargs = [], {}
    for i, info in enumerate(schema.arguments):
        if info.kwarg_only:
            new_kwargs[info.name] = kwargs[info.name] if info.name in kwargs else info.default_value
        else:
            new_args.append(args[i] if i < len(args) else info.default_value)
    return tuple(new_args), new_kwargs


def install() -> None:
    """Use :func:`fill_defaults` where torch's custom-op autograd calls the helper (idempotent; nothing
    happens on a torch without it)."""
    if TORCH_FILL_DEFAULTS is not None and getattr(torch._library.autograd, "utils", None) is torch._library.utils:
        torch._library.utils.fill_defaults = fill_defaults
