"""FP8 primary weights: ``tl.quantized_model_init`` (Transformer Engine's name; ``fp8_model_init`` too).

A ``tl.Linear`` built (or converted by ``convert_to_fp8``) or a ``tl.GroupedLinear`` built inside the
context keeps its weight only in the recipe's quantized form (a GroupedLinear's (num_gemms, out, in)
weight with each expert's own scales, as its forward quantizes it): its ``weight`` Parameter is a
:class:`QuantizedWeight`, a tensor of the weight's shape and dtype holding data and scales in both usages
the weight's quantizer produces (rowwise for the forward GEMM, columnwise for dgrad), which the forward
hands to the GEMM as it is. There is no
high-precision weight in the model. Nothing here branches on the recipe: the weight's quantizer says
what is stored.

Optimizer design (Transformer Engine's, not torchao's): the high-precision master copy lives with the
optimizer (``tl.optim.MasterWeights``: a stock ``torch.optim.AdamW`` steps plain fp32 masters, whose
gradients are the FP8 Parameters' gradients; after each step each Parameter is requantized from its
master in place). torchao keeps the high-precision weight as the Parameter and casts it in each forward
(or before FSDP2's all-gather), so it saves no parameter memory. The Parameter's other uses: any op but
the forward's reads the dequantized weight (``state_dict`` saves it: it loads into ``nn.Linear``), and
``copy_`` (``load_state_dict``) or an in-place op (``nn.init``) quantizes its result back. An optimizer
stepping the FP8 Parameters themselves would round each update to FP8 and lose AdamW's small updates: a
global optimizer pre-step hook raises instead.

Under FSDP2 (torch's own ``fully_shard``, as engines call it, or ``tl.distributed.fully_shard``) the
weight's shards are its high-precision master (the preserved initial weight where
``preserve_high_precision_init_val``, else the dequantized one), which FSDP2 all-gathers in the recipe's
quantized form with no further step: FSDP2's sharding ops on a :class:`QuantizedWeight` make its shards
``FP8AllGatherWeight`` shards (:class:`ShardGather`), so the weight exists unsharded only quantized. A stock
optimizer steps those masters. Where the recipe cannot gather the shards quantized (blocks straddling
shards; fp8_all_gather_shard.fp8_all_gather_type says why) the shards gather in high precision, with a
warning.

A layer's weight scale is computed from the weight itself when it is quantized (current scaling), also
under delayed scaling, whose history still records the weight's amax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from transformer_linear.modules.fp8_all_gather import GatheredFP8Weight, is_fp8_all_gathered, quantize_weight
from transformer_linear.modules.fp8_all_gather_shard import fp8_all_gather_type, register_plain_weight_hook
from transformer_linear.modules.fsdp_gather_usages import BACKWARD_READS_COLUMNWISE
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe import DelayedScaling, Recipe
from transformer_linear.recipe.kind_tensorwise import transposed as contiguous_transpose
from transformer_linear.recipe.quantization import (
    QuantizationSpec,
    TensorQuantizer,
    check_recipe,
    quantization_spec,
)

__all__ = [
    "QuantizedInitConfig",
    "QuantizedWeight",
    "ShardGather",
    "clear_high_precision_init_val",
    "fp8_model_init",
    "get_high_precision_init_val",
    "is_quantized_weight",
    "quantized_model_init",
    "quantized_weight_bytes",
    "requantize_weights",
]


@dataclasses.dataclass(frozen=True)
class QuantizedInitConfig:
    """How a layer built under :func:`quantized_model_init` keeps its weight.

    Attributes:
        recipe: the recipe whose weight quantizer makes the stored weight.
        preserve_high_precision_init_val: keep a CPU copy of the initial weight
            (:func:`get_high_precision_init_val`).
        rowwise_only: store only the rowwise copy also where the columnwise one has blocks of its own
            (MXFP8, rowwise, NVFP4): see :func:`quantized_model_init`.
    """

    recipe: Recipe
    preserve_high_precision_init_val: bool = False
    rowwise_only: bool = False

    def __post_init__(self) -> None:
        if self.recipe is None:
            raise TypeError("quantized_model_init: 'recipe' must be a recipe, got None")
        check_recipe("quantized_model_init", self.recipe)
        for name in ("preserve_high_precision_init_val", "rowwise_only"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"quantized_model_init: '{name}' must be a bool, got {getattr(self, name)!r}")

    @property
    def weight_quantizer(self) -> TensorQuantizer:
        """The quantizer the stored weight is made by."""
        return quantization_spec(self.recipe).weight


# The config of the innermost active context (None: off); a one-slot list so nesting restores it.
_ACTIVE: list[Optional[QuantizedInitConfig]] = [None]


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    preserve_high_precision_init_val: bool = False,
    rowwise_only: bool = False,
) -> Iterator[None]:
    """Layers built inside keep their weight only in the recipe's quantized form.

    Args:
        enabled: False leaves layers built inside as usual (an enclosing context is switched off).
        recipe: whose weight quantizer makes the stored weight; None: ``DelayedScaling()``, as in
            Transformer Engine. The forward must run under a recipe with the same weight quantizer.
        preserve_high_precision_init_val: keep a CPU copy of each initial weight, for
            :func:`get_high_precision_init_val`; ``tl.optim.MasterWeights`` (or ``fully_shard``) takes it as
            the master (else the master starts from the dequantized weight).
        rowwise_only: where the recipe's columnwise weight copy has blocks of its own (MXFP8's 32x1, the
            rowwise recipe's per-column scales, NVFP4's 1x16 blocks), store only the rowwise copy: about
            half the bytes (0.27x fp32 for MXFP8 instead of 0.52x). A forward that needs the columnwise
            copy (for dgrad) quantizes it from the stored weight's value, one more quantize per forward,
            so dgrad reads the stored weight quantized columnwise rather than the master quantized
            columnwise (two roundings from the master instead of one). Without it (the default), every
            recipe trains bit for bit as the high-precision-weight Linear with the same master.

    Raises:
        TypeError: ``enabled``, ``preserve_high_precision_init_val`` or ``rowwise_only`` not a bool, or
            an unknown recipe.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"quantized_model_init: 'enabled' must be a bool, got {enabled!r}")
    config = QuantizedInitConfig(
        recipe if recipe is not None else DelayedScaling(), preserve_high_precision_init_val, rowwise_only
    )
    previous = _ACTIVE[0]
    _ACTIVE[0] = config if enabled else None
    try:
        yield
    finally:
        _ACTIVE[0] = previous


