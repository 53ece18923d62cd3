// CPU block-scaled FP8 GEMM (1x128 x 128x128, 1x128 x 1x128, 1x32 E8M0, rowwise).
//
// Reuses the packing and register-tiled micro-kernels of the tensorwise GEMM
// (gemm_cpu.h): FP8 is decoded while packing and products are exact, so the
// micro-kernel's fp32 sum over one K-block of g values is the block's partial
// sum. After each K-block the partial tile is promoted into the fp32 total
// with the two block scales (acc += part * (sa[i] * sb[j]), DeepGEMM's
// promotion); the K-block g is the smaller of the operands' block widths.
// Loop nest as in gemm_cpu.cpp: NC blocks of B rows, KC chunks of k (a
// multiple of g), the B chunk packed by all threads, A blocks per thread, the
// chunks run with no barrier between them (run_passes, gemm_passes.h), and
// the next B panel is prefetched while the current one runs.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "../common/backend_block.h"
#include "cpu_features.h"
#include "gemm_block_cpu.h"
#include "gemm_cpu.h"
#include "gemm_passes.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "transformer_linear/block_math.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace gemm_block {
namespace {

using gemm::KernelSet;
using gemm::Operand;
using gemm::store_tile;
using gemm::sub_operand;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Exponents of power-of-two scales, [row][k-block] (the scales' own order, rows_padded rows, zero
// past `rows`), or empty when a scale is not a power of two whose products with every nonzero finite
// FP8 value are normal (e4m3 magnitudes lie in [2^-9, 2^9), e5m2 in [2^-16, 2^16)). One contiguous
// walk on the calling thread: a fork-join here waits, on a shared machine, for whichever thread the
// OS has descheduled, which cost more than the walk.
std::vector<int32_t> scale_exponents(const TensorDesc& scale, const BlockLayout& l, int64_t rows,
                                     int64_t rows_padded, DType fp8) {
  const int lo = fp8 == DType::kFloat8E4M3 ? -117 : -110;
  const int hi = fp8 == DType::kFloat8E4M3 ? 118 : 111;
  const int64_t cols = l.grid_cols;
  std::vector<int32_t> out(rows_padded * cols, 0);
  bool foldable = true;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = (i / l.rows) * cols;
    int32_t* e = out.data() + i * cols;
    if (l.e8m0) {
      const uint8_t* bits = scale.ptr<uint8_t>() + row;
      for (int64_t c = 0; c < cols; ++c) e[c] = static_cast<int32_t>(bits[c]) - fp8::kE8M0Bias;
    } else {
      const float* values = scale.ptr<float>() + row;
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t bits = fp8::bits_of(values[c]);
        const uint32_t biased = bits >> 23;  // a set sign bit makes this >= 256
        foldable &= (bits & 0x7fffffu) == 0 && biased != 0 && biased < 255;
        e[c] = static_cast<int32_t>(biased) - fp8::kE8M0Bias;
      }
    }
    for (int64_t c = 0; c < cols; ++c) foldable &= e[c] >= lo && e[c] <= hi;
    if (!foldable) return {};
  }
  return out;
}

// Exponents of the panel rows [row0, row0 + r) for the K-blocks of a chunk starting at pc, [block][row].
void panel_exponents(const std::vector<int32_t>& exps, int64_t cols, int64_t row0, int r, int64_t pc, int64_t kb,
                     int64_t block_k, int32_t* out) {
  const int64_t first = pc / block_k, blocks = ceil_div(pc + kb, block_k) - first;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < r; ++i) out[b * r + i] = exps[(row0 + i) * cols + first + b];
  }
}

