"""CUDA-specific behaviour: streams, CUDA graphs, the cuBLASLt / fallback GEMM
split, vector and scalar kernel paths, and the torch fallback.

The kernel-vs-reference tests of every op run on CUDA through the ``device``
fixture of conftest.py; this file covers what only the GPU path has. Its GPU
tests skip without a GPU and a CUDA build. The torch fallback (a CPU-only
build, a too-old driver, a GPU the build has no code for) is plain torch, so
its numerics and its routing decisions are checked here on the CPU too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pathlib
import re
import warnings

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_close_to_reference

from transformer_linear import _C, ops, reference
from transformer_linear.formats.layout import fp8_tensor_cores_take
from transformer_linear.ops import torch_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HAS_GPU = torch.cuda.is_available()
HAS_CUDA_KERNELS = HAS_GPU and _C.built_with_cuda()
ROOT = pathlib.Path(__file__).resolve().parent.parent


def fp8_operand(rows: int, cols: int, fmt: torch.dtype, device: str, column_major: bool = False) -> torch.Tensor:
    """(rows, cols) FP8 matrix; column_major gives the transposed view of a contiguous (cols, rows)."""
    if column_major:
        return (torch.randn(cols, rows, device=device) * 4).to(fmt).t()
    return (torch.randn(rows, cols, device=device) * 4).to(fmt)


def gemm_baseline(a, sa, b, sb, out_dtype, bias=None, accumulate_into=None, fast_accum=False) -> torch.Tensor:
    """Plain PyTorch at the kernel's precision, fp32 epilogue.

    On FP8 tensor cores (what cuBLASLt runs) that is ``torch._scaled_mm``:
    their accumulation is not fp32-exact, even without fast accumulation.
    Elsewhere it is an fp32 mm of the decoded operands.
    """
    if torch_cuda._scaled_mm_applies(a, b):
        out = torch._scaled_mm(a, b.t(), sa.reshape(()), sb.reshape(()), out_dtype=torch.float32,
                               use_fast_accum=fast_accum)
    else:
        out = (a.float() @ b.float().t()) * (sa.float() * sb.float())
    if bias is not None:
        out = out + bias.float()
    if accumulate_into is not None:
        out = out + accumulate_into.float()
    return out.to(out_dtype)


def check_gemm(d, a, sa, b, sb, out_dtype, bias=None, accumulate_into=None, fast_accum=False, what=""):
    expected = reference.fp8_gemm(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float64,
                                  None if bias is None else bias.cpu(),
                                  None if accumulate_into is None else accumulate_into.cpu())
    baseline = gemm_baseline(a, sa, b, sb, out_dtype, bias, accumulate_into, fast_accum)
    assert_close_to_reference(d.cpu(), expected, baseline.cpu(), what=what)


def scales(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device))


# ---------------------------------------------------------------------------
# The fallback of a CPU-only build (plain torch: checked on any device)
# ---------------------------------------------------------------------------


def test_fallback_is_inactive_for_cpu_tensors():
    assert not torch_cuda.active(torch.ones(2))


@pytest.mark.parametrize("scale", [None, 64.0], ids=["current", "delayed"])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dbias_dtype", [None, torch.bfloat16])
def test_fallback_quantize_matches_the_op(scale, rowwise, columnwise, dbias_dtype):
    x = torch.randn(48, 40, dtype=torch.bfloat16) * 3
    s = None if scale is None else torch.tensor([scale])
    got = torch_cuda.quantize(x, s, E4M3, 0, rowwise, columnwise, dbias_dtype)
    want = ops.quantize_fused(x, E4M3, s, rowwise=rowwise, columnwise=columnwise, dbias_dtype=dbias_dtype)
    for name, g, w in zip(want._fields, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name == "dbias":
            assert_close_to_reference(g, w.double(), what=name)
        else:
            assert_bitwise_equal(g, w, what=name)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fallback_gemm_and_accumulate(out_dtype):
    a, b = fp8_operand(24, 40, E4M3, "cpu"), fp8_operand(16, 40, E5M2, "cpu")
    sa, sb = scales("cpu")
    bias = torch.randn(16, dtype=out_dtype)
    d = torch_cuda.fp8_gemm(a, sa, b, sb, out_dtype, bias, True)
    check_gemm(d, a, sa, b, sb, out_dtype, bias, what="fallback gemm")
    acc = torch.randn(24, 16)
    before = acc.clone()
    torch_cuda.fp8_gemm_accumulate_(a, sa, b, sb, acc)
    check_gemm(acc, a, sa, b, sb, torch.float32, accumulate_into=before, what="fallback accumulate")


def default_archs() -> str:
    """The default TL_CUDA_ARCHS of cmake/cuda.cmake, which .ci/build_cuda.sh must repeat."""
    cmake = re.search(r'set\(TL_CUDA_ARCHS "([^"]+)"\)', (ROOT / "cmake" / "cuda.cmake").read_text()).group(1)
    ci = re.search(r'ARCHS="\$\{TL_CUDA_ARCHS:-([^}]+)\}"', (ROOT / ".ci" / "build_cuda.sh").read_text()).group(1)
    assert cmake == ci, f"cmake default {cmake!r} and CI default {ci!r} differ"
    return cmake.replace(";", ",")


@pytest.mark.parametrize(
    "capability", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)], ids=str
)
def test_default_architectures_cover_every_gpu_from_sm80(capability):
    """A100/A10/L4/H100/B200/RTX 50: machine code or PTX for each (the old 89;90a;100a left sm_80/86 with none)."""
    assert torch_cuda.has_image(capability, default_archs())
    assert not torch_cuda.has_image(capability, "89,90a,100a") or capability >= (8, 9)


@pytest.mark.parametrize(
    "capability,archs,expected",
    [
        ((8, 6), "80-real", True),  # sm_80 machine code runs on later minors
        ((8, 6), "89-real", False),
        ((9, 0), "80-real", False),  # machine code never crosses a major
        ((9, 0), "80", True),  # ... but PTX does
        ((9, 0), "80-virtual", True),
        ((7, 5), "80,90-real,100-real", False),  # T4: the torch fallback
        ((9, 0), "90a-real", True),
        ((9, 1), "90a", False),  # `a` code runs on its own minor only, and has no portable PTX
        ((10, 3), "100-real", True),
        ((12, 0), "90-real,100-real", False),
    ],
)
def test_has_image(capability, archs, expected):
    assert torch_cuda.has_image(capability, archs) is expected


@pytest.mark.parametrize(
    "runtime,driver,expected",
    [(13000, 13000, True), (13000, 12080, False), (12080, 12020, True), (12040, 13000, True), (12080, 0, False)],
)
def test_driver_supports(runtime, driver, expected):
    assert torch_cuda.driver_supports(runtime, driver) is expected


@pytest.mark.parametrize(
    "info,capability,expected",
    [
        (None, (9, 0), "TL_CUDA=1"),
        ({"runtime_version": 13000, "driver_version": 12080, "archs": "80"}, (9, 0), "R580"),
        ({"runtime_version": 13000, "driver_version": 0, "archs": "80"}, (9, 0), "no CUDA driver"),
        ({"runtime_version": 13000, "driver_version": 13000, "archs": "80,90-real"}, (7, 5), "TL_CUDA_ARCHS='75;80;90-real'"),
        ({"runtime_version": 13000, "driver_version": 13000, "archs": "80,90-real"}, (9, 0), None),
    ],
    ids=["cpu-build", "old-driver", "no-driver", "no-image", "runs"],
)
def test_kernel_problem_names_the_reason_and_remedy(info, capability, expected):
    problem = torch_cuda.kernel_problem(info, capability)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def test_cuda_build_info_matches_the_build():
    info = _C.cuda_build_info()
    assert (info is None) == (not _C.built_with_cuda())
    if info is not None:
        assert info["runtime_version"] >= 12000 and info["archs"]
    assert set(_C.cuda_gemm_path_counts()) == {"cublaslt", "padded", "fallback", "cached_algos", "cublaslt_block"}
    if info is not None:
        assert info["cublas_header_version"] >= 120000 and info["cublaslt_version"] >= 120000


@pytest.mark.parametrize(
    "m,n,k,fmt_b,column_major,fits",
    [
        (17, 32, 48, E4M3, False, True),  # any M
        (1, 16, 16, E5M2, False, True),
        (16, 24, 32, E4M3, False, False),  # N
        (16, 32, 24, E4M3, False, False),  # K
        (16, 32, 32, E4M3, True, False),  # layout
    ],
)
def test_scaled_mm_shape_rule_leaves_m_free(m, n, k, fmt_b, column_major, fits):
    a, b = fp8_operand(m, k, E4M3, "cpu"), fp8_operand(n, k, fmt_b, "cpu", column_major)
    assert fp8_tensor_cores_take(a, b, aligned=False) is fits
    assert not fp8_tensor_cores_take(fp8_operand(m, k, E5M2, "cpu"), fp8_operand(n, k, E5M2, "cpu"), aligned=False)


def fake_scaled_mm(calls):
    """A torch._scaled_mm stand-in on CPU tensors that records its bias and honours torch's rule."""

    def scaled_mm(a, b_t, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        calls.append(bias)
        if bias is not None and out_dtype == torch.float32:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        out = (a.float() @ b_t.float()) * (scale_a * scale_b)
        return (out if bias is None else out + bias.float()).to(out_dtype)

    return scaled_mm


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fallback_scaled_mm_bias_rule(monkeypatch, out_dtype):
    """An fp32 output adds the bias after _scaled_mm instead of failing into the 4x-memory path."""
    calls = []
    monkeypatch.setattr(torch_cuda, "_scaled_mm_applies", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm(calls))
    a, b = fp8_operand(17, 32, E4M3, "cpu"), fp8_operand(16, 32, E4M3, "cpu")
    sa, sb = scales("cpu")
    bias = torch.randn(16, dtype=out_dtype)
    d = torch_cuda.fp8_gemm(a, sa, b, sb, out_dtype, bias, True)
    assert len(calls) == 1 and (calls[0] is None) == (out_dtype == torch.float32)
    check_gemm(d, a, sa, b, sb, out_dtype, bias, what="fallback _scaled_mm + bias")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("CUDA error: misaligned")])
