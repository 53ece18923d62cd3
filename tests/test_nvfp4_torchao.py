"""NVFP4 quantize bits against torchao 0.18 (``torchao.prototype.mx_formats``) on the CPU.

Our quantize is ``ops.quantize_nvfp4`` (the CPU kernel, bitwise equal to ``reference.nvfp4``);
torchao's is ``nvfp4_quantize`` / ``NVFP4Tensor.to_nvfp4`` (pure PyTorch, rowwise 1x16 only, round
to nearest even; no RHT, 2D scaling or stochastic rounding, so only those options are compared).
Same layout: data (M, K/2) bytes with the first element of each pair in the low nibble, scales
(M, K/16) E4M3 unswizzled; the E2M1 codes are the same (saturating at 6, sign kept, -0 is code 8).

The bits differ where, and only where, the two compute different float32 roundings or clamp:

1. Global scale. TE (and so this package) stores the decode scale ``g = fl(1 / fl(2688 / amax))``;
   torchao's ``per_tensor_amax_to_scale`` gives ``p = fl(amax / 2688)``. They differ by at most 1 ulp
   (they are equal when amax / 2688 is a power of two). Mapping: pass torchao our ``g`` as its
   ``per_tensor_scale`` and the remaining differences are 2-4 below.
2. Block scale before the E4M3 rounding: ours ``u = fl(block_amax * fl(S_enc * fl(1/6)))`` with
   ``S_enc = fl(2688 / amax)``; torchao's ``u' = fl(fl(block_amax / 6) / p)``. Seven float32 roundings
   of at most half an ulp each separate them, so ``u`` and ``u'`` are within 4 ulps: the E4M3 scales
   differ only where an E4M3 rounding midpoint lies between (or on) them, and then by one E4M3 step
   (``test_block_scale_midpoint_case`` builds such a block). Where the scales differ, the whole
   block's codes follow the other scale.
3. Scale floor. torchao clamps the block scale up to 2^-6 (the smallest *normal* E4M3, its
   ``E4M3_EPS``); TE keeps subnormal E4M3 scales and 0 (an all-zero block). Blocks with
   ``u' < 2^-6`` (block amax below ~2^-6 * 6 * p) get scale 2^-6 in torchao, so their codes differ too.
4. Encode factor: ours ``f = min(fl(1 / fl(float(s) * g)), FLT_MAX)``, torchao's
   ``f' = fl(fl(1 / p) / float(s))``. Within 4 ulps (seven roundings again), so with equal block
   scales a code differs only where ``x * f`` and ``x * f'`` straddle an E2M1 rounding threshold, and
   then by one code step. With a power-of-two ``g`` both factors are exact and the codes are equal.
   Measured on randn(4096, 4096): float32 input, 2 of 8.4M bytes differ (no scale); bfloat16, none.
5. Single-level (torchao ``per_tensor_scale=None``) is ours with ``amax = 2688`` (``S_enc = g = 1``):
   the only difference left is ``fl(block_amax * fl(1/6))`` against ``fl(block_amax / 6)`` (2) and the
   floor (3); the encode factors are both ``fl(1 / s)``. Values beyond 2688 saturate alike (scale 448,
   code ±6).
6. Non-finite and degenerate input (not in the parametrized cases): a NaN gives a NaN block scale in
   both, but torchao turns every code of that block into 4 (0x44 bytes), ours keeps the other codes and
   gives the NaN code 7; an all-zero tensor with ``per_tensor_scale = amax / 2688 = 0`` gives torchao
   NaN scales, ours (amax 0: ``S_enc = 1``) zero scales and codes 0 (``test_degenerate_inputs``).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal

from transformer_linear.ops import nvfp4 as ops
from transformer_linear.reference import nvfp4 as ref

ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

E4M3_TINY = 2.0**-6  # torchao's E4M3_EPS = torch.finfo(torch.float8_e4m3fn).tiny
FLT_MAX = torch.finfo(torch.float32).max
SHAPES = [(1, 16), (16, 32), (33, 48), (128, 256)]
# "tensor": TE's two-level scaling with torchao's own per-tensor scale; "mapped": torchao given our
# decode scale; "single": torchao without a per-tensor scale against ours with S_enc = 1.
GLOBAL_SCALES = ["tensor", "mapped", "single"]


def f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps of positive finite floats (their bit patterns are ordered)."""
    return (a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs()


def e4m3(u: torch.Tensor) -> torch.Tensor:
    return u.clamp(max=448.0).to(torch.float8_e4m3fn)


def codes(data: torch.Tensor) -> torch.Tensor:
    return ref.unpack_e2m1(data.view(torch.uint8).view(ref.FP4_DTYPE))


def sample(shape, dtype, seed):
    """Rows of very different magnitudes, a few tiny blocks (the scale floor), exact zeros and -0."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 8, (m, 1), generator=g).float())
    if k >= 32:
        x[0, 16:32] *= 1e-6
    x[m // 2, 0] = 0.0
    x[m - 1, k - 1] = -0.0
    return x.to(dtype)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    return x.float().abs().reshape(m, k // 16, 16).amax(-1)


def torchao_quantize(x, per_tensor_scale):
    """torchao's NVFP4Tensor (unswizzled scales), checked against its functional form."""
    t = ao.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale)
    scale, data = ao.nvfp4_quantize(x, 16, per_tensor_scale)
    assert torch.equal(t.qdata, data) and torch.equal(t.scale.view(torch.uint8), scale.view(torch.uint8))
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("global_scale", GLOBAL_SCALES)
def test_quantize_bits_match_torchao_up_to_documented_differences(dtype, shape, global_scale):
    """Every bit of torchao's result is explained by the module doc's rules 1-5; equal elsewhere."""
    x = sample(shape, dtype, seed=sum(shape))
    amax = ops.nvfp4_amax(x) if global_scale != "single" else f32(2688.0)
    ours = ops.quantize_nvfp4(x, amax)
    s_enc = ref.global_encode_scale(amax)
    g = ours.global_scale
    assert_bitwise_equal(g, f32(1.0) / s_enc, "our decode scale = fl(1 / fl(2688 / amax))")
    if global_scale == "tensor":
        p = ao.per_tensor_amax_to_scale(amax)
        assert_bitwise_equal(p, amax / f32(2688.0), "torchao's per-tensor scale")
        assert ulps(g, p) <= 1, f"rule 1: global scales {g.item()!r} vs {p.item()!r}"
    elif global_scale == "mapped":
        p = g
    else:
        p = None
    theirs = torchao_quantize(x, p)
    if p is None:
        assert theirs.per_tensor_scale is None
        assert g.item() == 1.0
        p = f32(1.0)
    else:
        assert_bitwise_equal(theirs.per_tensor_scale, p, "per_tensor_scale")
    assert theirs.qdata.shape == ours.data.shape and theirs.scale.shape == ours.scale.shape

    # Rule 2 and 3: both block scales follow their formulas bit for bit, u and u' are 4 ulps apart.
    bamax = block_amax(x)
    u = bamax * (s_enc * f32(1.0 / 6.0))
    u_ao = bamax / 6.0 if global_scale == "single" else (bamax / 6.0) / p
    assert_bitwise_equal(ours.scale.view(torch.uint8), e4m3(u).view(torch.uint8), "our scale = e4m3(u)")
    assert_bitwise_equal(
        theirs.scale.view(torch.uint8), e4m3(u_ao.clamp(min=E4M3_TINY)).view(torch.uint8), "torchao's scale"
    )
    finite = (u > 0) & (u_ao > 0)
    assert (ulps(u, u_ao)[finite] <= 4).all(), "rule 2: pre-rounding block scales more than 4 ulps apart"
    floored = u_ao < E4M3_TINY
    same_scale = ours.scale.view(torch.uint8) == theirs.scale.view(torch.uint8)
    rounding = ~same_scale & ~floored
    # A scale difference outside the floor is one E4M3 step around a midpoint between u and u'.
    steps = (ours.scale.view(torch.uint8).int() - theirs.scale.view(torch.uint8).int()).abs()
    assert (steps[rounding] == 1).all(), "rule 2: scales differ by more than one E4M3 step"
    lo, hi = torch.minimum(u, u_ao)[rounding], torch.maximum(u, u_ao)[rounding]
    between = e4m3(lo).float() != e4m3(hi).float()
    assert between.all(), "rule 2: a scale difference without a midpoint between u and u'"
    if shape[1] >= 32:
        assert floored.any(), "the sample should exercise the floor (rule 3)"
        assert (theirs.scale.float()[floored] == E4M3_TINY).all()

    # Rule 4: with equal scales the codes are e2m1(x * f) and e2m1(x * f'), f and f' 4 ulps apart.
    s = ours.scale.float()
    f = torch.fmin(f32(1.0) / (s * g), f32(FLT_MAX))
    f_ao = (f32(1.0) / p) / s if global_scale != "single" else f32(1.0) / s
    xv = x.float().reshape(*bamax.shape, 16)
    ours_codes, ao_codes = codes(ours.data), codes(theirs.qdata)
    expect_ours = ref.e2m1_round((xv * f.unsqueeze(-1)).reshape(shape))
    expect_ao = ref.e2m1_round((xv * f_ao.unsqueeze(-1)).clamp(-6.0, 6.0).reshape(shape))
    block_same = same_scale.repeat_interleave(16, dim=1)
    assert_bitwise_equal(ours_codes, expect_ours, "our codes = e2m1(x * f)")
    assert_bitwise_equal(ao_codes[block_same], expect_ao[block_same], "torchao's codes = e2m1(x * f')")
    nonzero = same_scale & (s > 0)
    assert (ulps(f, f_ao)[nonzero] <= 4).all(), "rule 4: encode factors more than 4 ulps apart"
    differ = block_same & (ours_codes != ao_codes)
    assert ((ours_codes[differ] & 8) == (ao_codes[differ] & 8)).all(), "a code differs in sign"
    assert ((ours_codes[differ] & 7).int() - (ao_codes[differ] & 7).int()).abs().le(1).all()
    if global_scale != "tensor":
        # With torchao given our global scale (or none), equal scales mean equal codes whenever g is
        # a power of two (both factors exact); count what is left otherwise.
        power_of_two = g.view(torch.int32) & 0x7FFFFF == 0
        if power_of_two:
            assert not differ.any(), "rule 4: codes differ although both encode factors are exact"
    # Nibble order: torchao's bytes are its codes packed as ours (first element in the low nibble).
    assert_bitwise_equal(ref.pack_e2m1(ao_codes).view(torch.uint8), theirs.qdata, "torchao nibble order")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_power_of_two_global_scale_is_bit_identical(dtype):
    """amax = 2688 * 2^k makes rule 1 and 4 vanish: outside the floor every bit is equal."""
    x = sample((64, 128), dtype, seed=7).float()
    amax = f32(2688.0 * 2.0**-10)
    x = x.clamp(-amax.item(), amax.item()).to(dtype)
    ours = ops.quantize_nvfp4(x, amax)
    theirs = torchao_quantize(x, ao.per_tensor_amax_to_scale(amax))
    assert_bitwise_equal(ours.global_scale, theirs.per_tensor_scale, "global scale")
    keep = ~(ours.scale.float() < E4M3_TINY)
    assert (~keep).any()
    assert_bitwise_equal(ours.scale.view(torch.uint8)[keep], theirs.scale.view(torch.uint8)[keep], "block scales")
    byte_keep = keep.repeat_interleave(8, dim=1)
    assert_bitwise_equal(ours.data.view(torch.uint8)[byte_keep], theirs.qdata[byte_keep], "data bytes")


