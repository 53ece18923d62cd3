"""NVFP4: the CPU kernels held bitwise to reference.nvfp4, the reference against torchao, the ops' checks."""

from __future__ import annotations

import pytest
import torch
from cpu_paths import QUANTIZE_ISAS
from large_outputs import large_output_rows
from tolerances import assert_bitwise_equal, assert_nvfp4_gemm_close

from transformer_linear import _C
from transformer_linear.formats import nvfp4 as fmt
from transformer_linear.ops import nvfp4 as ops
from transformer_linear.ops.descriptors import desc
from transformer_linear.reference import nvfp4 as ref

HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTIONS = {
    "rowwise": dict(),
    "both": dict(columnwise=True),
    "columnwise": dict(rowwise=False, columnwise=True),
    "rht": dict(columnwise=True, rht=True),
    "2d": dict(columnwise=True, scaling_2d=True),
    "2d_columnwise": dict(rowwise=False, columnwise=True, scaling_2d=True),
    "sr": dict(columnwise=True, stochastic_rounding=True, seed=1234, offset=5),
    "sr_rht": dict(rowwise=False, columnwise=True, rht=True, stochastic_rounding=True, seed=-7, offset=2**40),
    "sr_2d": dict(columnwise=True, scaling_2d=True, stochastic_rounding=True, seed=2**62),
}


@pytest.fixture(params=QUANTIZE_ISAS)
def cpu_isa(request):
    """The NVFP4 kernels are portable; every path must give the same bits all the same."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def bits(t):
    """Byte tensors compare as uint8 (assert_bitwise_equal cannot print FP4 values)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_copies(got, expected, what=""):
    for field in ref.NVFP4Quantized._fields:
        g, e = getattr(got, field), getattr(expected, field)
        assert (g is None) == (e is None), f"{what}{field}: present {g is not None} vs {e is not None}"
        if g is not None:
            assert_bitwise_equal(bits(g), bits(e), f"{what}{field}")


def amaxes(x, options):
    return ops.nvfp4_amax(x), ops.nvfp4_amax(x, rht=options.get("rht", False))


def quantize_both(x, options):
    amax, amax_t = amaxes(x, options)
    return ops.quantize_nvfp4(x, amax, amax_t, **options), ref.quantize_nvfp4(x, amax, amax_t, **options)


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", HP_DTYPES)
# (560, 528): 35 bands of 16 rows, which the kernel walks in groups of 16 down each 256-column chunk where
# there is a columnwise copy (two whole groups and a short one), by three chunks (the last one short).
@pytest.mark.parametrize("shape", [(16, 16), (32, 48), (48, 272), (64, 16), (0, 32), (32, 0), (560, 528)])
def test_quantize_matches_reference(cpu_isa, shape, dtype, option):
    torch.manual_seed(hash((shape, option)) % 2**31)
    options = OPTIONS[option]
    x = (torch.randn(shape) * torch.rand(shape[0], 1) * 8).to(dtype)
    got, expected = quantize_both(x, options)
    assert_same_copies(got, expected, f"{shape} {dtype} {option}: ")


@pytest.mark.parametrize("option", ["rowwise", "2d", "sr_2d"])
def test_ragged_rows_rowwise(option):
    """The rowwise copy takes any M (a partial last 16x16 tile covers what is left)."""
    options = {k: v for k, v in OPTIONS[option].items() if k != "columnwise"}
    x = torch.randn(37, 64)
    got, expected = quantize_both(x, options)
    assert_same_copies(got, expected)


