"""Block-scaled FP8 ops: blockwise quantize, and the scaling inference and kernel of block-scaled GEMMs.

A scale per block of the tensor instead of one per tensor: 1x128 / 128x128
tiles (DeepSeek-V3, TE ``Float8BlockScaling``), 1x32 blocks with E8M0 scales
(OCP MXFP8) and one scale per row (torchao's rowwise). Each op is a
``torch.library`` custom op with a fake implementation; CPU tensors run the
extension's kernels, CUDA tensors the Triton kernels of
``transformer_linear.triton`` (block-scaled GEMMs: cuBLASLt's block-scaled
matmul where the GPU and build have it, see ``_block_gemm_cuda``), each
registered for its device. ``ops.fp8_gemm`` routes block scales here (through
the private ``_fp8_gemm_blockwise*`` functions, which take the blocks
``resolve_gemm_scalings`` found); the public functions are re-exported by ``ops``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from transformer_linear import _C, _block_gemm_cuda
from transformer_linear._checks import (
    check_fp8_dtype,
    check_hp_dtype,
    check_same_device,
    check_scale_values,
    check_tensor,
    gemm_out_shape,
)
from transformer_linear._tensor import desc, stream_for
from transformer_linear.reference import E8M0_DTYPE, E8M0_ROUNDINGS, SCALE_DTYPES, scale_layouts

__all__ = [
    "BlockQuantizeOutput",
    "blockwise_outputs",
    "check_quantize_blockwise_args",
    "columnwise_block_shape",
    "fp8_gemm_scalings",
    "quantize_blockwise",
    "quantize_blockwise_fused",
    "resolve_gemm_scalings",
]


# The (a, b) ScalingType pairs fp8_gemm runs, as torch's scaled_mm and cuBLASLt pair them.
_GEMM_SCALING_PAIRS = (
    ("TensorWise", "TensorWise"),
    ("RowWise", "RowWise"),
    ("BlockWise1x128", "BlockWise128x128"),
    ("BlockWise128x128", "BlockWise1x128"),
    ("BlockWise1x128", "BlockWise1x128"),
    ("BlockWise1x32", "BlockWise1x32"),
)


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
    """
    return _GEMM_SCALING_PAIRS


def _shape_conditions(scale_inv: torch.Tensor, expected: Optional[tuple]) -> list:
    """The conditions (bools, or SymBools while tracing) for ``scale_inv`` to have the ``expected`` shape
    of reference.scale_layouts (None: 1 element, at most 2 dims)."""
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
) -> tuple[str, tuple[int, int], str, tuple[int, int]]:
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
    _check_scale_dtypes(op, a_scale_inv, b_scale_inv)

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
                return a_type, a_found[2], b_type, b_found[2]

    def describe(t, found):
        names = [name for name, (_, matched, _) in found.items() if matched]
        return f"{list(t.shape)} {t.dtype} ({' or '.join(names) if names else 'no scaling'})"

    raise ValueError(
        f"{op}: unsupported scaling combination: 'a_scale_inv' {describe(a_scale_inv, a_types)} for 'a' of shape "
        f"{list(a.shape)}, 'b_scale_inv' {describe(b_scale_inv, b_types)} for 'b' of shape {list(b.shape)}; "
        f"supported (a, b): {', '.join(f'({x}, {y})' for x, y in _GEMM_SCALING_PAIRS)} "
        "(see ops.fp8_gemm_scalings)"
    )


def _check_scale_dtypes(op: str, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor) -> None:
    """A TypeError unless both scales are float32 or E8M0. The kernels read E8M0 as its uint8 bits, so a
    uint8 tensor would pass their checks: 2 read as 2^-125, 0xFF as NaN."""
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t.dtype not in SCALE_DTYPES:
            raise TypeError(f"{op}: argument '{name}' must be torch.float32 or torch.float8_e8m0fnu, got {t.dtype}")


def _check_block_gemm_op(op, a, a_scale_inv, b, b_scale_inv, bias, out):
    """What the block-GEMM ops check themselves (called directly through ``torch.ops``, they have no
    Python entry before them): one device (a 'meta' tensor among CPU tensors would route the call to
    the fake implementation) and the scale dtypes. Scale values: _run_blockwise_gemm (CPU only)."""
    check_same_device(
        op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, "bias": bias, "out": out},
        optional=("bias", "out"),
    )
    _check_scale_dtypes(op, a_scale_inv, b_scale_inv)


