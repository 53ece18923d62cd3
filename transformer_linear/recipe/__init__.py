"""FP8 recipes: which formats to use and how scales are chosen.

Names follow TransformerEngine (``recipe.Format.HYBRID``,
``recipe.DelayedScaling``) so TE users feel at home. Recipes are frozen
dataclasses validated at construction, so a bad value fails where it is
written rather than deep inside a forward pass.

Each built-in recipe also has a short name (``"delayed"``, ``"mxfp8"``, ...):
:func:`from_name` builds it, :func:`available_names` lists them. The CLI,
``numerics.compare``, the benchmarks and the tests all build recipes from that
one table.

A recipe's quantizers (recipe/quantization.py) each name a scaling kind, the behaviour of one way of
scaling a tensor (:class:`ScalingKind`, recipe/kind.py); :func:`register_scaling_kind` adds one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from transformer_linear.formats.block_scaling import E8M0_ROUNDINGS
from transformer_linear.recipe.kind import (
    GatheredShard,
    Quantized,
    QuantizerFields,
    ScalingKind,
    register_scaling_kind,
    scaling_kind,
    no_usages,
    scaling_kind_names,
    stack_experts,
    stacked,
)

__all__ = [
    "CUSTOM_RECIPE_ROLES",
    "CurrentScaling",
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Format",
    "GatheredShard",
    "HistoryConfig",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "BACKWARD_OVERRIDES",
    "Quantized",
    "QuantizerFields",
    "Recipe",
    "ScalingKind",
    "available_names",
    "from_name",
    "no_usages",
    "register_scaling_kind",
    "scaling_kind",
    "scaling_kind_names",
    "stack_experts",
    "stacked",
]


class Format(str, enum.Enum):
    """FP8 formats of the forward tensors (input, weight) and of the gradients."""

    E4M3 = "E4M3"
    """e4m3 everywhere."""
    HYBRID = "HYBRID"
    """e4m3 forward, e5m2 gradients (their range matters more than precision)."""
    E2M1 = "E2M1"
    """FP4 e2m1 everywhere (NVFP4BlockScaling's ``fp4_format``; no FP8 recipe takes it)."""

    @property
    def fwd_dtype(self) -> torch.dtype:
        """The dtype of the quantized input and weight."""
        return torch.float4_e2m1fn_x2 if self is Format.E2M1 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """The dtype of the quantized grad_output."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e5m2 if self is Format.HYBRID else torch.float8_e4m3fn


_FP8_FORMATS = (Format.E4M3, Format.HYBRID)


def _check_format(cls: str, fp8_format: object, name: str = "fp8_format", allowed=_FP8_FORMATS) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{cls}: '{name}' must be a recipe.Format, got {fp8_format!r}")
    if fp8_format not in allowed:
        expected = " or ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(f"{cls}: '{name}' must be {expected}, got Format.{fp8_format.name}")


def _check_ints(recipe: object) -> None:
    """Store every ``int`` field of a recipe dataclass as a Python int.

    Integral types (``np.int64``, a 0-dim integer tensor: anything with
    ``__index__``) are accepted and converted, so the recipe hashes, compares
    and guards under ``torch.compile`` like one built from ints; bools are
    rejected where an integer is meant.

    Raises:
        TypeError: naming the field, for a bool or a non-integral value.
    """
    cls = type(recipe).__name__
    for field in dataclasses.fields(recipe):
        if field.type not in (int, "int"):
            continue
        value = getattr(recipe, field.name)
        try:
            index = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            index = None
        if index is None:
            raise TypeError(f"{cls}: '{field.name}' must be an integer, got {value!r}")
        object.__setattr__(recipe, field.name, index)


def _check_margin(cls: str, margin: object) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin < 127:
        raise ValueError(f"{cls}: 'margin' must be an integer in [0, 127), got {margin!r}")


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
"""Transformer Engine's ``backward_override`` values: None (the backward GEMMs in FP8/FP4, each operand
quantized for its GEMM), ``"high_precision"`` (dgrad and wgrad in high precision from the original input,
weight and grad_output), ``"dequantized"`` (dgrad and wgrad in high precision from the forward's quantized
input and weight, dequantized, and the unquantized grad_output)."""


def _check_backward_override(cls: str, value: object) -> None:
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(f"{cls}: 'backward_override' must be None, 'high_precision' or 'dequantized', got {value!r}")


AMAX_COMPUTE_ALGOS = ("max", "most_recent")
"""How a delayed scale reads its amax history: over all of it, or its newest entry."""


def _check_history(cls: str, amax_history_len: int, amax_compute_algo: object, first_step_just_in_time: object) -> None:
    if amax_history_len < 1:
        raise ValueError(f"{cls}: 'amax_history_len' must be a positive integer, got {amax_history_len!r}")
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"{cls}: 'amax_compute_algo' must be 'max' or 'most_recent', got {amax_compute_algo!r}")
    if not isinstance(first_step_just_in_time, bool):
        raise TypeError(f"{cls}: 'first_step_just_in_time' must be a bool, got {first_step_just_in_time!r}")


@dataclass(frozen=True)
class HistoryConfig:
    """How scales taken from the layer's amax history are computed (delayed scaling).

    What the delayed-scaling state (delayed_scaling.py) reads of a recipe whose
    quantizers take their scale from the history (``scale_from_history``):
    :attr:`DelayedScaling.history`, or the ``history`` of a :class:`CustomRecipe`.

    Attributes:
        amax_history_len: number of past amaxes kept per tensor.
        amax_compute_algo: ``"max"`` (over the history) or ``"most_recent"``.
        first_step_just_in_time: a tensor whose history holds no amax yet is
            quantized with a scale from its own amax (see DelayedScaling).
    """

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    first_step_just_in_time: bool = True

    def __post_init__(self) -> None:
        _check_ints(self)
        _check_history("HistoryConfig", self.amax_history_len, self.amax_compute_algo, self.first_step_just_in_time)


@dataclass(frozen=True)
class DelayedScaling:
    """Scales from a history of past amaxes (TE's default recipe).

    Forward quantizes with the scale computed from earlier steps and records
    this step's amax in the same pass; afterwards the history rolls and the
    scale becomes ``fp8_max / amax / 2^margin`` where amax is the history's
    max (or its most recent entry). The scale is kept when amax is 0 or
    non-finite.

    Attributes:
        margin: power-of-two head room of the scale.
        fp8_format: the formats of forward tensors and gradients.
        amax_history_len: number of past amaxes kept per tensor.
        amax_compute_algo: ``"max"`` (over the history) or ``"most_recent"``.
        first_step_just_in_time: a tensor whose history holds no amax yet
            (the first step) is quantized with a scale from its own amax,
            all-reduced over the amax-reduction group first, so the first
            step does not depend on the data's magnitude (gradients of a
            loss scaled by 2^k are 2^k times those of the unscaled loss).
            False restores TransformerEngine's behaviour: the first step
            quantizes with the initial scale 1 (for bitwise comparisons with TE).
        backward_override: only None, as in TE (grad_output's amax history is recorded by its quantize).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    first_step_just_in_time: bool = True
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_ints(self)
        _check_backward_override("DelayedScaling", self.backward_override)
        if self.backward_override is not None:
            raise ValueError(
                "DelayedScaling: 'backward_override' must be None (as in Transformer Engine: grad_output's amax "
                f"history is recorded by its quantize), got {self.backward_override!r}"
            )
        _check_margin("DelayedScaling", self.margin)
        _check_format("DelayedScaling", self.fp8_format)
        _check_history("DelayedScaling", self.amax_history_len, self.amax_compute_algo, self.first_step_just_in_time)

    @property
    def history(self) -> HistoryConfig:
        """The amax-history knobs, as the delayed-scaling state reads them."""
        return HistoryConfig(self.amax_history_len, self.amax_compute_algo, self.first_step_just_in_time)


@dataclass(frozen=True)
class CurrentScaling:
    """Stateless scaling: each tensor's scale comes from its own amax, per call.

    Attributes:
        fp8_format: the formats of forward tensors and gradients.
        margin: power-of-two head room of the scale.
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_ints(self)
        _check_backward_override("CurrentScaling", self.backward_override)
        _check_format("CurrentScaling", self.fp8_format)
        _check_margin("CurrentScaling", self.margin)


# ---------------------------------------------------------------------------
# Block-scaled recipes (one scale per block of a tensor; quantization.py says
# how the Linear applies each).
# ---------------------------------------------------------------------------

Float8CurrentScaling = CurrentScaling
"""TransformerEngine's name for :class:`CurrentScaling`."""

# block_scaling_dim (TE's values) -> block shape: 1 -> 1x128 tiles, 2 -> 128x128 blocks.
_BLOCK_SCALING_DIMS = {1: (1, 128), 2: (128, 128)}


def _check_bool(cls: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{cls}: '{name}' must be a bool, got {value!r}")


def _check_block_dim(cls: str, name: str, value: object, allowed: tuple[int, ...]) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{cls}: '{name}' must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class Float8BlockScaling:
    """DeepSeek-V3 / DeepGEMM block scaling (TE ``Float8BlockScaling``).

    Activations and gradients get one scale per 1x128 tile, weights one per
    128x128 block; each scale is ``fp8_max / amax`` of its block (rounded down
    to a power of two with ``power_2_scale``).

    Attributes:
        fp8_format: the formats of forward tensors and gradients.
        x_block_scaling_dim: 1 for 1x128 tiles, 2 for 128x128 blocks (input).
        w_block_scaling_dim: the same for the weight.
        grad_block_scaling_dim: the same for grad_output.
        power_2_scale: round every block scale down to a power of two.
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        cls = "Float8BlockScaling"
        _check_backward_override(cls, self.backward_override)
        _check_format(cls, self.fp8_format)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_block_dim(cls, name, getattr(self, name), (1, 2))
        if self.x_block_scaling_dim == 2 and self.grad_block_scaling_dim == 2:
            # Each GEMM needs one 1x128 operand (DeepGEMM's and cuBLAS's block GEMMs).
            raise ValueError(f"{cls}: 'x_block_scaling_dim' and 'grad_block_scaling_dim' cannot both be 2")
        _check_bool(cls, "power_2_scale", self.power_2_scale)

    @property
    def x_block_shape(self) -> tuple[int, int]:
        """Block shape of the input's scales."""
        return _BLOCK_SCALING_DIMS[self.x_block_scaling_dim]

    @property
    def w_block_shape(self) -> tuple[int, int]:
        """Block shape of the weight's scales."""
        return _BLOCK_SCALING_DIMS[self.w_block_scaling_dim]

    @property
    def grad_block_shape(self) -> tuple[int, int]:
        """Block shape of grad_output's scales."""
        return _BLOCK_SCALING_DIMS[self.grad_block_scaling_dim]


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """OCP MXFP8 (TE ``MXFP8BlockScaling``): one E8M0 scale per 1x32 block.

    The scale_inv of a block is ``2^ceil(log2(amax / fp8_max))`` by default,
    ``2^(floor(log2(amax)) - floor(log2(fp8_max)))`` with ``e8m0_rounding="floor"``
    (reference.e8m0_exponent).

    Attributes:
        fp8_format: the formats of forward tensors and gradients.
        e8m0_rounding: "ceil" (TE's and cuBLAS's rule: nothing saturates;
            torchao's ``ScaleCalculationMode.RCEIL``) or "floor" (the OCP MX
            spec's rule: a block's largest values may saturate; torchao's
            ``ScaleCalculationMode.FLOOR``, its default).
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
    """

    fp8_format: Format = Format.E4M3
    e8m0_rounding: str = "ceil"
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_backward_override("MXFP8BlockScaling", self.backward_override)
        _check_format("MXFP8BlockScaling", self.fp8_format)
        if self.e8m0_rounding not in E8M0_ROUNDINGS:
            raise ValueError(f"MXFP8BlockScaling: 'e8m0_rounding' must be 'ceil' or 'floor', got {self.e8m0_rounding!r}")

    @property
    def block_shape(self) -> tuple[int, int]:
        """Block shape of every operand's scales."""
        return (1, 32)


@dataclass(frozen=True)
class Float8RowwiseScaling:
    """torchao's "rowwise" scaling: one scale per row of each GEMM operand.

    Attributes:
        fp8_format: the formats of forward tensors and gradients.
        power_2_scale: round every row scale down to a power of two.
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_backward_override("Float8RowwiseScaling", self.backward_override)
        _check_format("Float8RowwiseScaling", self.fp8_format)
        _check_bool("Float8RowwiseScaling", "power_2_scale", self.power_2_scale)


@dataclass(frozen=True)
class NVFP4BlockScaling:
    """NVFP4 (TE ``NVFP4BlockScaling``): FP4 E2M1 data, one E4M3 scale per 16 elements, one float32
    global scale per tensor (formats/nvfp4.py).

    As in Transformer Engine: the weight gets one scale per 16x16 tile (2D), so its rowwise and
    columnwise copies are each other's transpose; the wgrad operands (the columnwise copies of the input
    and grad_output) are quantized after a random Hadamard transform of each 16-element block along the
    batch dimension (the transforms cancel in the GEMM); grad_output is rounded stochastically (unbiased
    gradients), the input and weight to nearest. TE reads its switches' defaults from the environment
    (``NVTE_NVFP4_DISABLE_RHT`` ...); here they default to False and are set as fields.

    Stochastic rounding draws one seed per quantize from torch's default CPU generator
    (``ops.nvfp4.sr_seed``, a custom op, so eager and ``torch.compile`` draw the same seeds in the same
    order): the same ``torch.manual_seed`` reproduces a run, compiled or not.

    Attributes:
        fp4_format: the data format; only ``Format.E2M1``.
        fp8_format: the block scales' format; only ``Format.E4M3``.
        disable_rht: no Hadamard transform of the wgrad operands.
        disable_stochastic_rounding: round grad_output to nearest too.
        disable_2d_quantization: 1x16 weight scales (the weight's columnwise copy then quantized on its own).
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
    """

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        cls = "NVFP4BlockScaling"
        _check_backward_override(cls, self.backward_override)
        _check_format(cls, self.fp4_format, "fp4_format", (Format.E2M1,))
        _check_format(cls, self.fp8_format, "fp8_format", (Format.E4M3,))
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool(cls, name, getattr(self, name))


CUSTOM_RECIPE_ROLES = ("linear_input", "linear_weight", "linear_grad_output")
"""The roles a :class:`CustomRecipe`'s factory is asked for, in the order of QuantizationSpec's fields
(input, weight, grad_output): Transformer Engine's role names. The Linear quantizes no other tensor, so
TE's ``"linear_output"`` and ``"linear_grad_input"`` are never asked for."""


@dataclass(frozen=True, eq=False)
class CustomRecipe:
    """A recipe defined by its quantizers (Transformer Engine's ``CustomRecipe``).

    ``qfactory(role)`` returns the ``transformer_linear.TensorQuantizer`` of a
    tensor role, one of :data:`CUSTOM_RECIPE_ROLES`; the roles may differ in
    format, blocks and scaling (e.g. 128x128 block-scaled weights with
    tensorwise activations), as long as every GEMM of the Linear pairs
    scalings ``ops.fp8_gemm_scalings`` lists. The factory is called each time
    the Linear builds its quantizers, so it should be a pure function of the
    role; it is compared by identity, so two recipes with the same factory
    (and history) are equal and hash alike, and ``torch.compile`` guards on
    it cheaply.

    Attributes:
        qfactory: ``role -> TensorQuantizer``.
        history: where the quantizers take their scale from the layer's amax
            history (``scale_from_history=True``, all three or none): how the
            history computes it; None: ``HistoryConfig()``'s defaults.
        backward_override: None, ``"high_precision"`` or ``"dequantized"`` (:data:`BACKWARD_OVERRIDES`):
            the precision of the backward GEMMs (TE's field; TE reads its default from ``NVTE_BACKWARD_OVERRIDE``).
            Only None where the scales come from the amax history.
    """

    qfactory: Callable[[str], Any]
    history: Optional[HistoryConfig] = None
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_backward_override("CustomRecipe", self.backward_override)
        if not callable(self.qfactory):
            raise TypeError(
                f"CustomRecipe: 'qfactory' must be callable (role -> TensorQuantizer), got {self.qfactory!r}"
            )
        if self.history is not None and not isinstance(self.history, HistoryConfig):
            raise TypeError(f"CustomRecipe: 'history' must be a recipe.HistoryConfig or None, got {self.history!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CustomRecipe):
            return NotImplemented
        return (
            self.qfactory is other.qfactory
            and self.history == other.history
            and self.backward_override == other.backward_override
        )

    def __hash__(self) -> int:
        return hash((id(self.qfactory), self.history, self.backward_override))


Recipe = Union[
    DelayedScaling,
    CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    Float8RowwiseScaling,
    NVFP4BlockScaling,
    CustomRecipe,
]
"""Every recipe ``tl.Linear``, ``tl.autocast`` and ``tl.convert_to_fp8`` accept."""


# The built-in recipes by name: the one table the CLI, numerics.compare, the benchmarks and the tests use.
_BUILT_IN: dict[str, Callable[..., Recipe]] = {
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "delayed-e4m3": functools.partial(DelayedScaling, fp8_format=Format.E4M3),
    "current-e4m3": functools.partial(CurrentScaling, fp8_format=Format.E4M3),
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "rowwise": Float8RowwiseScaling,
    "nvfp4": NVFP4BlockScaling,
}


def available_names() -> tuple[str, ...]:
    """The names :func:`from_name` knows, in the order the CLI lists them."""
    return tuple(_BUILT_IN)


def from_name(name: str, **options: Any) -> Recipe:
    """The built-in recipe called ``name``, e.g. ``from_name("mxfp8")`` or ``from_name("delayed", margin=1)``.

    Args:
        name: one of :func:`available_names` (case and surrounding spaces ignored):
            ``"delayed"`` / ``"current"`` (HYBRID formats) and their ``"-e4m3"``
            variants, ``"block"`` (Float8BlockScaling), ``"mxfp8"``, ``"rowwise"``, ``"nvfp4"``
            (NVFP4BlockScaling).
        **options: fields of the recipe's dataclass that replace its defaults
            (validated like any recipe's).

    Raises:
        TypeError: ``name`` is not a string, or an option is not a field of the recipe.
        ValueError: an unknown name (the message lists the known ones), or a bad option value.
    """
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {name!r}")
    factory = _BUILT_IN.get(name.strip().lower())
    if factory is None:
        raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(_BUILT_IN)}")
    return factory(**options)
