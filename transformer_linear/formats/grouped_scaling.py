"""Scalings and argument checks of the grouped FP8 GEMMs (mixture-of-experts), shared by their op,
kernels and oracle.

A grouped GEMM multiplies the token rows routed to each expert by that expert's weight:
``a`` (total_tokens, K) is quantized once for every group, ``b`` (G, N, K) holds one weight per
group and ``offs`` (G,) int32 holds the cumulative row ends, as in ``torch._grouped_mm``: group g is
rows ``offs[g-1]:offs[g]`` (``offs[-1]`` read as 0); empty groups are allowed. Rows past
``offs[G-1]`` belong to no group and come out as zeros (torch leaves them unspecified).

Each operand's scale follows the ScalingTypes of ``block_scaling.fp8_gemm_scalings``, ``b``'s once
per group (``scale_layouts`` of one (N, K) weight, with a leading G):

================  =================================  ================================
(a, b)            a_scale_inv                        b_scale_inv
================  =================================  ================================
TensorWise        1 element float32                  (G,) float32: one per expert
RowWise           (total, 1) float32                 (G, N, 1) float32
1x128 x 128x128   (total, ceil(K/128)) float32       (G, ceil(N/128), ceil(K/128)) float32
1x32 (MX)         (total, ceil(K/32)) float8_e8m0fnu (G, N, ceil(K/32)) float8_e8m0fnu
================  =================================  ================================

The weight gradient contracts over the tokens, which the groups split. With one scale per tensor it
reads the rowwise data. With block scales it reads *grouped columnwise copies*: a (total, C) tensor
(grad_output, C = N; the input, C = K) transposed into (C, total) FP8 and quantized in blocks of
``token_block`` tokens along each row, the blocks restarting at every group's first token, so that no
block straddles two groups and no token is padded or moved. Group g's j-th block holds tokens
``start_g + j*B : min(start_g + (j+1)*B, end_g)`` and its scales sit in column
``start_g // B + g + j`` of a (C, ``total // B + G``) grid (:func:`token_scale_cols`): a static
shape that bounds every routing, with the columns no block uses holding 1. ``token_block`` WHOLE
gives one scale per (row, group) in a (C, G) grid (rowwise scaling, per group). The blocks are the
recipes': 128 (Float8BlockScaling's 1x128, float32 scales), 32 (MXFP8's 1x32, E8M0), WHOLE
(Float8RowwiseScaling).

The values of ``offs`` are never read here: that would copy them to the host (a device sync on a
GPU) and make shapes data-dependent. The kernels read them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_linear.formats.block_scaling import check_scale_dtype, scale_layouts
from transformer_linear.formats.checks import check_fp8_dtype, check_hp_dtype, check_same_device
from transformer_linear.formats.dtypes import E8M0_DTYPE

__all__ = [
    "GROUPED_GEMM_SCALINGS",
    "TOKEN_BLOCKS",
    "WHOLE",
    "GroupedScalings",
    "check_grouped_gemm_args",
    "check_grouped_wgrad_args",
    "check_grouped_wgrad_blockwise_args",
    "resolve_grouped_scalings",
    "token_scale_cols",
]

WHOLE = 0
"""A block size spanning the whole dimension (one scale along it, even when it is empty)."""

TOKEN_BLOCKS = {128: torch.float32, 32: E8M0_DTYPE, WHOLE: torch.float32}
"""The token blocks of the grouped columnwise copies the weight gradient takes, with their scale dtype."""

# (a, b) ScalingTypes with the blocks the kernels take; WHOLE where a block spans the dimension.
GROUPED_GEMM_SCALINGS = {
    ("TensorWise", "TensorWise"): ((WHOLE, WHOLE), (WHOLE, WHOLE)),
    ("RowWise", "RowWise"): ((1, WHOLE), (1, WHOLE)),
    ("BlockWise1x128", "BlockWise128x128"): ((1, 128), (128, 128)),
    ("BlockWise1x32", "BlockWise1x32"): ((1, 32), (1, 32)),
}


class GroupedScalings(NamedTuple):
    """The resolved scalings of a grouped GEMM: each operand's ScalingType and (rows, cols) block."""

    a_scaling: str
    a_block: tuple[int, int]
    b_scaling: str
    b_block: tuple[int, int]


