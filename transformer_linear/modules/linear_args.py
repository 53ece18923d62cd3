"""The argument bundles of the Linear forward and backward, and the one place
that turns them into custom-op schemas.

``LinearFwdArgs`` / ``LinearBwdArgs`` are what the module and the autograd
rule pass around. A custom op cannot take a dataclass (an exported program
must save and load), so :func:`args_op` registers an op whose parameters are
the dataclass fields, in declaration order, with the schema inferred from the
field annotations: adding a field to the dataclass is the only edit needed.
A field whose type is itself a dataclass (the recipe's ``QuantizationSpec``,
``DelayedScalingArgs``, ``CachedWeight``) is expanded into one op parameter
per leaf field, named by its path (``quantization__input__dtype``), so nested
configs need no schema of their own. An optional config (``Optional[...]``)
makes each of its leaves optional, all None when the config is None; it must
have a leaf that is never None, which tells the two apart.

A ``list[int]`` leaf (a quantizer's ``block_shape``) crosses the op as
``SymInt[]?``, with None for the empty list, which the op turns back into
``[]``: AOTInductor's runtime (torch 2.13's OSSProxyExecutor) passes an empty
int list to the op as None, so a tensorwise quantizer's ``[]`` would not
survive a packaged model's call.
"""

# No ``from __future__ import annotations``: the op schema is read from the
# field annotations, which must be real types.

import dataclasses
import inspect
import typing
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from transformer_linear.formats.checks import check_same_device
from transformer_linear.recipe.delayed_scaling import DelayedScalingArgs
from transformer_linear.recipe.quantization import NO_QUANTIZATION, QuantizationSpec, Quantized

__all__ = [
    "ArgsOp",
    "CachedWeight",
    "LinearBwdArgs",
    "LinearBwdContext",
    "LinearFwdArgs",
    "LinearFwdOutputs",
    "args_op",
]


@dataclasses.dataclass(frozen=True)
class CachedWeight:
    """The FP8 weight of the current microbatch group (``is_first_microbatch=False`` reuses it)."""

    weight_fp8: Tensor
    """Row-major (out_features, in_features)."""
    weight_fp8_t: Optional[Tensor]
    """The columnwise copy where layout.py needs one (and under block scaling), else None."""
    weight_scale_inv: Tensor
    weight_scale_inv_t: Optional[Tensor]
    """Block scaling: the scales of ``weight_fp8_t``, else None."""
    weight_amax: Optional[Tensor]
    """Tensorwise scaling: the weight's amax, which delayed scaling records (block scaling records none)."""

    def quantized(self) -> Quantized:
        """The cached weight as its quantizer returned it (absent usages empty)."""
        empty_fp8 = self.weight_fp8.new_empty(0)
        empty_scale = self.weight_scale_inv.new_empty(0)
        return Quantized(
            self.weight_fp8,
            self.weight_scale_inv,
            self.weight_fp8_t if self.weight_fp8_t is not None else empty_fp8,
            self.weight_scale_inv_t if self.weight_scale_inv_t is not None else empty_scale,
            self.weight_amax,
        )


@dataclasses.dataclass(slots=True)
class LinearFwdArgs:
    """Everything ``linear_fwd`` needs; one field = one op argument (a config: one per leaf)."""

    # --- tensors ---
    inp: Tensor
    """(..., in_features) activation."""
    weight: Tensor
    """(out_features, in_features)."""
    bias: Optional[Tensor]
    cached_weight: Optional[CachedWeight]
    """is_first_microbatch=False: the FP8 weight to reuse; None quantizes the weight."""
    # --- requires-grad flags ---
    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    # --- FP8 formats and scaling state ---
    fp8: bool
    """False: high-precision GEMMs (used only for the wgrad options without FP8)."""
    quantization: QuantizationSpec
    """The quantizers of input, weight and grad_output (quantization.py): their dtypes, scales and
    layouts; without FP8 only their dtypes are read."""
    delayed: Optional[DelayedScalingArgs]
    """The delayed-scaling state, given where the quantizers take their scales from it
    (``quantization.scale_from_history``); else None."""
    # --- options ---
    out_dtype: torch.dtype
    """The output dtype: the input's, or the enclosing torch.autocast dtype."""
    main_grad: Optional[Tensor]
    """fuse_wgrad_accumulation: fp32 buffer backward accumulates wgrad into."""
    wgrad_queue: int
    """delay_wgrad_compute: handle (_handles.py) of the layer's queue backward_dw() drains; -1 when off."""