def _kernel_scale(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales cross into the kernels as their uint8 bits."""
    return t.view(torch.uint8) if t.dtype == E8M0_DTYPE else t


@torch.library.custom_op("transformer_linear::fp8_gemm_blockwise", mutates_args=(), device_types="cpu")
def _fp8_gemm_blockwise_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: list[int],
    b_block: list[int],
) -> torch.Tensor:
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    out = torch.empty(gemm_out_shape(a, b), dtype=out_dtype, device=a.device)
    _run_blockwise_gemm("fp8_gemm", a, a_scale_inv, b, b_scale_inv, a_block, b_block, bias, out, accumulate=False)
    return out


def _run_blockwise_gemm(op, a, a_scale_inv, b, b_scale_inv, a_block, b_block, bias, out, accumulate):
    """The extension's block-scaled GEMM into ``out`` (= or +=), after checking the scale values."""
    check_scale_values(op, {"a_scale_inv": a_scale_inv, "b_scale_inv": b_scale_inv})
    _C.fp8_gemm_blockwise(
        desc(a, op, "a"),
        desc(_kernel_scale(a_scale_inv), op, "a_scale_inv"),
        desc(b, op, "b"),
        desc(_kernel_scale(b_scale_inv), op, "b_scale_inv"),
        a_block[0],
        a_block[1],
        b_block[0],
        b_block[1],
        desc(bias, op, "bias"),
        desc(out, op, "d"),
        accumulate,
        stream_for(a),
    )


def _cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block):
    """cuBLASLt's block-scaled matmul where it takes the pair (_block_gemm_cuda.py), the Triton GEMM otherwise."""
    out = _block_gemm_cuda.fp8_gemm_cublaslt(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block)
    if out is None:
        out = _triton_kernels().fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    return out


@_fp8_gemm_blockwise_op.register_kernel("cuda")
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block):
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    return _cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block)


@_fp8_gemm_blockwise_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_block, b_block):
    _check_block_gemm_op("fp8_gemm", a, a_scale_inv, b, b_scale_inv, bias, None)
    check_hp_dtype("fp8_gemm", "out_dtype", out_dtype)
    return a.new_empty(gemm_out_shape(a, b), dtype=out_dtype)


def _fp8_gemm_blockwise(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: tuple[int, int],
    b_block: tuple[int, int],
) -> torch.Tensor:
    """The block-scaled GEMM for scalings already resolved by :func:`resolve_gemm_scalings`.

    Private: ``ops.fp8_gemm`` is the public entry; it validates the operands
    and infers ``a_block`` / ``b_block`` from the scale tensors.
    """
    return _fp8_gemm_blockwise_op(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, list(a_block), list(b_block))


def _triton_kernels():
    """transformer_linear.triton, imported on first GPU use: triton is an optional dependency
    (the ``cuda`` extra) and importing it costs seconds."""
    import transformer_linear.triton as kernels  # noqa: PLC0415 (optional dependency)

    return kernels


_INT64_MAX = 2**63 - 1


def check_quantize_blockwise_args(
    x: torch.Tensor, dtype: torch.dtype, block_shape: object, scale_dtype: torch.dtype, e8m0_rounding: str
) -> tuple[int, int]:
    """Validate quantize_blockwise's arguments (shared by the Triton kernels); returns (bm, bk)."""
    op = "quantize_blockwise"
    check_tensor(op, "x", x)
    check_hp_dtype(op, "x", x.dtype)
    if x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D (M, K), got shape {list(x.shape)}")
    check_fp8_dtype(op, "dtype", dtype)
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"{op}: argument 'scale_dtype' must be torch.float32 or torch.float8_e8m0fnu, got {scale_dtype}")
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