def _require(condition, message: str) -> None:
    """A ValueError when a concrete condition fails; a run-time check (no guard) for a symbolic one."""
    if isinstance(condition, bool):
        if not condition:
            raise ValueError(message)
    else:
        torch._check(condition, lambda: message)


def _shape_matches(t: torch.Tensor, expected: tuple) -> bool:
    """Whether ``t`` has the ``expected`` shape; a symbolic size compares without a guard (checked later)."""
    if t.dim() != len(expected):
        return False
    return all(not isinstance(s == e, bool) or s == e for s, e in zip(t.shape, expected))


def _b_layouts(b_scale_inv: torch.Tensor, groups, n, k) -> dict[str, tuple]:
    """b's scale shape under each ScalingType: scale_layouts of one (N, K) weight, once per group."""
    out = {}
    for name, (shape, _) in scale_layouts(b_scale_inv.dtype, n, k).items():
        out[name] = (groups,) if shape is None else (groups, *shape)
    return out


def resolve_grouped_scalings(
    a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor
) -> GroupedScalings:
    """The scalings of a grouped GEMM, read from ``b_scale_inv`` (a weight's, of static shape), then
    ``a_scale_inv`` checked against the same pair. Call after :func:`check_grouped_gemm_args`.

    Raises:
        ValueError: no pair of :data:`GROUPED_GEMM_SCALINGS` fits (the message lists them), or
            ``a_scale_inv`` does not have the shape of b's pair.
    """
    op = "fp8_grouped_gemm"
    (total, k), (groups, n, _) = a.shape, b.shape
    b_layouts = _b_layouts(b_scale_inv, groups, n, k)
    a_layouts = scale_layouts(a_scale_inv.dtype, total, k)
    for (a_type, b_type), (a_block, b_block) in GROUPED_GEMM_SCALINGS.items():
        if b_type not in b_layouts or not _shape_matches(b_scale_inv, b_layouts[b_type]):
            continue
        for size, want in zip(b_scale_inv.shape, b_layouts[b_type]):
            _require(size == want, f"{op}: 'b_scale_inv' does not have {b_type}'s shape")
        if a_type not in a_layouts:  # another scale dtype
            ok = False
        elif a_layouts[a_type][0] is None:  # TensorWise: one element
            ok = a_scale_inv.dim() <= 2 and a_scale_inv.numel() == 1
        else:
            expected = a_layouts[a_type][0]
            ok = a_scale_inv.dim() == 2
            for size, want in zip(a_scale_inv.shape, expected) if ok else ():
                _require(size == want, f"{op}: 'a_scale_inv' of shape {list(a_scale_inv.shape)} does not have "
                         f"{a_type}'s shape {list(expected)} for 'a' of shape {list(a.shape)}")
        if not ok:
            raise ValueError(
                f"{op}: 'b_scale_inv' {list(b_scale_inv.shape)} {b_scale_inv.dtype} is {b_type}, which pairs with "
                f"{a_type} 'a_scale_inv' ({_describe_a(a_type, total, k)}), got {list(a_scale_inv.shape)} "
                f"{a_scale_inv.dtype}"
            )
        return GroupedScalings(a_type, a_block, b_type, b_block)
    expected = ", ".join(f"{y}: {_describe_b(y, groups, n, k)}" for _, y in GROUPED_GEMM_SCALINGS)
    raise ValueError(
        f"{op}: unsupported 'b_scale_inv' {list(b_scale_inv.shape)} {b_scale_inv.dtype} for 'b' of shape "
        f"{list(b.shape)}; supported (a, b) scalings: {'; '.join(f'{x} x {y}' for x, y in GROUPED_GEMM_SCALINGS)} "
        f"(b_scale_inv {expected})"
    )


def _describe_b(b_type: str, groups, n, k) -> str:
    return {
        "TensorWise": f"({groups},) float32",
        "RowWise": f"({groups}, {n}, 1) float32",
        "BlockWise128x128": f"({groups}, {-(-n // 128)}, {-(-k // 128)}) float32",
        "BlockWise1x32": f"({groups}, {n}, {-(-k // 32)}) float8_e8m0fnu",
    }[b_type]