def test_non_contiguous_operands():
    """The ops copy strided inputs (the kernels take contiguous ones)."""
    y = torch.randn(64, 32)
    amax = ops.nvfp4_amax(y)
    strided = ops.quantize_nvfp4(y.t(), amax, columnwise=True)
    assert_same_copies(strided, ops.quantize_nvfp4(y.t().contiguous(), amax, columnwise=True))
    q = ops.quantize_nvfp4(torch.randn(32, 64), torch.tensor(4.0))
    a_t = q.data.view(torch.uint8).t().contiguous().t().view(fmt.FP4_DTYPE)
    scale_t = q.scale.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn)
    assert not a_t.is_contiguous() and not scale_t.is_contiguous()
    expected = ops.nvfp4_gemm(q.data, q.scale, q.global_scale, q.data, q.scale, q.global_scale)
    got = ops.nvfp4_gemm(a_t, scale_t, q.global_scale, q.data, q.scale, q.global_scale)
    assert_bitwise_equal(got, expected)


def test_columnwise_takes_any_k():
    x = torch.randn(32, 19)
    got, expected = quantize_both(x, OPTIONS["columnwise"])
    assert got.data_t.shape == (19, 16)
    assert_same_copies(got, expected)


@pytest.mark.parametrize("option", ["rowwise", "rht", "2d", "sr"])
def test_special_values(cpu_isa, option):
    """Zero blocks, NaN, +-inf (saturate to 6 x 448), tiny blocks (subnormal E4M3 scales), -0."""
    x = torch.randn(32, 64)
    x[0, :16] = 0.0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 9] = -float("inf")
    x[4, 16:32] = 2e-4 * torch.linspace(-1, 1, 16)  # block scale 2e-4 * 448 / 10: subnormal
    x[5, 0] = -1e-30
    amax = torch.tensor(10.0)
    options = OPTIONS[option]
    got = ops.quantize_nvfp4(x, amax, amax, **options)
    expected = ref.quantize_nvfp4(x, amax, amax, **options)
    assert_same_copies(got, expected)
    if option == "rowwise":
        assert got.scale[1, 0].view(torch.uint8) == 0x7F  # the NaN's block scale is NaN
        assert got.scale[2, 0].float() == 448.0
        assert 0 < got.scale[4, 1].float() < 2.0**-6  # subnormal E4M3
        assert got.data.view(torch.uint8)[5, 0] & 0xF == 0x8  # -0


@pytest.mark.parametrize("option", ["rowwise", "columnwise", "2d", "sr"])
def test_rounding_ties_and_thresholds(cpu_isa, option):
    """Values on and next to every E2M1 rounding threshold, both signs, with a unit encode factor.

    A global amax of 6 x 448 gives S_enc = 1 and, in a block whose amax is 6, a block scale and
    factor of 1: the kernels round exactly these values (ties to the even code, saturation at 6).
    """
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(-1.0)), torch.nextafter(points, torch.tensor(9.0))])
    values = torch.cat([near, -near, near[:9]])  # 105 values: 7 blocks of 15
    blocks = torch.cat([torch.full((7, 1), 6.0), values.reshape(7, 15)], dim=1)  # every block's amax is 6: factor 1
    x = blocks.repeat(32, 1).reshape(112, 32)
    amax = torch.tensor(6.0 * 448.0)
    options = OPTIONS[option]
    assert_same_copies(ops.quantize_nvfp4(x, amax, amax, **options), ref.quantize_nvfp4(x, amax, amax, **options))


FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("amax, s_enc", [(0.0, 1.0), (float("inf"), 1.0), (2688.0, 1.0), (1e-45, FLT_MAX)])
def test_global_encode_scale(amax, s_enc):
    """TE's rule: 448 * 6 / amax, 1 for amax 0 and inf, FLT_MAX where the quotient overflows."""
    assert ref.global_encode_scale(torch.tensor(amax)).item() == s_enc


def test_global_scale_outputs_and_zero_amax():
    x = torch.zeros(16, 32)
    got = ops.quantize_nvfp4(x, torch.tensor(0.0), columnwise=True)
    assert got.global_scale.item() == 1.0 and got.global_scale_t.item() == 1.0
    assert (got.data.view(torch.uint8) == 0).all() and (got.scale.float() == 0).all()
    got = ops.quantize_nvfp4(torch.ones(16, 32), torch.tensor(3.0))
    assert got.global_scale.item() == (1.0 / torch.tensor(2688.0 / 3.0)).item()


