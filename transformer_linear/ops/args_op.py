"""Custom ops whose parameters come from an argument dataclass: the Linear's ``linear_fwd``,
``linear_dgrad``, ``linear_wgrad`` and ``grouped_linear_fwd``.

A custom op cannot take a dataclass (an exported program must save and load), so :func:`args_op`
registers (through :func:`library.custom_op`, like every op of the package) an op whose parameters are
derived from the dataclass's field annotations: adding a field is the only edit needed. Few parameters,
each saying what it holds:

- a top-level tensor field (``inp``, ``weight``, ``bias``) is a ``Tensor`` parameter; an ``int`` or
  ``list[int]`` field (``input_shape``, a queue handle) a ``SymInt`` one, as it may be a traced size;
- a field whose type is a dataclass is a config. The tensors of a config (``CachedWeight``'s, the
  delayed-scaling state's), nested configs' included, are one ``Tensor?[]`` parameter named after it,
  one entry per tensor leaf in declaration order;
- an ``int`` of a config holding tensors (a layer's handles, which differ from layer to layer and which
  torch.compile may trace as symbolic ints) is a ``SymInt`` parameter named by its path
  (``delayed__reduction_handle``);
- every other value (bools, floats, strings, dtypes, and the leaves of configs of plain values only, such
  as the recipe's whole ``QuantizationSpec``, whose ints are constants) is written into one ``str``
  parameter, ``options``, as
  ``path=value`` pairs: ``fp8=True,...,quantization.input.dtype=torch.float8_e4m3fn,
  quantization.input.block_shape=1x128,...``. An exported program shows the quantizers it was traced
  with, and one of another version of the package is refused with the leaf that differs.

An optional config (``Optional[...]``) is None where all its leaves are None; it must have a leaf that
is never None, which tells the two apart. A Linear's options are the same few strings call after call:
each is parsed once, and the frozen configs it holds are reused.

Keeping the schema short is not only for readability: torch's custom-op autograd fills in default
arguments at a cost quadratic in the op's parameter count on each call (``torch._library.utils.
fill_defaults`` reads ``schema.arguments``, which copies the whole list, once per parameter); at the
58 parameters ``linear_fwd`` once had that cost more host time than a small layer's kernels.

A ``list[int]`` parameter crosses as ``SymInt[]?``, with None for the empty list, which the op turns
back into ``[]``: AOTInductor's runtime (torch 2.13's OSSProxyExecutor) passes an empty int list to an
op as None, so an empty list would not survive a packaged model's call.
"""

# No ``from __future__ import annotations``: the op schema is built from real annotations.

import dataclasses
import inspect
import typing
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from transformer_linear.formats.checks import check_same_device
from transformer_linear.ops import library

__all__ = ["ArgsOp", "args_op"]

OPTIONS = "options"
"""The name of the op parameter holding the plain values."""

_PLAIN = (bool, int, float, str, torch.dtype)
"""The types of the values written into the options string (besides ``list[int]`` and Optional of them)."""


def _is_config(hint: Any) -> bool:
    """A field type args_op expands into its leaf fields (a dataclass, not a tensor or a list)."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _optional_of(hint: Any) -> Any:
    """X for ``Optional[X]``, else None."""
    if typing.get_origin(hint) is Union:
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:
            return next(a for a in args if a is not type(None))
    return None


def _is_tensor(hint: Any) -> bool:
    return (_optional_of(hint) or hint) is Tensor


def _is_size(hint: Any) -> bool:
    """An int or int list: a symbolic size while tracing (a parameter of its own at the top level)."""
    hint = _optional_of(hint) or hint
    return hint is int or hint == list[int]


def _text(path: str, value: Any) -> str:
    """``path=value`` as the options string holds it (read back by :func:`_value`).

    torch.compile traces this (the op's caller writes the string), so it is plain string building."""
    if value is None:
        text = "None"
    elif isinstance(value, list):
        text = "x".join([str(int(v)) for v in value])
    elif isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        text = str(int(value))  # a traced int is specialized: these are a recipe's constants
    else:
        text = str(value)
        if isinstance(value, str) and ("," in text or "=" in text or text == "None"):
            raise ValueError(f"args_op: the string '{path}' must not contain ',' or '=' nor be 'None', got {value!r}")
    return f"{path}={text}"


def _value(hint: Any, text: str) -> Any:
    """The value :func:`_text` wrote as ``text`` for a leaf annotated ``hint``.

    Raises:
        ValueError: ``text`` is not a value of that type.
    """
    inner = _optional_of(hint)
    if inner is not None:
        return None if text == "None" else _value(inner, text)
    if hint is bool:
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"
    if hint is int:
        return int(text)
    if hint is float:
        return float(text)
    if hint is torch.dtype:
        dtype = getattr(torch, text[len("torch."):], None) if text.startswith("torch.") else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"expected a torch dtype, got {text!r}")
        return dtype
    if hint == list[int]:
        return [int(v) for v in text.split("x")] if text else []
    if hint is str:
        return text
    raise TypeError(f"args_op: no text form for {hint}")