def _describe_a(a_type: str, total, k) -> str:
    return {
        "TensorWise": "1 element float32",
        "RowWise": f"({total}, 1) float32",
        "BlockWise1x128": f"({total}, {-(-k // 128)}) float32",
        "BlockWise1x32": f"({total}, {-(-k // 32)}) float8_e8m0fnu",
    }[a_type]


def _check_rank(op: str, name: str, t: torch.Tensor, rank: int, what: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{op}: argument '{name}' must be {rank}-D {what}, got shape {list(t.shape)}")


def check_offs(op: str, offs: object, groups) -> None:
    """``offs`` is a 1-D int32 tensor of ``groups`` entries (its values are the kernels' to check).

    Raises:
        TypeError: not int32.
        ValueError: not 1-D of length ``groups``.
    """
    if offs.dtype != torch.int32:
        raise TypeError(f"{op}: argument 'offs' must have dtype torch.int32 (cumulative row ends), got {offs.dtype}")
    _check_rank(op, "offs", offs, 1, f"({groups},) int32")
    _require(offs.shape[0] == groups, f"{op}: argument 'offs' must have one entry per group ({groups}), "
             f"got shape {list(offs.shape)}")


def check_grouped_gemm_args(
    a: object,
    a_scale_inv: object,
    b: object,
    b_scale_inv: object,
    offs: object,
    out_dtype: object,
    bias: Optional[torch.Tensor] = None,
) -> None:
    """Validate a grouped GEMM's arguments, without reading any tensor's values. ``out_dtype`` None
    (the oracle, which computes in any dtype) leaves the output and bias dtypes unchecked.

    Raises:
        TypeError: an argument is not a tensor, not on a's device (a 'meta' one among CPU tensors
            included), or of a wrong dtype.
        ValueError: a wrong rank or shape.
    """
    op = "fp8_grouped_gemm"
    check_same_device(
        op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, "offs": offs, "bias": bias},
        optional=("bias",),
    )
    check_fp8_dtype(op, "a", a.dtype)
    check_fp8_dtype(op, "b", b.dtype)
    check_scale_dtype(op, "a_scale_inv", a_scale_inv.dtype)
    check_scale_dtype(op, "b_scale_inv", b_scale_inv.dtype)
    if out_dtype is not None:
        check_hp_dtype(op, "out_dtype", out_dtype)
    _check_rank(op, "a", a, 2, "(total_tokens, K)")
    _check_rank(op, "b", b, 3, "(G, N, K)")
    _require(b.shape[2] == a.shape[1], f"{op}: inner dimensions differ: 'a' is {list(a.shape)} and 'b' is "
             f"{list(b.shape)} (expected b of shape [G, N, {a.shape[1]}])")
    check_offs(op, offs, b.shape[0])
    if bias is not None:
        if out_dtype is not None and bias.dtype != out_dtype:
            raise TypeError(f"{op}: argument 'bias' must have the output dtype {out_dtype}, got {bias.dtype}")
        _check_rank(op, "bias", bias, 2, f"(G, N) = ({b.shape[0]}, {b.shape[1]})")
        _require(bias.shape[0] == b.shape[0] and bias.shape[1] == b.shape[1],
                 f"{op}: argument 'bias' must have shape {[b.shape[0], b.shape[1]]} (G, N), got {list(bias.shape)}")


