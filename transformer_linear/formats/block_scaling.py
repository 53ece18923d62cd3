"""Scalings of FP8 GEMM operands: the scale layouts, the pairs fp8_gemm runs, resolving a call's pair.

One low module for what the ops (``ops``, ``ops.block``), their backends
(``ops.triton``, ``ops.gemm_block_cuda``) and the oracle
(``reference``) all need to agree on: which scaled_mm ScalingType a scale
tensor stands for, with which blocks; the checks of a blockwise quantize's
arguments; the shapes of its outputs. A GEMM's scalings are resolved once,
by :func:`resolve_gemm_scalings` in ``ops.fp8_gemm``, and the result
(:class:`GemmScalings`) is passed down to the kernels, never worked out again.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from transformer_linear.formats.checks import check_fp8_dtype, check_hp_dtype, check_tensor, gemm_out_shape
from transformer_linear.formats.dtypes import E8M0_DTYPE, SCALE_DTYPES

__all__ = [
    "E8M0_ROUNDINGS",
    "BlockQuantizeOutput",
    "GemmScalings",
    "blockwise_outputs",
    "check_quantize_blockwise_args",
    "check_scale_dtype",
    "columnwise_block_shape",
    "fp8_gemm_scalings",
    "k_block_width",
    "resolve_gemm_scalings",
    "scale_layouts",
]

E8M0_ROUNDINGS = ("ceil", "floor")
"""How an E8M0 block scale rounds (reference.e8m0_exponent)."""

# The float32 scalings a block-scaled GEMM mixes: every K-block width among them (K, K, 128, 128)
# divides or covers the others, which is all the CPU and Triton kernels need of a pair.
_MIXABLE = ("TensorWise", "RowWise", "BlockWise1x128", "BlockWise128x128")

# The (a, b) ScalingType pairs fp8_gemm runs. First the pairs of torch's scaled_mm and cuBLASLt, then
# the mixed float32 pairs the package's kernels run (a recipe whose roles differ in scaling: tensorwise
# activations with 128x128 weights, ...; cuBLASLt takes none of them). The order matters: where a shape
# fits several pairs, the first one is the resolution, so the mixed pairs come last.
_GEMM_SCALING_PAIRS = (
    ("TensorWise", "TensorWise"),
    ("RowWise", "RowWise"),
    ("BlockWise1x128", "BlockWise128x128"),
    ("BlockWise128x128", "BlockWise1x128"),
    ("BlockWise1x128", "BlockWise1x128"),
    ("BlockWise1x32", "BlockWise1x32"),
    *(
        pair
        for i, first in enumerate(_MIXABLE)
        for second in _MIXABLE[i + 1 :]
        if {first, second} != {"BlockWise1x128", "BlockWise128x128"}  # scaled_mm's pairs, above
        for pair in ((first, second), (second, first))
    ),
)

# Block width along K of the ScalingTypes whose blocks do not cover a whole row.
_K_BLOCK_WIDTHS = {"BlockWise1x128": 128, "BlockWise128x128": 128, "BlockWise1x32": 32}


def fp8_gemm_scalings() -> tuple[tuple[str, str], ...]:
    """The (a, b) scalings :func:`fp8_gemm` accepts; anything else is a ValueError.

    Each operand's scaling is read from its scale_inv (R: the operand's rows,
    K: the inner dimension), following torch.nn.functional.scaled_mm's ScalingType:

    ================  ==========================  ==================  =========
    ScalingType       scale_inv shape             dtype               block
    ================  ==========================  ==================  =========
    TensorWise        1 element                   float32             R x K
    RowWise           (R, 1)                      float32             1 x K
    BlockWise1x128    (R, ceil(K/128))            float32             1 x 128
    BlockWise128x128  (ceil(R/128), ceil(K/128))  float32             128 x 128
    BlockWise1x32     (R, ceil(K/32))             float8_e8m0fnu      1 x 32
    ================  ==========================  ==================  =========

    Where a shape fits several rows (R = 1, K <= 128) they mean the same blocks.

    Besides the pairs of torch's scaled_mm (both operands alike, or 1x128 with 128x128), the float32
    ScalingTypes TensorWise, RowWise, BlockWise1x128 and BlockWise128x128 pair with each other either
    way round (e.g. (TensorWise, BlockWise128x128)): each K-block's partial sum is promoted with the
    scales of the two operands' blocks that cover it. cuBLASLt runs only its own pairs
    (csrc/common/cublaslt_block_pairs.cpp); the others run the Triton kernel on CUDA.
    """
    return _GEMM_SCALING_PAIRS


def k_block_width(scaling: str) -> int:
    """The width along K of a ScalingType's blocks; 1 for those whose blocks cover whole rows
    (TensorWise, RowWise), which any K fills."""
    return _K_BLOCK_WIDTHS.get(scaling, 1)


def scale_layouts(
    dtype: torch.dtype, rows: int, cols: int
) -> dict[str, tuple[Optional[tuple[int, ...]], tuple[int, int]]]:
    """The scaled_mm ScalingTypes a scale_inv of ``dtype`` can stand for on a (rows, cols) operand:
    ScalingType -> (the scale_inv's shape, the block); TensorWise's shape is None (any 1-element
    scale of at most 2 dims). The table of :func:`fp8_gemm_scalings`.

    ``rows`` and ``cols`` may be symbolic (torch.SymInt): nothing here branches on them.
    """
    block_rows, block_cols = torch.sym_max(rows, 1), torch.sym_max(cols, 1)
    if dtype == E8M0_DTYPE:
        return {"BlockWise1x32": ((rows, -(-cols // 32)), (1, 32))}
    if dtype != torch.float32:
        return {}
    c128 = -(-cols // 128)
    return {
        "TensorWise": (None, (block_rows, block_cols)),
        "RowWise": ((rows, 1), (1, block_cols)),
        "BlockWise1x128": ((rows, c128), (1, 128)),
        "BlockWise128x128": ((-(-rows // 128), c128), (128, 128)),
    }


class GemmScalings(NamedTuple):
    """The resolved scalings of an fp8_gemm call: each operand's ScalingType and its (rows, cols) block."""

    a_scaling: str
    a_block: tuple[int, int]
    b_scaling: str
    b_block: tuple[int, int]

    @property
    def tensorwise(self) -> bool:
        """One scale per operand (the tensorwise GEMM ops); otherwise a block-scaled GEMM."""
        return (self.a_scaling, self.b_scaling) == ("TensorWise", "TensorWise")


def check_scale_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    """A TypeError unless ``dtype`` is a block scale dtype (float32 or E8M0). The kernels read E8M0 as its
    uint8 bits, so a uint8 scale would pass their checks: 2 read as 2^-125, 0xFF as NaN."""
    if dtype not in SCALE_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be torch.float32 or torch.float8_e8m0fnu, got {dtype}")


def _shape_conditions(scale_inv: torch.Tensor, expected: Optional[tuple]) -> list:
    """The conditions (bools, or SymBools while tracing) for ``scale_inv`` to have the ``expected`` shape
    of scale_layouts (None: 1 element, at most 2 dims)."""
    if expected is None:
        return [scale_inv.dim() <= 2, scale_inv.numel() == 1]
    if scale_inv.dim() != len(expected):
        return [False]
    return [size == want for size, want in zip(scale_inv.shape, expected)]


def _holds_for_traced_sizes(c) -> bool:
    """A condition's value for the sizes being traced, read from their hints (no guard); an unbacked
    size has none, so the condition may hold."""
    if isinstance(c, bool):
        return c
    if torch.compiler.is_dynamo_compiling():
        # Dynamo (fp8_gemm called in compiled code) reads no hints; its guard costs at most a recompile.
        return guard_or_false(c)
    hint = c.node.hint
    return True if hint is None else bool(hint)


def _negated(c):
    return not c if isinstance(c, bool) else torch.sym_not(c)


def _match(conditions: list) -> Optional[bool]:
    """True where the conditions hold for every size, None where they hold for the sizes being traced
    but depend on them (to be checked at run time), False otherwise. Concrete sizes give True or False.

    Under torch.compile and torch.export the row count is symbolic and so is a row-block count
    (ceil(M / 128)); asking whether it equals the scale's rows, or 1, would guard (specialize the graph
    or fail export) on a relation that holds or not depending on M. So no condition is evaluated with
    a guard here.
    """
    if all(statically_known_true(c) for c in conditions):
        return True
    if any(statically_known_true(_negated(c)) for c in conditions):
        return False
    return None if all(_holds_for_traced_sizes(c) for c in conditions) else False


def resolve_gemm_scalings(
    a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor
) -> GemmScalings:
    """(a's ScalingType, a's block, b's ScalingType, b's block) of an fp8_gemm call.

    With concrete sizes the first pair of fp8_gemm_scalings whose shapes match. With symbolic ones
    (tracing) the first pair that matches for every size (a 1x128 scale of an operand contracting over
    M rows matches BlockWise1x128 for any M, RowWise only while M <= 128: the same blocks then); failing
    that, the first pair that matches the traced sizes, its shapes checked at run time (torch._check).
    So a traced graph serves every batch size without guarding on the row-block count.

    Raises:
        TypeError: an argument is not a tensor or not on a's device.
        ValueError: the pair is not in fp8_gemm_scalings (the message names both).
    """
    op = "fp8_gemm"
    for name, t in (("a", a), ("a_scale_inv", a_scale_inv), ("b", b), ("b_scale_inv", b_scale_inv)):
        check_tensor(op, name, t, like=None if name == "a" else a, like_name="a")
    gemm_out_shape(a, b)
    check_fp8_dtype(op, "a", a.dtype)
    check_fp8_dtype(op, "b", b.dtype)
    check_scale_dtype(op, "a_scale_inv", a_scale_inv.dtype)
    check_scale_dtype(op, "b_scale_inv", b_scale_inv.dtype)
    tensors = (a, a_scale_inv, b, b_scale_inv)
    key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    if not torch.compiler.is_compiling() and all(type(size) is int for _, shape in key for size in shape):
        # Concrete sizes: the answer depends on dtypes and shapes alone, and the same few recur every step.
        # (Not while torch.compile traces the caller: there the cache would be graph state.)
        found = _CONCRETE_SCALINGS.get(key)
        if found is None:
            found = _resolve(op, *tensors)
            if len(_CONCRETE_SCALINGS) >= 4096:
                _CONCRETE_SCALINGS.clear()
            _CONCRETE_SCALINGS[key] = found
        return found
    return _resolve(op, *tensors)


_CONCRETE_SCALINGS: dict[tuple, GemmScalings] = {}


def _resolve(
    op: str, a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor
) -> GemmScalings:
    """resolve_gemm_scalings after its argument checks."""

    def layouts(t: torch.Tensor, operand: torch.Tensor) -> dict[str, tuple[list, Optional[bool], tuple[int, int]]]:
        return {
            name: (conditions, _match(conditions), block)
            for name, (shape, block) in scale_layouts(t.dtype, *operand.shape).items()
            for conditions in (_shape_conditions(t, shape),)
        }

    a_types, b_types = layouts(a_scale_inv, a), layouts(b_scale_inv, b)
    for acceptable in ((True,), (True, None)):
        for a_type, b_type in _GEMM_SCALING_PAIRS:
            a_found, b_found = a_types.get(a_type), b_types.get(b_type)
            if a_found and b_found and a_found[1] in acceptable and b_found[1] in acceptable:
                for (conditions, matched, _), name, t_type in (
                    (a_found, "a_scale_inv", a_type),
                    (b_found, "b_scale_inv", b_type),
                ):
                    for c in conditions if matched is None else ():
                        torch._check(c, lambda name=name, t_type=t_type: f"{op}: '{name}' does not have {t_type}'s shape")
                return GemmScalings(a_type, a_found[2], b_type, b_found[2])

    def describe(t, found):
        names = [name for name, (_, matched, _) in found.items() if matched]
        return f"{list(t.shape)} {t.dtype} ({' or '.join(names) if names else 'no scaling'})"

    raise ValueError(
        f"{op}: unsupported scaling combination: 'a_scale_inv' {describe(a_scale_inv, a_types)} for 'a' of shape "
        f"{list(a.shape)}, 'b_scale_inv' {describe(b_scale_inv, b_types)} for 'b' of shape {list(b.shape)}; "
        f"supported (a, b): {', '.join(f'({x}, {y})' for x, y in _GEMM_SCALING_PAIRS)} "
        "(see ops.fp8_gemm_scalings)"
    )


# ---------------------------------------------------------------------------
# Blockwise quantize: its arguments and outputs (the CPU op, the Triton kernel and the oracle share them)
# ---------------------------------------------------------------------------

_INT64_MAX = 2**63 - 1


def check_quantize_blockwise_args(
    x: torch.Tensor, dtype: torch.dtype, block_shape: object, scale_dtype: torch.dtype, e8m0_rounding: str
) -> tuple[int, int]:
    """Validate quantize_blockwise's arguments; returns (bm, bk).

    Raises:
        TypeError: ``x`` is not a tensor; a dtype is not one the kernels take.
        ValueError: ``x`` is not 2-D; a bad block shape or E8M0 rounding.
    """
    op = "quantize_blockwise"
    check_tensor(op, "x", x)
    check_hp_dtype(op, "x", x.dtype)
    if x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D (M, K), got shape {list(x.shape)}")
    check_fp8_dtype(op, "dtype", dtype)
    check_scale_dtype(op, "scale_dtype", scale_dtype)
    if (
        not isinstance(block_shape, (tuple, list))
        or len(block_shape) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= _INT64_MAX for v in block_shape)
    ):
        # The bound: the op's block_shape is a SymInt[] (int64); the dispatcher's message would not name it.
        raise ValueError(
            f"{op}: argument 'block_shape' must be two ints in [1, 2**63 - 1] (rows, cols), got {block_shape!r}"
        )
    if e8m0_rounding not in E8M0_ROUNDINGS:
        raise ValueError(f"{op}: argument 'e8m0_rounding' must be 'ceil' or 'floor', got {e8m0_rounding!r}")
    return int(block_shape[0]), int(block_shape[1])