fp8_model_init = quantized_model_init
"""Transformer Engine's earlier name of :func:`quantized_model_init`."""


def active_config() -> Optional[QuantizedInitConfig]:
    """The config of the innermost active :func:`quantized_model_init` (None outside)."""
    return _ACTIVE[0]


def stored_form(quantizer: TensorQuantizer, cached: CachedWeight, rowwise_only: bool = False) -> CachedWeight:
    """``cached`` without the columnwise copy where it is the rowwise one transposed, or (``rowwise_only``)
    wherever it is."""
    if not (rowwise_only or quantizer.columnwise_is_transpose):
        return cached
    return dataclasses.replace(cached, weight_fp8_t=None, weight_scale_inv_t=None)


def _columnwise_copy(quantizer: TensorQuantizer, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(data_t, scale_inv_t): ``weight``'s columnwise copy alone, as :func:`quantize_weight` makes it (a 2-D
    weight in one columnwise-only pass; a stacked 3-D one expert by expert, both usages)."""
    if weight.dim() == 3:
        q = quantize_weight(quantizer, weight)
        return q.weight_fp8_t, q.weight_scale_inv_t
    with torch.no_grad():
        q = quantizer.quantize(weight.detach().contiguous(), rowwise=False, columnwise=True)
    return q.data_t, q.scale_inv_t


def transposed_weight(cached: CachedWeight) -> CachedWeight:
    """The quantized form of the 2-D weight ``cached`` represents, transposed: its rowwise copy is
    ``cached``'s columnwise copy and the other way round (each copy is the quantization of one GEMM operand,
    whatever the blocks). ``cached`` holds both copies (``QuantizedWeight.cached_weight``), or (one scale
    per tensor, no columnwise copy needed here) the rowwise one alone, whose transpose is made now."""
    data_t = cached.weight_fp8_t if cached.weight_fp8_t is not None else contiguous_transpose(cached.weight_fp8)
    if cached.weight_scale_inv_t is None:  # one scale for both copies
        return dataclasses.replace(cached, weight_fp8=data_t, weight_fp8_t=cached.weight_fp8)
    return dataclasses.replace(
        cached,
        weight_fp8=data_t,
        weight_fp8_t=cached.weight_fp8,
        weight_scale_inv=cached.weight_scale_inv_t,
        weight_scale_inv_t=cached.weight_scale_inv,
    )


def dequantize_weight(quantizer: TensorQuantizer, cached: CachedWeight, dtype: torch.dtype) -> Tensor:
    """The high-precision (rows, cols) weight ``cached``'s rowwise usage represents, in ``dtype``; a
    stacked (num_gemms, rows, cols) one expert by expert."""
    data, scale_inv = cached.weight_fp8, cached.weight_scale_inv
    if data.dim() == 2:
        return quantizer.dequantize(data, scale_inv, dtype)
    experts = [quantizer.dequantize(data[e], scale_inv[e], dtype) for e in range(data.shape[0])]
    if not experts:
        return torch.empty(quantizer.value_shape(tuple(data.shape)), dtype=dtype, device=data.device)
    return torch.stack(experts)


_CACHED_FIELDS = tuple(f.name for f in dataclasses.fields(CachedWeight))
# Ops whose result is the same weight (what nn.Parameter, autograd and module code do to a parameter).
_SAME_WEIGHT_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_RESHAPE_OPS = (torch.ops.aten.as_strided.default, torch.ops.aten.view.default)
_COPY_OPS = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)
_SHARDING_OPS = (torch.ops.aten.split.Tensor, torch.ops.aten.new_zeros.default)
"""What FSDP2's ``fully_shard`` does to a parameter it shards (``_init_sharded_param``)."""


