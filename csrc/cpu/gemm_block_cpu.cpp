// CPU block-scaled FP8 GEMM (1x128 x 128x128, 1x128 x 1x128, 1x32 E8M0, rowwise).
//
// Reuses the packing and register-tiled micro-kernels of the tensorwise GEMM
// (gemm_cpu.h): FP8 is decoded while packing and products are exact, so the
// micro-kernel's fp32 sum over one K-block of g values is the block's partial
// sum. After each K-block the partial tile is promoted into the fp32 total
// with the two block scales (acc += part * (sa[i] * sb[j]), DeepGEMM's
// promotion); the K-block g is the smaller of the operands' block widths.
// Loop nest as in gemm_cpu.cpp: NC blocks of B rows, KC chunks of k (a
// multiple of g), the B chunk packed by all threads, A blocks per thread.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "../common/backend_block.h"
#include "cpu_features.h"
#include "gemm_block_cpu.h"
#include "gemm_cpu.h"
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

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

void promote_generic(const float* part, const float* sa, const float* sb, int rows, int cols,
                     int ld, float* acc) {
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) acc[i * ld + j] = acc[i * ld + j] + part[i * ld + j] * (sa[i] * sb[j]);
  }
}

KernelSet kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return gemm::amx_usable() ? gemm::amx_kernels() : gemm::avx512_bf16_kernels();
    case Isa::kAvx512:
      return gemm::avx512_kernels();
    default:
      return gemm::generic_kernels();
  }
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Buffer aligned_buffer(size_t bytes) {
  Buffer b(static_cast<uint8_t*>(std::aligned_alloc(64, round_up(std::max<size_t>(bytes, 64), 64))));
  TL_CHECK(b != nullptr, "fp8_gemm: out of memory allocating ", bytes, " bytes");
  return b;
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

Operand sub_operand(const Operand& op, int64_t row, int64_t k) {
  return Operand{op.data + row * op.row_stride + k * op.col_stride, op.row_stride, op.col_stride,
                 op.dtype};
}

template <typename Out>
void store_tile(const float* acc, int64_t ld, int64_t rows, int64_t cols,
                const typename Out::storage* bias, bool accumulate, typename Out::storage* d,
                int64_t ldd) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float v = acc[i * ld + j];
      if (bias) v = v + Out::load(bias[j]);
      if (accumulate) v = Out::load(d[i * ldd + j]) + v;
      d[i * ldd + j] = Out::store(v);
    }
  }
}

