"""The NVFP4 format's constants and layouts, shared by its kernels' front end and its reference.

NVFP4 (NVIDIA Transformer Engine's ``NVFP4BlockScaling``) stores a tensor as
FP4 E2M1 codes (values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two per byte in
``torch.float4_e2m1fn_x2`` (the first element of each pair in the low nibble,
as torch and torchao pack them), one FP8 E4M3 block scale per 16 consecutive
elements of a row, and one float32 global scale per tensor:
``x = e2m1 * float(scale_e4m3) * global_decode_scale``.

The random Hadamard transform (RHT) is defined here rather than in the
reference because the ops use it too (for the amax of a transformed copy):
each 16-element block ``v`` becomes ``v @ (diag(signs) @ H16) / 4`` with H16
the Sylvester Hadamard matrix and ``signs`` TE's fixed wgrad sign vector.
It is computed as a fast Walsh-Hadamard butterfly in float32 (so every
backend can reproduce its rounding): signs applied first, then four stages of
``(a, b) -> (a + b, a - b)`` on pairs 1, 2, 4, 8 apart, then a multiply by 0.25.
The matrix is orthogonal, so ``hadamard_transform(v, inverse=True)`` (the
transpose: butterfly first, then the signs) undoes it, and a GEMM of two
operands transformed along their K dimension equals the untransformed GEMM.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP4_DTYPE",
    "RHT_SIGNS",
    "check_quantize_shape",
    "hadamard_amax_of_transpose",
    "hadamard_transform",
    "pad_rows",
    "padded_rows",
]

FP4_DTYPE = torch.float4_e2m1fn_x2
"""Packed FP4 data: two E2M1 codes per byte, the first element in the low nibble."""
BLOCK = 16
"""Elements per block scale (1x16), and the edge of a 2D block (16x16)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code: bit 3 the sign, bits 0-2 the magnitude's index."""
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's fixed random sign vector of the wgrad RHT (``get_wgrad_sign_vector``)."""


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along dim -2 of a (..., 16, C) tensor, in the fixed stage order
    (each of the C columns transformed on its own)."""
    lead, cols = v.shape[:-2], v.shape[-1]
    for half in (1, 2, 4, 8):
        pairs = v.reshape(*lead, BLOCK // (2 * half), 2, half, cols)
        a, b = pairs[..., 0, :, :], pairs[..., 1, :, :]
        v = torch.stack((a + b, a - b), dim=-3).reshape(*lead, BLOCK, cols)
    return v


def hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The random Hadamard transform of each 16-element block of the last dimension, in float32.

    Args:
        x: (..., K) with K a multiple of 16, any floating dtype (read as float32).
        inverse: apply the transpose (which is the inverse) instead.

    Returns:
        float32 tensor of x's shape.

    Raises:
        ValueError: the last dimension is not a multiple of 16.
    """
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"hadamard_transform: the last dimension must be a multiple of {BLOCK}, got {tuple(x.shape)}")
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device).unsqueeze(-1)
    v = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK, 1)
    if inverse:
        v = _butterfly(v) * 0.25 * signs
    else:
        v = _butterfly(v * signs) * 0.25
    return v.reshape(x.shape)


def hadamard_amax_of_transpose(x: torch.Tensor) -> torch.Tensor:
    """``hadamard_transform(x.t()).abs().amax()`` without the transposing copy.

    The torch form of the amax (CUDA, fake and meta tensors, traced graphs); on the CPU the extension's
    kernel computes the same bits in one pass (``ops.nvfp4.nvfp4_amax``).

    The blocks of ``x.t()``'s rows are 16 consecutive rows of ``x`` in one column, so the transform runs
    on ``x``'s rows, every column at once, with the same arithmetic for each element; the maximum (exact,
    and commuting with the exact scaling by 0.25) is then bitwise the same.

    Args:
        x: (M, K) floating tensor, M a multiple of 16, not empty.

    Returns:
        () float32; NaN if x holds a NaN.
    """
    m, k = x.shape
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device).unsqueeze(-1)
    v = _butterfly(x.float().reshape(m // BLOCK, BLOCK, k) * signs)
    return v.abs_().amax() * 0.25


def padded_rows(rows):
    """``rows`` rounded up to a multiple of :data:`BLOCK`: the tokens of a padded columnwise copy.

    Integer arithmetic only, so a symbolic row count (torch.compile's dynamic shapes) stays one expression,
    with no guard on its remainder.
    """
    return (rows + BLOCK - 1) // BLOCK * BLOCK


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``x`` with zero rows appended up to a multiple of :data:`BLOCK` rows; ``x`` itself where it has one.

    What lets a columnwise copy take any token count: the copy's last 16-token block holds zeros past the real
    tokens, which leave the amax unchanged and add nothing to a GEMM contracting over the tokens (a weight
    gradient) whose operands are both padded so; the Hadamard transform is orthogonal per block, so two
    transformed padded operands contract to the same sum. A copy of ``x`` where rows are added (concrete
    sizes: the ops' implementations call it, never a traced graph).
    """
    rows = x.shape[0]
    if rows % BLOCK == 0:
        return x
    out = x.new_zeros((padded_rows(rows), x.shape[1]))
    out[:rows].copy_(x)
    return out


def check_quantize_shape(op: str, shape: tuple[int, ...], rowwise: bool, columnwise: bool, scaling_2d: bool, rht: bool,
                         pad: bool = False):
    """Raise unless a (M, K) input can be quantized as asked (ValueError naming the dimension).

    ``pad``: the input's rows are padded to a multiple of 16 first (:func:`pad_rows`), so any M is taken.
    """
    if len(shape) != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D, got shape {tuple(shape)}")
    m, k = shape
    if not (rowwise or columnwise):
        raise ValueError(f"{op}: at least one of 'rowwise' and 'columnwise' must be set")
    if (rowwise or scaling_2d) and k % BLOCK:
        raise ValueError(f"{op}: the columns of 'x' ({k}) must be a multiple of {BLOCK} for the rowwise copy")
    if columnwise and not pad and m % BLOCK:
        raise ValueError(f"{op}: the rows of 'x' ({m}) must be a multiple of {BLOCK} for the columnwise copy")
    if rht and scaling_2d:
        raise ValueError(f"{op}: 'rht' and 'scaling_2d' cannot be combined (2D copies are each other's transpose)")