def test_nibble_order():
    """The first element of a pair sits in the low nibble, as in torch/torchao (code 1 = 0.5, code 7 = 6)."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 0.5, 6.0, -1.0
    got = ops.quantize_nvfp4(x, torch.tensor(6.0))  # S_enc = 448: block scale 448, 6 stays 6
    assert got.data.view(torch.uint8)[0, 0] == 0x71
    assert got.data.view(torch.uint8)[0, 1] == 0x0A
    values = ref.dequantize_nvfp4(got.data, got.scale, got.global_scale)[0, :3]
    assert torch.allclose(values, torch.tensor([0.5, 6.0, -1.0]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_reference_matches_torchao(dtype, power_of_two):
    """torchao 0.18's ``nvfp4_quantize`` with per_tensor_scale = amax / (448 * 6) gives the same bits.

    Differences, each checked here: (1) torchao clamps block scales up to the smallest normal E4M3
    (2^-6); TE (and so this package) keeps subnormal and zero block scales, so blocks whose amax is
    below ~2^-6 / 448 of the tensor amax get a smaller scale (and other codes) here. (2) torchao
    computes the block scale as (block_amax / 6) / (amax / 2688) and TE as block_amax * (S_enc *
    fl(1/6)); the two float32 results can differ by an ulp, which changes the E4M3 scale only at a
    rounding midpoint (never seen on these inputs; with a power-of-two S_enc they are equal up to
    the rounding of fl(1/6)). (3) torchao maps NaN to code 3, this package to code 7 (no NaN here).
    """
    kernels = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch.manual_seed(3)
    x = (torch.randn(128, 256) * torch.rand(128, 1) * 10).to(dtype)
    x[7, 32:48] *= 1e-5  # a tiny block: difference (1)
    amax = torch.tensor(2688.0 * 2.0**-8) if power_of_two else x.float().abs().max()
    x = x.clamp(-amax.item(), amax.item())
    ours = ref.quantize_nvfp4(x, amax)
    ao_scale, ao_data = kernels.nvfp4_quantize(x, 16, amax / 2688.0)
    normal = ours.scale.float() >= 2.0**-6
    assert not normal.all()
    assert (ao_scale.float()[~normal] == 2.0**-6).all()
    assert torch.equal(ours.scale.view(torch.uint8)[normal], ao_scale.view(torch.uint8)[normal])
    block_of_byte = normal.repeat_interleave(8, dim=1)
    assert torch.equal(ours.data.view(torch.uint8)[block_of_byte], ao_data[block_of_byte])


def test_hadamard_transform_is_the_orthogonal_rht():
    """v -> v @ diag(signs) @ H16 / 4 (Sylvester H16), and the inverse undoes it."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    matrix = torch.diag(torch.tensor(fmt.RHT_SIGNS, dtype=torch.float64)) @ h / 4
    assert torch.allclose(matrix @ matrix.T, torch.eye(16, dtype=torch.float64))
    x = torch.randn(8, 64)
    y = fmt.hadamard_transform(x)
    expected = (x.double().reshape(8, 4, 16) @ matrix).reshape(8, 64)
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fmt.hadamard_transform(y, inverse=True), x, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 16"):
        fmt.hadamard_transform(torch.randn(4, 24))


def test_rht_copies_multiply_like_the_untransformed_ones():
    """wgrad = dy.T @ x: both columnwise copies transformed along M, so their GEMM is unchanged."""
    torch.manual_seed(0)
    x, dy = torch.randn(256, 32), torch.randn(256, 48)
    qx, qd = (
        ops.quantize_nvfp4(t, ops.nvfp4_amax(t), ops.nvfp4_amax(t, rht=True), rowwise=False, columnwise=True, rht=True)
        for t in (x, dy)
    )
    wgrad = ops.nvfp4_gemm(qd.data_t, qd.scale_t, qd.global_scale_t, qx.data_t, qx.scale_t, qx.global_scale_t)
    exact = dy.T @ x
    assert ((wgrad - exact).norm() / exact.norm()).item() < 0.15


