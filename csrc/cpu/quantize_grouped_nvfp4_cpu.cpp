// CPU grouped columnwise NVFP4 quantize: for each group, the columnwise copy (1x16 blocks along
// the tokens) of the tokens masked to the group, as quantize_nvfp4 makes it of the masked tensor,
// touching only the 16-token bands that hold the group's tokens.
//
// The masked tensor's global amax is the maximum over the group's rows (its other rows are +0);
// with the Hadamard transform, over the transformed blocks of the group's bands (the others
// transform to 0), the transform of a band computed with the group's rows only, as the kernel
// transforms it. Its bands outside the group quantize to zero codes and zero scales (a block of
// zeros: amax 0, scale 0, code 0 in either rounding), which the caller's zeroed output holds
// already; the group's bands go through the quantize kernel with the tensor's full token
// count, so every element keeps its index in the copy and its stochastic-rounding bits.
//
// The copies are compact: only each group's bands are stored (the rest of a masked copy is zero
// codes with zero scales, and the wgrad GEMM reads the bands only), one group after another
// (group_bands), in a buffer of compact_tokens(total, groups) tokens, about the input's FP4 size
// rather than groups times it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/backend_nvfp4.h"
#include "parallel.h"
#include "quantize_nvfp4_cpu.h"
#include "quantize_nvfp4_cpu_amax.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"
#include "transformer_linear/fp8_math.h"

namespace tl {
namespace cpu {

using nvfp4::kBlock;

void quantize_grouped_nvfp4(const QuantizeGroupedNvfp4Params& p) {
  const std::vector<GroupBands> bands = group_bands(p.offs, p.groups);
  for (int64_t g = 0; g < p.groups; ++g) {
    const GroupBands& b = bands[g];
    const int64_t band0 = b.band_begin / kBlock, band1 = b.band_end / kBlock;
    // The masked tensor's global amax: over the group's rows, or over the transforms of its bands
    // (the transform of a band computed with the group's rows only, as the kernel transforms it).
    float amax = 0.0f;
    const nvfp4::AmaxRange range{b.start, b.end, band0, band1};
    nvfp4::nvfp4_amaxes(p.input, p.k, range, p.rht ? nullptr : &amax, p.rht ? &amax : nullptr);
    TL_CHECK(std::isfinite(amax), "quantize_grouped_nvfp4: the global amax of group ", g,
             " must be finite and non-negative (the global scale is 448 * 6 / amax), got ", amax);
    const float s_enc = nvfp4::global_encode_scale(amax);
    // The global decode scale, packed as pack_scales does: 8 elements of 4 bits, least significant first.
    const uint32_t bits = fp8::bits_of(1.0f / s_enc);
    uint8_t* global_t = p.global_t + g * 8;
    for (int i = 0; i < 8; ++i) global_t[i] = static_cast<uint8_t>((bits >> (4 * i)) & 0xF);
    if (band0 == band1) continue;
    // The group's bands of its copy, at its compact columns: the kernel runs on the whole tensor
    // (m = total), so every element keeps its index in the copy (its random bits), and writes
    // band r0 of column c at c * capacity + (r0 - band_begin) of this group's first column.
    QuantizeNvfp4Params q{};
    q.input = p.input;
    q.output_t = p.input;  // the group's copy: only data (and dtype-free pointer use) is read
    q.output_t.dtype = DType::kUInt8;
    q.output_t.data = p.output_t + b.column / 2;
    q.output_t.ndim = 2;
    q.output_t.shape[0] = p.k;
    q.output_t.shape[1] = p.capacity / 2;
    q.output_t.strides[0] = p.capacity / 2;
    q.output_t.strides[1] = 1;
    q.scale_t = q.output_t;
    q.scale_t.dtype = DType::kFloat8E4M3;
    q.scale_t.data = p.scale_t + b.column / kBlock;
    q.scale_t.shape[1] = p.capacity / kBlock;
    q.scale_t.strides[0] = p.capacity / kBlock;
    q.s_enc = s_enc;
    q.s_enc_t = s_enc;
    q.m = p.total;
    q.k = p.k;
    q.scaling_2d = false;
    q.rht = p.rht;
    q.stochastic_rounding = p.stochastic_rounding;
    q.seed = p.stochastic_rounding ? static_cast<uint64_t>(p.seeds[g]) : 0;
    q.offset = 0;
    q.band_begin = band0;
    q.band_end = band1;
    q.keep_begin = b.start;
    q.keep_end = b.end;
    q.t_ld = p.capacity;
    q.t_row0 = b.band_begin;
    quantize_nvfp4(q);
  }
}

}  // namespace cpu
}  // namespace tl
