// CPU FP8 GEMM: BLIS-style blocked driver, the FP8 decode tables and the
// portable (generic) packing and micro-kernel.
//
// Loop nest (BLIS): for each NC block of B rows (columns of D), for each KC
// block of k: the threads pack the B block together into a shared buffer,
// then each packs its own MC x KC block of A and runs the micro-kernel over
// the register tiles. FP8 is decoded while packing; no full-size decoded copy
// of an operand exists. Partial sums of K > KC go to an fp32 scratch holding
// the current NC block of C; the epilogue (alpha, bias, accumulate, rounding
// to D's dtype) runs on each tile after its last KC pass.
//
// Every FP8 value and every product of two is exact in fp32 (and FP8 values
// in bf16), so all paths compute the same function up to summation order.
// Paths (cpu::current_isa(), measured or forced: isa_select.cpp): generic
// (portable C++, below), avx2 (8-lane fp32 FMA micro-kernel), avx512 (16-lane
// fp32 FMA micro-kernel), avx512_bf16 (AMX tiles where present, else
// vdpbf16ps). Threads run the KC passes of an NC block with no barrier
// between them (run_passes, gemm_passes.h), so a busy machine that deschedules
// one thread does not leave the others idle at the end of each pass. While
// the A micro-panels run against one B panel, the next B panel is prefetched
// into L2 a slice per micro-kernel call (prefetch_slice).
#include "gemm_cpu.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "../common/backend.h"
#include "cpu_features.h"
#include "gemm_passes.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace gemm {
namespace {

template <typename Fp8>
std::array<float, 256> make_float_table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = Fp8::load(static_cast<uint8_t>(i));
  return t;
}

