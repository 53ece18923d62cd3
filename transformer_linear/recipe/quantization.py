"""How a recipe quantizes the Linear's three tensors: the one place that reads the recipe class.

:func:`quantization_spec` turns a recipe into a :class:`QuantizationSpec`: one
:class:`TensorQuantizer` per tensor role (``input``, ``weight``,
``grad_output``), as Transformer Engine's Float8Quantizer /
Float8CurrentScalingQuantizer / Float8BlockQuantizer / MXFP8Quantizer, without
tensor subclasses. A quantizer knows its data and scale dtypes, its blocks, its
margin, whether its scale comes from the layer's delayed-scaling state, how to
quantize (every recipe's result is a :class:`Quantized`), how a GEMM reads each
usage of that result and which ScalingType it resolves to. linear.py and
linear_ops.py ask the quantizers, never the recipe: a recipe whose quantizers the
kernels support is a new entry in ``_SPEC_BUILDERS`` here, or a ``recipe.CustomRecipe`` whose
factory returns them (no edit of the package at all). A subclass of a recipe class is built as
that class.

The quantizers and their results (:class:`TensorQuantizer`, :class:`Quantized`, re-exported here) are
recipe/tensor_quantizer.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.recipe import (
    BACKWARD_OVERRIDES,
    CUSTOM_RECIPE_ROLES,
    CurrentScaling,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8RowwiseScaling,
    HistoryConfig,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from transformer_linear.recipe.tensor_quantizer import (
    DATA_DTYPES,
    FP4_STORAGE_DTYPE,
    QUANTIZER_SCALE_DTYPES,
    Quantized,
    TensorQuantizer,
    flat,
    quantize_tensorwise,
    tensorwise_result,
)

__all__ = [
    "DATA_DTYPES",
    "FP4_STORAGE_DTYPE",
    "QUANTIZER_SCALE_DTYPES",
    "QuantizationSpec",
    "Quantized",
    "TensorQuantizer",
    "check_recipe",
    "is_recipe",
    "flat",
    "quantization_spec",
    "quantize_tensorwise",
    "tensorwise_result",
]


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
    """How a recipe quantizes the Linear's input, weight and grad_output.

    Each tensor has its own quantizer: the roles may differ in format, blocks and scaling. Only where
    the scales come from the layer's amax history must all three agree on that, and input and weight
    on their dtype and margin (the forward state updates their scales together); ``history`` then says
    how the scales are computed.

    Raises:
        TypeError: a role is not a TensorQuantizer, or ``history`` not a HistoryConfig.
        ValueError: ``scale_from_history`` differs across the roles, ``history`` is given without it
            (or missing with it), or input and weight taking scales from it differ in dtype or margin.
    """

    input: TensorQuantizer
    weight: TensorQuantizer
    grad_output: TensorQuantizer
    history: Optional[HistoryConfig] = None
    """Scales from the amax history: its length, how amax is computed from it, the first step's rule."""
    backward_override: Optional[str] = None
    """The recipe's ``backward_override`` (recipe.BACKWARD_OVERRIDES): None, the backward GEMMs read each
    operand quantized for them; ``"high_precision"``, they read the original input, weight and grad_output;
    ``"dequantized"``, the forward's quantized input and weight dequantized (:meth:`TensorQuantizer.dequantize`)
    and the original grad_output. See :attr:`backward_operands`."""

    def __post_init__(self) -> None:
        for role in ("input", "weight", "grad_output"):
            if not isinstance(getattr(self, role), TensorQuantizer):
                raise TypeError(f"QuantizationSpec: '{role}' must be a TensorQuantizer, got {getattr(self, role)!r}")
        from_history = {role: getattr(self, role).scale_from_history for role in ("input", "weight", "grad_output")}
        if len(set(from_history.values())) != 1:
            raise ValueError(
                "QuantizationSpec: 'scale_from_history' must be the same for input, weight and grad_output "
                f"(the layer updates their amax histories together), got {from_history}"
            )
        if self.history is not None and not isinstance(self.history, HistoryConfig):
            raise TypeError(f"QuantizationSpec: 'history' must be a recipe.HistoryConfig or None, got {self.history!r}")
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(
                "QuantizationSpec: 'backward_override' must be None, 'high_precision' or 'dequantized', "
                f"got {self.backward_override!r}"
            )
        if self.backward_override is not None and self.input.scale_from_history:
            # The backward would quantize no grad_output, so its amax history would never be recorded (TE too).
            raise ValueError("QuantizationSpec: 'backward_override' must be None where the scales come from the "
                             "amax history")
        if (self.history is not None) != self.input.scale_from_history:
            raise ValueError("QuantizationSpec: 'history' is given exactly where the scales come from the history")
        fwd = {(q.dtype, q.margin) for q in (self.input, self.weight)}
        if self.history is not None and len(fwd) > 1:
            # The forward state updates both scales in one pass, with one FP8 maximum and margin.
            raise ValueError(
                "QuantizationSpec: with scales from the amax history, input and weight must have the same dtype "
                f"and margin, got {self.input.dtype} / {self.input.margin} and "
                f"{self.weight.dtype} / {self.weight.margin}"
            )

    @property
    def scale_from_history(self) -> bool:
        """The scales come from the layer's delayed-scaling state (all three or none)."""
        return self.input.scale_from_history

    @property
    def backward_operands(self) -> str:
        """What the backward GEMMs (dgrad, wgrad) read: ``"quantized"`` (each operand in the usage its
        quantizer gives the GEMM, grad_output quantized too), ``"high_precision"`` (the original tensors,
        which forward saves) or ``"dequantized"`` (forward saves the rowwise usage it computed with, which
        backward dequantizes; grad_output is not quantized)."""
        return self.backward_override or "quantized"