def test_random_bits_are_philox4x32_10():
    """Random123's known-answer vectors."""
    words = ref.philox4x32(tuple(torch.tensor([w]) for w in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)),
                           (0xA4093822, 0x299F31D0))
    assert [int(w) for w in words] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    words = ref.philox4x32(tuple(torch.tensor([0]) for _ in range(4)), (0, 0))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("option", ["sr", "sr_rht", "sr_2d"])
def test_stochastic_rounding_ignores_thread_count(option):
    x = torch.randn(256, 512)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(quantize_both(x, OPTIONS[option])[0])
    finally:
        torch.set_num_threads(saved)
    assert_same_copies(results[0], results[1], f"{option}, 1 vs 2 threads: ")


@pytest.mark.parametrize("option", ["columnwise", "rht", "2d"])
def test_large_columnwise_copy_ignores_thread_count(option):
    """A columnwise copy of 8 MiB or more (written with non-temporal stores) whose rows of 2056 bytes start
    off cache lines; 1 to 3 threads claim different runs of bands (each gathered and written out per run):
    the reference's bits every time."""
    torch.manual_seed(11)
    x = torch.randn(4112, 4112) * torch.rand(4112, 1)
    options = OPTIONS[option]
    amax, amax_t = amaxes(x, options)
    expected = ref.quantize_nvfp4(x, amax, amax_t, **options)
    assert expected.data_t.numel() >= 8 << 20
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = ops.quantize_nvfp4(x, amax, amax_t, **options)
            assert_same_copies(got, expected, f"{option}, {threads} threads: ")
    finally:
        torch.set_num_threads(saved)


def test_stochastic_rounding_depends_on_seed_offset_and_usage():
    x = torch.randn(32, 64)
    amax = ops.nvfp4_amax(x)
    base = ops.quantize_nvfp4(x, amax, columnwise=True, stochastic_rounding=True, seed=1, offset=0)
    for kw in (dict(seed=2, offset=0), dict(seed=1, offset=1)):
        other = ops.quantize_nvfp4(x, amax, columnwise=True, stochastic_rounding=True, **kw)
        assert not torch.equal(bits(base.data), bits(other.data)), kw
    rows, cols = ref.random_bits((4, 4), 1, 0, 0), ref.random_bits((4, 4), 1, 0, 1)
    assert not torch.equal(rows, cols)


def test_stochastic_rounding_is_unbiased():
    """Many small values (0.2 on a grid step of 0.5): RNE rounds every one to 0, SR keeps the mean."""
    x = torch.full((64, 4096), 0.2)
    x[:, ::16] = 6.0  # each block's amax maps to 6: the block scale is 1 in units of the grid
    amax = torch.tensor(6.0)
    small = torch.ones_like(x, dtype=torch.bool)
    small[:, ::16] = False
    means = {}
    for sr in (False, True):
        q = ops.quantize_nvfp4(x, amax, stochastic_rounding=sr, seed=11)
        values = ref.dequantize_nvfp4(q.data, q.scale, q.global_scale)
        means[sr] = values[small].double().mean().item()
    assert means[False] == 0.0
    # 245760 draws of 0 or 0.5 with p = 0.4: the standard deviation of the mean is about 5e-4.
    assert abs(means[True] - 0.2) < 5e-3, means


def quantized_operand(rows, k, seed, option="rowwise"):
    torch.manual_seed(seed)
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
    return ops.quantize_nvfp4(x, ops.nvfp4_amax(x), **{k: v for k, v in OPTIONS[option].items() if k != "columnwise"})