class _Node(NamedTuple):
    """One field of an args dataclass (or of a config in it) and where its value crosses the op."""

    attr: str
    """The field's name in its dataclass."""
    path: str
    """Its dotted path from the args dataclass (the options string's key; a top-level field's name)."""
    hint: Any
    """The field's annotation (a leaf), or the config's dataclass."""
    place: str
    """``"param"`` (an op parameter of its own), ``"text"`` (in the options string), ``"tensor"`` (an
    entry of its top-level config's tensor list), ``"config"`` (a config: its children say)."""
    optional: bool = False
    """A config that may be None (then all its leaves are)."""
    children: tuple["_Node", ...] = ()
    """A config's fields, in declaration order."""
    tensors: int = 0
    """A top-level config: its tensor leaves, the length of its list parameter."""
    nullable: bool = False
    """A leaf of an optional config: None where the config is None, whatever its annotation."""
    cached: bool = False
    """A top-level config of text leaves only (it is frozen): its text is kept per instance, and the
    instance is built once per options string (:meth:`ArgsOp.parse`)."""

    def leaves(self) -> Iterator["_Node"]:
        if self.place == "config":
            for child in self.children:
                yield from child.leaves()
        else:
            yield self

    def put(self, value: Any, params: list, parts: list, tensors: Optional[list]) -> None:
        """Place ``value`` of this field: into ``params``, the options ``parts`` or its config's ``tensors``."""
        if self.place == "param":
            params.append(None if value is not None and type(value) is list and len(value) == 0 else value)
        elif self.place == "text":
            parts.append(_text(self.path, value))
        elif self.place == "tensor":
            tensors.append(value)
        elif self.cached and value is not None:
            parts.append(self._cached_text(value))
        else:
            own = [] if tensors is None and self.tensors else None
            if own is not None:
                params.append(own)  # filled below: the list comes before the config's int parameters
            for child in self.children:
                child.put(None if value is None else getattr(value, child.attr), params, parts,
                          own if own is not None else tensors)

    def _cached_text(self, value: Any) -> str:
        # torch.compile traces this code (the op's caller): there the cache would be graph state.
        if torch.compiler.is_compiling():
            return self._text_of(value)
        hit = _TEXTS.get(id(value))
        if hit is None or hit[0] is not value:
            hit = (value, self._text_of(value))
            _remember(_TEXTS, id(value), hit)
        return hit[1]

    def _text_of(self, value: Any) -> str:
        parts: list[str] = []
        for child in self.children:
            child.put(getattr(value, child.attr), [], parts, None)
        return ",".join(parts)

    def take(self, params: Iterator[Any], texts: Iterator[Any], tensors: Optional[Iterator[Any]]) -> Any:
        """The field's value, taken back from where :meth:`put` placed it (a cached config: built already)."""
        return next(texts) if self.cached else self.build(params, texts, tensors)

    def build(self, params: Iterator[Any], texts: Iterator[Any], tensors: Optional[Iterator[Any]]) -> Any:
        """The field's value from the values of its leaves."""
        if self.place == "param":
            value = next(params)
            return [] if value is None and _optional_of(self.hint) is None and self.hint == list[int] else value
        if self.place == "text":
            return next(texts)
        if self.place == "tensor":
            return next(tensors)
        if tensors is None and self.tensors:
            given = next(params)
            tensors = iter(given if given is not None else [None] * self.tensors)
        values = {child.attr: child.take(params, texts, tensors) for child in self.children}
        if self.optional and all(v is None for v in values.values()):
            return None
        return self.hint(**values)


