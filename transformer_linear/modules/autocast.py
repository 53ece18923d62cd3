"""``tl.autocast``: turn FP8 on, or off, for the layers inside a block.

``tl.autocast(enabled=True, recipe=r)`` runs every ``tl.Linear`` /
``tl.GroupedLinear`` without a recipe of its own under ``r``;
``tl.autocast(enabled=False)`` runs every layer in high precision, those with
a recipe of their own included (Transformer Engine's ``fp8_autocast(enabled=False)``:
evaluating a converted model in high precision, with no delayed-scaling state
updated). Outside any ``tl.autocast`` a layer runs under its own recipe, if any.

The state is a plain module-level object read in the layers' forward; Dynamo
reads it at trace time and guards on it, so entering or leaving the context
outside a compiled region selects (and at first compiles) the graph of that
state rather than silently reusing another: three states, three graphs at most.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from transformer_linear.recipe import DelayedScaling, Recipe
from transformer_linear.recipe.quantization import check_recipe

__all__ = ["autocast", "fp8_autocast", "get_fp8_recipe", "is_fp8_enabled", "layer_recipe", "outside_autocast"]


class _State:
    # None: outside any tl.autocast; True / False: inside tl.autocast(enabled=...).
    enabled: Optional[bool] = None
    recipe: Optional[Recipe] = None


_STATE = _State()


def is_fp8_enabled() -> bool:
    """Whether an enclosing ``tl.autocast(enabled=True)`` is active."""
    return _STATE.enabled is True


def get_fp8_recipe() -> Optional[Recipe]:
    """The active autocast recipe, or None outside ``tl.autocast(enabled=True)``."""
    return _STATE.recipe if _STATE.enabled else None


def layer_recipe(own: Optional[Recipe]) -> Optional[Recipe]:
    """The recipe a layer whose own recipe is ``own`` runs under now (None: high precision).

    Inside ``tl.autocast(enabled=False)`` that is None; otherwise the layer's
    own recipe, else the enclosing ``tl.autocast(enabled=True)``'s.
    """
    if _STATE.enabled is False:
        return None
    return own if own is not None else _STATE.recipe


@contextlib.contextmanager
def _state(enabled: Optional[bool], recipe: Optional[Recipe]) -> Iterator[None]:
    saved = (_STATE.enabled, _STATE.recipe)
    _STATE.enabled, _STATE.recipe = enabled, recipe
    try:
        yield
    finally:
        _STATE.enabled, _STATE.recipe = saved


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Optional[Recipe] = None) -> Iterator[None]:
    """Run ``tl.Linear`` layers in FP8, or in high precision, inside the block.

    Args:
        enabled: True runs the layers without a recipe of their own under
            ``recipe`` (layers with one keep theirs). False turns FP8 off
            inside the block for every layer, those with a recipe of their
            own included: they run ``F.linear`` and leave their
            delayed-scaling state alone. Nesting restores the outer state.
        recipe: the recipe; ``None`` means ``recipe.DelayedScaling()`` (TE's default).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast: 'enabled' must be a bool, got {enabled!r}")
    check_recipe("autocast", recipe)
    with _state(enabled, (recipe or DelayedScaling()) if enabled else None):
        yield


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Run the block as outside any ``tl.autocast``: each layer under its own recipe, if any.

    For code that sets each layer's recipe itself (``transformer-linear
    compare``) and must not be reached by a caller's ``tl.autocast``.
    """
    with _state(None, None):
        yield


fp8_autocast = autocast