@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "m, n, k",
    # 4160: past two 2048-k passes of the AMX kernels (totals carried through memory between them).
    [(1, 1, 16), (37, 70, 48), (64, 64, 512), (130, 9, 272), (350, 45, 1072), (40, 33, 4160), (0, 8, 32), (8, 0, 32),
     (5, 6, 0)],
)
def test_gemm(gemm_isa, m, n, k, out_dtype, with_bias):
    a, b = quantized_operand(m, k, 1), quantized_operand(n, k, 2, "2d")
    bias = torch.randn(n).to(out_dtype) if with_bias else None
    got = ops.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale, out_dtype, bias)
    expected = ref.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale, out_dtype, bias)
    assert_bitwise_equal(got, expected, "nvfp4_gemm vs reference")
    one = torch.tensor(1.0)
    a_values = ref.dequantize_nvfp4(a.data, a.scale, one)
    b_values = ref.dequantize_nvfp4(b.data, b.scale, one)
    alpha = (a.global_scale * b.global_scale).item()
    assert_nvfp4_gemm_close(got, a_values, b_values, alpha, bias)


@pytest.mark.parametrize("out_dtype", HP_DTYPES)
def test_gemm_large_output(gemm_isa, out_dtype):
    """An output large enough for the streamed epilogue (where the path has it): the reference's bits, with
    bias; N = 2049 leaves the rows' ends off a cache line."""
    n, k = 2049, 64
    m = large_output_rows(n, out_dtype)
    a, b = quantized_operand(m, k, 5), quantized_operand(n, k, 6, "2d")
    bias = torch.randn(n).to(out_dtype)
    got = ops.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale, out_dtype, bias)
    expected = ref.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale, out_dtype, bias)
    assert_bitwise_equal(got, expected, f"nvfp4_gemm {m}x{n}x{k} vs reference")


def raw_gemm_args(a, a_scale, a_global, b, b_scale, b_global):
    """nvfp4_gemm's operands from uint8 code and E4M3 scale bytes and float global scales."""
    return (a.view(fmt.FP4_DTYPE), a_scale.view(torch.float8_e4m3fn), torch.tensor(a_global),
            b.view(fmt.FP4_DTYPE), b_scale.view(torch.float8_e4m3fn), torch.tensor(b_global))