@dataclasses.dataclass(slots=True)
class LinearBwdArgs:
    """What ``linear_dgrad`` / ``linear_wgrad`` need; each op takes a subset
    (so a graph pass can split them: dgrad never sees the input, wgrad never the weight)."""

    # --- grad_output, quantized (or high precision without FP8) ---
    grad_output: Tensor
    """(M, out_features) row-major."""
    grad_output_t: Optional[Tensor]
    """For wgrad: the columnwise usage of grad_output (TensorQuantizer.columnwise_usage): layout.saved_form
    of grad_output (the same tensor on the CPU), or its columnwise copy (out_features, M)."""
    grad_output_scale_inv: Optional[Tensor]
    grad_output_t_scale_inv: Optional[Tensor]
    """The scales of ``grad_output_t`` (tensorwise: ``grad_output_scale_inv`` itself)."""
    # --- tensors saved by forward: their quantizers' columnwise usage (TensorQuantizer.columnwise_usage;
    # each quantizer's columnwise_operand makes the GEMM operand of it) ---
    inp: Tensor
    inp_scale_inv: Optional[Tensor]
    weight: Tensor
    weight_scale_inv: Optional[Tensor]
    # --- results ---
    input_shape: list[int]
    """The shape dgrad is returned in."""
    dgrad_dtype: torch.dtype
    wgrad_dtype: torch.dtype
    # --- how the operands were quantized ---
    quantization: QuantizationSpec = NO_QUANTIZATION
    """The quantizers, which say how a GEMM reads the saved operands and their scales (block scales
    of activations cross the graph 1-D, see TensorQuantizer.quantize_flat)."""


class LinearFwdOutputs(NamedTuple):
    """What ``linear_fwd`` returns (unused slots are empty tensors); only ``out`` has a gradient."""

    out: Tensor
    """(rows of the input, out_features): the caller restores the input's leading dims."""
    inp_saved: Tensor
    """The FP8 input in layout.saved_form (what wgrad reads)."""
    inp_scale_inv: Tensor
    weight_fp8: Tensor
    """Row-major FP8 weight (empty when a cached one was given)."""
    weight_fp8_t: Tensor
    """Its columnwise copy where layout.py needs one, else empty."""
    weight_scale_inv: Tensor
    weight_scale_inv_t: Tensor
    """Block scaling: the scales of ``weight_fp8_t``, else empty."""
    amax: Tensor
    """(2,) amaxes of [input, weight], for the delayed-scaling update."""
    grad_output_scale: Tensor
    """Delayed scaling: the grad_output scale as of this forward (negated: backward computes a just-in-time
    one), so a second backward through a retained graph quantizes like the first."""
    fwd_scales: Tensor
    """Delayed scaling: the scales this forward used for [input, weight, grad_output]; the module records
    them as ``fp8_fwd_scale`` for activation checkpointing's recompute."""


@dataclasses.dataclass(frozen=True)
class LinearBwdContext:
    """What backward needs from forward besides the saved tensors (kept on the autograd ctx)."""

    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    fp8: bool
    quantization: QuantizationSpec
    delayed: Optional[DelayedScalingArgs]
    """Delayed scaling: the state backward updates (grad_output's history and scale), by reference (not
    saved: its updates would trip the saved-tensor version check); None otherwise."""
    input_shape: list[int]
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]
    wgrad_queue: int
    main_grad: Optional[Tensor]

    @classmethod
    def from_fwd_args(cls, a: LinearFwdArgs) -> "LinearBwdContext":
        return cls(
            input_requires_grad=a.input_requires_grad,
            weight_requires_grad=a.weight_requires_grad,
            bias_requires_grad=a.bias_requires_grad,
            fp8=a.fp8,
            quantization=a.quantization,
            delayed=a.delayed if a.fp8 else None,
            input_shape=list(a.inp.shape),
            input_dtype=a.inp.dtype,
            weight_dtype=a.weight.dtype,
            bias_dtype=a.bias.dtype if a.bias is not None else None,
            wgrad_queue=a.wgrad_queue,
            main_grad=a.main_grad,
        )