def test_global_scale_formulas_differ_by_one_ulp():
    """Rule 1 over many amax values: never more than 1 ulp apart, sometimes exactly 1."""
    amax = torch.exp2(torch.linspace(-20.0, 20.0, 4001))
    g = f32(1.0) / ref.global_encode_scale(amax)
    p = ao.per_tensor_amax_to_scale(amax)
    distance = ulps(g, p)
    assert distance.max() == 1
    assert 0 < (distance == 1).sum() < amax.numel()


def test_block_scale_midpoint_case():
    """Rule 2, built: torchao given our global scale, a block amax whose u and u' straddle a midpoint.

    With amax = 1000 the block amax b next to 6 * 1.0625 * g has u = 1.0625 + 1 ulp (rounds up to
    E4M3 1.125) but u' = 1.0625 exactly (a tie: nearest even, 1.0). With S_enc = 1 (single-level) no
    such b exists: fl(1/6) exceeds 1/6 by less than half an ulp of any midpoint.
    """
    amax = f32(1000.0)
    s_enc = ref.global_encode_scale(amax)
    g = f32(1.0) / s_enc
    midpoint = f32(1.0625)  # between E4M3 1.0 and 1.125
    center = (midpoint * 6.0 * g).view(torch.int32)
    b = (center + torch.arange(-64, 64, dtype=torch.int32)).view(torch.float32)
    u, u_ao = b * (s_enc * f32(1.0 / 6.0)), (b / 6.0) / g
    straddle = (e4m3(u).float() != e4m3(u_ao).float()).nonzero().flatten()
    assert straddle.numel() == 1
    x = torch.zeros(1, 16)
    x[0, 0] = b[straddle[0]]
    ours = ops.quantize_nvfp4(x, amax)
    theirs = torchao_quantize(x, g)
    assert ours.scale.float().item() == 1.125  # u = 1.0625 + 1 ulp rounds up
    assert theirs.scale.float().item() == 1.0  # u' = 1.0625 ties to even
    # Both saturate b to code 7 (6), so b dequantizes to 6.75 g here and 6 g in torchao.
    assert codes(ours.data)[0, 0] == codes(theirs.qdata)[0, 0] == 7
    assert ref.dequantize_nvfp4(ours.data, ours.scale, g)[0, 0] == 6.75 * g


def test_degenerate_inputs():
    """Rule 6: NaN blocks and an all-zero tensor."""
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1], x[0, 3] = float("nan"), -1.0, 1.0
    ours = ops.quantize_nvfp4(x, f32(1.0))
    theirs = torchao_quantize(x, f32(1.0 / 2688.0))
    assert torch.isnan(ours.scale.float()[0, 0]) and torch.isnan(theirs.scale.float()[0, 0])
    assert (theirs.qdata[0] == 0x44).all()
    ours_codes = codes(ours.data)[0]
    assert ours_codes[0] == 7 and (ours_codes[4:] == 0).all()
    zeros = torch.zeros(4, 32)
    ours = ops.quantize_nvfp4(zeros, ops.nvfp4_amax(zeros))
    theirs = torchao_quantize(zeros, ao.per_tensor_amax_to_scale(ops.nvfp4_amax(zeros)))
    assert torch.isnan(theirs.scale.float()).all()
    assert (ours.scale.float() == 0).all() and (ours.data.view(torch.uint8) == 0).all()
    assert ours.global_scale.item() == 1.0