def test_fallback_gemm_lets_real_errors_through(monkeypatch, error):
    """Out of memory or a CUDA error is not retried through a.float() (4x the memory)."""

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch_cuda, "_scaled_mm_applies", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_mm", failing)
    monkeypatch.setattr(torch_cuda, "_dequantized_product", lambda *a: pytest.fail("retried in fp32"))
    a, b = fp8_operand(16, 32, E4M3, "cpu"), fp8_operand(16, 32, E4M3, "cpu")
    sa, sb = scales("cpu")
    with pytest.raises(type(error)):
        torch_cuda.fp8_gemm(a, sa, b, sb, torch.bfloat16, None, False)


@pytest.mark.skipif(not HAS_GPU or _C.built_with_cuda(), reason="needs a GPU and a CPU-only build")
def test_cpu_only_build_warns_once_and_works_on_cuda_tensors(monkeypatch):
    monkeypatch.setattr(torch_cuda, "_warned", False)
    x = torch.randn(64, 32, device="cuda")
    with pytest.warns(UserWarning, match="TL_CUDA=1"):
        q, scale_inv, x_amax = ops.quantize_current(x, E4M3)
    q_ref, scale_inv_ref, amax_ref = reference.quantize_current(x, E4M3)
    assert_bitwise_equal(q, q_ref)
    assert_bitwise_equal(scale_inv, scale_inv_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.bfloat16)
    check_gemm(d, q, scale_inv, q, scale_inv, torch.bfloat16)