// Scales of every K-block of width g, laid out [k-block][row] and zero past `rows`
// (padded rows of packed panels hold zeros; 0 * 0 keeps them 0).
std::vector<float> expand_scales(const TensorDesc& scale, const BlockLayout& l, int64_t rows,
                                 int64_t rows_padded, int64_t g, int64_t k_blocks) {
  std::vector<float> out(k_blocks * rows_padded, 0.0f);
  for (int64_t s = 0; s < k_blocks; ++s) {
    const int64_t c = (s * g) / l.cols;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t index = (i / l.rows) * l.grid_cols + c;
      out[s * rows_padded + i] = l.e8m0 ? fp8::float_from_e8m0_bits(scale.ptr<uint8_t>()[index])
                                        : scale.ptr<float>()[index];
    }
  }
  return out;
}

std::vector<float> unit_scales(int64_t rows, int64_t rows_padded) {
  std::vector<float> out(rows_padded, 0.0f);
  std::fill(out.begin(), out.begin() + rows, 1.0f);
  return out;
}

template <typename Out>
void run(const GemmBlockParams& p, const KernelSet& ks, PromoteFn promote, FoldFn fold) {
  using T = typename Out::storage;
  T* d = p.d.ptr<T>();
  const T* bias = p.bias.defined() ? p.bias.ptr<T>() : nullptr;
  const int64_t m = p.m, n = p.n, k = p.k;
  if (k == 0) {  // empty product: D = bias [+ D]
    const std::vector<float> zeros(n, 0.0f);
    for (int64_t i = 0; i < m; ++i) store_tile<Out>(zeros.data(), 0, 1, n, 1.0f, bias, p.accumulate, d + i * n, n);
    return;
  }
  const int64_t m_pad = round_up(m, ks.mr), n_pad = round_up(n, ks.nr);
  // Power-of-two scales fold exactly into the decoded operands while packing (the
  // packed panels are then a plain GEMM's) where K-blocks hold whole packing groups.
  const auto foldable = [&](const BlockLayout& l) {
    return fold && (l.cols >= k || (ks.kc % l.cols == 0 && l.cols % ks.k_align == 0));
  };
  std::vector<int32_t> ea, eb;
  if (foldable(p.a_block) && foldable(p.b_block)) {
    ea = scale_exponents(p.a_scale_inv, p.a_block, m, m_pad, p.a.dtype);
    if (!ea.empty()) eb = scale_exponents(p.b_scale_inv, p.b_block, n, n_pad, p.b.dtype);
  }
  const bool folded = !eb.empty();
  const int64_t g = folded ? k : std::max<int64_t>(1, std::min(p.a_block.cols, p.b_block.cols));
  const int64_t k_blocks = ceil_div(k, g);
  const std::vector<float> sa = folded ? unit_scales(m, m_pad) : expand_scales(p.a_scale_inv, p.a_block, m, m_pad, g, k_blocks);
  const std::vector<float> sb = folded ? unit_scales(n, n_pad) : expand_scales(p.b_scale_inv, p.b_block, n, n_pad, g, k_blocks);
  const int64_t a_bk = std::min(p.a_block.cols, k), b_bk = std::min(p.b_block.cols, k);

  const int threads = gemm::gemm_threads(m, n, k);
  const gemm::StoreTileFn<Out> store = ks.store.get<Out>(static_cast<size_t>(m * n) * sizeof(T));
  // Partial sums are promoted every `step` k: each K-block, or every run of the kernel's
  // sum_k() when one block covers K (tensorwise, rowwise), which also keeps fp32 sums short.
  const int64_t step = g >= k ? std::min<int64_t>(k, ks.sum_k()) : g;
  TL_CHECK(step <= ks.kc, "fp8_gemm: a K-block of ", g, " wider than the kernel's ", ks.kc,
           " that does not cover K is not supported");
  const int64_t kc = ks.kc / step * step;
  const bool multi_pass = k > kc;
  const int64_t nc = gemm::nc_block(ks.nc, ks.nr, n, m_pad, multi_pass);
  const int64_t kc_max = std::min(kc, k);
  const int64_t passes = ceil_div(k, kc);
  const size_t b_chunk_bytes = ceil_div(nc, ks.nr) * ks.panel_bytes(kc_max, ks.nr);
  const gemm::PassBuffers buffers(gemm::pass_slots(threads, passes), b_chunk_bytes,
                                  multi_pass ? static_cast<size_t>(m_pad * nc) : 0, "fp8_gemm");
  const gemm::PartialTiles partials(buffers.totals(), m_pad, ks.mr, ks.nr);
  const Operand a_op{p.a.ptr<uint8_t>(), p.a_row, p.a_col, p.a.dtype};
  const Operand b_op{p.b.ptr<uint8_t>(), p.b_row, p.b_col, p.b.dtype};
  const int mr = ks.mr, nr = ks.nr;
  for (int64_t jc = 0; jc < n; jc += nc) {
    const int64_t nb = std::min(nc, n - jc);
    const int64_t b_panels = ceil_div(nb, nr);
    const gemm::UnitGrid grid(m, ks.mc, mr, b_panels, threads);
    gemm::run_passes(
        threads, passes, b_panels, grid.units(),
        [&](int64_t pass, int64_t slot, int64_t q) {
          const int64_t pc = pass * kc, kb = std::min(kc, k - pc), j = jc + q * nr;
          uint8_t* panel = buffers.b_chunk(slot) + q * ks.panel_bytes(kb, nr);
          ks.pack_b(sub_operand(b_op, j, pc), std::min<int64_t>(nr, n - j), kb, nr, panel);
          if (folded) {
            int32_t exps[kMaxFoldExps];
            panel_exponents(eb, p.b_block.grid_cols, j, nr, pc, kb, b_bk, exps);
            fold(panel, ks.elem_bytes, kb, nr, ks.kpack_b(), exps, b_bk);
          }
        },
        [&](int64_t pass, int64_t slot, int64_t w) {
          const int64_t pc = pass * kc, kb = std::min(kc, k - pc);
          const bool first = pc == 0, last = pc + kb == k;
          const size_t a_panel_bytes = ks.panel_bytes(kb, mr), b_panel_bytes = ks.panel_bytes(kb, nr);
          uint8_t* a_packed = gemm::a_block_buffer(ceil_div(grid.mc, mr) * a_panel_bytes, "fp8_gemm");
          alignas(64) float part[64 * 64];  // mr * nr <= 64 * 64 for every KernelSet
          alignas(64) float acc[64 * 64];
          const gemm::UnitGrid::Unit u = grid.unit(w);
          ks.pack_a(sub_operand(a_op, u.row, pc), u.rows, kb, mr, a_packed);
          for (int64_t ir = 0; folded && ir < u.rows; ir += mr) {
            int32_t exps[kMaxFoldExps];
            panel_exponents(ea, p.a_block.grid_cols, u.row + ir, mr, pc, kb, a_bk, exps);
            fold(a_packed + (ir / mr) * a_panel_bytes, ks.elem_bytes, kb, mr, ks.kpack_a(), exps, a_bk);
          }
          if (ks.prepare) ks.prepare();
          const uint8_t* b_chunk = buffers.b_chunk(slot);
          const bool prefetch = ks.prefetch_next_b;
          gemm::for_each_tile(u, b_chunk, b_panel_bytes, mr, prefetch, [&](int64_t q, int64_t ir, const uint8_t* b_panel) {
            const int64_t i = u.row + ir, j = q * nr;  // j: within the NC block
            const uint8_t* a_panel = a_packed + (ir / mr) * a_panel_bytes;
            // The fp32 total of this tile (mr x nr, leading dimension nr): in `partials` across K chunks,
            // else on the stack.
            float* total = multi_pass ? partials.at(q, i) : acc;
            if (folded) {  // unit scales: the micro-kernel adds into the total itself
              // (the last chunk's sums go to the stack tile, as in the tensorwise GEMM).
              gemm::micro_runs(ks, kb, a_panel, b_panel, first ? nullptr : total, nr, last ? acc : total, nr);
              if (last) total = acc;
            }
            for (int64_t s0 = 0; !folded && s0 < kb; s0 += step) {
              // Packed panels store k in order: a sub-panel at k offset s0 starts
              // s0 * rows elements in (step is a multiple of the kernel's k_align).
              ks.micro(std::min(step, kb - s0), a_panel + s0 * mr * ks.elem_bytes, b_panel + s0 * nr * ks.elem_bytes,
                       nullptr, 0, part, nr);
              const int64_t s = (pc + s0) / g;
              promote(part, nr, sa.data() + s * m_pad + i, sb.data() + s * n_pad + jc + j, mr, nr, first && s0 == 0,
                      total, nr);
            }
            if (last) {
              store(total, nr, std::min<int64_t>(mr, m - i), std::min<int64_t>(nr, nb - j), 1.0f,
                    bias ? bias + jc + j : nullptr, p.accumulate, d + i * n + jc + j, n);
            }
          });
        });
  }
}

}  // namespace