@dataclasses.dataclass(frozen=True)
class ShardGather:
    """What FSDP2's sharding of a layer's :class:`QuantizedWeight` needs: the shards are the layer's
    high-precision master (:func:`high_precision_weight`), made :func:`fp8_all_gather_shard.fp8_all_gather_type`'s
    class, which gathers them quantized by ``spec``."""

    spec: QuantizationSpec
    """The layer's quantizers (its recipe's): the weight's and, for delayed scaling, the history."""
    layer: "weakref.ReferenceType[nn.Module]"
    """The layer (its preserved initial weight is the master, and is freed once the master is made)."""

    def shard_type(self, weight: "QuantizedWeight", shard_rows: int) -> Optional[type]:
        """The class of ``weight``'s shards of ``shard_rows`` rows (experts, for 3-D), or None where they gather
        in high precision (with a warning saying why)."""
        world = -(-weight.shape[0] // max(shard_rows, 1))
        try:
            return fp8_all_gather_type(self.spec, tuple(weight.shape), world, "fully_shard")
        except ValueError as e:
            warnings.warn(f"quantized_model_init: the weight gathers in high precision: {e}", stacklevel=2)
            return None

    def master(self, weight: "QuantizedWeight") -> Tensor:
        """The high-precision weight FSDP2 shards: the preserved initial one, else ``weight`` dequantized."""
        layer = self.layer()
        init_val = getattr(layer, "_high_precision_init_val", None) if layer is not None else None
        if init_val is None:
            return weight.dequantize()
        clear_high_precision_init_val(layer)
        return init_val.to(device=weight.device, dtype=weight.dtype)


class QuantizedWeight(GatheredFP8Weight):
    """A ``tl.Linear``'s weight kept only in its recipe's quantized form (the Parameter under
    :func:`quantized_model_init`): the weight's shape and dtype, data and scales of both usages.

    The forward reads :attr:`cached_weight` (as it reads a weight FSDP2 gathered in FP8) and gives the
    weight gradient, in the weight's dtype, to this Parameter. Any other op reads :meth:`dequantize`;
    ``copy_`` and in-place ops quantize their result back into the same tensors (so ``load_state_dict``
    and ``nn.init`` work and the Parameter object stays the one the optimizer and autograd know).

    Args:
        cached_weight: the quantized weight (:func:`quantize_weight`).
        quantizer: the quantizer that made it.
        dtype: the weight's (nominal) dtype: its gradient's, and what :meth:`dequantize` returns.
        shard_gather: a layer's weight: how FSDP2's shards of it gather (:class:`ShardGather`).
    """

    source = "kept quantized by quantized_model_init's recipe"

    @staticmethod
    def __new__(
        cls, cached_weight: CachedWeight, quantizer: TensorQuantizer, dtype: torch.dtype,
        shard_gather: Optional[ShardGather] = None,
    ) -> "QuantizedWeight":
        data = cached_weight.weight_fp8
        shape = quantizer.value_shape(tuple(data.shape))  # FP4 data packs two values a byte
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(
        self, cached_weight: CachedWeight, quantizer: TensorQuantizer, dtype: torch.dtype,
        shard_gather: Optional[ShardGather] = None,
    ) -> None:
        super().__init__(cached_weight, quantizer, dtype)
        self.shard_gather = shard_gather
        """How FSDP2's shards of this weight gather (None: a QuantizedWeight made by an op, not a layer's)."""

    @classmethod
    def of(
        cls, quantizer: TensorQuantizer, weight: Tensor, rowwise_only: bool = False,
        shard_gather: Optional[ShardGather] = None,
    ) -> "QuantizedWeight":
        """``weight`` quantized by ``quantizer`` (``rowwise_only``: its rowwise copy alone is stored)."""
        _install_optimizer_guard()
        stored = stored_form(quantizer, quantize_weight(quantizer, weight), rowwise_only)
        return cls(stored, quantizer, weight.dtype, shard_gather)

    @property
    def cached_weight(self) -> CachedWeight:
        """The quantized weight as the forward's GEMMs read it: the stored usages and, where the columnwise
        usage is the rowwise one transposed, that transpose made now (exact; freed with the step); where it
        has blocks of its own but was not stored (``rowwise_only``), quantized now from the stored weight."""
        stored = self._stored()
        if stored.weight_fp8_t is not None:
            return stored
        if not self.quantizer.columnwise_is_transpose:
            data_t, scale_inv_t = _columnwise_copy(self.quantizer, self.dequantize())
            return dataclasses.replace(stored, weight_fp8_t=data_t, weight_scale_inv_t=scale_inv_t)
        data_t, scale_inv_t = self.quantizer.transpose_copy(stored.weight_fp8, stored.weight_scale_inv)
        return dataclasses.replace(stored, weight_fp8_t=data_t, weight_scale_inv_t=scale_inv_t)

    @property
    def stored_copies(self) -> CachedWeight:
        """The stored copies alone, with no columnwise copy made (what a forward without autograd reads)."""
        return self._stored()

    def _stored(self) -> CachedWeight:
        return CachedWeight(**{name: getattr(self, name) for name in _CACHED_FIELDS})

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={list(self.shape)}, dtype={self.dtype}, quantizer={self.quantizer})"

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The weight the stored data represents, as a plain tensor in ``dtype`` (default: the weight's)."""
        return dequantize_weight(self.quantizer, self._stored(), dtype or self.dtype)

    def quantize_(self, weight: Tensor) -> None:
        """Quantize ``weight`` (plain, the same shape) into this tensor's data and scales, in place.

        Raises:
            ValueError: ``weight`` has another shape.
        """
        if tuple(weight.shape) != tuple(self.shape):
            raise ValueError(f"QuantizedWeight: cannot store a {list(weight.shape)} weight in a {list(self.shape)} one")
        fresh = quantize_weight(self.quantizer, weight.to(device=self.device))
        with torch.no_grad():
            for name in _CACHED_FIELDS:
                dst, src = getattr(self, name), getattr(fresh, name)
                if dst is not None:
                    dst.copy_(src)

    def _shard(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """FSDP2's sharding (``fully_shard``: the dim-0 chunks, then a zero-padded shard they are copied into)
        on the master, whose shards are made the class that gathers them quantized (or stay plain)."""
        if func is torch.ops.aten.split.Tensor:
            shard_type = self.shard_gather.shard_type(self, int(args[1]))
            shards = func(self.shard_gather.master(self), *args[1:], **kwargs)
        else:  # new_zeros(size): the padded shard
            size = list(args[1])
            shard_type = self.shard_gather.shard_type(self, int(size[0]))
            shards = torch.zeros(size, dtype=kwargs.get("dtype") or self.dtype, device=kwargs.get("device") or self.device)
        if shard_type is None:
            return shards
        spec = self.shard_gather.spec
        return pytree.tree_map_only(Tensor, lambda t: shard_type(t, spec.weight, spec.history), shards)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, QuantizedWeight))
        first = args[0] if args else None
        if first is this and (func in _SAME_WEIGHT_OPS or (func in _RESHAPE_OPS and list(args[1]) == list(this.shape))):
            return QuantizedWeight(this._stored(), this.quantizer, this.dtype, this.shard_gather)
        if first is this and this.shard_gather is not None and func in _SHARDING_OPS:
            return this._shard(func, args, kwargs)
        if first is this and func in _COPY_OPS:
            # clone (deepcopy) and .to(device/dtype): the quantized tensors copied, the dtype the nominal one.
            device = kwargs.get("device") or this.device
            moved = {name: getattr(this, name) for name in _CACHED_FIELDS}
            moved = {name: None if t is None else t.to(device, copy=True) for name, t in moved.items()}
            return QuantizedWeight(CachedWeight(**moved), this.quantizer, kwargs.get("dtype") or this.dtype,
                                   this.shard_gather)
        if first is this and func is torch.ops.aten.copy_.default:
            src = args[1]
            this.quantize_(src.dequantize(this.dtype) if isinstance(src, QuantizedWeight) else src)
            return this
        plain_args, plain_kwargs = pytree.tree_map_only(QuantizedWeight, lambda t: t.dequantize(), (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if first is this and func._schema.is_mutable:
            # An in-place op (nn.init's uniform_, a scaling mul_): its result quantized back.
            this.quantize_(plain_args[0])
            return this
        return out

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride) -> "QuantizedWeight":
        quantizer, dtype = meta
        cached = CachedWeight(**{name: inner_tensors.get(name) for name in _CACHED_FIELDS})
        return QuantizedWeight(cached, quantizer, dtype)


class _Transposed(torch.autograd.Function):
    """The transposed weight as a :class:`QuantizedWeight` (its copies swapped); the gradient transposed back."""

    @staticmethod
    def forward(ctx, weight: QuantizedWeight) -> QuantizedWeight:
        return QuantizedWeight(transposed_weight(weight.cached_weight), weight.quantizer, weight.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.t()


def transposed(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` (2-D) transposed, still quantized, for a forward that reads it transposed (a Conv1D's
    (in, out) weight): no dequantize, the gradient reaches ``weight``. (``weight.t()`` is the dequantized
    weight transposed, as every op but the forward's reads it.)"""
    return _Transposed.apply(weight)


def _optimizer_guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuse an optimizer step on FP8 Parameters (each update would be rounded to FP8)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, QuantizedWeight):
                raise TypeError(
                    f"{type(optimizer).__name__}.step: a parameter is a tl.quantized_model_init FP8 weight "
                    f"{list(p.shape)}; the optimizer must step its high-precision master: build it over "
                    "tl.optim.MasterWeights(model).parameters() and call .attach(optimizer)"
                )


_GUARD_INSTALLED: list[bool] = [False]


def _install_optimizer_guard() -> None:
    """Register :func:`_optimizer_guard` for every optimizer, once (when the first FP8 weight is made)."""
    if not _GUARD_INSTALLED[0]:
        register_optimizer_step_pre_hook(_optimizer_guard)
        _GUARD_INSTALLED[0] = True


def requantize(layer: nn.Module) -> None:
    """Make ``layer``'s plain weight a :class:`QuantizedWeight` (no-op for a layer not built in the context,
    one whose weight is quantized already, sharded by FSDP2, or on the meta device).

    Called where a layer gets a high-precision weight: ``convert_to_fp8`` (``from_linear``) and
    materializing a meta-device layer (``to_empty``; initialize the weight after: in-place ops quantize).
    """
    config: Optional[QuantizedInitConfig] = getattr(layer, "quantized_init", None)
    if config is None:
        return
    weight = layer.weight
    if (
        isinstance(weight, QuantizedWeight)
        or is_fp8_all_gathered(weight)
        or getattr(layer, "fsdp_sharded", False)
        or hasattr(weight, "_local_tensor")
        or weight.device.type == "meta"
    ):
        return
    if config.preserve_high_precision_init_val and not hasattr(layer, "_high_precision_init_val"):
        layer._high_precision_init_val = weight.detach().to("cpu", copy=True)
    spec = quantization_spec(config.recipe)
    shard_gather = ShardGather(spec, weakref.ref(layer))
    stored = QuantizedWeight.of(config.weight_quantizer, weight, config.rowwise_only, shard_gather)
    layer.weight = nn.Parameter(stored, requires_grad=weight.requires_grad)
    if not getattr(layer, "_dequantized_state_dict_hook", False):
        layer._register_state_dict_hook(_dequantized_weight_in_state_dict)
        layer._dequantized_state_dict_hook = True
    # Where FSDP2 shards the weight (ShardGather): backward's gather may carry the columnwise copy alone, and
    # state_dict saves the plain master.
    setattr(layer, BACKWARD_READS_COLUMNWISE, spec.backward_operands == "quantized")
    register_plain_weight_hook(layer)


def _dequantized_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``state_dict`` holds the dequantized weight as a plain tensor (it loads into ``nn.Linear``)."""
    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, QuantizedWeight):
        state_dict[key] = weight.dequantize()


def high_precision_weight(layer: nn.Module) -> Tensor:
    """A plain high-precision copy of ``layer``'s :class:`QuantizedWeight`: the preserved initial weight
    (``preserve_high_precision_init_val``; freed here: it becomes the master), else the dequantized one."""
    weight = layer.weight
    init_val = getattr(layer, "_high_precision_init_val", None)
    if init_val is not None:
        clear_high_precision_init_val(layer)
        return init_val.to(device=weight.device, dtype=weight.dtype)
    return weight.dequantize()


def init_layer(layer: nn.Module) -> None:
    """Attach the active context's config to a newly built ``layer`` and quantize its weight."""
    layer.quantized_init = active_config()
    requantize(layer)


def is_quantized_weight(layer: nn.Module) -> bool:
    """Whether ``layer`` keeps its weight quantized (built under :func:`quantized_model_init`)."""
    return getattr(layer, "quantized_init", None) is not None


def quantized_weight_bytes(layer: nn.Module) -> int:
    """Bytes ``layer``'s weight Parameter holds: data and scales of every usage and the amax of a
    :class:`QuantizedWeight`, else the plain weight's (0 for a meta-device one)."""
    weight = layer.weight
    if isinstance(weight, QuantizedWeight):
        tensors = [getattr(weight, name) for name in _CACHED_FIELDS]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return 0 if weight.device.type == "meta" else weight.numel() * weight.element_size()


def requantize_weights(model: nn.Module) -> None:
    """Quantize the plain weight of every layer of ``model`` built under :func:`quantized_model_init`
    (one built on the meta device and materialized since): see :func:`requantize`."""
    for module in model.modules():
        if is_quantized_weight(module):
            requantize(module)


def get_high_precision_init_val(layer: nn.Module) -> Optional[Tensor]:
    """The CPU copy of ``layer``'s initial weight kept by ``preserve_high_precision_init_val=True`` (else None)."""
    return getattr(layer, "_high_precision_init_val", None)


def clear_high_precision_init_val(layer: nn.Module) -> None:
    """Free the copy :func:`get_high_precision_init_val` returns."""
    if hasattr(layer, "_high_precision_init_val"):
        del layer._high_precision_init_val


def load_state_dict_post_hook(layer: nn.Module, incompatible_keys: Any) -> None:
    """A layer whose weight is still plain (materialized from the meta device) is quantized once loaded
    (a :class:`QuantizedWeight` quantizes what ``load_state_dict`` copies into it itself)."""
    requantize(layer)