# ---------------------------------------------------------------------------
# CUDA kernels
# ---------------------------------------------------------------------------

# cuBLASLt takes any M (1 and 13 included) and, on zero-padded copies, any K
# (24, 45, 100 tokens of a ragged wgrad); N = 17 and K = 0 take the tiled kernel.
GEMM_SHAPES = [
    (64, 128, 256),
    (256, 48, 512),
    (13, 64, 32),
    (1, 64, 16),
    (17, 32, 24),
    (48, 32, 100),
    (33, 17, 45),
    (96, 80, 0),
]


def _k_major_ld(t: torch.Tensor):
    """The leading dimension of a K-contiguous (row-major) operand, else None (validate.cpp's rule)."""
    rows, cols = t.shape
    if (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols):
        return cols if rows <= 1 else t.stride(0)
    return None


def expected_gemm_path(a: torch.Tensor, b: torch.Tensor) -> str:
    """The path gemm_cuda.cpp must take (its stated rule): "cublaslt", "padded" (cuBLASLt on
    zero-padded operand copies) or "fallback" (the tiled kernel)."""
    lda, ldb = _k_major_ld(a), _k_major_ld(b)
    k, n = a.shape[1], b.shape[0]
    tensor_cores = (
        torch.cuda.get_device_capability() >= (8, 9)
        and not (a.dtype == E5M2 and b.dtype == E5M2)
        and lda is not None
        and ldb is not None
        and k > 0
        and n % 16 == 0
    )
    if not tensor_cores:
        return "fallback"
    fit = k % 16 == 0 and lda % 16 == 0 and ldb % 16 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    return "cublaslt" if fit else "padded"


