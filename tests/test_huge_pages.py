"""Large CPU kernel outputs are backed by transparent huge pages (csrc/cpu/memory_cpu.cpp: advise_huge_pages).

A fresh output of 32 MiB or more is a mapping of its own, which the kernels advise MADV_HUGEPAGE before
writing it, so that its first write faults 2 MiB at a time, not 4 KiB (a grouped GEMM's weight gradient
took 16384 page faults a step). Checked through the mapping's VmFlags in /proc/self/smaps ("hg"); the
values are what the other tests check (the advice never changes them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from blockwise_cases import E4M3, E5M2
from grouped_cases import offsets

from transformer_linear import ops, reference
from transformer_linear.ops import block as ops_block
from transformer_linear.ops import grouped as ops_grouped
from transformer_linear.ops import nvfp4 as ops_nvfp4


def _smaps_has_vm_flags() -> bool:
    try:
        with open("/proc/self/smaps") as smaps:
            return any(line.startswith("VmFlags:") for line in smaps)
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not os.path.exists("/sys/kernel/mm/transparent_hugepage")
    or not _smaps_has_vm_flags(),
    reason="transparent huge pages are a Linux kernel feature (this kernel has none, or does not show a "
    "mapping's flags in /proc/self/smaps)",
)

OWN_MAPPING = 32 << 20  # glibc's largest mmap threshold: outputs this large are mappings of their own


def _vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping holding ``t``'s middle byte (its first page also holds the allocator's header,
    which is not advised)."""
    address = t.data_ptr() + t.nbytes // 2
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dense_gemm_output(out_dtype):
    n = 2048
    m = OWN_MAPPING // (n * out_dtype.itemsize)
    a, a_scale_inv = reference.quantize_current(torch.randn(m, 16), E4M3)[:2]
    b, b_scale_inv = reference.quantize_current(torch.randn(n, 16), E4M3)[:2]
    out = ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype)
    assert out.nbytes >= OWN_MAPPING
    assert "hg" in _vm_flags(out), "a 32 MiB GEMM output is not advised to huge pages"


def test_grouped_wgrad_output():
    n = k = 2048
    grad, s_grad = reference.quantize_current(torch.randn(16, n), E5M2)[:2]
    x, s_x = reference.quantize_current(torch.randn(16, k), E4M3)[:2]
    dw = ops_grouped.fp8_grouped_gemm_wgrad(grad, s_grad, x, s_x, offsets([6, 10]), torch.float32)
    assert dw.nbytes >= OWN_MAPPING
    assert "hg" in _vm_flags(dw), "a 32 MiB grouped weight gradient is not advised to huge pages"


def _rows(cols: int, dtype: torch.dtype) -> int:
    """Rows of an (rows, cols) ``dtype`` tensor of OWN_MAPPING bytes."""
    return OWN_MAPPING // (cols * dtype.itemsize)


def _input(rows_of: torch.dtype) -> torch.Tensor:
    """A bfloat16 input whose ``rows_of`` copy (4096 columns) is OWN_MAPPING bytes."""
    return torch.ones(_rows(4096, rows_of), 4096, dtype=torch.bfloat16)


def _cast_transpose() -> list[torch.Tensor]:
    out = ops.quantize_fused(_input(E4M3), E4M3, columnwise=True)
    return [out.data, out.data_t]


def _block_quantize() -> list[torch.Tensor]:
    out = ops_block.quantize_blockwise_fused(_input(E4M3), E4M3, (1, 128), columnwise=True)
    return [out.data, out.data_t]


def _nvfp4_quantize() -> list[torch.Tensor]:
    x = torch.ones(2 * _rows(4096, E4M3), 4096, dtype=torch.bfloat16)  # two E2M1 values a byte
    return [ops_nvfp4.quantize_nvfp4(x, torch.ones(())).data]


# The quantize family's large outputs: each case returns the outputs that must be advised.
QUANTIZE_CASES = {
    "quantize": lambda: [ops.quantize_current(_input(E4M3), E4M3)[0]],
    "cast + transpose": _cast_transpose,
    "dequantize": lambda: [ops.dequantize(_input(torch.float32).to(E4M3), torch.ones(1), torch.float32)],
    "block quantize 1x128": _block_quantize,
    "nvfp4 quantize": _nvfp4_quantize,
}


@pytest.mark.parametrize("case", QUANTIZE_CASES)
def test_quantize_outputs(case):
    outputs = QUANTIZE_CASES[case]()
    for out in outputs:
        assert out.nbytes >= OWN_MAPPING
        assert "hg" in _vm_flags(out), f"{case}: a {out.nbytes >> 20} MiB output is not advised to huge pages"


def test_small_output_left_alone(tmp_path):
    """Below 32 MiB an output may share a heap mapping with other allocations: no advice splits it.

    Checked in a fresh process (run from a neutral folder, so the installed package is the one imported):
    in this one, an earlier test's 32 MiB output may have been cut from the top of the heap (glibc serves
    any request from there when the heap has that much free) and advised, and the small output may reuse
    that memory, whose mapping keeps the flag."""
    child = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch\n"
        "from test_huge_pages import E4M3, _vm_flags\n"
        "from transformer_linear import ops, reference\n"
        "a, a_scale_inv = reference.quantize_current(torch.randn(512, 16), E4M3)[:2]\n"
        "out = ops.fp8_gemm(a, a_scale_inv, a, a_scale_inv, torch.float32)\n"
        "print(' '.join(_vm_flags(out)))\n"
    )
    done = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hg" not in done.stdout.split(), done.stdout
