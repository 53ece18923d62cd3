"""A Linear's forward and backward emulated from the reference alone: the one oracle the recipe tests
compare ``tl.Linear`` against (FP8 recipes: :func:`emulate_linear`'s GEMM results; NVFP4:
:func:`nvfp4_copies`, the quantized operands its GEMMs read).

A recipe is written out here as what it means (TE / DeepSeek-V3 / OCP MX / torchao), independently of
the package's quantization.py: per tensor role, the FP8 dtype, the blocks (``None``: one current scale
for the tensor; ``ROW``: one scale per row) and the scales' form. The emulation follows TE's rules:

- forward: the input's and the weight's rowwise copies (blocks along in_features);
- dgrad: grad_output's rowwise copy (blocks along out_features) with the weight's columnwise copy: the
  rowwise copy transposed where the weight's blocks are square (or it has one scale), else Wᵀ quantized
  with the weight's blocks along out_features;
- wgrad: grad_outputᵀ and the inputᵀ, each quantized with its role's blocks along the tokens.

Each result is an (exact float64, fp32 baseline) pair, as ``tolerances.assert_close_to_reference``
takes: ``reference.fp8_gemm_blockwise`` in float64, and torch.mm of the dequantized operands in fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import torch

from tolerances import assert_bitwise_equal, assert_column_sums_close

from transformer_linear import reference
from transformer_linear.reference import nvfp4 as ref_nvfp4

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
ROW = "row"
"""Blocks of a whole row (rowwise scaling)."""

Block = Union[None, str, tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class RoleQuantizer:
    """How the reference quantizes one tensor role of a recipe."""

    dtype: torch.dtype
    block: Block
    """None: one current scale (tensorwise); ROW: one scale per row; (rows, cols) blocks."""
    scale_dtype: torch.dtype = torch.float32
    power_2_scale: bool = False
    e8m0_rounding: str = "ceil"

    def quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale_inv) of a 2-D ``t``, blocks along its rows."""
        if self.block is None:
            q, scale_inv, _ = reference.quantize_current(t, self.dtype)
            return q, scale_inv
        block = (1, t.shape[1]) if self.block == ROW else self.block
        return reference.quantize_blockwise_ref(t, self.dtype, block, self.scale_dtype, self.power_2_scale,
                                                self.e8m0_rounding)

    @property
    def transposes(self) -> bool:
        """Whether the columnwise copy is the rowwise one transposed (one scale, or square blocks)."""
        return self.block is None or (self.block != ROW and self.block[0] == self.block[1])


@dataclasses.dataclass(frozen=True)
class EmulatedRecipe:
    """A recipe's three roles, as the reference quantizes them."""

    input: RoleQuantizer
    weight: RoleQuantizer
    grad_output: RoleQuantizer

    def with_e8m0_rounding(self, rounding: str) -> "EmulatedRecipe":
        return EmulatedRecipe(*(dataclasses.replace(q, e8m0_rounding=rounding)
                                for q in (self.input, self.weight, self.grad_output)))


class Emulated(NamedTuple):
    """(exact, baseline) pairs of the three GEMMs' results."""

    out: tuple[torch.Tensor, torch.Tensor]
    dx: tuple[torch.Tensor, torch.Tensor]
    dw: tuple[torch.Tensor, torch.Tensor]


def dequantized(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of a (q, scale_inv) operand (scales of any block shape, one scale included)."""
    rows, cols = q.shape
    block = reference.block_shape_of(scale_inv, rows, cols)
    return (q.double() * reference.expand_scale_inv(scale_inv, block, rows, cols)).float()


def gemm(a: tuple, b: tuple, bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference.fp8_gemm_blockwise, fp32 torch.mm of the dequantized operands) of a @ bᵀ."""
    exact = reference.fp8_gemm_blockwise(*a, *b, torch.float64, bias)
    baseline = dequantized(*a) @ dequantized(*b).t()
    return exact, baseline if bias is None else baseline + bias


def _transposed(q: tuple) -> tuple:
    data, scale_inv = q
    return data.t().contiguous(), scale_inv.t().contiguous() if scale_inv.dim() == 2 else scale_inv


def emulate_linear(r: EmulatedRecipe, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                   dy: torch.Tensor) -> Emulated:
    """The Linear's out, dx and dw for 2-D ``x`` (tokens, in), ``w`` (out, in) and ``dy`` (tokens, out)."""
    qx, qw = r.input.quantize(x), r.weight.quantize(w)
    qw_t = _transposed(qw) if r.weight.transposes else r.weight.quantize(w.t().contiguous())
    dx = gemm(r.grad_output.quantize(dy), qw_t)
    dw = gemm(r.grad_output.quantize(dy.t().contiguous()), r.input.quantize(x.t().contiguous()))
    return Emulated(gemm(qx, qw, bias), dx, dw)


class NVFP4Copies(NamedTuple):
    """The NVFP4 copies (reference.nvfp4.quantize_nvfp4's, both usages) of the Linear's three tensors: the
    forward reads x's and w's rowwise copies, dgrad grad_output's rowwise and w's columnwise copy, wgrad the
    columnwise copies of grad_output and x."""

    x: Any
    w: Any
    grad_output: Any


def nvfp4_amax(t: torch.Tensor, rht: bool = False) -> torch.Tensor:
    """The global amax of t's NVFP4 copy (of its transpose's Hadamard transform with ``rht``)."""
    v = ref_nvfp4.hadamard_transform(t.t()) if rht else t.float()
    return v.abs().amax()


def nvfp4_copies(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, *, rht: bool, stochastic_rounding: bool,
                 weight_2d: bool, seed: int) -> NVFP4Copies:
    """The copies TE's NVFP4 recipe makes: the activations' and gradients' columnwise copies Hadamard-
    transformed (``rht``), grad_output rounded stochastically from ``seed`` (``stochastic_rounding``), the
    weight in 16x16 tiles (``weight_2d``); each with its tensor's global amax."""
    qx = ref_nvfp4.quantize_nvfp4(x, nvfp4_amax(x), nvfp4_amax(x, rht), rowwise=True, columnwise=True, rht=rht)
    qw = ref_nvfp4.quantize_nvfp4(w, nvfp4_amax(w), rowwise=True, columnwise=True, scaling_2d=weight_2d)
    qg = ref_nvfp4.quantize_nvfp4(dy, nvfp4_amax(dy), nvfp4_amax(dy, rht), rowwise=True, columnwise=True, rht=rht,
                                  stochastic_rounding=stochastic_rounding, seed=seed, offset=0)
    return NVFP4Copies(qx, qw, qg)


def assert_bias_grad(db: torch.Tensor, dy: torch.Tensor) -> None:
    """A Linear's bias gradient from output gradient ``dy``: bitwise ``reference.bias_grad`` (which fixes the
    float32 summation order), and within float32 summation's bound of the exact column sums."""
    assert_bitwise_equal(db, reference.bias_grad(dy, db.dtype), "dbias")
    assert_column_sums_close(db, dy, "dbias")