def _tensorwise(recipe: DelayedScaling | CurrentScaling, scale_from_history: bool) -> QuantizationSpec:
    fmt = recipe.fp8_format
    fwd, bwd = (
        TensorQuantizer(d, [], torch.float32, False, margin=recipe.margin, scale_from_history=scale_from_history)
        for d in (fmt.fwd_dtype, fmt.bwd_dtype)
    )
    return QuantizationSpec(fwd, fwd, bwd, recipe.history if scale_from_history else None)


def _float8_block(recipe: Float8BlockScaling) -> QuantizationSpec:
    fmt, p2 = recipe.fp8_format, recipe.power_2_scale
    return QuantizationSpec(
        TensorQuantizer(fmt.fwd_dtype, list(recipe.x_block_shape), torch.float32, p2),
        TensorQuantizer(fmt.fwd_dtype, list(recipe.w_block_shape), torch.float32, p2),
        TensorQuantizer(fmt.bwd_dtype, list(recipe.grad_block_shape), torch.float32, p2),
    )


def _mxfp8(recipe: MXFP8BlockScaling) -> QuantizationSpec:
    fmt = recipe.fp8_format
    fwd, bwd = (
        TensorQuantizer(d, [1, 32], E8M0_DTYPE, False, recipe.e8m0_rounding) for d in (fmt.fwd_dtype, fmt.bwd_dtype)
    )
    return QuantizationSpec(fwd, fwd, bwd)


def _rowwise(recipe: Float8RowwiseScaling) -> QuantizationSpec:
    fmt, p2 = recipe.fp8_format, recipe.power_2_scale
    fwd, bwd = (TensorQuantizer(d, [1, 0], torch.float32, p2) for d in (fmt.fwd_dtype, fmt.bwd_dtype))
    return QuantizationSpec(fwd, fwd, bwd)


def _nvfp4(recipe: NVFP4BlockScaling) -> QuantizationSpec:
    """TE's NVFP4 quantizers: RHT on the wgrad operands' columnwise copies (input, grad_output), 16x16
    weight tiles, stochastic rounding of grad_output; each switch of the recipe turns one off."""
    rht = not recipe.disable_rht
    weight_block = [1, 16] if recipe.disable_2d_quantization else [16, 16]

    def fp4(block_shape: list[int], rht: bool = False, stochastic_rounding: bool = False) -> TensorQuantizer:
        return TensorQuantizer(recipe.fp4_format.fwd_dtype, block_shape, recipe.fp8_format.fwd_dtype, False,
                               rht=rht, stochastic_rounding=stochastic_rounding)

    return QuantizationSpec(
        fp4([1, 16], rht=rht),
        fp4(weight_block),
        fp4([1, 16], rht=rht, stochastic_rounding=not recipe.disable_stochastic_rounding),
    )