def test_gemm_extreme_scales_and_values(gemm_isa):
    """Largest and subnormal E4M3 scales, +-6 and +-0 codes, a NaN scale: still the reference's bits.

    The vdpbf16ps path flushes denormals; every folded value and product must stay normal.
    """
    m, n, k = 20, 40, 96
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    b[0] = 0x77  # +6 everywhere
    b[1] = 0xFF  # -6 everywhere
    b[2] = 0x88  # -0 everywhere
    a_scale = torch.randint(0, 0x7F, (m, k // 16), dtype=torch.uint8, generator=gen)
    b_scale = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)
    a_scale[0] = 0x7E  # 448
    a_scale[1] = 0x01  # 2^-9, the smallest subnormal
    b_scale[0:2] = 0x7E
    b_scale[3] = 0x01
    a_scale[2, 1] = 0x7F  # NaN: row 2 of the output is NaN
    args = raw_gemm_args(a, a_scale, 0.5, b, b_scale, 0.25)
    got = ops.nvfp4_gemm(*args, torch.float32)
    expected = ref.nvfp4_gemm(*args, torch.float32)
    assert got[2].isnan().all()
    assert_bitwise_equal(got, expected, "nvfp4_gemm vs reference", any_nan=True)


def test_gemm_adds_block_sums_in_k_order(gemm_isa):
    """Block scales over the whole E4M3 range make the float32 totals round at almost every block: the
    kernel must add the block sums in K order, as the reference, across several 2048-k passes too.

    Checked against the same blocks added last to first, which must differ, so the data can tell.
    """
    m, n, k = 24, 40, 4160
    gen = torch.Generator().manual_seed(7)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    a_scale = torch.randint(1, 0x7F, (m, k // 16), dtype=torch.uint8, generator=gen)
    b_scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)
    args = raw_gemm_args(a, a_scale, 1.0, b, b_scale, 1.0)
    got = ops.nvfp4_gemm(*args, torch.float32)
    expected = ref.nvfp4_gemm(*args, torch.float32)
    one = torch.tensor(1.0)
    a_values, b_values = ref.dequantize_nvfp4(args[0], args[1], one), ref.dequantize_nvfp4(args[3], args[4], one)
    backwards = torch.zeros(m, n)
    for kb in reversed(range(k // 16)):
        backwards += a_values[:, kb * 16 : (kb + 1) * 16] @ b_values[:, kb * 16 : (kb + 1) * 16].T
    assert (backwards != expected).float().mean() > 0.5, "the data must make the K order matter"
    assert_bitwise_equal(got, expected, "nvfp4_gemm vs reference")


def test_gemm_ignores_thread_count():
    a, b = quantized_operand(200, 256, 3), quantized_operand(150, 256, 4)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(ops.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale))
    finally:
        torch.set_num_threads(saved)
    assert_bitwise_equal(results[0], results[1])


def test_opcheck_quantize():
    x = torch.randn(32, 48)
    amax = ops.nvfp4_amax(x)
    # (rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset)
    cases = (
        (True, True, False, True, False, 0, 0),
        (True, True, True, False, True, 5, 9),
        (False, True, False, False, False, 0, 0),
    )
    for args in cases:
        torch.library.opcheck(torch.ops.transformer_linear.quantize_nvfp4.default, (x, amax, amax, *args))


@pytest.mark.usefixtures("allclose_on_fp8")
def test_opcheck_gemm():
    a, b = quantized_operand(8, 32, 5), quantized_operand(12, 32, 6)
    for out_dtype, bias in ((torch.float32, None), (torch.bfloat16, torch.randn(12, dtype=torch.bfloat16))):
        torch.library.opcheck(
            torch.ops.transformer_linear.nvfp4_gemm.default,
            (bits(a.data), a.scale, a.global_scale, bits(b.data), b.scale, b.global_scale, out_dtype, bias),
        )


def test_gemm_operands_unchanged():
    a, b = quantized_operand(8, 32, 5), quantized_operand(12, 32, 6)
    before = [bits(t).clone() for t in (*a[:3], *b[:3])]
    ops.nvfp4_gemm(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale)
    for old, new in zip(before, (*a[:3], *b[:3])):
        assert torch.equal(old, bits(new))


def test_meta_inputs_give_shapes():
    x = torch.empty(32, 64, device="meta")
    got = ops.quantize_nvfp4(x, torch.empty((), device="meta"), columnwise=True)
    assert got.data.shape == (32, 32) and got.scale.shape == (32, 4) and got.data_t.shape == (64, 16)
    assert got.data.dtype == fmt.FP4_DTYPE and got.scale_t.dtype == torch.float8_e4m3fn


X = torch.randn(32, 64)
AMAX = torch.tensor(4.0)
A = ops.quantize_nvfp4(X, AMAX)


SHORT_K = dict(a=A.data[:, :4], b=A.data[:, :4], a_scale=A.scale[:, :1], b_scale=A.scale[:, :1])


def gemm_with(**changes):
    args = dict(a=A.data, a_scale=A.scale, a_global_scale=A.global_scale, b=A.data, b_scale=A.scale,
                b_global_scale=A.global_scale)
    args.update(changes)
    return lambda: ops.nvfp4_gemm(**args)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ops.quantize_nvfp4(X.double(), AMAX), TypeError, "'x' must be torch.float32"),
        (lambda: ops.quantize_nvfp4(X.to(torch.int32), AMAX), TypeError, "'x'"),
        (lambda: ops.quantize_nvfp4("x", AMAX), TypeError, "'x' must be a torch.Tensor"),
        (lambda: ops.quantize_nvfp4(X, AMAX.to("meta")), TypeError, "'amax' must be on cpu"),
        (lambda: ops.quantize_nvfp4(X.to("meta"), AMAX), TypeError, "'amax' must be on meta"),
        (lambda: ops.quantize_nvfp4(X, AMAX.double()), TypeError, "'amax' must be a float32"),
        (lambda: ops.quantize_nvfp4(X, torch.ones(2)), ValueError, "'amax' must be a one-element"),
        (lambda: ops.quantize_nvfp4(X, torch.tensor(float("inf"))), ValueError, "'amax' must be finite"),
        (lambda: ops.quantize_nvfp4(X, torch.tensor(float("nan"))), ValueError, "'amax' must be finite"),
        (lambda: ops.quantize_nvfp4(X, torch.tensor(-1.0)), ValueError, "'amax' must be finite and non-negative"),
        (lambda: ops.quantize_nvfp4(X, AMAX, torch.tensor(float("nan")), columnwise=True), ValueError, "'amax_t'"),
        (lambda: ops.quantize_nvfp4(X[:, :40], AMAX), ValueError, "columns of 'x' \\(40\\) must be a multiple of 16"),
        (lambda: ops.quantize_nvfp4(X[:20], AMAX, columnwise=True), ValueError, "rows of 'x' \\(20\\)"),
        (lambda: ops.quantize_nvfp4(X[0], AMAX), ValueError, "'x' must be 2-D"),
        (lambda: ops.quantize_nvfp4(X, AMAX, rowwise=False), ValueError, "at least one of"),
        (lambda: ops.quantize_nvfp4(X, AMAX, columnwise=True, rht=True, scaling_2d=True), ValueError, "be combined"),
        (lambda: ops.quantize_nvfp4(X, AMAX, offset=-1), ValueError, "'offset'"),
        (lambda: ops.quantize_nvfp4(X, AMAX, seed=2**63), ValueError, "'seed'"),
        (lambda: ops.quantize_nvfp4(X, AMAX, seed=1.5), ValueError, "'seed'"),
        (gemm_with(a=A.data.view(torch.uint8)), TypeError, "'a' must be torch.float4_e2m1fn_x2"),
        (gemm_with(b_scale=A.scale.float()), TypeError, "'b_scale' must be torch.float8_e4m3fn"),
        (gemm_with(a_scale=A.scale[:, :2]), ValueError, "'a_scale' must have shape \\[32, 4\\]"),
        (gemm_with(b=A.data[:, :16], b_scale=A.scale[:, :2]), ValueError, "K dimensions"),
        (gemm_with(**SHORT_K), ValueError, "K \\(8 FP4 values per row of 'a'\\) must be a multiple of 16"),
        (gemm_with(a_global_scale=torch.tensor(float("inf"))), ValueError, "'a_global_scale' must be finite"),
        (gemm_with(b_global_scale=torch.tensor(float("nan"))), ValueError, "'b_global_scale' must be finite"),
        (gemm_with(b_global_scale=torch.ones(2)), ValueError, "'b_global_scale' must be a one-element"),
        (gemm_with(a_global_scale=A.global_scale.to("meta")), TypeError, "'a_global_scale' must be on cpu"),
        (gemm_with(a=A.data.to("meta")), TypeError, "must be on meta"),
        (gemm_with(out_dtype=torch.int8), TypeError, "'out_dtype'"),
        (gemm_with(bias=torch.ones(32, dtype=torch.float16)), TypeError, "'bias' must have the output dtype"),
        (gemm_with(bias=torch.ones(31)), ValueError, "'bias' must have shape"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def kernel_quantize(x, amax, output, scale, global_scale, **kw):
    """_C.quantize_nvfp4 with well-formed defaults for the arguments not given (rowwise only)."""
    d = lambda t, name: desc(t, "test", name)  # noqa: E731
    args = dict(output_t=None, scale_t=None, global_scale_t=None, scaling_2d=False, rht=False,
                stochastic_rounding=False, seed=0, offset=0)
    args.update(kw)
    return _C.quantize_nvfp4(d(x, "x"), d(amax, "amax"), d(amax, "amax_t"), d(output, "o"), d(scale, "s"),
                             d(global_scale, "g"), **args)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(output=torch.empty(32, 16, dtype=torch.uint8)), ValueError, "'output' must have shape"),
        (dict(scale=torch.empty(32, 4, dtype=torch.uint8)), TypeError, "'scale' must have dtype float8_e4m3fn"),
        (dict(scale=torch.empty(32, 3, dtype=torch.float8_e4m3fn)), ValueError, "'scale' must have shape"),
        (dict(global_scale=torch.empty(2)), ValueError, "'global_scale' must be a one-element"),
        (dict(amax=torch.tensor(float("inf"))), ValueError, "'amax' must be finite"),
        (dict(offset=-3), ValueError, "'offset' must be non-negative"),
        (dict(x=X.t()), ValueError, "'x' must be contiguous"),
    ],
)
def test_kernel_front_end_checks(change, error, match):
    """The C++ front end checks everything again (the kernels can be reached through _C directly)."""
    args = dict(x=X, amax=AMAX, output=torch.empty(32, 32, dtype=torch.uint8),
                scale=torch.empty(32, 4, dtype=torch.float8_e4m3fn), global_scale=torch.empty(()))
    with pytest.raises(error, match=match):
        kernel_quantize(**{**args, **change})