def columnwise_block_shape(block_shape: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """The block of the columnwise (transposed, (K, M)) copy: the same block applied to x^T,
    except that a block covering whole rows of x (bk >= K, rowwise scaling) covers whole
    rows of x^T."""
    bm, bk = block_shape
    return (bm, torch.sym_max(rows, 1)) if bk >= cols else (bm, bk)


def blockwise_outputs(
    x: torch.Tensor, dtype: torch.dtype, block_shape, scale_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate (q, scale_inv, q_t, scale_inv_t) of a blockwise quantize; unrequested ones are empty."""
    m, k = x.shape
    empty = x.new_empty(0, dtype=dtype)
    empty_scale = x.new_empty((0, 0), dtype=scale_dtype)

    def grid(rows, cols, block):
        return (-(-rows // block[0]), -(-cols // block[1]))

    q = x.new_empty((m, k), dtype=dtype) if rowwise else empty
    s = x.new_empty(grid(m, k, block_shape), dtype=scale_dtype) if rowwise else empty_scale
    if columnwise:
        # The columnwise block only where asked for: it compares the block with the row length, which
        # for a transpose quantized on its own (rows of M, the batch) would guard on M while tracing.
        q_t = x.new_empty((k, m), dtype=dtype)
        s_t = x.new_empty(grid(k, m, columnwise_block_shape(block_shape, m, k)), dtype=scale_dtype)
    else:
        q_t, s_t = empty.clone(), empty_scale.clone()
    return q, s, q_t, s_t


class BlockQuantizeOutput(NamedTuple):
    """The outputs of one blockwise quantize pass (unrequested tensors are empty)."""

    data: torch.Tensor
    """FP8 (M, K)."""
    scale_inv: torch.Tensor
    """(ceil(M / bm), ceil(K / bk)) float32 or float8_e8m0fnu."""
    data_t: torch.Tensor
    """FP8 (K, M): x^T quantized with its own blocks (columnwise_block_shape)."""
    scale_inv_t: torch.Tensor
    """The scales of data_t."""