void promote_generic(const float* part, int ld_part, const float* sa, const float* sb, int rows,
                     int cols, bool first, float* acc, int64_t ld_acc) {
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      const float v = part[i * ld_part + j] * (sa[i] * sb[j]);
      acc[i * ld_acc + j] = first ? v : acc[i * ld_acc + j] + v;
    }
  }
}

void fold_generic(void* panel, int elem_bytes, int64_t kc, int r, int kpack, const int32_t* row_exp,
                  int64_t block_k) {
  const int64_t groups = ceil_div(kc, kpack);
  for (int64_t g = 0; g < groups; ++g) {
    for (int row = 0; row < r; ++row) {
      for (int t = 0; t < kpack; ++t) {
        const int64_t idx = (g * r + row) * kpack + t;
        const int32_t e = row_exp[((g * kpack + t) / block_k) * r + row];
        if (elem_bytes == 2) {
          uint16_t& v = static_cast<uint16_t*>(panel)[idx];
          const uint16_t mag = v & 0x7fffu;
          if (mag != 0 && mag < 0x7f80u) v = static_cast<uint16_t>(v + e * 128);
        } else {
          uint32_t& v = static_cast<uint32_t*>(panel)[idx];
          const uint32_t mag = v & 0x7fffffffu;
          if (mag != 0 && mag < 0x7f800000u) v = static_cast<uint32_t>(static_cast<int64_t>(v) + e * (int64_t{1} << 23));
        }
      }
    }
  }
}

}  // namespace gemm_block