def _custom(recipe: CustomRecipe) -> QuantizationSpec:
    """The quantizers ``recipe.qfactory`` returns for the roles of CUSTOM_RECIPE_ROLES."""
    quantizers = []
    for role in CUSTOM_RECIPE_ROLES:
        quantizer = recipe.qfactory(role)
        if not isinstance(quantizer, TensorQuantizer):
            raise TypeError(
                f"CustomRecipe: qfactory({role!r}) must return a transformer_linear.TensorQuantizer, got {quantizer!r}"
            )
        quantizers.append(quantizer)
    from_history = [q.scale_from_history for q in quantizers]
    if len(set(from_history)) != 1:
        roles = ", ".join(f"{role}={flag}" for role, flag in zip(CUSTOM_RECIPE_ROLES, from_history))
        raise ValueError(
            f"CustomRecipe: 'scale_from_history' must be the same for every role (the layer updates their amax "
            f"histories together), got {roles}"
        )
    history = (recipe.history or HistoryConfig()) if from_history[0] else None
    return QuantizationSpec(*quantizers, history=history)


_SPEC_BUILDERS: dict[type, Callable[..., QuantizationSpec]] = {
    DelayedScaling: functools.partial(_tensorwise, scale_from_history=True),
    CurrentScaling: functools.partial(_tensorwise, scale_from_history=False),
    Float8BlockScaling: _float8_block,
    MXFP8BlockScaling: _mxfp8,
    Float8RowwiseScaling: _rowwise,
    NVFP4BlockScaling: _nvfp4,
    CustomRecipe: _custom,
}

# What the Linear runs without a recipe (high precision); only its dtypes are read.
NO_QUANTIZATION = _tensorwise(CurrentScaling(), scale_from_history=False)


def _builder(recipe: object) -> Optional[Callable[..., QuantizationSpec]]:
    """The spec builder of ``recipe``'s class or of the nearest recipe class it derives from (None: none)."""
    for cls in type(recipe).__mro__:
        builder = _SPEC_BUILDERS.get(cls)
        if builder is not None:
            return builder
    return None


def _unknown_recipe(where: str, recipe: object) -> TypeError:
    names = ", ".join(t.__name__ for t in _SPEC_BUILDERS)
    return TypeError(f"{where}: 'recipe' must be one of {names} (or a subclass) or None, got {recipe!r}")


def is_recipe(obj: object) -> bool:
    """Whether ``obj`` is a recipe this module builds quantizers for (a subclass of one included)."""
    return obj is not None and _builder(obj) is not None


def check_recipe(where: str, recipe: object) -> None:
    """Raise unless ``recipe`` is None or a recipe this module builds quantizers for.

    Raises:
        TypeError: naming ``where`` and the recipes that have quantizers.
    """
    if recipe is not None and _builder(recipe) is None:
        raise _unknown_recipe(where, recipe)


def quantization_spec(recipe: Recipe) -> QuantizationSpec:
    """The :class:`QuantizationSpec` of ``recipe`` (a subclass of a recipe class is built as that class).

    Raises:
        TypeError: ``recipe`` has no quantizers (see check_recipe); a CustomRecipe's factory returned
            something other than a TensorQuantizer (the message names the role).
        ValueError: a CustomRecipe's quantizers differ in ``scale_from_history``.
    """
    builder = _builder(recipe)
    if builder is None:
        raise _unknown_recipe("quantization_spec", recipe)
    spec = builder(recipe)
    override = recipe.backward_override  # a field of every recipe class, as in TE
    return spec if override is None else dataclasses.replace(spec, backward_override=override)
