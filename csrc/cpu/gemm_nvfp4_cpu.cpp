// CPU NVFP4 GEMM: d = (A @ B^T) * alpha [+ bias]. Micro-kernels: gemm_nvfp4_cpu.h.
//
// Loop nest as the FP8 GEMMs' (gemm_cpu.cpp, gemm_block_cpu.cpp): NC blocks of B rows,
// KC chunks of k (multiples of 16), the B chunk decoded and packed by all threads, then
// MC blocks of A rows decoded and packed per thread and run through the register-tiled
// micro-kernel. Decoding multiplies each E2M1 value by its E4M3 block scale (exact in
// fp32 and in bf16), so a 16-element K block's products sum exactly in any order and
// the micro-kernel only has to add each block's sum to the fp32 total in K order, as
// reference/nvfp4.py nvfp4_gemm does. The fp32 totals stay in a tile on the stack when
// one chunk covers K, else in an M x NC buffer (tile by tile) across chunks; the global scales (alpha)
// and the bias come in the fp32 epilogue (the kernel set's, streaming large outputs where it has
// that). The chunks run with no barrier between them (run_passes, gemm_passes.h), and the next B panel
// is prefetched while the current one runs where the kernel set asks. Every output element is computed the same way
// whatever the thread count, so results do not depend on it.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "../common/backend_nvfp4.h"
#include "cpu_features.h"
#include "gemm_cpu.h"
#include "gemm_nvfp4_cpu.h"
#include "gemm_passes.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "quantize_nvfp4_cpu.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace gemm_nvfp4 {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// The two E2M1 values of each byte (low nibble first).
struct PairTable {
  float v[256][2];
  PairTable() {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = nvfp4::kE2M1Values[b & 0xF];
      v[b][1] = nvfp4::kE2M1Values[b >> 4];
    }
  }
};

// A packed NVFP4 operand: row r starts ld / 2 bytes and ld / 16 E4M3 scales after row r - 1.
struct Operand {
  const uint8_t* data;
  const uint8_t* scale;
  int64_t ld;
};

// Decode rows [row0, row0 + rows) x k [pc, pc + kc) (kc a multiple of 16) of `op`, block
// scales applied, into micro-panels of r rows (layout in gemm_nvfp4_cpu.h); rows up to
// the next multiple of r are zero.
void pack(const Operand& op, int64_t row0, int64_t rows, int64_t pc, int64_t kc, int r, int kpack, void* dst) {
  static const PairTable table;
  const int64_t row_bytes = op.ld / 2, row_scales = op.ld / kBlockK;
  for (int64_t p0 = 0; p0 < rows; p0 += r) {
    const int64_t panel = (p0 / r) * kc * r;
    for (int i = 0; i < r; ++i) {
      const int64_t row = row0 + p0 + i;
      const bool valid = p0 + i < rows;
      const uint8_t* bytes = op.data + row * row_bytes;
      const uint8_t* scales = op.scale + row * row_scales;
      for (int64_t kk = 0; kk < kc; kk += kBlockK) {
        const float s = valid ? fp8::float_from_e4m3_bits(scales[(pc + kk) / kBlockK]) : 0.0f;
        for (int t = 0; t < kBlockK; t += 2) {
          float v0 = 0.0f, v1 = 0.0f;
          if (valid) {
            const uint8_t byte = bytes[(pc + kk + t) / 2];
            v0 = table.v[byte][0] * s;
            v1 = table.v[byte][1] * s;
          }
          const int64_t k = kk + t;
          if (kpack == 1) {
            float* out = static_cast<float*>(dst) + panel;
            out[k * r + i] = v0;
            out[(k + 1) * r + i] = v1;
          } else {  // bf16: v0 and v1 have at most 5 significant bits, exact in bf16
            uint16_t* out = static_cast<uint16_t*>(dst) + panel + ((k / kpack) * r + i) * kpack + k % kpack;
            out[0] = static_cast<uint16_t>(fp8::bits_of(v0) >> 16);
            out[1] = static_cast<uint16_t>(fp8::bits_of(v1) >> 16);  // k + 1: the same group (kpack even)
          }
        }
      }
    }
  }
}

// `pack` with the kernel set's own packing of A (`is_a`) or B where it has one.
void pack_rows(const KernelSet& ks, bool is_a, const Operand& op, int64_t row0, int64_t rows, int64_t pc, int64_t kc,
               int r, void* dst) {
  const PackFn own = is_a && ks.pack_a ? ks.pack_a : ks.pack;
  if (own) {
    own(op.data, op.scale, op.ld, row0, rows, pc, kc, r, dst);
  } else {
    pack(op, row0, rows, pc, kc, r, ks.kpack, dst);
  }
}

// The portable MicroFn: kMr x kNr tile.
constexpr int kMr = 4, kNr = 8;

void micro_generic(int64_t kc, const void* a_packed, const void* b_packed, float* total, int64_t ld_total) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  for (int64_t k0 = 0; k0 < kc; k0 += kBlockK) {
    float part[kMr][kNr] = {};
    for (int64_t k = k0; k < k0 + kBlockK; ++k) {
      for (int i = 0; i < kMr; ++i) {
        for (int j = 0; j < kNr; ++j) part[i][j] += a[k * kMr + i] * b[k * kNr + j];
      }
    }
    for (int i = 0; i < kMr; ++i) {
      for (int j = 0; j < kNr; ++j) total[i * ld_total + j] += part[i][j];
    }
  }
}