def check_grouped_wgrad_args(
    grad: object, grad_scale_inv: object, x: object, x_scale_inv: object, offs: object, out_dtype: object
) -> None:
    """Validate the weight-gradient grouped GEMM's arguments (tensorwise scales only); ``out_dtype``
    None leaves the output dtype unchecked.

    Raises:
        TypeError: a non-tensor, another device, a wrong dtype.
        ValueError: a wrong rank or shape, or block scales (not supported by this form yet).
    """
    op = "fp8_grouped_gemm_wgrad"
    check_same_device(op, {"grad": grad, "grad_scale_inv": grad_scale_inv, "x": x, "x_scale_inv": x_scale_inv,
                           "offs": offs})
    check_fp8_dtype(op, "grad", grad.dtype)
    check_fp8_dtype(op, "x", x.dtype)
    if out_dtype is not None:
        check_hp_dtype(op, "out_dtype", out_dtype)
    _check_rank(op, "grad", grad, 2, "(total_tokens, N)")
    _check_rank(op, "x", x, 2, "(total_tokens, K)")
    _require(grad.shape[0] == x.shape[0], f"{op}: 'grad' and 'x' must have the same rows (tokens), got "
             f"{list(grad.shape)} and {list(x.shape)}")
    for name, s in (("grad_scale_inv", grad_scale_inv), ("x_scale_inv", x_scale_inv)):
        if s.dtype != torch.float32 or s.dim() > 2 or s.numel() != 1:
            raise ValueError(
                f"{op}: argument '{name}' must be one float32 element (TensorWise), got shape {list(s.shape)} "
                f"{s.dtype}; the weight gradient of a grouped GEMM takes tensorwise scales only (block scales "
                "along the token dimension would split each group's contraction)"
            )
    if offs.dtype != torch.int32:
        raise TypeError(f"{op}: argument 'offs' must have dtype torch.int32 (cumulative row ends), got {offs.dtype}")
    _check_rank(op, "offs", offs, 1, "(G,) int32")


def token_scale_cols(total, groups, token_block: int):
    """Columns of a grouped columnwise copy's scale grid: ``total // token_block + groups`` (every
    group's blocks, whatever the routing), ``groups`` for WHOLE (one scale per group)."""
    return groups if token_block == WHOLE else total // token_block + groups


def check_grouped_wgrad_blockwise_args(
    grad_t: object, grad_t_scale_inv: object, x_t: object, x_t_scale_inv: object, offs: object, out_dtype: object,
    token_block: object,
) -> None:
    """Validate the block-scaled weight-gradient grouped GEMM's arguments (grouped columnwise copies,
    see the module docstring); ``out_dtype`` None leaves the output dtype unchecked.

    Raises:
        TypeError: a non-tensor, another device, a wrong dtype (the scales' must be token_block's).
        ValueError: a wrong rank or shape, or a token block other than 128, 32 or WHOLE.
    """
    op = "fp8_grouped_gemm_wgrad_blockwise"
    if isinstance(token_block, bool) or token_block not in TOKEN_BLOCKS:
        raise ValueError(f"{op}: argument 'token_block' must be 128, 32 or 0 (the whole group), got {token_block!r}")
    check_same_device(op, {"grad_t": grad_t, "grad_t_scale_inv": grad_t_scale_inv, "x_t": x_t,
                           "x_t_scale_inv": x_t_scale_inv, "offs": offs})
    check_fp8_dtype(op, "grad_t", grad_t.dtype)
    check_fp8_dtype(op, "x_t", x_t.dtype)
    if out_dtype is not None:
        check_hp_dtype(op, "out_dtype", out_dtype)
    _check_rank(op, "grad_t", grad_t, 2, "(N, total_tokens)")
    _check_rank(op, "x_t", x_t, 2, "(K, total_tokens)")
    _require(grad_t.shape[1] == x_t.shape[1], f"{op}: 'grad_t' and 'x_t' must have the same columns (tokens), "
             f"got {list(grad_t.shape)} and {list(x_t.shape)}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{op}: argument 'offs' must have dtype torch.int32 (cumulative row ends), got {offs.dtype}")
    _check_rank(op, "offs", offs, 1, "(G,) int32")
    cols = token_scale_cols(grad_t.shape[1], offs.shape[0], token_block)
    scale_dtype = TOKEN_BLOCKS[token_block]
    for name, s, rows in (("grad_t_scale_inv", grad_t_scale_inv, grad_t.shape[0]),
                          ("x_t_scale_inv", x_t_scale_inv, x_t.shape[0])):
        if s.dtype != scale_dtype:
            raise TypeError(f"{op}: argument '{name}' must have dtype {scale_dtype} for token_block {token_block}, "
                            f"got {s.dtype}")
        _check_rank(op, name, s, 2, f"({rows}, {cols})")
        _require(s.shape[0] == rows and s.shape[1] == cols, f"{op}: argument '{name}' must have shape "
                 f"[{rows}, {cols}] (rows, total // token_block + G), got {list(s.shape)}")