@torch.library.custom_op("transformer_linear::quantize_blockwise", mutates_args=(), device_types="cpu")
def _quantize_blockwise_op(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: list[int],
    scale_dtype: torch.dtype,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
    e8m0_floor: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s, q_t, s_t = blockwise_outputs(x, dtype, block_shape, scale_dtype, rowwise, columnwise)
    bt = columnwise_block_shape(tuple(block_shape), *x.shape)
    op = "quantize_blockwise"
    _C.quantize_blockwise(
        desc(x, op, "x"),
        desc(q, op, "output") if rowwise else None,
        desc(_kernel_scale(s), op, "scale_inv") if rowwise else None,
        desc(q_t, op, "output_t") if columnwise else None,
        desc(_kernel_scale(s_t), op, "scale_inv_t") if columnwise else None,
        block_shape[0],
        block_shape[1],
        bt[0],
        bt[1],
        power_2_scale,
        e8m0_floor,
        stream_for(x),
    )
    return q, s, q_t, s_t


@_quantize_blockwise_op.register_kernel("cuda")
def _(x, dtype, block_shape, scale_dtype, power_2_scale, rowwise, columnwise, e8m0_floor):
    rounding = "floor" if e8m0_floor else "ceil"
    return _triton_kernels().quantize_blockwise_fused(
        x, dtype, tuple(block_shape), scale_dtype, power_2_scale, rowwise=rowwise, columnwise=columnwise,
        e8m0_rounding=rounding,
    )


@_quantize_blockwise_op.register_fake
def _(x, dtype, block_shape, scale_dtype, power_2_scale, rowwise, columnwise, e8m0_floor):
    return blockwise_outputs(x, dtype, block_shape, scale_dtype, rowwise, columnwise)


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


def quantize_blockwise_fused(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    e8m0_rounding: str = "ceil",
) -> BlockQuantizeOutput:
    """Blockwise quantize producing the row-major and/or the transposed copy from one pass.

    Numerics: reference.quantize_blockwise_ref. The transposed copy is
    ``quantize_blockwise(x.t(), ...)`` with the block of columnwise_block_shape.

    Args:
        x: contiguous (M, K) float32, bfloat16 or float16.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        block_shape: (bm, bk): (1, 128), (128, 128), (1, 32), (1, K), ...
        scale_dtype: torch.float32 or torch.float8_e8m0fnu (MX).
        power_2_scale: round float32 scales down to powers of two.
        rowwise: produce data / scale_inv.
        columnwise: produce data_t / scale_inv_t.
        e8m0_rounding: E8M0 scales only: "ceil" (default; TE and cuBLAS,
            torchao's ``ScaleCalculationMode.RCEIL``) or "floor" (the OCP MX
            spec, torchao's ``ScaleCalculationMode.FLOOR``); the rules are
            reference.e8m0_exponent's.
    """
    bm, bk = check_quantize_blockwise_args(x, dtype, block_shape, scale_dtype, e8m0_rounding)
    if not (rowwise or columnwise):
        raise ValueError("quantize_blockwise: at least one of 'rowwise' and 'columnwise' must be True")
    out = _quantize_blockwise_op(
        x, dtype, [bm, bk], scale_dtype, bool(power_2_scale), rowwise, columnwise, e8m0_rounding == "floor"
    )
    return BlockQuantizeOutput(*out)


def quantize_blockwise(
    x: torch.Tensor,
    dtype: torch.dtype,
    block_shape: tuple[int, int],
    scale_dtype: torch.dtype = torch.float32,
    power_2_scale: bool = False,
    *,
    e8m0_rounding: str = "ceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``x`` with one scale per ``block_shape`` block; returns ``(q, scale_inv)``.

    scale_inv has shape (ceil(M / bm), ceil(K / bk)); partial edge blocks use
    the amax of what they hold. Numerics: reference.quantize_blockwise_ref.
    Arguments as :func:`quantize_blockwise_fused`'s.
    """
    out = quantize_blockwise_fused(x, dtype, block_shape, scale_dtype, power_2_scale, e8m0_rounding=e8m0_rounding)
    return out.data, out.scale_inv


@torch.library.custom_op(
    "transformer_linear::fp8_gemm_blockwise_accumulate", mutates_args=("out",), device_types="cpu"
)
def _fp8_gemm_blockwise_accumulate_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    a_block: list[int],
    b_block: list[int],
) -> None:
    op = "fp8_gemm_accumulate"
    _check_block_gemm_op(op, a, a_scale_inv, b, b_scale_inv, None, out)
    _run_blockwise_gemm(op, a, a_scale_inv, b, b_scale_inv, a_block, b_block, None, out, accumulate=True)


@_fp8_gemm_blockwise_accumulate_op.register_kernel("cuda")
def _(a, a_scale_inv, b, b_scale_inv, out, a_block, b_block):
    _check_block_gemm_op("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, None, out)
    # Neither cuBLASLt's block-scaled matmul nor the Triton GEMM accumulates into out here: an fp32 result, added.
    out.add_(_cuda_blockwise_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32, None, a_block, b_block))


@_fp8_gemm_blockwise_accumulate_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out, a_block, b_block):
    _check_block_gemm_op("fp8_gemm_accumulate", a, a_scale_inv, b, b_scale_inv, None, out)
    return None


def _fp8_gemm_blockwise_accumulate_(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    a_block: tuple[int, int],
    b_block: tuple[int, int],
) -> None:
    """out += block-scaled (a @ b.T), in place, for scalings already resolved by
    :func:`resolve_gemm_scalings`.

    Private: ``ops.fp8_gemm_accumulate_`` is the public entry (block scales route here).
    Each K-block's fp32 partial sum is promoted with its two block scales into
    an fp32 total, which is added to ``out`` in float32 and rounded once to
    ``out``'s dtype (on the CPU no separate product tensor is made).
    """
    _fp8_gemm_blockwise_accumulate_op(a, a_scale_inv, b, b_scale_inv, out, list(a_block), list(b_block))