template <typename Fp8>
std::array<uint16_t, 128> make_bf16_table() {
  std::array<uint16_t, 128> t{};
  uint32_t bits;
  for (int i = 0; i < 128; ++i) {
    // Exact: FP8 values have at most 3 mantissa bits and fit bf16's exponent range.
    const float v = Fp8::load(static_cast<uint8_t>(i));
    std::memcpy(&bits, &v, sizeof(bits));
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return t;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// ---- generic path: fp32 panels, kpack = 1 --------------------------------

void pack_generic(const Operand& src, int64_t rows, int64_t kc, int r, void* dst) {
  const float* lut = fp8_to_float_table(src.dtype);
  float* out = static_cast<float*>(dst);
  for (int64_t p0 = 0; p0 < rows; p0 += r, out += kc * r) {
    const int64_t n = std::min<int64_t>(r, rows - p0);
    for (int64_t i = 0; i < r; ++i) {
      const uint8_t* row = src.data + (p0 + i) * src.row_stride;
      for (int64_t k = 0; k < kc; ++k) {
        out[k * r + i] = i < n ? lut[row[k * src.col_stride]] : 0.0f;
      }
    }
  }
}

constexpr int kGenericMr = 4;
constexpr int kGenericNr = 8;

void micro_generic(int64_t kc, const void* a_packed, const void* b_packed, const float* c_in,
                   int64_t ldc_in, float* c_out, int64_t ldc_out) {
  const float* a = static_cast<const float*>(a_packed);
  const float* b = static_cast<const float*>(b_packed);
  float acc[kGenericMr][kGenericNr] = {};
  for (int64_t k = 0; k < kc; ++k, a += kGenericMr, b += kGenericNr) {
    for (int i = 0; i < kGenericMr; ++i) {
      // Products of FP8 values are exact, so mul + add equals an FMA here.
      for (int j = 0; j < kGenericNr; ++j) acc[i][j] += a[i] * b[j];
    }
  }
  for (int i = 0; i < kGenericMr; ++i) {
    for (int j = 0; j < kGenericNr; ++j) {
      c_out[i * ldc_out + j] = c_in ? acc[i][j] + c_in[i * ldc_in + j] : acc[i][j];
    }
  }
}

// ---- driver ----------------------------------------------------------------

// `fill_a` (may be empty): see fp8_gemm_filling_a.
template <typename Out>
void run(const GemmParams& p, const KernelSet& ks, float alpha, int threads, const FillRows& fill_a = {}) {
  using T = typename Out::storage;
  T* d = p.d.ptr<T>();
  const T* bias = p.bias.defined() ? p.bias.ptr<T>() : nullptr;
  const int64_t m = p.m, n = p.n, k = p.k;

  if (k == 0) {  // empty product: D = epilogue(0)
    if (fill_a) fill_a(0, m);
    std::vector<float> zeros(n, 0.0f);
    parallel_for(m, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        store_tile<Out>(zeros.data(), 0, 1, n, alpha, bias, p.accumulate, d + i * n, n);
      }
    });
    return;
  }

  const bool multi_pass = k > ks.kc;
  const int64_t m_padded = round_up(m, ks.mr);
  const int64_t nc = nc_block(ks.nc, ks.nr, n, m_padded, multi_pass);
  const int64_t kc_max = std::min(ks.kc, k);
  const int64_t passes = ceil_div(k, ks.kc);
  const size_t b_chunk_bytes = ceil_div(nc, ks.nr) * ks.panel_bytes(kc_max, ks.nr);
  const PassBuffers buffers(pass_slots(threads, passes), b_chunk_bytes,
                            multi_pass ? static_cast<size_t>(m_padded * nc) : 0, "fp8_gemm");
  const PartialTiles partials(buffers.totals(), m_padded, ks.mr, ks.nr);
  const Operand a_op{p.a.ptr<uint8_t>(), p.a_row, p.a_col, p.a.dtype};
  const Operand b_op{p.b.ptr<uint8_t>(), p.b_row, p.b_col, p.b.dtype};
  const StoreTileFn<Out> store = ks.store.get<Out>(static_cast<size_t>(m * n) * sizeof(T));

  for (int64_t jc = 0; jc < n; jc += nc) {
    const int64_t nb = std::min(nc, n - jc);
    const int64_t b_panels = ceil_div(nb, ks.nr);
    const UnitGrid grid(m, ks.mc, ks.mr, b_panels, threads);
    // Each block of A rows is filled by the unit that packs it first (its first pass of the first NC
    // block), unless the block is cut among several units: then all rows first, by all threads.
    const bool fill_in_units = fill_a && jc == 0 && grid.n_splits == 1;
    if (fill_a && jc == 0 && !fill_in_units) {
      parallel_for(m, std::max<int64_t>(1, kClaimRunElems / std::max<int64_t>(k, 1)), fill_a);
    }
    run_passes(
        threads, passes, b_panels, grid.units(),
        [&](int64_t pass, int64_t slot, int64_t q) {
          const int64_t pc = pass * ks.kc, kb = std::min(ks.kc, k - pc), j = jc + q * ks.nr;
          ks.pack_b(sub_operand(b_op, j, pc), std::min<int64_t>(ks.nr, n - j), kb, ks.nr,
                    buffers.b_chunk(slot) + q * ks.panel_bytes(kb, ks.nr));
        },
        [&](int64_t pass, int64_t slot, int64_t w) {
          const int64_t pc = pass * ks.kc, kb = std::min(ks.kc, k - pc);
          const bool first = pc == 0, last = pc + kb == k;
          const size_t a_panel_bytes = ks.panel_bytes(kb, ks.mr), b_panel_bytes = ks.panel_bytes(kb, ks.nr);
          uint8_t* a_packed = a_block_buffer(ceil_div(grid.mc, ks.mr) * a_panel_bytes, "fp8_gemm");
          alignas(64) float tile[64 * 64];  // mr * nr <= 64 * 64 for every KernelSet
          const UnitGrid::Unit u = grid.unit(w);
          if (fill_in_units && pass == 0) fill_a(u.row, u.row + u.rows);
          ks.pack_a(sub_operand(a_op, u.row, pc), u.rows, kb, ks.mr, a_packed);
          if (ks.prepare) ks.prepare();
          const uint8_t* b_chunk = buffers.b_chunk(slot);
          const bool prefetch = ks.prefetch_next_b;
          for_each_tile(u, b_chunk, b_panel_bytes, ks.mr, prefetch, [&](int64_t q, int64_t ir, const uint8_t* b_panel) {
            const int64_t i = u.row + ir, j = q * ks.nr;  // j: within the NC block
            float* partial = partials.at(q, i);
            float* out = last ? tile : partial;
            micro_runs(ks, kb, a_packed + (ir / ks.mr) * a_panel_bytes, b_panel, first ? nullptr : partial, ks.nr,
                       out, ks.nr);
            if (last) {
              store(tile, ks.nr, std::min<int64_t>(ks.mr, m - i), std::min<int64_t>(ks.nr, nb - j), alpha,
                              bias ? bias + jc + j : nullptr, p.accumulate, d + i * n + jc + j, n);
            }
          });
        });
  }
}

// The GEMM time_paths() runs: large enough that the micro-kernel dominates,
// small enough (a few MFLOP) that even the portable path takes milliseconds.
constexpr int64_t kProbeM = 96, kProbeN = 96, kProbeK = 256;

