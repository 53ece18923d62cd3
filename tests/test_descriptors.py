"""Descriptors the raw extension must refuse, and allocation failures it must survive.

``transformer_linear._C`` is internal, but it must not crash the process on
descriptors whose sizes overflow int64 or the address space (the kernels index
in int64), and a failed allocation must come back as a Python error on any
thread count (an exception escaping an OpenMP region would abort).
"""

import math

import pytest
import torch
from cpu_paths import QUANTIZE_ISAS

from transformer_linear import _C
from transformer_linear.ops.descriptors import desc

E4M3 = torch.float8_e4m3fn
THREADS = [1, 2, 8]


def forged(t: torch.Tensor, shape: tuple, strides: tuple, address: int = 0) -> tuple:
    """The descriptor of ``t`` with its shape and strides (and, if given, its address) replaced."""
    d = desc(t, "test", "t")
    return (address or d[0], d[1], shape, strides, d[4], d[5])


# Scalars the forged calls read: module-level, so that they outlive every descriptor.
ONE = torch.ones(1)
SCALE_INV = torch.empty(1)


def scalar(t: torch.Tensor = ONE) -> tuple:
    return desc(t, "test", "scalar")


@pytest.mark.parametrize("threads", THREADS)
def test_element_count_wrapping_to_zero_is_a_value_error(threads):
    """(2**32, 2**32) has 2**64 elements: a wrapping count of 0 used to pass every check."""
    x = torch.ones(4, 4)
    q_t = torch.empty(4, 4, dtype=E4M3)
    huge = (2**32, 2**32)
    with pytest.raises(ValueError, match=r"shape \[4294967296, 4294967296\] has more elements than int64"):
        _C.quantize(
            forged(x, huge, (2**32, 1)), scalar(), None, forged(q_t, huge, (2**32, 1)), scalar(SCALE_INV),
            None, None, False, 0, threads,
        )


GEMM_OPERAND_CASES = {
    "elements overflow int64": ((2**62, 3), (3, 1), "more elements than int64"),
    "row stride overflows int64": ((4, 3), (2**62, 1), "byte offsets beyond int64"),
    "row stride past the address space": ((2, 3), (2**62, 1), "past the end of the address space"),
    "negative stride before address 0": ((2, 3), (-(2**62), 1), "past the end of the address space"),
    "int64 min stride": ((2, 3), (-(2**63), 1), "byte offsets beyond int64"),
    "column stride overflows int64": ((3, 2**40), (1, 2**40), "more elements than int64|byte offsets"),
}


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("case", GEMM_OPERAND_CASES, ids=list(GEMM_OPERAND_CASES))
def test_overflowing_gemm_operand_is_a_value_error(case, operand):
    shape, strides, message = GEMM_OPERAND_CASES[case]
    small = torch.zeros(4, 3, dtype=E4M3)
    other = desc(small, "test", "other")
    bad = forged(small, shape, strides)
    d = torch.zeros(4, 4)
    a, b = (bad, other) if operand == "a" else (other, bad)
    with pytest.raises(ValueError, match=message):
        _C.fp8_gemm(a, scalar(), b, scalar(), None, desc(d, "test", "d"), False, False, None, 1)


@pytest.mark.parametrize("shape", [(2**62, 3), (2**31, 2**31, 4)])
def test_overflowing_amax_input_is_a_value_error(shape):
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    x, out = torch.ones(3), torch.empty(())
    with pytest.raises(ValueError, match="more elements than int64"):
        _C.amax(forged(x, shape, strides), desc(out, "test", "amax"), 1)


def test_empty_tensor_with_huge_dimensions_is_accepted():
    """No element of an empty tensor is addressed, however large its other dimensions."""
    x = torch.empty(2**30, 0, 2**40)  # 2**70 "elements" if the zero were ignored
    out = torch.full((), 5.0)
    _C.amax(desc(x, "test", "x"), desc(out, "test", "amax"), 1)
    assert out.item() == 0.0


@pytest.mark.parametrize("launch", [2**12 + 1, 2**63])
def test_out_of_range_thread_count_is_a_value_error(launch):
    x, out = torch.ones(4), torch.empty(())
    with pytest.raises(ValueError, match="the launch argument is the thread count"):
        _C.amax(desc(x, "test", "x"), desc(out, "test", "amax"), launch)


@pytest.mark.skipif(QUANTIZE_ISAS == ["generic"], reason="the stripe scratch exists on the vector paths only")
@pytest.mark.parametrize("threads", THREADS)
def test_failed_scratch_allocation_is_a_memory_error(threads):
    """A transposed-only cast needs a 64-row stripe of scratch per thread. For
    2**41 columns that is 2**47 bytes, which no allocator grants: the failure is
    a MemoryError whatever the thread count (it used to happen inside the
    parallel region and abort). The forged input is never read: the scratch is
    allocated first."""
    rows, cols = 128, 2**41
    x = torch.ones(8)
    q_t = torch.empty(8, dtype=E4M3)
    # Unmapped addresses far above every allocation (but below the 2**57 limit),
    # so that the forged input and output overlap neither each other nor the scales.
    x_address = 2**55
    q_t_address = x_address + rows * cols * x.element_size()
    try:
        _C.set_cpu_isa(QUANTIZE_ISAS[-1])
        with pytest.raises(MemoryError):
            _C.quantize(
                forged(x, (rows, cols), (cols, 1), x_address), scalar(), None,
                forged(q_t, (cols, rows), (rows, 1), q_t_address),
                scalar(SCALE_INV), None, None, False, 0, threads,
            )
    finally:
        _C.set_cpu_isa("auto")
