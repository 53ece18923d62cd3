"""Int handles through which a custom op reaches a Python object its layer owns.

A custom op takes tensors and scalars, not Python objects, yet the
delayed-scaling update must leave its background amax reduction with the
layer's state, and a delayed-wgrad backward must queue its work with the
layer. The layer owns that object; the op gets its handle, an int the op
schema can carry (and torch.compile guards on as a constant), and looks the
object up here.

The table refers to the objects weakly: it keeps nothing alive, so an
object dies with its layer and its entry goes with it. Handles count up and
are never reused, so a later object cannot inherit an earlier one's handle.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Generic, Optional, TypeVar

__all__ = ["NO_HANDLE", "HandleTable"]

NO_HANDLE = -1
"""The handle of no object: the op has nothing to reach."""

T = TypeVar("T")


class HandleTable(Generic[T]):
    """Objects by handle, held weakly."""

    def __init__(self) -> None:
        self._objects: weakref.WeakValueDictionary[int, T] = weakref.WeakValueDictionary()
        self._handles = itertools.count()

    def add(self, obj: T) -> int:
        """A new handle for ``obj``, valid while ``obj`` lives."""
        handle = next(self._handles)
        self._objects[handle] = obj
        return handle

    def get(self, handle: int) -> Optional[T]:
        """The object of ``handle``; None for :data:`NO_HANDLE`, an unknown handle or an object gone."""
        return self._objects.get(handle)

    def __len__(self) -> int:
        return len(self._objects)
