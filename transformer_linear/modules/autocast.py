"""``tl.autocast``: turn FP8 on for every ``tl.Linear`` without a recipe of its own.

The state is a plain module-level object read in ``Linear.forward``; Dynamo
reads it at trace time and guards on it, so entering or leaving the context
outside a compiled region recompiles rather than silently reusing a graph.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from transformer_linear.recipe import DelayedScaling, Recipe
from transformer_linear.recipe.quantization import check_recipe

__all__ = ["autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled"]


class _State:
    enabled: bool = False
    recipe: Optional[Recipe] = None


_STATE = _State()


def is_fp8_enabled() -> bool:
    """Whether an enclosing ``tl.autocast(enabled=True)`` is active."""
    return _STATE.enabled


def get_fp8_recipe() -> Optional[Recipe]:
    """The active autocast recipe, or None outside ``tl.autocast(enabled=True)``."""
    return _STATE.recipe if _STATE.enabled else None


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Optional[Recipe] = None) -> Iterator[None]:
    """Run ``tl.Linear`` layers in FP8 inside the block.

    Args:
        enabled: False turns FP8 off inside the block (nesting restores the outer state).
        recipe: the recipe; ``None`` means ``recipe.DelayedScaling()`` (TE's default).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast: 'enabled' must be a bool, got {enabled!r}")
    check_recipe("autocast", recipe)
    saved = (_STATE.enabled, _STATE.recipe)
    _STATE.enabled = enabled
    _STATE.recipe = (recipe or DelayedScaling()) if enabled else None
    try:
        yield
    finally:
        _STATE.enabled, _STATE.recipe = saved


fp8_autocast = autocast