# Each cache is cleared when it reaches _CACHE_LIMIT entries.
_CACHE_LIMIT = 4096
_TEXTS: dict[int, tuple[Any, str]] = {}
_PARSED: dict[tuple[int, str], tuple] = {}


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _node(cls: type, name: str, path: str, top: bool, nullable: bool = False, within_plain: bool = False) -> _Node:
    """The :class:`_Node` of field ``name`` of ``cls`` (``nullable``: inside an optional config;
    ``within_plain``: inside a config of plain values only, whose ints are constants)."""
    hint = typing.get_type_hints(cls)[name]
    inner = _optional_of(hint)
    config, optional = (inner, True) if _is_config(inner) else (hint, False)
    if not _is_config(config):
        if _is_tensor(hint):
            return _Node(name, path, hint, "param" if top else "tensor")
        if _is_size(hint) and (top or not within_plain):
            return _Node(name, path, hint, "param", nullable=nullable)
        if (_optional_of(hint) or hint) not in _PLAIN and hint != list[int]:
            raise TypeError(f"args_op: field '{path}' of type {hint} cannot cross an op")
        return _Node(name, path, hint, "text", nullable=nullable)
    plain = within_plain or _all_plain(config)
    children = tuple(
        _node(config, f.name, f"{path}.{f.name}", False, nullable or optional, plain) for f in dataclasses.fields(config)
    )
    node = _Node(name, path, config, "config", optional, children)
    leaves = list(node.leaves())
    if optional and all(_optional_of(leaf.hint) is not None for leaf in leaves):
        # Nothing would tell a config whose leaves are all None from no config.
        raise TypeError(f"args_op: the optional config {config.__name__} ('{path}') needs a leaf that is never None")
    tensors = sum(leaf.place == "tensor" for leaf in leaves)
    return node._replace(tensors=tensors if top else 0, cached=top and tensors == 0)


def _all_plain(config: type) -> bool:
    """No leaf of ``config`` (nested configs included) is a tensor."""
    hints = typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        inner = _optional_of(hint) or hint
        if (_is_config(inner) and not _all_plain(inner)) or _is_tensor(hint):
            return False
    return True


def _param_hint(node: _Node) -> Any:
    hint = _optional_of(node.hint) or node.hint
    if typing.get_origin(hint) is list or node.nullable or _optional_of(node.hint) is not None:
        return Optional[hint]  # an empty list crosses as None (module doc)
    return hint