template <typename Out>
void run(const GemmView& p, const KernelSet& ks) {
  using T = typename Out::storage;
  T* d = static_cast<T*>(p.d);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t m = p.m, n = p.n, k = p.k;
  if (k == 0) {  // empty product: D = 0 * alpha [+ bias]
    const std::vector<float> zeros(n, 0.0f);
    for (int64_t i = 0; i < m; ++i) gemm::store_tile<Out>(zeros.data(), 0, 1, n, p.alpha, bias, false, d + i * n, n);
    return;
  }
  const int mr = ks.mr, nr = ks.nr;
  const int elem_bytes = ks.elem_bytes();
  const int64_t m_pad = round_up(m, mr);
  const int64_t kc = ks.kc;
  const bool multi_pass = k > kc;
  const int64_t nc = gemm::nc_block(ks.nc, nr, n, m_pad, multi_pass);
  const int64_t kc_max = std::min(kc, k);
  const int threads = gemm::gemm_threads(m, n, k);
  const int64_t passes = ceil_div(k, kc);
  const size_t b_chunk_bytes = static_cast<size_t>(ceil_div(nc, nr) * kc_max * nr * elem_bytes);
  const gemm::PassBuffers buffers(gemm::pass_slots(threads, passes), b_chunk_bytes,
                                  multi_pass ? static_cast<size_t>(m_pad * nc) : 0, "nvfp4_gemm");
  float* totals = buffers.totals();
  const Operand a_op{p.a, p.a_scale, p.a_ld};
  const Operand b_op{p.b, p.b_scale, p.b_ld};
  const gemm::StoreTileFn<Out> store = ks.store.get<Out>(static_cast<size_t>(m * n) * sizeof(T));

  for (int64_t jc = 0; jc < n; jc += nc) {
    const int64_t nb = std::min(nc, n - jc);
    const int64_t b_panels = ceil_div(nb, nr);
    const gemm::UnitGrid grid(m, ks.mc, mr, b_panels, threads);
    gemm::run_passes(
        threads, passes, b_panels, grid.units(),
        [&](int64_t pass, int64_t slot, int64_t q) {
          const int64_t pc = pass * kc, kb = std::min(kc, k - pc), j = jc + q * nr;
          pack_rows(ks, false, b_op, j, std::min<int64_t>(nr, n - j), pc, kb, nr,
                    buffers.b_chunk(slot) + q * static_cast<size_t>(kb) * nr * elem_bytes);
        },
        [&](int64_t pass, int64_t slot, int64_t w) {
          const int64_t pc = pass * kc, kb = std::min(kc, k - pc);
          const bool first = pc == 0, last = pc + kb == k;
          const size_t panel_bytes = static_cast<size_t>(kb) * nr * elem_bytes;
          const size_t a_panel_bytes = static_cast<size_t>(kb) * mr * elem_bytes;
          uint8_t* a_packed = gemm::a_block_buffer(ceil_div(grid.mc, mr) * a_panel_bytes, "nvfp4_gemm");
          alignas(64) float acc[64 * 64];  // mr * nr <= 64 * 64 for every KernelSet
          const gemm::UnitGrid::Unit u = grid.unit(w);
          pack_rows(ks, true, a_op, u.row, u.rows, pc, kb, mr, a_packed);
          if (ks.prepare) ks.prepare();
          const uint8_t* b_chunk = buffers.b_chunk(slot);
          gemm::for_each_tile(u, b_chunk, panel_bytes, mr, ks.prefetch_next_b, [&](int64_t q, int64_t ir, const uint8_t* b_panel) {
            const int64_t i = u.row + ir, j = q * nr;  // j: within the NC block
            // Each tile's totals are contiguous (mr x nr): rows nc apart would share L1 sets.
            float* total = totals ? totals + ((i / mr) * (nc / nr) + q) * mr * nr : acc;
            if (first) std::fill(total, total + mr * nr, 0.0f);
            ks.micro(kb, a_packed + (ir / mr) * a_panel_bytes, b_panel, total, nr);
            if (last) {
              store(total, nr, std::min<int64_t>(mr, m - i), std::min<int64_t>(nr, nb - j), p.alpha,
                                    bias ? bias + jc + j : nullptr, false, d + i * n + jc + j, n);
            }
          });
        });
  }
}

}  // namespace

KernelSet generic_kernels() { return KernelSet{kMr, kNr, 1, 256, 64, 512, micro_generic}; }

KernelSet current_kernels() {
  switch (current_isa()) {
    case Isa::kAvx2: return avx2_kernels();
    case Isa::kAvx512: return avx512_kernels();
    // vdpbf16ps runs at about half the fp32-FMA rate on CPUs with AMX (Sapphire Rapids), twice it
    // on AMD Zen 4 (see gemm_cpu_avx512.cpp): where AMX is usable, its tiles run the blocks.
    case Isa::kAvx512Bf16: return gemm::amx_usable() ? amx_kernels() : avx512_bf16_kernels();
    case Isa::kGeneric: break;
  }
  return generic_kernels();
}

void gemm(const GemmView& v, DType out, const KernelSet& ks) {
  if (v.m == 0 || v.n == 0) return;
  dispatch_high_precision(out, "nvfp4_gemm: argument 'd'", [&](auto tag) { run<decltype(tag)>(v, ks); });
}

}  // namespace gemm_nvfp4

void nvfp4_gemm(const GemmNvfp4Params& p) {
  const gemm_nvfp4::GemmView v{p.a.ptr<const uint8_t>(), static_cast<const uint8_t*>(p.a_scale.data), p.k,
                               p.b.ptr<const uint8_t>(), static_cast<const uint8_t*>(p.b_scale.data), p.k,
                               p.bias.defined() ? p.bias.data : nullptr, p.d.data, p.alpha, p.m, p.n, p.k};
  advise_huge_pages(p.d.data, static_cast<size_t>(p.d.numel() * element_size(p.d.dtype)));
  gemm_nvfp4::gemm(v, p.d.dtype, gemm_nvfp4::current_kernels());
}

}  // namespace cpu
}  // namespace tl