def test_kernel_front_end_rejects_overlap():
    buf = torch.empty(32 * 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shares memory"):
        kernel_quantize(X, AMAX, buf.view(32, 32), buf[:128].view(torch.float8_e4m3fn).view(32, 4), torch.empty(()))
    d = torch.empty(32, 32)
    with pytest.raises(ValueError, match="shares memory"):
        _C.nvfp4_gemm(desc(A.data.view(torch.uint8), "t", "a"), desc(A.scale, "t", "s"), desc(A.global_scale, "t", "g"),
                      desc(A.data.view(torch.uint8), "t", "b"), desc(A.scale, "t", "s"), desc(d[0, 0], "t", "g"),
                      None, desc(d, "t", "d"))


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize(
    "usage",
    [
        dict(rowwise=True, columnwise=True, rht=True, stochastic_rounding=True),
        dict(rowwise=True, columnwise=True, scaling_2d=True),
        dict(rowwise=False, columnwise=True, rht=True),
        dict(rowwise=True, columnwise=False, stochastic_rounding=True),
    ],
    ids=["input_or_grad", "weight_2d", "columnwise_rht", "rowwise_sr"],
)
def test_packed_quantize_is_quantize_then_pack(cpu_isa, dtype, usage):
    """The Linear's packed form (the CPU kernel writing into the packed scales) has the bits of
    ``quantize_nvfp4`` with ``nvfp4_amax``'s amaxes followed by ``pack_scales``."""
    x = (torch.randn(48, 80) * 3).to(dtype)
    sr = usage.get("stochastic_rounding", False)
    got = ops.quantize_nvfp4_packed(x, **usage, seed=torch.tensor(-99) if sr else None)
    amax_t = ops.nvfp4_amax(x, rht=True) if usage.get("rht") else None
    want = ops.quantize_nvfp4(x, ops.nvfp4_amax(x), amax_t, **usage, seed=-99 if sr else 0)
    if usage["rowwise"]:
        assert_bitwise_equal(got[0], want.data.view(torch.uint8), "data")
        assert_bitwise_equal(got[1], ops.pack_scales(want.scale, want.global_scale), "packed scales")
    if usage["columnwise"]:
        assert_bitwise_equal(got[2], want.data_t.view(torch.uint8), "data_t")
        assert_bitwise_equal(got[3], ops.pack_scales(want.scale_t, want.global_scale_t), "packed scales_t")
