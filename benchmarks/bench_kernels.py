"""Kernel benchmarks: quantize family and FP8 GEMM against named baselines, in one run.

Quantize rows (current scaling, cast+transpose, dequantize) compare
``transformer_linear.ops`` with ``transformer_linear.reference`` run eagerly and
under ``torch.compile``, and with a plain copy of the input bytes (``copy_``
into a preallocated tensor). GB/s counts the bytes an op must move once:
input read + output written (a copy: 2x the input bytes).

GEMM rows compare ``ops.fp8_gemm`` with ``torch.mm`` in fp32 and in bf16 on
the already-dequantized operands (bf16 is what a CPU user would pick instead:
oneDNN, on AMX tiles where present), each with an output of its dtype, and
with ``torch._scaled_mm`` (CPU), which is timed only where one call is
predicted (from a small probe) to fit in ``--slow-call-s``. The CPU path
the GEMM took, and why (forced or measured), is printed and recorded.

Block rows: blockwise quantize per block shape (1x128, 128x128, 1x32 E8M0,
rowwise) and layout (row-major, and with the transposed copy) in GB/s,
median and best of the timed calls, against ``reference.quantize_blockwise_ref``
(of x, and of x.t() with the columnwise block) eager and under ``torch.compile``
and the same copy; the block-scaled
GEMM against the tensorwise FP8 GEMM and fp32 ``torch.mm``.

NVFP4 rows: ``ops.nvfp4.quantize_nvfp4`` per layout (1x16 rowwise, with the
columnwise copy, with its RHT, 16x16 tiles, stochastic rounding) in GB/s
(input read + E2M1 data and E4M3 scales written) against the same copy; the
NVFP4 GEMM against the tensorwise FP8 GEMM, the FP8 block GEMM (1x128 x 128x128) and fp32
``torch.mm``.

Usage::

    python benchmarks/bench_kernels.py                 # everything
    python benchmarks/bench_kernels.py --quick         # small sizes (CI smoke)
    python benchmarks/bench_kernels.py --only quantize --json out.json
    python benchmarks/bench_kernels.py --threads 1 --tag 1thread   # per-core numbers
    python benchmarks/bench_kernels.py --only block-quantize --threads 1 --clock thread
    python benchmarks/bench_kernels.py --only nvfp4 --threads 1 --clock thread
    TL_CPU_ISA=avx512 python benchmarks/bench_kernels.py --only gemm --shapes 2048x2048x2048

On a machine shared with other work, one thread per op is spared the
OpenMP barrier waits that a busy core imposes on a two-thread region.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from transformer_linear import _C, ops
from transformer_linear import reference as ref
from transformer_linear.formats.block_scaling import columnwise_block_shape
from transformer_linear.ops import nvfp4

E4M3 = torch.float8_e4m3fn
MIB = 2**20
QUANTIZE_SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_QUANTIZE_SIZES = [256 * 1024, 1 * MIB]
GEMM_SQUARE = [512, 1024, 2048, 4096]
GEMM_LLM = [(2048, 4096, 4096), (2048, 11008, 4096), (2048, 4096, 11008)]  # M x N x K
QUICK_GEMM = [(256, 256, 256), (512, 512, 512)]
ROW_LENGTH = 4096  # quantize inputs are (n / 4096, 4096) matrices


def time_slow(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Median seconds of a possibly very slow function: one call decides whether to repeat."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > budget_s / 2:
        return first
    return measure({"fn": fn}, repeats, 1, budget_s)["fn"][0]


# What the timed calls are measured with. "thread" (CPU time of the calling
# thread) needs --threads 1, where every candidate runs on that thread: it
# leaves out the time the OS gives other processes, so per-core rates on a
# busy shared machine stay close to those of an idle one.
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK = "wall"


def measure(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, budget_s: float = 20.0) -> dict:
    """(median, min) seconds of each function over ``repeats`` calls after ``warmup`` calls, and its median
    count of minor page faults a call (the process's; a fresh output faults in each page it writes).

    Calls are interleaved round-robin, so on a shared machine every candidate
    sees the same background load and their ratios stay meaningful. The first
    warmup round sets how many rounds fit in ``budget_s`` (at least one).
    """
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        for fn in fns.values():
            fn()
    repeats = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = CLOCKS[CLOCK]()
            fn()
            times[name].append(CLOCKS[CLOCK]() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return {name: (statistics.median(t), min(t), statistics.median(faults[name])) for name, t in times.items()}


# ---------------------------------------------------------------------------
# Quantize family
# ---------------------------------------------------------------------------


def _ref_cast_transpose(x: torch.Tensor, scale: torch.Tensor):
    q, scale_inv = ref.quantize(x, scale, E4M3)
    return q, ref.transpose_2d(q), scale_inv


def _ref_quantize_amax(x: torch.Tensor, scale: torch.Tensor):
    q, scale_inv = ref.quantize(x, scale, E4M3)
    return q, scale_inv, ref.amax(x)


def _quantize_cases(x: torch.Tensor):
    """(name, ours, reference fn, bytes moved) for each quantize-family op on ``x``."""
    n = x.numel()
    in_bytes = n * x.element_size()
    scale = torch.ones(1)
    q, scale_inv, _ = ops.quantize_current(x, E4M3)
    return [
        # Delayed scaling: one pass (cast + amax of the same read).
        ("quantize+amax", lambda: ops.quantize_with_amax(x, scale, E4M3), lambda f: f(x, scale),
         _ref_quantize_amax, in_bytes + n),
        # Current scaling reads the input twice (amax, then cast), so by this
        # byte count its ceiling is (in + n) / (2 in + n) of memcpy's rate.
        ("quantize_current", lambda: ops.quantize_current(x, E4M3), lambda f: f(x, E4M3),
         ref.quantize_current, in_bytes + n),
        ("cast+transpose", lambda: ops.quantize_fused(x, E4M3, scale, columnwise=True),
         lambda f: f(x, scale), _ref_cast_transpose, in_bytes + 2 * n),
        ("dequantize", lambda: ops.dequantize(q, scale_inv, x.dtype), lambda f: f(q, scale_inv, x.dtype),
         ref.dequantize, n + in_bytes),
    ]


def bench_quantize(sizes: list[int], repeats: int, warmup: int) -> list[dict]:
    rows = []
    compiled = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n // ROW_LENGTH, ROW_LENGTH).to(dtype)
            copy_dst = torch.empty_like(x)
            for name, ours, call_ref, ref_fn, nbytes in _quantize_cases(x):
                if name not in compiled:
                    compiled[name] = torch.compile(ref_fn)
                t = measure(
                    {
                        "ours": ours,
                        "eager": lambda: call_ref(ref_fn),
                        "compiled": lambda: call_ref(compiled[name]),
                        "memcpy": lambda: copy_dst.copy_(x),
                    },
                    repeats,
                    warmup,
                )
                copy_bytes = 2 * x.numel() * x.element_size()
                gbs = {k: (copy_bytes if k == "memcpy" else nbytes) / v[0] / 1e9 for k, v in t.items()}
                best_gbs = {k: (copy_bytes if k == "memcpy" else nbytes) / v[1] / 1e9 for k, v in t.items()}
                rows.append({
                    "op": name, "dtype": str(dtype).removeprefix("torch."), "numel": n,
                    **{f"{k}_gbs": v for k, v in gbs.items()},
                    "ours_ms": t["ours"][0] * 1e3,
                    "vs_eager": t["eager"][0] / t["ours"][0],
                    "vs_compiled": t["compiled"][0] / t["ours"][0],
                    "of_memcpy": gbs["ours"] / gbs["memcpy"],
                    "ours_faults": t["ours"][2],
                    "best_of": {f"{k}_gbs": v for k, v in best_gbs.items()},
                })
                print_quantize_row(rows[-1])
    return rows


QUANTIZE_HEADER = (
    f"{'op':<17}{'dtype':<10}{'numel':>10}{'ours GB/s':>11}{'eager':>8}{'compiled':>10}{'memcpy':>8}"
    f"{'x eager':>9}{'x compiled':>12}{'of memcpy':>11}{'faults':>8}"
)


def print_quantize_row(r: dict) -> None:
    print(
        f"{r['op']:<17}{r['dtype']:<10}{r['numel']:>10}{r['ours_gbs']:>11.1f}{r['eager_gbs']:>8.1f}"
        f"{r['compiled_gbs']:>10.1f}{r['memcpy_gbs']:>8.1f}{r['vs_eager']:>9.2f}{r['vs_compiled']:>12.2f}"
        f"{r['of_memcpy']:>10.0%}{r.get('ours_faults', float('nan')):>8.0f}",
        flush=True,
    )


# ---------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------


def _scaled_mm_cpu(a, sa, b, sb):
    return torch._scaled_mm(a, b.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=torch.float32)


def bench_gemm(shapes: list[tuple[int, int, int]], repeats: int, warmup: int, slow_call_s: float) -> list[dict]:
    rows = []
    # torch._scaled_mm's CPU rate, first from one call at a small probe size (a CPU build may take
    # minutes for one call at the benchmark's sizes); a shape is timed only where it predicts a call
    # under slow_call_s.
    probe = min(256, *(min(shape) for shape in shapes))
    pa, psa, _ = ops.quantize_current(torch.randn(probe, probe), E4M3)
    scaled_rate = 2.0 * probe**3 / time_slow(lambda: _scaled_mm_cpu(pa, psa, pa, psa), 1, slow_call_s) / 1e9
    for m, n, k in shapes:
        a, sa, _ = ops.quantize_current(torch.randn(m, k), E4M3)
        b, sb, _ = ops.quantize_current(torch.randn(n, k), E4M3)
        a_hp, b_hp = ref.dequantize(a, sa, torch.float32), ref.dequantize(b, sb, torch.float32)
        a_bf16, b_bf16 = a_hp.bfloat16(), b_hp.bfloat16()
        flop = 2.0 * m * n * k
        t = measure(
            {
                "ours": lambda: ops.fp8_gemm(a, sa, b, sb, torch.float32),
                # bf16 out beside bf16 mm: the same output bytes (a float32 output of 32 MiB or more
                # is a fresh mapping each call, whose page faults can cost as much as the GEMM).
                "ours_bf16": lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16),
                "mm_fp32": lambda: torch.mm(a_hp, b_hp.t()),
                "mm_bf16": lambda: torch.mm(a_bf16, b_bf16.t()),
            },
            repeats,
            warmup,
        )
        row = {"m": m, "n": n, "k": k, **{f"{name}_gflops": flop / v[0] / 1e9 for name, v in t.items()}}
        if flop / (scaled_rate * 1e9) <= slow_call_s:
            t_scaled = time_slow(lambda: _scaled_mm_cpu(a, sa, b, sb), repeats, slow_call_s)
            scaled_rate, probe = flop / t_scaled / 1e9, m
            row["scaled_mm_gflops"] = scaled_rate
        else:
            row["scaled_mm_skipped"] = f"too slow: {scaled_rate:.3g} GFLOP/s at {probe}"
        row["vs_mm_fp32"] = row["ours_gflops"] / row["mm_fp32_gflops"]
        row["vs_mm_bf16"] = row["ours_bf16_gflops"] / row["mm_bf16_gflops"]
        if "scaled_mm_gflops" in row:
            row["vs_scaled_mm"] = row["ours_gflops"] / row["scaled_mm_gflops"]
        rows.append(row)
        print_gemm_row(row)
    return rows


GEMM_HEADER = (
    f"{'M x N x K':<22}{'ours fp32 out':>14}{'mm fp32':>10}{'ours bf16 out':>14}{'mm bf16':>10}{'x mm fp32':>11}"
    f"{'x mm bf16':>11}"
    f"{'_scaled_mm':>12}{'x _scaled_mm':>14}"
)


def print_gemm_row(r: dict) -> None:
    shape = f"{r['m']}x{r['n']}x{r['k']}"
    if "scaled_mm_gflops" in r:
        scaled = f"{r['scaled_mm_gflops']:>12.3g}{r['vs_scaled_mm']:>14.1f}"
    else:
        scaled = f"  skipped ({r['scaled_mm_skipped']})"
    print(
        f"{shape:<22}{r['ours_gflops']:>14.1f}{r['mm_fp32_gflops']:>10.1f}{r['ours_bf16_gflops']:>14.1f}"
        f"{r['mm_bf16_gflops']:>10.1f}"
        f"{r['vs_mm_fp32']:>11.2f}{r['vs_mm_bf16']:>11.2f}{scaled}",
        flush=True,
    )


def cpu_model() -> str:
    """The CPU's model name and the flags that decide the GEMM paths (Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in cpuinfo.read_text().split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    amx = "" if "amx_tile" in flags else "; no AMX"
    return f"{fields.get('model name', platform.machine())} ({', '.join(wanted) or 'no AVX-512'}{amx})"


def cpu_path() -> dict:
    """The CPU path the kernels take and why (builds before cpu_isa_info() give the name only)."""
    if hasattr(_C, "cpu_isa_info"):
        return _C.cpu_isa_info()
    return {"isa": _C.cpu_isa(), "reason": "not reported by this build"}


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxNxK' -> (M, N, K)."""
    m, n, k = (int(v) for v in text.lower().split("x"))
    return m, n, k


# ---------------------------------------------------------------------------
# Block scaling: blockwise quantize and the block-scaled GEMM
# ---------------------------------------------------------------------------

# (name, block_shape, scale dtype, power_2_scale) of each recipe's operands.
BLOCK_QUANTIZE_CASES = [
    ("1x128", (1, 128), torch.float32, True),
    ("128x128", (128, 128), torch.float32, True),
    ("1x32 e8m0", (1, 32), torch.float8_e8m0fnu, False),
    ("rowwise", (1, ROW_LENGTH), torch.float32, True),
]
# (name, a block, b block, scale dtype): Float8BlockScaling's fprop, wgrad, MXFP8, rowwise.
BLOCK_GEMM_CASES = [
    ("1x128 x 128x128", (1, 128), (128, 128), torch.float32),
    ("1x128 x 1x128", (1, 128), (1, 128), torch.float32),
    ("1x32 x 1x32 e8m0", (1, 32), (1, 32), torch.float8_e8m0fnu),
    ("rowwise", None, None, torch.float32),
]


def _quantize_blockwise_ref(x: torch.Tensor, block, scale_dtype, power_2: bool):
    """reference.quantize_blockwise_ref, E8M0 scale_inv returned as its uint8 bits: inductor (torch
    2.13) has no CPU E8M0 dtype, so the compiled baseline stops short of that free reinterpretation."""
    if scale_dtype != torch.float8_e8m0fnu:
        return ref.quantize_blockwise_ref(x, E4M3, block, scale_dtype, power_2)
    (bm, bk), (m, k) = block, x.shape
    limit = torch.finfo(E4M3).max
    e = ref.e8m0_exponent(ref.block_amax(x, (bm, bk)), limit)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), -e)
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    return torch.clamp(x.float() * full, -limit, limit).to(E4M3), (e + 127).to(torch.uint8)


