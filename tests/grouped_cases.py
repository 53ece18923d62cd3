"""Routings, offsets, the error baseline and the host-read detector shared by the grouped GEMM tests
(test_grouped_gemm.py) and the grouped Linear tests (test_grouped_linear.py), and a recipe the grouped GEMMs
lack (the transformers experts tests)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import transformer_linear as tl
from transformer_linear import reference
from transformer_linear.recipe.quantization import quantization_spec
from transformer_linear.reference import grouped as reference_grouped


def recipe_without_grouped_gemms() -> tl.recipe.CustomRecipe:
    """A recipe the grouped GEMMs lack: NVFP4 input and weight, an FP8 grad_output (a tl.Linear takes it)."""
    nvfp4 = quantization_spec(tl.recipe.NVFP4BlockScaling())
    quantizers = {"linear_input": nvfp4.input, "linear_weight": nvfp4.weight,
                  "linear_grad_output": tl.TensorQuantizer(torch.float8_e5m2, [], torch.float32, False)}
    return tl.recipe.CustomRecipe(quantizers.__getitem__)


def routing(pattern: str, total: int, groups: int) -> list[int]:
    """Rows per group of a routing pattern (summing to at most ``total``)."""
    if pattern == "uniform":
        base = [total // groups] * groups
        base[-1] += total - sum(base)
        return base
    if pattern == "skewed":  # the first group gets 4x the rows of each other one
        unit = total // (groups + 3)
        sizes = [4 * unit] + [unit] * (groups - 1)
        sizes[0] += total - sum(sizes)
        return sizes
    if pattern == "empty_groups":  # empty groups first, in the middle and last
        sizes = [0] * groups
        sizes[1], sizes[2] = total // 3, total - total // 3
        return sizes
    if pattern == "one_group":  # every row in one group
        sizes = [0] * groups
        sizes[groups // 2] = total
        return sizes
    if pattern == "rows_left_over":  # rows past the last group: zeros
        sizes = [total // (groups + 1)] * groups
        sizes[groups // 2] = 0
        return sizes
    raise ValueError(pattern)


PATTERNS = ["uniform", "skewed", "empty_groups", "one_group", "rows_left_over"]


def offsets(sizes: list[int]) -> torch.Tensor:
    """The int32 cumulative row ends of group sizes."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def dequantized_grouped_fp32(a, sa, b, sb, offs, out_dtype, bias=None):
    """Plain PyTorch at the kernels' precision (the error baseline): fp32 mm of each group's dequantized operands."""
    total, k = a.shape
    n = b.shape[1]
    a_deq = (a.double() * reference.expand_scale_inv(sa, reference.block_shape_of(sa, total, k), total, k)).float()
    out = torch.zeros(total, n)
    for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, total)):
        s = sb[g]
        b_deq = (b[g].double() * reference.expand_scale_inv(s, reference.block_shape_of(s, n, k), n, k)).float()
        out[start:end] = a_deq[start:end] @ b_deq.t() + (0 if bias is None else bias[g].float())
    return out.to(out_dtype)


@contextmanager
def nothing():
    yield


_HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__", "numpy")


@contextmanager
def host_reads_of(offs: torch.Tensor):
    """Records every host read (item, tolist, nonzero, bool(), int(), ...) of ``offs``, of a view
    of it, or of any int32 tensor (what is computed from offs): on a GPU each is a device sync."""
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    storage = offs.untyped_storage().data_ptr()

    def recording(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if self.dtype == torch.int32 or self.untyped_storage().data_ptr() == storage:
                reads.append(name)
            return original(self, *args, **kwargs)

        return read

    original_nonzero = torch.nonzero

    def nonzero(t, *args, **kwargs):
        if t.dtype == torch.int32 or t.untyped_storage().data_ptr() == storage:
            reads.append("torch.nonzero")
        return original_nonzero(t, *args, **kwargs)

    try:
        for name in _HOST_READS:
            setattr(torch.Tensor, name, recording(name))
        torch.nonzero = nonzero
        yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = original_nonzero
