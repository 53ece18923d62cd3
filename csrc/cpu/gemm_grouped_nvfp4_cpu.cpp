// CPU grouped NVFP4 GEMM: each group's GEMM is the NVFP4 GEMM driver (gemm_nvfp4_cpu.cpp) on
// a view of the group's rows (forward, dgrad) or of the 16-token blocks holding its tokens
// (wgrad), so each output element has the bits of the per-expert NVFP4 GEMM.
//
// Forward: rows of a group depend on nothing but their own row of A and the group's B; the
// driver computes every element the same way whatever m. Wgrad: each group's operands are
// its tokens masked to the group and quantized columnwise on the tensor's 16-token grid, so
// every block outside [offs[g-1] / 16, ceil(offs[g] / 16)) is all zero codes with zero block
// scales; its block sum is +0, and adding +0 to a float32 total that starts at +0 leaves it
// unchanged (the total is never -0: x + (+0) = x for x != -0, and a sum that cancels to
// zero rounds to +0). Skipping those blocks therefore gives the same bits at 1/G of the work.
//
// Threading over groups x tiles: a group large enough for the driver to split across the
// threads runs alone with all of them (the driver splits its tiles); the groups below that
// run side by side, one per thread, each single-threaded. Results do not depend on it.
#include <cstring>
#include <vector>

#include "../common/backend_nvfp4.h"
#include "gemm_nvfp4_cpu.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {

void nvfp4_grouped_gemm(const GroupedGemmNvfp4Params& p) {
  const gemm_nvfp4::KernelSet ks = gemm_nvfp4::current_kernels();
  const int64_t out_bytes = element_size(p.out_dtype);
  const int64_t k_bytes = p.k / 2, k_scales = p.k / gemm_nvfp4::kBlockK;
  advise_huge_pages(p.d, static_cast<size_t>(p.wgrad ? p.groups * p.n * p.k : p.total * p.n) * out_bytes);
  std::vector<gemm_nvfp4::GemmView> views;
  views.reserve(p.groups);
  const std::vector<GroupBands> bands = group_bands(p.offs, p.groups);
  for (int64_t g = 0; g < p.groups; ++g) {
    const GroupBands& gb = bands[g];
    gemm_nvfp4::GemmView v{};
    v.alpha = p.a_global[g] * p.b_global[g];
    if (!p.wgrad) {
      if (gb.start == gb.end) continue;
      v.a = p.a + gb.start * k_bytes;
      v.a_scale = p.a_scale + gb.start * k_scales;
      v.a_ld = p.k;
      v.b = p.b + g * p.b_group_stride;
      v.b_scale = p.b_scale + g * p.b_scale_stride;
      v.b_ld = p.k;
      v.bias = p.bias ? static_cast<const uint8_t*>(p.bias) + g * p.n * out_bytes : nullptr;
      v.d = static_cast<uint8_t*>(p.d) + gb.start * p.n * out_bytes;
      v.m = gb.end - gb.start;
      v.n = p.n;
      v.k = p.k;
    } else {
      // The group's bands in the compact copies; none for an empty group (d[g] = 0 * alpha).
      v.a = p.a + gb.column / 2;
      v.a_scale = p.a_scale + gb.column / gemm_nvfp4::kBlockK;
      v.a_ld = p.capacity;
      v.b = p.b + gb.column / 2;
      v.b_scale = p.b_scale + gb.column / gemm_nvfp4::kBlockK;
      v.b_ld = p.capacity;
      v.bias = nullptr;
      v.d = static_cast<uint8_t*>(p.d) + g * p.n * p.k * out_bytes;
      v.m = p.n;
      v.n = p.k;
      v.k = gb.band_end - gb.band_begin;
    }
    views.push_back(v);
  }
  if (!p.wgrad) {  // rows past the last group: zero
    const int64_t used = p.groups == 0 ? 0 : p.offs[p.groups - 1];
    std::memset(static_cast<uint8_t*>(p.d) + used * p.n * out_bytes, 0,
                static_cast<size_t>((p.total - used) * p.n * out_bytes));
  }
  // As the driver's own threshold: below it a GEMM runs on one thread anyway.
  constexpr double kMinParallelFlops = 1 << 22;
  const int threads = get_num_threads();
  std::vector<const gemm_nvfp4::GemmView*> small;
  for (const auto& v : views) {
    if (threads > 1 && 2.0 * v.m * v.n * v.k < kMinParallelFlops) {
      small.push_back(&v);
    } else {
      gemm_nvfp4::gemm(v, p.out_dtype, ks);
    }
  }
  parallel_for(static_cast<int64_t>(small.size()), 1, [&](int64_t i0, int64_t i1) {
    const ThreadCountScope one(1);
    for (int64_t i = i0; i < i1; ++i) gemm_nvfp4::gemm(*small[i], p.out_dtype, ks);
  });
}

}  // namespace cpu
}  // namespace tl