def _block_quantize_ref(block, scale_dtype, power_2, columnwise: bool) -> Callable:
    """The reference of one blockwise-quantize case: row-major blocks, and the transposed copy's."""

    def quantize(x: torch.Tensor):
        out = _quantize_blockwise_ref(x, block, scale_dtype, power_2)
        if not columnwise:
            return out
        block_t = columnwise_block_shape(tuple(block), *x.shape)
        # x.t() made contiguous: inductor (torch 2.13) fails an assertion in its loop split on the
        # block reshape of the transposed view.
        return out + _quantize_blockwise_ref(x.t().contiguous(), block_t, scale_dtype, power_2)

    return quantize


def bench_block(sizes: list[int], shapes: list[tuple[int, int, int]], repeats: int, warmup: int) -> dict:
    """Blockwise quantize GB/s vs memcpy; block-scaled GEMM vs the tensorwise FP8 GEMM and fp32 torch.mm."""
    quantize_rows, gemm_rows = [], []
    print(
        f"{'block quantize':<24}{'dtype':<10}{'numel':>10}{'layouts':>9}{'GB/s':>8}{'best':>8}{'eager':>8}"
        f"{'compiled':>10}{'memcpy':>8}{'best':>8}{'x compiled':>12}{'of memcpy':>11}"
    )
    compiled = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n // ROW_LENGTH, ROW_LENGTH).to(dtype)
            copy_dst = torch.empty_like(x)
            for name, block, scale_dtype, p2 in BLOCK_QUANTIZE_CASES:
                for columnwise in (False, True):
                    ref_fn = _block_quantize_ref(block, scale_dtype, p2, columnwise)
                    if (name, columnwise) not in compiled:
                        compiled[(name, columnwise)] = torch.compile(ref_fn)
                    compiled_fn = compiled[(name, columnwise)]
                    t = measure(
                        {
                            "ours": lambda: ops.quantize_blockwise_fused(
                                x, E4M3, block, scale_dtype, p2, columnwise=columnwise
                            ),
                            "eager": lambda: ref_fn(x),
                            "compiled": lambda: compiled_fn(x),
                            "memcpy": lambda: copy_dst.copy_(x),
                        },
                        repeats,
                        warmup,
                    )
                    nbytes = n * x.element_size() + n * (2 if columnwise else 1)
                    row = {
                        "op": name, "dtype": str(dtype).removeprefix("torch."), "numel": n,
                        "layouts": "row+col" if columnwise else "row",
                        "ours_gbs": nbytes / t["ours"][0] / 1e9,
                        "ours_best_gbs": nbytes / t["ours"][1] / 1e9,
                        "memcpy_gbs": 2 * n * x.element_size() / t["memcpy"][0] / 1e9,
                        "memcpy_best_gbs": 2 * n * x.element_size() / t["memcpy"][1] / 1e9,
                        "eager_gbs": nbytes / t["eager"][0] / 1e9,
                        "compiled_gbs": nbytes / t["compiled"][0] / 1e9,
                        "vs_eager": t["eager"][0] / t["ours"][0],
                        "vs_compiled": t["compiled"][0] / t["ours"][0],
                    }
                    row["of_memcpy"] = row["ours_gbs"] / row["memcpy_gbs"]
                    quantize_rows.append(row)
                    print(
                        f"{name:<24}{row['dtype']:<10}{n:>10}{row['layouts']:>9}{row['ours_gbs']:>8.1f}"
                        f"{row['ours_best_gbs']:>8.1f}{row['eager_gbs']:>8.1f}{row['compiled_gbs']:>10.1f}"
                        f"{row['memcpy_gbs']:>8.1f}{row['memcpy_best_gbs']:>8.1f}{row['vs_compiled']:>11.2f}x"
                        f"{row['of_memcpy']:>10.0%}",
                        flush=True,
                    )
    print(f"\n{'block GEMM':<20}{'M x N x K':<18}{'GFLOP/s':>9}{'tensorwise':>12}{'mm fp32':>9}{'of tensorwise':>15}")
    for m, n, k in shapes:
        a_hp, b_hp = torch.randn(m, k), torch.randn(n, k)
        a_t, sa_t, _ = ops.quantize_current(a_hp, E4M3)
        b_t, sb_t, _ = ops.quantize_current(b_hp, E4M3)
        flop = 2.0 * m * n * k
        for name, a_block, b_block, scale_dtype in BLOCK_GEMM_CASES:
            a, sa = ops.quantize_blockwise(a_hp, E4M3, a_block or (1, k), scale_dtype, True)
            b, sb = ops.quantize_blockwise(b_hp, E4M3, b_block or (1, k), scale_dtype, True)
            t = measure(
                {
                    "ours": lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16),
                    "tensorwise": lambda: ops.fp8_gemm(a_t, sa_t, b_t, sb_t, torch.bfloat16),
                    "mm": lambda: torch.mm(a_hp, b_hp.t()),
                },
                repeats,
                warmup,
            )
            row = {"case": name, "m": m, "n": n, "k": k}
            row.update({f"{key}_gflops": flop / v[0] / 1e9 for key, v in t.items()})
            row["of_tensorwise"] = row["ours_gflops"] / row["tensorwise_gflops"]
            gemm_rows.append(row)
            print(
                f"{name:<20}{f'{m}x{n}x{k}':<18}{row['ours_gflops']:>9.1f}{row['tensorwise_gflops']:>12.1f}"
                f"{row['mm_gflops']:>9.1f}{row['of_tensorwise']:>14.0%}",
                flush=True,
            )
    return {"quantize": quantize_rows, "gemm": gemm_rows}