TensorDesc matrix_desc(void* data, DType dtype, int64_t rows, int64_t cols) {
  TensorDesc t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  t.device = DeviceType::kCPU;
  t.device_index = 0;
  return t;
}

}  // namespace

KernelSet kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return amx_usable() ? amx_kernels() : avx512_bf16_kernels();
    case Isa::kAvx512:
      return avx512_kernels();
    case Isa::kAvx2:
      return avx2_kernels();
    default:
      return generic_kernels();
  }
}

const char* kernel_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return amx_usable() ? "amx-bf16" : "vdpbf16ps";
    case Isa::kAvx512:
      return "fp32-fma";
    case Isa::kAvx2:
      return "fp32-fma-avx2";
    default:
      return "portable";
  }
}

std::string probe_shape() {
  return std::to_string(kProbeM) + "x" + std::to_string(kProbeN) + "x" + std::to_string(kProbeK);
}

std::vector<double> time_paths(const std::vector<Isa>& paths, int rounds) {
  // Row-major operands, as in the forward GEMM; FP8 patterns spread over
  // several binades, none of them NaN (0x7f / 0xff in e4m3).
  std::vector<uint8_t> a(kProbeM * kProbeK), b(kProbeN * kProbeK);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>((i * 37 + 11) & 0xf7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>((i * 53 + 5) & 0xf7);
  std::vector<float> d(kProbeM * kProbeN);
  GemmParams p{};
  p.a = matrix_desc(a.data(), DType::kFloat8E4M3, kProbeM, kProbeK);
  p.b = matrix_desc(b.data(), DType::kFloat8E4M3, kProbeN, kProbeK);
  p.d = matrix_desc(d.data(), DType::kFloat32, kProbeM, kProbeN);
  p.m = kProbeM;
  p.n = kProbeN;
  p.k = kProbeK;
  p.a_row = p.b_row = kProbeK;
  p.a_col = p.b_col = 1;
  std::vector<double> best(paths.size(), std::numeric_limits<double>::infinity());
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up (tables, scratch)
    for (size_t i = 0; i < paths.size(); ++i) {
      const KernelSet ks = kernels_for(paths[i]);
      const auto start = std::chrono::steady_clock::now();
      run<Float32>(p, ks, 1.0f, 1);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (round >= 0) best[i] = std::min(best[i], took.count());
    }
  }
  return best;
}

const float* fp8_to_float_table(DType dtype) {
  static const std::array<float, 256> e4m3 = make_float_table<Float8E4M3>();
  static const std::array<float, 256> e5m2 = make_float_table<Float8E5M2>();
  return dtype == DType::kFloat8E4M3 ? e4m3.data() : e5m2.data();
}

const uint16_t* fp8_magnitude_bf16_table(DType dtype) {
  static const std::array<uint16_t, 128> e4m3 = make_bf16_table<Float8E4M3>();
  static const std::array<uint16_t, 128> e5m2 = make_bf16_table<Float8E5M2>();
  return dtype == DType::kFloat8E4M3 ? e4m3.data() : e5m2.data();
}

KernelSet generic_kernels() {
  return KernelSet{kGenericMr, kGenericNr, 1, 4, 256, 128, 1024, pack_generic, pack_generic, micro_generic,
                   nullptr, true, StoreTiles{}};
}

}  // namespace gemm

namespace {

void run_fp8_gemm(const GemmParams& p, const gemm::FillRows& fill_a) {
  if (p.m == 0) return;
  if (p.n == 0) {
    if (fill_a) fill_a(0, p.m);
    return;
  }
  advise_huge_pages(p.d.data, static_cast<size_t>(p.d.numel() * element_size(p.d.dtype)));
  const gemm::KernelSet ks = gemm::kernels_for(current_isa());
  const float alpha = *p.a_scale_inv.ptr<float>() * *p.b_scale_inv.ptr<float>();
  dispatch_high_precision(p.d.dtype, "fp8_gemm: argument 'd'", [&](auto out_tag) {
    gemm::run<decltype(out_tag)>(p, ks, alpha, gemm::gemm_threads(p.m, p.n, p.k), fill_a);
  });
}

}  // namespace

void fp8_gemm(const GemmParams& p) { run_fp8_gemm(p, {}); }

namespace gemm {

void fp8_gemm_filling_a(const GemmParams& p, const FillRows& fill_a) { run_fp8_gemm(p, fill_a); }

}  // namespace gemm

}  // namespace cpu
}  // namespace tl