@contextlib.contextmanager
def gemm_path(path: str):
    """Asserts that every GEMM in the block took ``path`` (see expected_gemm_path), at least one."""
    before = _C.cuda_gemm_path_counts()
    yield
    after = _C.cuda_gemm_path_counts()
    ran = {name: after[name] - before[name] for name in ("cublaslt", "padded", "fallback")}
    lt = "fallback" if path == "fallback" else "cublaslt"
    assert ran[lt] >= 1 and ran["cublaslt"] + ran["fallback"] == ran[lt], f"expected only the {path} path, ran {ran}"
    assert ran["padded"] == (ran["cublaslt"] if path == "padded" else 0), f"expected the {path} path, ran {ran}"


def gemm_layouts(m: int, n: int, k: int, fmt_a, fmt_b) -> dict:
    """The same values as row-major, column-major, strided (leading dimension K + 16, the
    ``big[:, :k]`` view) and misaligned (address 1 byte past 16) operands."""
    a, b = fp8_operand(m, k, fmt_a, "cuda"), fp8_operand(n, k, fmt_b, "cuda")

    def strided(t):
        big = torch.zeros(t.shape[0], t.shape[1] + 16, dtype=t.dtype, device="cuda")
        big[:, : t.shape[1]] = t
        return big[:, : t.shape[1]]

    def misaligned(t):
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device="cuda")
        flat[1:] = t.flatten()
        return flat[1:].view(t.shape)

    return {
        "row-major": (a, b),
        "column-major": (a.t().contiguous().t(), b.t().contiguous().t()),
        "strided": (strided(a), strided(b)),
        "misaligned": (misaligned(a), misaligned(b)),
    }


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build")
class TestCudaKernels:
    @pytest.mark.parametrize(
        "shape,offset",
        [
            ((256, 512), 0),
            ((256, 512), 3),
            ((1000, 24), 0),
            ((33, 45), 0),
            ((7,), 0),
            ((3, 5, 16), 1),
            # >= 4M elements: grid-stride loops take a second pass; odd tails.
            ((2049, 2051), 0),
            ((4099, 1024), 0),
            (((1 << 22) + 7,), 0),
            # more than 65535 row tiles: rows are not bound by grid.y.
            ((65536 * 64 + 65, 2), 0),
        ],
        ids=["vector", "misaligned", "tall", "odd", "1d", "3d-misaligned", "4m-odd", "4m-rows-odd", "4m-1d",
             "tall-grid"],
    )
    @pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("fmt", [E4M3, E5M2])
    def test_vector_and_scalar_paths_are_bitwise(self, shape, offset, in_dtype, fmt):
        """Aligned tensors take the vector path; offset views and odd sizes the scalar one
        (vector loads need only cols % 8, 8-byte transposed stores only rows % 8)."""
        n = torch.Size(shape).numel()
        base = torch.randn(n + offset, device="cuda") * 200
        base[offset] = 6e4  # saturates both formats at scale 3
        x = base.to(in_dtype)[offset:].view(shape)
        scale = torch.tensor([3.0], device="cuda")
        out = ops.quantize_fused(x, fmt, scale, columnwise=True, dbias_dtype=torch.bfloat16)
        q_ref, scale_inv_ref = reference.quantize(x, scale, fmt)
        assert_bitwise_equal(out.data, q_ref, what="data")
        assert_bitwise_equal(out.data_t, reference.transpose_2d(q_ref), what="data_t")
        assert_bitwise_equal(out.scale_inv, scale_inv_ref, what="scale_inv")
        assert_bitwise_equal(out.amax, reference.amax(x), what="amax")
        dbias_ref = x.reshape(-1, x.shape[-1]).double().sum(0)
        assert_close_to_reference(out.dbias, dbias_ref, reference.bias_grad(x, torch.bfloat16), what="dbias")
        assert_bitwise_equal(ops.dequantize(out.data, out.scale_inv, in_dtype),
                             reference.dequantize(q_ref, scale_inv_ref, in_dtype), what="dequantize")

    def test_amax_propagates_nan_through_the_atomic_max(self):
        x = torch.randn(1 << 20, device="cuda")
        x[12345] = float("nan")
        x[5] = float("inf")
        assert torch.isnan(ops.amax(x))
        _, scale_inv, x_amax = ops.quantize_current(x, E4M3)
        assert torch.isnan(x_amax)
        assert_bitwise_equal(scale_inv, torch.ones(1, device="cuda"), what="scale 1 for a NaN amax")

    @pytest.mark.parametrize("problem", ["no-image", "old-driver"])
    def test_unusable_build_routes_to_the_torch_fallback(self, monkeypatch, problem):
        """A GPU the build has no code for, or a too-old driver: torch runs the ops, with one warning."""
        major, minor = torch.cuda.get_device_capability()
        info = dict(_C.cuda_build_info())
        if problem == "no-image":
            info["archs"] = f"{10 * major + minor + 1}-real"
        else:
            info["driver_version"] = info["runtime_version"] - 1000
        monkeypatch.setattr(torch_cuda, "_BUILD_INFO", info)
        monkeypatch.setattr(torch_cuda, "_problems", {})
        monkeypatch.setattr(torch_cuda, "_warned", False)
        before = _C.cuda_gemm_path_counts()
        x = torch.randn(64, 32, device="cuda")
        with pytest.warns(UserWarning, match="no code for this GPU" if problem == "no-image" else "driver"):
            q, scale_inv, _ = ops.quantize_current(x, E4M3)
        d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.float32)
        assert _C.cuda_gemm_path_counts() == before, "the extension ran a GEMM"
        q_ref, scale_inv_ref, _ = reference.quantize_current(x, E4M3)
        assert_bitwise_equal(q, q_ref)
        check_gemm(d, q_ref, scale_inv_ref, q_ref, scale_inv_ref, torch.float32)

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    def test_devices_first_used_from_concurrent_threads(self):
        """The per-device facts table is filled while another thread reads it (the bindings release the GIL)."""

        def work(index: int) -> None:
            device = f"cuda:{index}"
            with torch.cuda.device(index):
                x = torch.randn(256, 512, device=device)
                for _ in range(20):
                    q, scale_inv, _ = ops.quantize_current(x, E4M3)
                    d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.float32)
                torch.cuda.synchronize(device)
                q_ref, scale_inv_ref, _ = reference.quantize_current(x, E4M3)
                assert_bitwise_equal(q, q_ref)
                check_gemm(d, q_ref, scale_inv_ref, q_ref, scale_inv_ref, torch.float32)

        with concurrent.futures.ThreadPoolExecutor(torch.cuda.device_count()) as pool:
            for future in [pool.submit(work, i) for i in range(torch.cuda.device_count())]:
                future.result()

    def test_ops_launch_on_the_current_stream(self):
        """The side stream is busy when the input is written: an op on any other stream reads stale data."""
        src = torch.randn(512, 1024, device="cuda") * 5
        x = torch.zeros_like(src)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            x.copy_(src)
            q, scale_inv, x_amax = ops.quantize_current(x, E4M3)
            d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.float32, use_split_accumulator=True)
        side.synchronize()
        q_ref, scale_inv_ref, amax_ref = reference.quantize_current(src, E4M3)
        assert_bitwise_equal(q, q_ref)
        assert_bitwise_equal(x_amax, amax_ref)
        check_gemm(d, q_ref, scale_inv_ref, q_ref, scale_inv_ref, torch.float32)

    def test_hot_path_never_synchronizes(self):
        x = torch.randn(256, 512, device="cuda")
        w = torch.randn(128, 512, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            qx, sx, _ = ops.quantize_current(x, E4M3)
            qw, sw, _ = ops.quantize_current(w, E4M3)
            out = ops.quantize_fused(x, E5M2, columnwise=True, dbias_dtype=torch.float32)
            ops.fp8_gemm(qx, sx, qw, sw, torch.bfloat16)
            ops.dequantize(out.data, out.scale_inv, torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_training_step_captures_in_a_cuda_graph(self):
        """set_sync_debug_mode cannot see the extension's own runtime: capture is the guard that
        no op syncs or allocates outside the stream (current and delayed scaling, columnwise,
        dbias, the fp32 bias pass, dequantize, beta=1 accumulate over a ragged token count
        (zero-padded operand copies in stream-ordered scratch))."""
        x = torch.randn(120, 256, device="cuda")
        w = torch.randn(64, 256, device="cuda")
        grad = torch.randn(120, 64, device="cuda", dtype=torch.bfloat16)
        g_scale = torch.tensor([8.0], device="cuda")
        bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
        bias32 = torch.randn(64, device="cuda")
        main_grad = torch.randn(64, 256, device="cuda")
        main_grad_before = main_grad.clone()

        def step():
            qx = ops.quantize_fused(x, E4M3, columnwise=True)
            qw, sw, _ = ops.quantize_current(w, E4M3)
            qg = ops.quantize_fused(grad, E5M2, g_scale, columnwise=True, dbias_dtype=torch.bfloat16)
            y = ops.fp8_gemm(qx.data, qx.scale_inv, qw, sw, torch.bfloat16, bias)
            y32 = ops.fp8_gemm(qx.data, qx.scale_inv, qw, sw, torch.float32, bias32)
            ops.fp8_gemm_accumulate_(qg.data_t, qg.scale_inv, qx.data_t, qx.scale_inv, main_grad)
            return y, y32, qx.data_t, qg.dbias, ops.dequantize(qx.data, qx.scale_inv, torch.float32)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: cuBLASLt handle and heuristic cache outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, y32, x_t, dbias, x_deq = step()
        x.copy_(torch.randn_like(x) * 7)  # a new input: the replay must recompute the scale on the device
        main_grad.copy_(main_grad_before)
        graph.replay()
        torch.cuda.synchronize()
        qx, sx, _ = reference.quantize_current(x, E4M3)
        qw, sw, _ = reference.quantize_current(w, E4M3)
        qg, sg = reference.quantize(grad, g_scale, E5M2)
        check_gemm(y, qx, sx, qw, sw, torch.bfloat16, bias, what="graph replay")
        check_gemm(y32, qx, sx, qw, sw, torch.float32, bias32, what="graph replay, fp32 + bias")
        assert_bitwise_equal(x_t, reference.transpose_2d(qx), what="graph replay columnwise")
        assert_bitwise_equal(x_deq, reference.dequantize(qx, sx, torch.float32), what="graph replay dequantize")
        assert_close_to_reference(dbias, grad.double().sum(0), reference.bias_grad(grad, torch.bfloat16),
                                  what="graph replay dbias")
        check_gemm(main_grad, qg.t().contiguous(), sg, qx.t().contiguous(), sx, torch.float32,
                   accumulate_into=main_grad_before, what="graph replay accumulate")

    def test_dbias_is_deterministic(self):
        """Per-tile partial sums added in a fixed order: bitwise the same on every run."""
        g = torch.randn(8192 + 3, 1000, device="cuda", dtype=torch.bfloat16)
        runs = [ops.quantize_fused(g, E5M2, columnwise=True, dbias_dtype=torch.float32).dbias for _ in range(3)]
        for other in runs[1:]:
            assert_bitwise_equal(other, runs[0], what="dbias run to run")
        assert_close_to_reference(runs[0], g.double().sum(0), reference.bias_grad(g, torch.float32), what="dbias")

    def test_algorithm_cache_is_bounded_under_dynamic_m(self):
        """One heuristic entry per token count must not grow without bound."""
        b = fp8_operand(16, 16, E4M3, "cuda")
        sa, sb = scales("cuda")
        for m in range(1, 1200):
            ops.fp8_gemm(fp8_operand(m, 16, E4M3, "cuda"), sa, b, sb, torch.bfloat16)
        assert _C.cuda_gemm_path_counts()["cached_algos"] <= 1024

    @pytest.mark.parametrize("m,n,k", GEMM_SHAPES, ids=lambda v: str(v))
    @pytest.mark.parametrize("fmt_a,fmt_b", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_cublaslt_and_fallback_paths_match_the_reference(self, m, n, k, fmt_a, fmt_b, out_dtype):
        """K-major operands must take cuBLASLt for any M, and an fp32 output with a bias too;
        a K, leading dimension or address off 16 through zero-padded copies. Column-major views of
        the same values, N off 16, K == 0 and e5m2 x e5m2 take the tiled kernel. All must hold."""
        sa, sb = scales("cuda")
        bias = torch.randn(n, device="cuda", dtype=out_dtype)
        layouts = gemm_layouts(m, n, k, fmt_a, fmt_b)
        a, b = layouts["row-major"]
        for layout, (a_l, b_l) in layouts.items():
            path = expected_gemm_path(a_l, b_l)
            with gemm_path(path):
                d = ops.fp8_gemm(a_l, sa, b_l, sb, out_dtype, bias, use_split_accumulator=True)
            check_gemm(d, a, sa, b, sb, out_dtype, bias, what=f"{layout} ({path})")
            acc = torch.randn(m, n, device="cuda")
            before = acc.clone()
            with gemm_path(path):
                ops.fp8_gemm_accumulate_(a_l, sa, b_l, sb, acc)
            check_gemm(acc, a, sa, b, sb, torch.float32, accumulate_into=before, what=f"{layout} accumulate ({path})")

    def test_fast_accumulation_stays_close(self):
        """The forward GEMM's fast accumulation, bf16 output: within the budget."""
        a, b = fp8_operand(256, 1024, E4M3, "cuda"), fp8_operand(256, 1024, E4M3, "cuda")
        sa, sb = scales("cuda")
        with gemm_path(expected_gemm_path(a, b)):
            d = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, use_split_accumulator=False)
        check_gemm(d, a, sa, b, sb, torch.bfloat16, fast_accum=True)