class ArgsOp:
    """A custom op taking some fields of an args dataclass, callable with the dataclass."""

    def __init__(self, op: Any, cls: type, fields: Sequence[str], result: Optional[type] = None, name: str = ""):
        self.op = op
        self.name = name
        """The op's name without its namespace, for error messages."""
        self.cls = cls
        self.fields = tuple(fields)
        self.result = result
        self._all_fields = tuple(f.name for f in dataclasses.fields(cls))
        self._nodes = tuple(_node(cls, f, f, True) for f in self.fields)
        params = []
        for node in self._nodes:
            if node.place == "param":
                params.append((node.attr, _param_hint(node)))
            elif node.tensors:
                params.append((node.attr, list[Optional[Tensor]]))
            params += [(leaf.path.replace(".", "__"), _param_hint(leaf)) for leaf in node.leaves()
                       if leaf.place == "param" and leaf is not node]
        self._texts = [leaf for n in self._nodes for leaf in n.leaves() if leaf.place == "text"]
        """The options string's leaves, in order."""
        self._keys = [leaf.path for leaf in self._texts]
        if self._texts:
            params.append((OPTIONS, str))
        self.params = tuple(params)
        """(name, annotation) of the op's parameters."""
        self._list_lengths = {n.attr: n.tensors for n in self._nodes if n.tensors}

    def full_lists(self, values: Sequence[Any]) -> frozenset[str]:
        """The tensor-list parameters among the op's arguments ``values`` that hold no None (what
        :meth:`input_grads` needs: torch's autograd takes such a list's gradient as a list)."""
        return frozenset(
            name for (name, _), v in zip(self.params, values)
            if name in self._list_lengths and v is not None and all(isinstance(t, Tensor) for t in v)
        )

    def input_grads(self, full_lists: frozenset[str], **grads: Optional[Tensor]) -> tuple:
        """What the op's autograd ``backward`` returns: ``grads`` for the tensor parameters they name, None
        for the others, a list of Nones for a tensor list in ``full_lists`` (:meth:`full_lists` of the
        forward's arguments; torch checks the structure: a list holding a None is one input to it).

        Raises:
            ValueError: ``grads`` names no parameter of the op.
        """
        unknown = set(grads) - {name for name, _ in self.params}
        if unknown:
            raise ValueError(f"{self.name}: no parameters {sorted(unknown)}")
        return tuple(
            [None] * self._list_lengths[name] if name in full_lists else grads.get(name) for name, _ in self.params
        )

    def flatten(self, args: Any) -> tuple:
        """The op's positional arguments taken from ``args``."""
        params: list = []
        parts: list[str] = []
        for node in self._nodes:
            node.put(getattr(args, node.attr), params, parts, None)
        if self._texts:
            params.append(",".join(parts))
        return tuple(params)

    def unflatten(self, values: Sequence[Any]) -> Any:
        """The dataclass rebuilt from the op's positional arguments (other fields None)."""
        kwargs = dict.fromkeys(self._all_fields)
        params = iter(values)
        texts = iter(self.parse(values[-1]) if self._texts else ())
        kwargs.update({node.attr: node.take(params, texts, None) for node in self._nodes})
        return self.cls(**kwargs)

    def parse(self, options: Any) -> tuple:
        """The values the options string holds, in order, a cached config's as one instance (parsed once per
        string).

        Raises:
            TypeError: ``options`` is not a string.
            ValueError: naming the leaf, if it is not this op's options string (other leaves, as from
                an exported program of another version, or a value of the wrong type).
        """
        hit = _PARSED.get((id(self), options)) if isinstance(options, str) else None
        if hit is not None:
            return hit
        if not isinstance(options, str):
            raise TypeError(f"{self.name}: '{OPTIONS}' must be a string, got {type(options).__name__}")
        parts = options.split(",")
        if [part.partition("=")[0] for part in parts] != self._keys:
            raise ValueError(f"{self.name}: '{OPTIONS}' must list {', '.join(self._keys)}; got {options!r}")
        values = []
        for leaf, part in zip(self._texts, parts):
            try:
                text = part.partition("=")[2]
                values.append(None if leaf.nullable and text == "None" else _value(leaf.hint, text))
            except ValueError as e:
                raise ValueError(f"{self.name}: '{OPTIONS}': leaf '{leaf.path}': {e}") from None
        leaf_values = iter(values)
        items = []
        for node in self._nodes:
            if node.cached:
                items.append(node.build(iter(()), leaf_values, None))
            else:
                items.extend([next(leaf_values) for leaf in node.leaves() if leaf.place == "text"])
        parsed = tuple(items)
        _remember(_PARSED, (id(self), options), parsed)
        return parsed

    def __call__(self, args: Any) -> Any:
        out = self.op(*self.flatten(args))
        return self.result(*out) if self.result is not None else out

    def check_devices(self, values: Sequence[Any]) -> None:
        """One device for every tensor among the op's arguments (absent ones skipped).

        The op and its fake implementation both check: a meta tensor among CPU ones routes a call
        (through ``torch.ops``, where no module checked first) to the fake implementation.

        Raises:
            TypeError: naming the parameter on another device.
        """
        tensors = {}
        for (name, _), v in zip(self.params, values):
            if isinstance(v, Tensor):
                tensors[name] = v
            elif isinstance(v, (list, tuple)):
                tensors.update({f"{name}[{i}]": t for i, t in enumerate(v) if isinstance(t, Tensor)})
        if tensors:
            check_same_device(self.name, tensors)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fake(*values)`` as the op's fake implementation, after :meth:`check_devices`."""

        def checked(*values: Any) -> Any:
            self.check_devices(values)
            return fake(*values)

        self.op.register_fake(checked)
        return fake


def args_op(
    name: str,
    cls: type,
    returns: Any,
    fields: Optional[Sequence[str]] = None,
    mutates_args: Sequence[str] = (),
    result: Optional[type] = None,
) -> Callable[[Callable[[Any], Any]], ArgsOp]:
    """Register ``impl(args: cls) -> returns`` as the custom op ``name``.

    Args:
        name: ``"namespace::op"``.
        cls: the args dataclass.
        returns: the op's return annotation.
        fields: the fields the op takes (default: all, in declaration order).
        mutates_args: top-level tensor fields the op writes to.
        result: a NamedTuple the op's tuple is returned as (the schema sees a plain tuple).
    """
    names = tuple(fields) if fields is not None else tuple(f.name for f in dataclasses.fields(cls))

    def register(impl: Callable[[Any], Any]) -> ArgsOp:
        wrapped = ArgsOp(None, cls, names, result, name.split("::")[-1])

        def flat(*values: Any) -> Any:
            wrapped.check_devices(values)
            out = impl(wrapped.unflatten(values))
            return tuple(out) if isinstance(out, tuple) else out  # a NamedTuple result, as the schema's tuple

        flat.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=h) for n, h in wrapped.params],
            return_annotation=returns,
        )
        flat.__name__ = flat.__qualname__ = name.split("::")[-1]
        flat.__module__ = impl.__module__
        wrapped.op = library.custom_op(name, flat, mutates_args=tuple(mutates_args))
        return wrapped

    return register
