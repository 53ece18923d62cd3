"""The CUDA block-scaled GEMM's routing (cuBLASLt's block-scaled matmul or Triton), the scale
layouts cuBLASLt reads, and the per-device kernels of the custom ops.

The decision and the layouts are plain Python and torch, checked here on the CPU
with fake capabilities and versions; the layouts also against torch's own
helper. The GPU tests (marked ``cuda``) run cuBLASLt against the float64
reference and torch._scaled_mm, and skip without a GPU and a CUDA build.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from blockwise_cases import E4M3, E5M2, E8M0, GEMM_SCALINGS, block_operands, dequantized_mm_fp32
from tolerances import assert_bitwise_equal, assert_close_to_reference

from transformer_linear import _C, ops, reference
from transformer_linear.ops import gemm_block_cuda, torch_cuda
from transformer_linear.ops.descriptors import desc
from transformer_linear.ops.gemm_block_cuda import cublaslt_block_applies, cublaslt_operands_fit, cublaslt_scale

HAS_CUDA_KERNELS = torch.cuda.is_available() and _C.built_with_cuda()
BUILD = {"runtime_version": 13000, "driver_version": 13000, "archs": "80,90-real,100-real"}
V128, V129 = 120800, 120900
PAIRS = {
    "1x128_x_128x128": ("BlockWise1x128", "BlockWise128x128"),
    "128x128_x_1x128": ("BlockWise128x128", "BlockWise1x128"),
    "1x128_x_1x128": ("BlockWise1x128", "BlockWise1x128"),
    "1x32_x_1x32_e8m0": ("BlockWise1x32", "BlockWise1x32"),
    "rowwise": ("RowWise", "RowWise"),
}


def build(header: int, library: int, **overrides) -> dict:
    return {**BUILD, "cublas_header_version": header, "cublaslt_version": library, **overrides}


# ---------------------------------------------------------------------------
# Which kernel runs (CPU: fake capabilities and versions)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pair,capability,info,expected",
    [
        ("1x32_x_1x32_e8m0", (10, 0), build(V128, V128), True),  # MXFP8 on B200 with cuBLAS 12.8
        ("1x32_x_1x32_e8m0", (10, 3), build(V129, 131000), True),
        ("1x32_x_1x32_e8m0", (9, 0), build(V129, V129), False),  # no MXFP8 on Hopper
        ("1x32_x_1x32_e8m0", (10, 0), build(120700, V129), False),  # headers older than 12.8
        ("1x128_x_128x128", (9, 0), build(V129, V129), True),
        ("128x128_x_1x128", (9, 0), build(V129, V129), True),
        ("1x128_x_1x128", (9, 0), build(V129, V129), True),
        ("1x128_x_128x128", (9, 0), build(V128, V129), False),  # built against 12.8 headers
        ("1x128_x_128x128", (9, 0), build(V129, V128), False),  # loaded an older libcublasLt
        ("1x128_x_128x128", (10, 0), build(V129, V129), False),  # 1x128 / 128x128: sm_90 only
        ("1x128_x_128x128", (8, 9), build(V129, V129), False),
        ("rowwise", (9, 0), build(V129, V129), True),
        ("rowwise", (10, 0), build(V129, V129), False),
        ("1x128_x_128x128", (9, 0), None, False),  # a CPU-only build
        ("1x128_x_128x128", (9, 0), build(V129, V129, driver_version=12080), False),  # driver too old
        ("1x32_x_1x32_e8m0", (12, 0), build(V129, V129, archs="80,90-real"), True),  # PTX serves sm_120
        ("1x128_x_128x128", (9, 0), {**BUILD}, False),  # a build that reports no cuBLAS version
    ],
)
def test_cublaslt_block_decision(pair, capability, info, expected):
    a_scaling, b_scaling = PAIRS[pair]
    assert cublaslt_block_applies(a_scaling, b_scaling, capability, info) is expected


@pytest.mark.parametrize(
    "pair",
    [
        ("BlockWise128x128", "BlockWise128x128"),
        ("TensorWise", "TensorWise"),
        # The mixed pairs fp8_gemm runs with the package's kernels only (after scaled_mm's six).
        *ops.fp8_gemm_scalings()[6:],
    ],
)
def test_pairs_cublaslt_has_not_take_triton(pair):
    for capability in [(9, 0), (10, 0)]:
        assert not cublaslt_block_applies(*pair, capability, build(V129, V129))


@pytest.mark.parametrize("pair", list(PAIRS.values()))
def test_pair_table_lives_in_the_extension(pair):
    """Every build answers from the C++ table (csrc/common/cublaslt_block_pairs.cpp), CPU-only ones too:
    each pair from its cuBLAS version on, never one version earlier, never for unknown names."""
    major = 10 if pair[0] == "BlockWise1x32" else 9
    version = V128 if pair[0] == "BlockWise1x32" else V129
    assert _C.cublaslt_block_pair_runs(*pair, major, 0, version)
    assert not _C.cublaslt_block_pair_runs(*pair, major, 0, version - 1)
    assert not _C.cublaslt_block_pair_runs(pair[0], "NoSuchScaling", major, 0, version)
    assert not _C.cublaslt_block_pair_runs(*reversed(pair), 8, 9, version)


def fp8(rows: int, cols: int, fmt=E4M3) -> torch.Tensor:
    return torch.randn(rows, cols).to(fmt)


@pytest.mark.parametrize(
    "m,n,k,pair,fits",
    [
        (256, 512, 1024, "1x128_x_128x128", True),
        (1000, 512, 1024, "1x128_x_128x128", True),
        (1001, 512, 1024, "128x128_x_1x128", True),  # M is free when a has 128x128 blocks
        (1001, 512, 1024, "1x128_x_128x128", False),  # M % 8: TE's outer-dimension rule
        (256, 520, 1024, "1x128_x_1x128", False),  # N % 16
        (256, 512, 1040, "1x128_x_1x128", False),  # K not whole 128-blocks
        (256, 512, 1040, "rowwise", True),
        (256, 512, 96, "1x32_x_1x32_e8m0", True),
        (256, 512, 80, "1x32_x_1x32_e8m0", False),  # K not whole 32-blocks
        (256, 512, 0, "rowwise", False),
    ],
)
def test_operand_rules(m, n, k, pair, fits):
    assert cublaslt_operands_fit(fp8(m, k), fp8(n, k), *PAIRS[pair]) is fits


def test_operand_layout_rules():
    a, b = fp8(64, 256), fp8(64, 256)
    pair = PAIRS["1x128_x_128x128"]
    assert cublaslt_operands_fit(a, b, *pair)
    assert not cublaslt_operands_fit(a.t().contiguous().t(), b, *pair), "column-major a"
    assert not cublaslt_operands_fit(a, fp8(256, 64).t(), *pair), "column-major b"
    big = fp8(64, 256 + 8)
    assert not cublaslt_operands_fit(big[:, :256], b, *pair), "leading dimension off 16"
    flat = fp8(1, 64 * 256 + 1).flatten()
    assert not cublaslt_operands_fit(flat[1:].view(64, 256), b, *pair), "address off 16"
    assert not cublaslt_operands_fit(fp8(64, 256, E5M2), fp8(64, 256, E5M2), *pair), "e5m2 x e5m2"
    assert cublaslt_operands_fit(fp8(64, 256, E5M2), b, *pair)


# ---------------------------------------------------------------------------
# The scale layouts cuBLASLt reads (csrc/cuda/gemm_block_cuda.h)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 5), (256, 32), (300, 7)])
def test_mx_scales_are_torchs_blocked_layout(rows, cols):
    """The 128x4-tile swizzle equals torch's own to_blocked and the documented index formula."""
    common_quantized = pytest.importorskip("torch.testing._internal.common_quantized")
    bits = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    ours = cublaslt_scale(bits.view(E8M0), "BlockWise1x32", rows)
    assert_bitwise_equal(ours, common_quantized.to_blocked(bits), what="vs torch to_blocked")
    tile_cols = -(-cols // 4)
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2), (min(rows - 1, 33), min(cols - 1, 2))]:
        tile = (r // 128) * tile_cols + c // 4
        offset = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert int(ours[offset]) == int(bits[r, c]), (r, c)


@pytest.mark.parametrize("rows", [1, 8, 13, 256])
def test_1x128_scales_are_row_major_in_k_blocks(rows):
    """(Kb, round_up(R, 4)), R fastest: torch's "outer-dim-major" 1x128 scales, padded like TE's."""
    s = torch.rand(rows, 3) + 0.5
    out = cublaslt_scale(s, "BlockWise1x128", rows)
    assert out.is_contiguous() and out.shape == (3, -(-rows // 4) * 4)
    assert torch.equal(out[:, :rows], s.t()) and not out[:, rows:].any()
    if rows % 4 == 0:  # torch._scaled_mm's stride rule for a's 1x128 scales: (1, M)
        view = out.t()
        assert view.shape == (rows, 3) and view.stride() == (1, rows)


@pytest.mark.parametrize("row_blocks,k_blocks", [(1, 1), (2, 3), (3, 4), (2, 9)])
def test_128x128_scales_pad_k_blocks_to_four(row_blocks, k_blocks):
    s = torch.rand(row_blocks, k_blocks) + 0.5
    out = cublaslt_scale(s, "BlockWise128x128", row_blocks * 128)
    padded = -(-k_blocks // 4) * 4
    assert out.is_contiguous() and out.shape == (row_blocks, padded)
    assert torch.equal(out[:, :k_blocks], s) and not out[:, k_blocks:].any()
    # torch._scaled_mm's rule: shape (ceil(R/128), Kb), strides (round_up(Kb, 4), 1)
    assert out[:, :k_blocks].stride() == (padded, 1)


def test_rowwise_scales_are_a_column():
    s = torch.rand(5, 1)
    assert torch.equal(cublaslt_scale(s, "RowWise", 5), s)
    with pytest.raises(ValueError, match="TensorWise"):
        cublaslt_scale(torch.ones(1), "TensorWise", 5)


def lt_scale_reader(scale: torch.Tensor, scaling: str, rows: int, k: int):
    """scale(r, kb) as cuBLASLt reads the buffer it is handed (the layouts of gemm_block_cuda.h),
    written from the layout descriptions, independently of cublaslt_scale."""
    flat = scale.reshape(-1)
    if scaling == "RowWise":
        return lambda r, kb: float(flat[r])
    if scaling == "BlockWise1x128":
        ld = -(-rows // 4) * 4
        return lambda r, kb: float(flat[kb * ld + r])
    if scaling == "BlockWise128x128":
        ld = -(-(-(-k // 128)) // 4) * 4
        return lambda r, kb: float(flat[(r // 128) * ld + kb])
    tiles_per_row = -(-(-(-k // 32)) // 4)  # BlockWise1x32: 128x4 tiles of E8M0 bits
    def read(r, kb):
        tile = (r // 128) * tiles_per_row + kb // 4
        return 2.0 ** (int(flat[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + kb % 4]) - 127)
    return read


def fake_cublaslt(calls):
    """A stand-in for _C.fp8_gemm_blockwise_cublaslt on CPU tensors: checks what it is handed and
    computes D in float64 from the operands and the scales as cuBLASLt would read them."""

    def run(a, a_scale, a_scaling, b, b_scale, b_scaling, bias, d, workspace, stream):
        calls.append((a_scaling, b_scaling))
        (m, k), n = a.shape, b.shape[0]
        assert a_scale.is_contiguous() and b_scale.is_contiguous() and workspace.dtype == torch.uint8
        width = {"RowWise": k, "BlockWise1x32": 32}.get
        operands = []
        for t, s, scaling, rows in ((a, a_scale, a_scaling, m), (b, b_scale, b_scaling, n)):
            read, bk = lt_scale_reader(s, scaling, rows, k), width(scaling, 128)
            grid = torch.tensor([[read(r, kb) for kb in range(-(-k // bk))] for r in range(rows)],
                                dtype=torch.float64)
            operands.append(t.double() * grid.repeat_interleave(bk, dim=1)[:, :k])
        out = operands[0] @ operands[1].t()
        d.copy_(out if bias is None else out + bias.double())
        return True

    return run


@pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
@pytest.mark.parametrize("m,n,k", [(136, 48, 384), (8, 16, 128), (264, 32, 96)], ids=str)
def test_scales_handed_to_cublaslt_read_back_as_the_reference(monkeypatch, scaling, m, n, k):
    """fp8_gemm_cublaslt on CPU tensors with a fake GPU and binding: the scales it hands over, read
    with cuBLASLt's layouts, give the reference GEMM (layout and plumbing, no GPU needed)."""
    calls = []
    gpu = (10, 0) if scaling == "1x32_x_1x32_e8m0" else (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu)
    monkeypatch.setattr(torch_cuda, "_BUILD_INFO", build(V129, V129))
    monkeypatch.setattr(gemm_block_cuda, "desc", lambda t, op, name: t)
    monkeypatch.setattr(gemm_block_cuda, "stream_for", lambda t: 0)
    fake_c = type("FakeC", (), {"fp8_gemm_blockwise_cublaslt": staticmethod(fake_cublaslt(calls))})
    monkeypatch.setattr(gemm_block_cuda, "_C", fake_c)
    a, sa, b, sb = block_operands(m, n, k, E4M3, E4M3, scaling, power_2=False)
    a_scaling, _, b_scaling, _ = ops.resolve_gemm_scalings(a, sa, b, sb)  # as ops.fp8_gemm resolves them
    whole_blocks = a_scaling == "RowWise" or k % (32 if a_scaling == "BlockWise1x32" else 128) == 0
    bias = torch.randn(n)
    d = gemm_block_cuda.fp8_gemm_cublaslt(a, sa, b, sb, torch.float32, bias, a_scaling, b_scaling)
    if not whole_blocks:
        assert d is None and not calls, "K not whole blocks is the Triton kernel's case"
        return
    assert calls == [(a_scaling, b_scaling)], "the resolved scalings, handed down as they are"
    expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64, bias)
    assert_close_to_reference(d, expected, dequantized_mm_fp32(a, sa, b, sb, torch.float32, bias), what=scaling)


@pytest.mark.skipif(_C.built_with_cuda(), reason="a CPU-only build's binding")
def test_cpu_only_build_has_no_cublaslt_block_matmul():
    with pytest.raises(TypeError, match="no CUDA kernels"):
        _C.fp8_gemm_blockwise_cublaslt(None, None, "BlockWise1x128", None, None, "BlockWise1x128", None, None,
                                       None, 0)


# ---------------------------------------------------------------------------
# Per-device kernels of the custom ops
# ---------------------------------------------------------------------------

OPS = ["amax", "quantize", "dequantize", "fp8_gemm", "fp8_gemm_accumulate", "fp8_gemm_blockwise",
       "quantize_blockwise"]


@pytest.mark.parametrize("name", OPS)
def test_each_op_has_a_cpu_and_a_cuda_kernel(name):
    """Registered per device (no catch-all body that branches on the device)."""
    qualified = f"transformer_linear::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd")


@pytest.mark.parametrize("fallback_active", [True, False])
def test_cuda_kernel_checks_then_picks_extension_or_fallback(monkeypatch, fallback_active):
    calls = []
    monkeypatch.setattr(torch_cuda, "active", lambda t: fallback_active)

    def check(*args):
        calls.append(("check", args))

    kernel = torch_cuda.cuda_kernel(lambda *a: ("extension", a), lambda *a: ("fallback", a), check)
    x = torch.ones(2)
    assert kernel(x, 3) == ("fallback" if fallback_active else "extension", (x, 3))
    assert calls == [("check", (x, 3))]


def test_cuda_kernel_checks_reach_the_fallback(monkeypatch):
    """A bad argument is the op's error on the fallback path too, not the fallback's behaviour."""
    monkeypatch.setattr(torch_cuda, "active", lambda t: True)
    kernel = torch_cuda.cuda_kernel(ops._dequantize_kernel, torch_cuda.dequantize, ops._dequantize_checks)
    q, s = torch.ones(2, 2).to(E4M3), torch.ones(1)
    with pytest.raises(TypeError, match="dequantize: argument 'out_dtype'"):
        kernel(q, s, torch.int32)
    assert_bitwise_equal(kernel(q, s, torch.float32), reference.dequantize(q, s, torch.float32))


# ---------------------------------------------------------------------------
# On a GPU: cuBLASLt (where the decision says so) against the reference and torch
# ---------------------------------------------------------------------------


def torch_scales(sa, sb, a_scaling, b_scaling, m, n):
    """The scales in torch._scaled_mm's layouts for (a, b.t()), built from cuBLASLt's (torch
    checks sizes and strides, so a wrong layout here is torch's error, not a silent pass)."""
    if a_scaling == "RowWise":
        return sa, sb.reshape(1, n)
    lt_a, lt_b = cublaslt_scale(sa, a_scaling, m), cublaslt_scale(sb, b_scaling, n)
    if a_scaling == "BlockWise1x32":
        return lt_a.view(E8M0), lt_b.view(E8M0)
    ta = lt_a[:, :m].t() if a_scaling == "BlockWise1x128" else lt_a[:, : sa.shape[1]]
    tb = lt_b[:, :n] if b_scaling == "BlockWise1x128" else lt_b[:, : sb.shape[1]].t()
    return ta, tb


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build")
class TestCublasltBlockGemm:
    @pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
    @pytest.mark.parametrize("m,n,k", [(256, 512, 1024), (136, 256, 384), (1001, 256, 512)], ids=str)
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
    def test_matches_reference_and_takes_the_decided_path(self, scaling, m, n, k, out_dtype, with_bias):
        a, sa, b, sb = (t.cuda() for t in block_operands(m, n, k, E4M3, E4M3, scaling))
        bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
        a_scaling, b_scaling = PAIRS[scaling]
        expect_lt = cublaslt_block_applies(
            a_scaling, b_scaling, torch.cuda.get_device_capability(), _C.cuda_build_info()
        ) and cublaslt_operands_fit(a, b, a_scaling, b_scaling)
        before = _C.cuda_gemm_path_counts()["cublaslt_block"]
        d = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias)
        ran = _C.cuda_gemm_path_counts()["cublaslt_block"] - before
        # Strict: where the decision says cuBLASLt, its heuristic declining (Triton running) is a
        # finding about the table in gemm_block_cuda.py, not something to pass over.
        assert ran == int(expect_lt), f"cuBLASLt ran {ran} GEMMs where the decision said {expect_lt}"
        cpu = [t.cpu() for t in (a, sa, b, sb)]
        expected = reference.fp8_gemm_blockwise(*cpu, torch.float64, None if bias is None else bias.cpu())
        baseline = dequantized_mm_fp32(*cpu, out_dtype, None if bias is None else bias.cpu())
        assert_close_to_reference(d.cpu(), expected, baseline, what=f"{scaling} cuBLASLt={bool(ran)}")

    @pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
    def test_matches_torch_scaled_mm_where_torch_has_the_pair(self, scaling):
        m, n, k = 256, 512, 1024
        a, sa, b, sb = (t.cuda() for t in block_operands(m, n, k, E4M3, E4M3, scaling))
        scales = torch_scales(sa, sb, *PAIRS[scaling], m, n)
        try:
            theirs = torch._scaled_mm(a, b.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
        except RuntimeError as error:  # torch or this GPU lacks the pair
            pytest.skip(f"torch._scaled_mm has no {scaling} here: {str(error).splitlines()[0]}")
        ours = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16)
        expected = reference.fp8_gemm_blockwise(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float64)
        assert_close_to_reference(ours.cpu(), expected, theirs.cpu(), what=f"{scaling} vs torch._scaled_mm")

    def test_binding_rejects_scales_not_in_cublaslt_layout(self):
        a, sa, b, sb = (t.cuda() for t in block_operands(256, 256, 512, E4M3, E4M3, "1x128_x_128x128"))
        d = torch.empty(256, 256, device="cuda")
        b_scale = cublaslt_scale(sb, "BlockWise128x128", 256)

        def run(a_scale):
            op = "fp8_gemm"
            return _C.fp8_gemm_blockwise_cublaslt(
                desc(a, op, "a"), desc(a_scale, op, "a_scale_inv"), "BlockWise1x128", desc(b, op, "b"),
                desc(b_scale, op, "b_scale_inv"), "BlockWise128x128", None, desc(d, op, "d"), None,
            )

        with pytest.raises(ValueError, match="'a_scale_inv'"):  # the package's (M, Kb), not (Kb, M)
            run(sa)
        flat = torch.zeros(4 * 256 + 1, device="cuda")
        with pytest.raises(ValueError, match="16-byte aligned"):
            run(flat[1:].view(4, 256))
        with pytest.raises(ValueError, match="scaling pair"):
            _C.fp8_gemm_blockwise_cublaslt(
                desc(a, "x", "a"), desc(b_scale, "x", "a"), "BlockWise128x128", desc(b, "x", "b"),
                desc(b_scale, "x", "b"), "BlockWise128x128", None, desc(d, "x", "d"), None,
            )


def test_bench_gpu_dry_run_lists_the_block_rows(capsys):
    """benchmarks/bench_gpu.py runs without a GPU in --dry-run: the block rows and each one's path."""
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["all", "--dry-run", "--shapes", "256x256x256"]) == 0
    out = capsys.readouterr().out
    for name in bench.BLOCK_GEMMS:
        assert f"{name} at 256x256x256: sm_90: " in out
    for name in bench.BLOCK_QUANTIZE:
        assert name in out