template <typename Out>
void run(const GemmBlockParams& p, const KernelSet& ks, PromoteFn promote) {
  using T = typename Out::storage;
  T* d = p.d.ptr<T>();
  const T* bias = p.bias.defined() ? p.bias.ptr<T>() : nullptr;
  const int64_t m = p.m, n = p.n, k = p.k;
  if (k == 0) {  // empty product: D = bias [+ D]
    const std::vector<float> zeros(n, 0.0f);
    for (int64_t i = 0; i < m; ++i) store_tile<Out>(zeros.data(), 0, 1, n, bias, p.accumulate, d + i * n, n);
    return;
  }
  const int64_t g = std::max<int64_t>(1, std::min(p.a_block.cols, p.b_block.cols));
  const int64_t k_blocks = ceil_div(k, g);
  const int64_t m_pad = round_up(m, ks.mr), n_pad = round_up(n, ks.nr);
  const std::vector<float> sa = expand_scales(p.a_scale_inv, p.a_block, m, m_pad, g, k_blocks);
  const std::vector<float> sb = expand_scales(p.b_scale_inv, p.b_block, n, n_pad, g, k_blocks);

  constexpr double kMinParallelFlops = 1 << 22;
  const bool serial = 2.0 * m * n * k < kMinParallelFlops;
  const int threads = serial ? 1 : get_num_threads();
  // Partial sums are promoted every `step` k: each K-block, or every KC when one
  // block covers K (tensorwise, rowwise), which also keeps fp32 sums short.
  const int64_t step = g >= k ? std::min<int64_t>(k, ks.kc) : g;
  TL_CHECK(step <= ks.kc, "fp8_gemm: a K-block of ", g, " wider than the kernel's ", ks.kc,
           " that does not cover K is not supported");
  const int64_t kc = ks.kc / step * step;
  const bool multi_pass = k > kc;
  int64_t nc = std::min(ks.nc, n_pad);
  if (multi_pass) {  // bound the fp32 totals (M x NC) to 64 MiB
    const int64_t budget_cols = (int64_t{16} << 20) / m_pad;
    nc = std::max<int64_t>(ks.nr, std::min(nc, budget_cols / ks.nr * ks.nr));
  }
  const int64_t kc_max = std::min(kc, k);
  Buffer b_buffer = aligned_buffer(ceil_div(nc, ks.nr) * ks.panel_bytes(kc_max, ks.nr));
  Buffer totals_buffer = multi_pass ? aligned_buffer(m_pad * nc * sizeof(float)) : nullptr;
  uint8_t* b_packed = b_buffer.get();
  float* totals = reinterpret_cast<float*>(totals_buffer.get());
  const Operand a_op{p.a.ptr<uint8_t>(), p.a_row, p.a_col, p.a.dtype};
  const Operand b_op{p.b.ptr<uint8_t>(), p.b_row, p.b_col, p.b.dtype};
  const int mr = ks.mr, nr = ks.nr;

  for (int64_t jc = 0; jc < n; jc += nc) {
    const int64_t nb = std::min(nc, n - jc);
    const int64_t b_panels = ceil_div(nb, nr);
    for (int64_t pc = 0; pc < k; pc += kc) {
      const int64_t kb = std::min(kc, k - pc);
      const bool first = pc == 0, last = pc + kb == k;
      const size_t b_panel_bytes = ks.panel_bytes(kb, nr);
      parallel_for(b_panels, serial ? b_panels : 4, [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t j = jc + q * nr;
          ks.pack_b(sub_operand(b_op, j, pc), std::min<int64_t>(nr, n - j), kb, nr,
                    b_packed + q * b_panel_bytes);
        }
      });
      // Work items: A blocks of mc rows (a multiple of mr) x slices of the B panels.
      const int64_t blocks = round_up(ceil_div(m, ks.mc), threads);
      const int64_t mc = round_up(ceil_div(m, blocks), mr);
      const int64_t m_blocks = ceil_div(m, mc);
      const int64_t n_splits = std::min<int64_t>(b_panels, ceil_div(threads, m_blocks));
      const size_t a_panel_bytes = ks.panel_bytes(kb, mr);
      parallel_for(m_blocks * n_splits, serial ? m_blocks * n_splits : 1, [&](int64_t w0, int64_t w1) {
        Buffer a_buffer = aligned_buffer(ceil_div(mc, mr) * a_panel_bytes);
        alignas(64) float part[64 * 64];  // mr * nr <= 64 * 64 for every KernelSet
        alignas(64) float acc[64 * 64];
        for (int64_t w = w0; w < w1; ++w) {
          const int64_t ic = (w / n_splits) * mc;
          const int64_t split = w % n_splits;
          const int64_t mb = std::min(mc, m - ic);
          ks.pack_a(sub_operand(a_op, ic, pc), mb, kb, mr, a_buffer.get());
          if (ks.prepare) ks.prepare();
          for (int64_t q = split * b_panels / n_splits; q < (split + 1) * b_panels / n_splits; ++q) {
            const int64_t j = q * nr;  // within the NC block
            const uint8_t* b_panel = b_packed + q * b_panel_bytes;
            for (int64_t ir = 0; ir < mb; ir += mr) {
              const int64_t i = ic + ir;
              const uint8_t* a_panel = a_buffer.get() + (ir / mr) * a_panel_bytes;
              float* total = totals ? totals + i * nc + j : nullptr;
              for (int r = 0; r < mr; ++r) {
                for (int c = 0; c < nr; ++c) acc[r * nr + c] = first ? 0.0f : total[r * nc + c];
              }
              for (int64_t s0 = 0; s0 < kb; s0 += step) {
                // Packed panels store k in order: a sub-panel at k offset s0 starts
                // s0 * rows elements in (step is a multiple of the kernel's k_align).
                ks.micro(std::min(step, kb - s0), a_panel + s0 * mr * ks.elem_bytes,
                         b_panel + s0 * nr * ks.elem_bytes, nullptr, 0, part, nr);
                const int64_t s = (pc + s0) / g;
                promote(part, sa.data() + s * m_pad + i, sb.data() + s * n_pad + jc + j, mr, nr,
                        nr, acc);
              }
              if (last) {
                store_tile<Out>(acc, nr, std::min<int64_t>(mr, m - i),
                                std::min<int64_t>(nr, nb - j), bias ? bias + jc + j : nullptr,
                                p.accumulate, d + i * n + jc + j, n);
              } else {
                for (int r = 0; r < mr; ++r) {
                  for (int c = 0; c < nr; ++c) total[r * nc + c] = acc[r * nr + c];
                }
              }
            }
          }
        }
      });
    }
  }
}

}  // namespace
}  // namespace gemm_block

void fp8_gemm_blockwise(const GemmBlockParams& p) {
  if (p.m == 0 || p.n == 0) return;
  const Isa isa = current_isa();
  gemm::KernelSet ks = gemm_block::kernels_for(isa);
  const int64_t g = std::min(p.a_block.cols, p.b_block.cols);
  // Sub-panels start at multiples of g (or of KC): g must keep whole k-groups of the packing.
  if (g < p.k && (g % ks.k_align != 0 || g > ks.kc)) ks = gemm::generic_kernels();
  const gemm_block::PromoteFn promote =
      isa == Isa::kGeneric ? gemm_block::promote_generic : gemm_block::promote_avx512();
  dispatch_high_precision(p.d.dtype, "fp8_gemm: argument 'd'", [&](auto out_tag) {
    gemm_block::run<decltype(out_tag)>(p, ks, promote);
  });
}

}  // namespace cpu
}  // namespace tl