void fp8_gemm_blockwise(const GemmBlockParams& p) {
  if (p.m == 0 || p.n == 0) return;
  advise_huge_pages(p.d.data, static_cast<size_t>(p.d.numel() * element_size(p.d.dtype)));
  const Isa isa = current_isa();
  gemm::KernelSet ks = gemm::kernels_for(isa);
  const int64_t g = std::min(p.a_block.cols, p.b_block.cols);
  // Sub-panels start at multiples of g (or of KC): g must keep whole k-groups of the packing.
  if (g < p.k && (g % ks.k_align != 0 || g > ks.kc)) ks = gemm::generic_kernels();
  gemm_block::PromoteFn promote = gemm_block::promote_generic;
  gemm_block::FoldFn fold = gemm_block::fold_generic;
  if (isa == Isa::kAvx2) {
    promote = gemm_block::promote_avx2();
    fold = gemm_block::fold_avx2();
  } else if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) {
    promote = gemm_block::promote_avx512();
    fold = gemm_block::fold_avx512();
  }
  // Panels of more exponents than kMaxFoldExps (tiny blocks) take the promotion path.
  const int64_t min_bk = std::max<int64_t>(1, std::min({p.a_block.cols, p.b_block.cols, p.k}));
  if (((ks.kc + min_bk - 1) / min_bk + 1) * std::max(ks.mr, ks.nr) > gemm_block::kMaxFoldExps) fold = nullptr;
  dispatch_high_precision(p.d.dtype, "fp8_gemm: argument 'd'", [&](auto out_tag) {
    gemm_block::run<decltype(out_tag)>(p, ks, promote, fold);
  });
}

}  // namespace cpu
}  // namespace tl