# (name, quantize_nvfp4 options): the Linear's operands under NVFP4BlockScaling (x and grad_output with the
# RHT columnwise copy, the weight's 16x16 tiles, grad_output's stochastic rounding) and the plain 1x16 copies.
NVFP4_QUANTIZE_CASES = [
    ("1x16", {}),
    ("1x16 +col", {"columnwise": True}),
    ("1x16 +col rht", {"columnwise": True, "rht": True}),
    ("16x16 +col", {"columnwise": True, "scaling_2d": True}),
    ("1x16 +col rht sr", {"columnwise": True, "rht": True, "stochastic_rounding": True, "seed": 7}),
]


def bench_nvfp4(sizes: list[int], shapes: list[tuple[int, int, int]], repeats: int, warmup: int) -> dict:
    """NVFP4 quantize GB/s vs memcpy; the NVFP4 GEMM vs the tensorwise and block FP8 GEMMs and fp32 torch.mm."""
    quantize_rows, gemm_rows = [], []
    print(f"{'nvfp4 quantize':<20}{'dtype':<10}{'numel':>10}{'GB/s':>8}{'best':>8}{'memcpy':>8}{'of memcpy':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n // ROW_LENGTH, ROW_LENGTH).to(dtype)
            amax, amax_t = nvfp4.nvfp4_amax(x), nvfp4.nvfp4_amax(x, rht=True)
            copy_dst = torch.empty_like(x)
            for name, options in NVFP4_QUANTIZE_CASES:
                col_amax = amax_t if options.get("rht") else None
                t = measure(
                    {
                        "ours": lambda: nvfp4.quantize_nvfp4(x, amax, col_amax, **options),
                        "memcpy": lambda: copy_dst.copy_(x),
                    },
                    repeats,
                    warmup,
                )
                copies = 2 if options.get("columnwise") else 1
                nbytes = n * x.element_size() + copies * (n // 2 + n // 16)
                row = {
                    "op": name, "dtype": str(dtype).removeprefix("torch."), "numel": n,
                    "ours_gbs": nbytes / t["ours"][0] / 1e9, "ours_best_gbs": nbytes / t["ours"][1] / 1e9,
                    "memcpy_gbs": 2 * n * x.element_size() / t["memcpy"][0] / 1e9,
                }
                row["of_memcpy"] = row["ours_gbs"] / row["memcpy_gbs"]
                quantize_rows.append(row)
                print(
                    f"{name:<20}{row['dtype']:<10}{n:>10}{row['ours_gbs']:>8.2f}{row['ours_best_gbs']:>8.2f}"
                    f"{row['memcpy_gbs']:>8.1f}{row['of_memcpy']:>10.1%}",
                    flush=True,
                )
    print(f"\n{'nvfp4 GEMM':<12}{'M x N x K':<18}{'GFLOP/s':>9}{'fp8 tensorwise':>16}{'fp8 block':>11}{'mm fp32':>9}"
          f"{'of fp8':>8}{'of block':>10}{'of mm':>8}")
    for m, n, k in shapes:
        a_hp, b_hp = torch.randn(m, k), torch.randn(n, k)
        a_t, sa_t, _ = ops.quantize_current(a_hp, E4M3)
        b_t, sb_t, _ = ops.quantize_current(b_hp, E4M3)
        # The FP8 block GEMM of the same shape: 1x128 activations x 128x128 weights (DeepSeek-V3).
        a_b, sa_b = ops.quantize_blockwise(a_hp, E4M3, (1, 128), torch.float32, True)
        b_b, sb_b = ops.quantize_blockwise(b_hp, E4M3, (128, 128), torch.float32, True)
        qa = nvfp4.quantize_nvfp4(a_hp, nvfp4.nvfp4_amax(a_hp))
        qb = nvfp4.quantize_nvfp4(b_hp, nvfp4.nvfp4_amax(b_hp))
        t = measure(
            {
                "ours": lambda: nvfp4.nvfp4_gemm(qa.data, qa.scale, qa.global_scale, qb.data, qb.scale,
                                                 qb.global_scale, torch.bfloat16),
                "fp8": lambda: ops.fp8_gemm(a_t, sa_t, b_t, sb_t, torch.bfloat16),
                "fp8_block": lambda: ops.fp8_gemm(a_b, sa_b, b_b, sb_b, torch.bfloat16),
                "mm": lambda: torch.mm(a_hp, b_hp.t()),
            },
            repeats,
            warmup,
        )
        flop = 2.0 * m * n * k
        row = {"m": m, "n": n, "k": k}
        row.update({f"{key}_gflops": flop / v[0] / 1e9 for key, v in t.items()})
        row["of_fp8"] = row["ours_gflops"] / row["fp8_gflops"]
        row["of_fp8_block"] = row["ours_gflops"] / row["fp8_block_gflops"]
        row["of_mm"] = row["ours_gflops"] / row["mm_gflops"]
        gemm_rows.append(row)
        print(
            f"{'nvfp4':<12}{f'{m}x{n}x{k}':<18}{row['ours_gflops']:>9.1f}{row['fp8_gflops']:>16.1f}"
            f"{row['fp8_block_gflops']:>11.1f}{row['mm_gflops']:>9.1f}{row['of_fp8']:>8.0%}"
            f"{row['of_fp8_block']:>10.0%}{row['of_mm']:>8.0%}",
            flush=True,
        )
    return {"quantize": quantize_rows, "gemm": gemm_rows}


# ---------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (CI smoke test)")
    parser.add_argument(
        "--only", choices=["quantize", "gemm", "block", "block-quantize", "nvfp4"],
        help="run one part (block-quantize: no GEMMs)"
    )
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/kernels_<tag>.json)")
    parser.add_argument("--tag", default=None, help="name for the default JSON path (default: host name)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--slow-call-s", type=float, default=5.0, help="longest torch._scaled_mm call to time")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, help="GEMM shapes MxNxK (default: all)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="thread: CPU time, needs --threads 1")
    args = parser.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1")
    global CLOCK
    CLOCK = args.clock
    repeats = args.repeats or (3 if args.quick else 10)
    if args.threads:
        torch.set_num_threads(args.threads)

    result = {
        "command": " ".join(
            [f"TL_CPU_ISA={os.environ.get('TL_CPU_ISA')}"] * ("TL_CPU_ISA" in os.environ)
            + [shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]]
        ),
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "cpu_path": cpu_path(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "median of interleaved calls; best_of: minimum",
        "clock": "CPU time of the calling thread" if args.clock == "thread" else "wall clock",
        # Other work on a shared machine slows every candidate alike, but
        # absolute numbers are only as good as this.
        "loadavg_before": os.getloadavg(),
    }
    print(f"# {result['command']}\n# {result['cpu_model']}, torch {result['torch']}, {result['torch_threads']} threads")
    print(f"# CPU path: {result['cpu_path']['isa']} ({result['cpu_path']['reason']})")
    if args.only in (None, "quantize"):
        print("\n" + QUANTIZE_HEADER)
        sizes = QUICK_QUANTIZE_SIZES if args.quick else QUANTIZE_SIZES
        result["quantize"] = bench_quantize(sizes, repeats, args.warmup)
    if args.only in (None, "gemm"):
        print("\n" + GEMM_HEADER)
        shapes = args.shapes or (QUICK_GEMM if args.quick else [(s, s, s) for s in GEMM_SQUARE] + GEMM_LLM)
        result["gemm"] = bench_gemm(shapes, repeats, args.warmup, args.slow_call_s)
    if args.only in (None, "block", "block-quantize"):
        shapes = QUICK_GEMM if args.quick else args.shapes or [(1024, 1024, 1024), (2048, 2048, 2048)]
        shapes = [] if args.only == "block-quantize" else shapes
        result["block"] = bench_block(QUICK_QUANTIZE_SIZES if args.quick else [16 * MIB], shapes, repeats, args.warmup)
    if args.only in (None, "nvfp4"):
        shapes = QUICK_GEMM if args.quick else args.shapes or [(1024, 1024, 1024), (2048, 2048, 2048)]
        print()
        result["nvfp4"] = bench_nvfp4(QUICK_QUANTIZE_SIZES if args.quick else [16 * MIB], shapes, repeats, args.warmup)

    tag = args.tag or (result["host"] + ("_quick" if args.quick else ""))
    path = args.json or Path(__file__).resolve().parent / "results" / f"kernels_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result["loadavg_after"] = os.getloadavg()
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