def _is_config(hint: Any) -> bool:
    """A field type args_op expands into its leaf fields (a dataclass, not a tensor or a list)."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _optional_of(hint: Any) -> Any:
    """X for ``Optional[X]``, else None."""
    if typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:
            return next(a for a in args if a is not type(None))
    return None


class _Field(NamedTuple):
    """How one field (or a config's field) becomes op parameters: a leaf, or a config of fields."""

    attr: str
    """The field's name in its dataclass."""
    name: str
    """The op parameter name (a config's leaves are named ``config__leaf``)."""
    hint: Any
    """The parameter's annotation (a leaf), or the config's dataclass."""
    optional: bool
    """An ``Optional`` config: its leaves are optional, all None when it is None."""
    fields: tuple["_Field", ...] = ()
    """A config's fields, in declaration order; empty for a leaf."""
    size: int = 1
    """How many op parameters the field takes."""
    empty_as_none: bool = False
    """A ``list[int]`` leaf: optional in the schema, the empty list passed as None (see the module doc)."""

    def params(self) -> list[tuple[str, Any]]:
        if not self.fields:
            return [(self.name, Optional[self.hint] if self.empty_as_none else self.hint)]
        params = [p for f in self.fields for p in f.params()]
        return [(n, Optional[h]) for n, h in params] if self.optional else params

    def flatten(self, value: Any) -> tuple:
        if not self.fields:
            return (None if self.empty_as_none and value is not None and len(value) == 0 else value,)
        # torch.compile traces this code (the op's caller): there the cache would be graph state.
        cache = value is not None and not torch.compiler.is_compiling()
        if cache:
            cached = _FLAT_CONFIGS.get(id(value))
            if cached is not None and cached[0] is value:
                return cached[1]
        flat = tuple(v for f in self.fields for v in f.flatten(None if value is None else getattr(value, f.attr)))
        if cache and _config_key(flat) is not None:
            _remember(_FLAT_CONFIGS, id(value), (value, flat))
        return flat

    def unflatten(self, values: Iterator[Any]) -> Any:
        if not self.fields:
            value = next(values)
            return [] if self.empty_as_none and value is None else value
        taken = tuple(next(values) for _ in range(self.size))
        if self.optional and all(v is None for v in taken):
            return None
        key = _config_key(taken)
        if key is not None:
            config = _CONFIGS.get((self.hint, key))
            if config is not None:
                return config
        it = iter(taken)
        config = self.hint(**{f.attr: f.unflatten(it) for f in self.fields})
        if key is not None:
            _remember(_CONFIGS, (self.hint, key), config)
        return config


# A Linear's configs (its QuantizationSpec, say) are the same few values call after call, and each op call
# flattens them into op arguments and rebuilds them from those: about a third of a small layer's host time
# before these caches. Only configs made entirely of plain values are cached (a config holding tensors,
# like CachedWeight, or symbolic sizes while tracing is rebuilt every time); configs are frozen, so one
# instance serves every call. Each cache is cleared when it reaches _CACHE_LIMIT entries.
_CACHE_LIMIT = 4096
_CONFIGS: dict[tuple, Any] = {}
_FLAT_CONFIGS: dict[int, tuple[Any, tuple]] = {}
_PLAIN = frozenset((bool, int, float, str, type(None), torch.dtype))


def _config_key(leaves: tuple) -> Optional[tuple]:
    """A hashable key of a config's leaf values, or None if a leaf is not a plain value (or a list of
    ints). The leaves' types are part of the key: True and 1 are equal, but not the same argument."""
    types = tuple(map(type, leaves))
    if _PLAIN.issuperset(types):
        return leaves, types
    if not _PLAIN.union((list,)).issuperset(types):
        return None
    if not all(type(x) is int for v in leaves if type(v) is list for x in v):
        return None
    return tuple(tuple(v) if type(v) is list else v for v in leaves), types


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _field(cls: type, name: str, param: str) -> _Field:
    """The :class:`_Field` of field ``name`` of ``cls``, whose op parameter is named ``param``."""
    hint = typing.get_type_hints(cls)[name]
    inner = _optional_of(hint)
    config, optional = (inner, True) if _is_config(inner) else (hint, False)
    if not _is_config(config):
        return _Field(name, param, hint, False, empty_as_none=typing.get_origin(hint) is list)
    fields = tuple(_field(config, f.name, f"{param}__{f.name}") for f in dataclasses.fields(config))
    node = _Field(name, param, config, optional, fields, sum(f.size for f in fields))
    if optional and all(_optional_of(h) is not None for _, h in node._replace(optional=False).params()):
        # Nothing would tell a config whose leaves are all None from no config.
        raise TypeError(f"args_op: the optional config {config.__name__} ('{param}') needs a leaf that is never None")
    return node


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
        self._fields = tuple(_field(cls, f, f) for f in self.fields)
        self.params = tuple(p for f in self._fields for p in f.params())
        """(name, annotation) of the op's parameters."""

    def flatten(self, args: Any) -> tuple:
        """The op's positional arguments taken from ``args``."""
        return tuple(v for f in self._fields for v in f.flatten(getattr(args, f.attr)))

    def unflatten(self, values: Sequence[Any]) -> Any:
        """The dataclass rebuilt from the op's positional arguments (other fields None)."""
        kwargs = dict.fromkeys(self._all_fields)
        it = iter(values)
        kwargs.update({f.attr: f.unflatten(it) for f in self._fields})
        return self.cls(**kwargs)

    def __call__(self, args: Any) -> Any:
        out = self.op(*self.flatten(args))
        return self.result(*out) if self.result is not None else out

    def check_devices(self, values: Sequence[Any]) -> None:
        """One device for every tensor among the op's positional arguments (absent ones skipped).

        The op and its fake implementation both check: a meta tensor among CPU ones routes a call
        (through ``torch.ops``, where no module checked first) to the fake implementation.

        Raises:
            TypeError: naming the parameter on another device.
        """
        tensors = {name: v for (name, _), v in zip(self.params, values) if isinstance(v, Tensor)}
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
        mutates_args: fields the op writes to.
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
        wrapped.op = torch.library.custom_op(name, flat, mutates_args=tuple(mutates_args))
        return wrapped

    return register
