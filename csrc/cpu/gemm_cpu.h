// Internal interface of the blocked CPU FP8 GEMM: the driver (gemm_cpu.cpp)
// runs BLIS-style NC/KC/MC loops over a KernelSet, the packing routines and
// register-tiled micro-kernel of one instruction-set path.
//
// Packed layout. An operand block of `rows` x `kc` (rows of A, or rows of B
// which are columns of D) is packed into ceil(rows / R) micro-panels of R
// rows, each of round_up(kc, k_align) * R elements. Within a panel, k-groups
// of `kpack` consecutive k values are stored row after row:
//   panel[g][r][t] = decode(src[r, g * kpack + t])
// kpack = 1 for fp32 elements, 2 for bf16 pairs (vdpbf16ps, and AMX's B
// tiles), 32 for AMX's A tiles (a 64-byte row of bf16). Rows past `rows` and
// k past `kc` are zero, so micro-kernels always run full tiles.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/backend.h"
#include "cpu_features.h"
#include "memory_cpu.h"
#include "transformer_linear/element_types.h"
#include "transformer_linear/tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tl {
namespace cpu {
namespace gemm {

/*! \brief A strided FP8 matrix view: element (r, k) is data[r * row_stride + k * col_stride]. */
struct Operand {
  const uint8_t* data;
  int64_t row_stride, col_stride;
  DType dtype;  // kFloat8E4M3 or kFloat8E5M2
};

/*! \brief The view of `op` starting at (row, k). */
inline Operand sub_operand(const Operand& op, int64_t row, int64_t k) {
  return Operand{op.data + row * op.row_stride + k * op.col_stride, op.row_stride, op.col_stride,
                 op.dtype};
}

/*! \brief One row of store_tile with its bias / accumulate choice fixed (a loop the compiler vectorizes). */
template <typename Out, bool kBias, bool kAccumulate, typename IsaTag>
inline void store_row(const float* t, int64_t cols, float alpha, const typename Out::storage* bias,
                      typename Out::storage* out) {
  // omp simd: -O2 vectorizes only loops it needs no runtime overlap check for, and t, bias and out
  // never overlap.
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    float v = t[j] * alpha;
    if (kBias) v = v + Out::load(bias[j]);
    if (kAccumulate) v = Out::load(out[j]) + v;
    out[j] = Out::store(v);
  }
}

/*!
 * \brief D[0:rows, 0:cols] = epilogue(tile): v = tile * alpha; v += bias; v = D + v, rounded
 *        to Out (a dispatch.h high-precision type); bias may be null.
 *
 * `IsaTag` is a type local to the translation unit that instantiates it (see StoreTiles), so each
 * instruction-set file gets its own copy, compiled with its flags, which the linker never merges
 * with another file's.
 */
template <typename Out, typename IsaTag = void>
void store_tile(const float* tile, int64_t ld_tile, int64_t rows, int64_t cols, float alpha,
                const typename Out::storage* bias, bool accumulate, typename Out::storage* d,
                int64_t ldd) {
  // The bias / accumulate branches are taken once per tile, not per element, so each row is one
  // branch-free loop the compiler vectorizes (a scalar epilogue took a fifth of an AMX GEMM's time).
  const auto rows_with = [&](auto row_fn) {
    for (int64_t i = 0; i < rows; ++i) row_fn(tile + i * ld_tile, cols, alpha, bias, d + i * ldd);
  };
  if (bias) {
    accumulate ? rows_with(store_row<Out, true, true, IsaTag>) : rows_with(store_row<Out, true, false, IsaTag>);
  } else {
    accumulate ? rows_with(store_row<Out, false, true, IsaTag>) : rows_with(store_row<Out, false, false, IsaTag>);
  }
}

/*!
 * \brief store_tile without `accumulate`, D's rows written with stream_copy, ending with a store fence
 *        (non-temporal stores are not ordered with the plain store that tells another thread the tile is
 *        done). Rows of more than 64 columns (no KernelSet's tile has them) are stored as store_tile does.
 */
template <typename Out, typename IsaTag = void>
void store_tile_streaming(const float* tile, int64_t ld_tile, int64_t rows, int64_t cols, float alpha,
                          const typename Out::storage* bias, bool accumulate, typename Out::storage* d,
                          int64_t ldd) {
  constexpr int64_t kMaxCols = 64;
  if (accumulate || cols > kMaxCols) {
    store_tile<Out, IsaTag>(tile, ld_tile, rows, cols, alpha, bias, accumulate, d, ldd);
    return;
  }
  alignas(64) typename Out::storage row[kMaxCols];
  for (int64_t i = 0; i < rows; ++i) {
    bias ? store_row<Out, true, false, IsaTag>(tile + i * ld_tile, cols, alpha, bias, row)
         : store_row<Out, false, false, IsaTag>(tile + i * ld_tile, cols, alpha, bias, row);
    stream_copy<IsaTag>(row, cols, d + i * ldd);
  }
  stream_fence();
}

/*! \brief The signature of store_tile<Out>. */
template <typename Out>
using StoreTileFn = void (*)(const float* tile, int64_t ld_tile, int64_t rows, int64_t cols, float alpha,
                             const typename Out::storage* bias, bool accumulate, typename Out::storage* d,
                             int64_t ldd);

/*!
 * \brief store_tile for each output dtype, as compiled in one instruction-set file: the epilogue
 *        vectorized with the path's registers (the portable build has only SSE2's).
 */
struct StoreTiles {
  StoreTileFn<Float32> f32 = nullptr;
  StoreTileFn<BFloat16> bf16 = nullptr;
  StoreTileFn<Float16> f16 = nullptr;
  // store_tile_streaming, for outputs of kStreamOutputBytes or more; null: store_tile for those too.
  // Only a micro-kernel that runs from L2 near its bandwidth (AMX) gains by it: the AVX2 set, whose
  // fp32 FMAs bound it, ran 1-6% slower with it (2048 x 4096 x 1024, bf16 out, two threads of an AMX
  // CPU forced to the avx2 path).
  StoreTileFn<Float32> f32_streaming = nullptr;
  StoreTileFn<BFloat16> bf16_streaming = nullptr;
  StoreTileFn<Float16> f16_streaming = nullptr;

  /*!
   * \brief The StoreTiles of the file that calls it with a type of its own anonymous namespace, with
   *        streaming entries when `streaming`.
   */
  template <typename IsaTag>
  static StoreTiles instantiate(bool streaming = false) {
    StoreTiles t{&store_tile<Float32, IsaTag>, &store_tile<BFloat16, IsaTag>, &store_tile<Float16, IsaTag>};
    if (streaming) {
      t.f32_streaming = &store_tile_streaming<Float32, IsaTag>;
      t.bf16_streaming = &store_tile_streaming<BFloat16, IsaTag>;
      t.f16_streaming = &store_tile_streaming<Float16, IsaTag>;
    }
    return t;
  }

  /*!
   * \brief The entry for Out: the streaming one, where this set has it, for an output of `output_bytes`
   *        >= kStreamOutputBytes; the portable store_tile where this set has none.
   */
  template <typename Out>
  StoreTileFn<Out> get(size_t output_bytes) const {
    const bool streaming = output_bytes >= kStreamOutputBytes;
    StoreTileFn<Out> fn = nullptr, streaming_fn = nullptr;
    if constexpr (std::is_same_v<Out, Float32>) fn = f32, streaming_fn = f32_streaming;
    if constexpr (std::is_same_v<Out, BFloat16>) fn = bf16, streaming_fn = bf16_streaming;
    if constexpr (std::is_same_v<Out, Float16>) fn = f16, streaming_fn = f16_streaming;
    if (streaming && streaming_fn) return streaming_fn;
    return fn ? fn : &store_tile<Out>;
  }
};

/*!
 * \brief Asks for slice `part` of `parts` of the `bytes` at `next` to be brought into L2.
 *
 * The drivers run every A micro-panel of a block against one packed B panel,
 * then move to the next B panel. The packed B of an NC block (megabytes) does
 * not fit in L2, so each panel would come from L3 or memory while its first
 * micro-kernel call stalls on it. Called before each of the `parts` calls on
 * the current panel with the next panel's address, it spreads that panel's
 * prefetches over them (measured +5-12% on the AVX2 micro-kernel's loop on
 * AMD Zen 3, 2048 x 2048 x 256 blocks).
 */
inline void prefetch_slice(const uint8_t* next, size_t bytes, int64_t part, int64_t parts) {
  const size_t begin = bytes * part / parts / 64 * 64, end = bytes * (part + 1) / parts;
  for (size_t offset = begin; offset < end; offset += 64) __builtin_prefetch(next + offset, 0, 2);
}

/*! \brief Packs rows [0, rows) x k [0, kc) of `src` into micro-panels of `r` rows at `dst`. */
using PackFn = void (*)(const Operand& src, int64_t rows, int64_t kc, int r, void* dst);

/*!
 * \brief c_out[i, j] = sum_k a[i, k] * b[j, k] (+ c_in[i, j] when c_in is not null)
 *        for one full mr x nr tile, fp32 accumulation. a and b are packed micro-panels.
 */
using MicroFn = void (*)(int64_t kc, const void* a, const void* b, const float* c_in,
                         int64_t ldc_in, float* c_out, int64_t ldc_out);

/*! \brief The packing, micro-kernel and block sizes of one instruction-set path. */
struct KernelSet {
  int mr, nr;          // register tile (rows of A, rows of B)
  int k_align;         // packed panels hold k rounded up to this
  int elem_bytes;      // bytes per packed element
  int64_t kc, mc, nc;  // cache blocks: k per pass, rows of A, rows of B
  PackFn pack_a, pack_b;
  MicroFn micro;
  void (*prepare)() = nullptr;  // per thread, before a run of micro-kernel calls (AMX tile config)
  // Whether the drivers prefetch each next B panel into L2 (prefetch_slice). A kernel whose panels
  // are long enough for the hardware prefetchers to follow (AMX: 128 KiB) only loses by it.
  bool prefetch_next_b = true;
  StoreTiles store;  // the epilogue compiled for this path (empty: the portable one)
  // k values per packed group (the layout above) of A and B panels, where it is not k_align.
  int a_kpack = 0, b_kpack = 0;
  // k values the micro-kernel sums from zero before adding them to a tile's running total (a multiple of
  // both kpacks; 0: a whole KC block). Runs shorter than KC keep fp32 sums short, and their bits those of a
  // KC of that size, while the panels stay KC long (micro_runs).
  int64_t sum_kc = 0;

  int kpack_a() const { return a_kpack ? a_kpack : k_align; }
  int kpack_b() const { return b_kpack ? b_kpack : k_align; }
  int64_t sum_k() const { return sum_kc ? sum_kc : kc; }

  /*! \brief Bytes of one packed micro-panel of `r` rows and `kc` k values. */
  size_t panel_bytes(int64_t kc_block, int r) const {
    return static_cast<size_t>((kc_block + k_align - 1) / k_align) * k_align * r * elem_bytes;
  }
};

/*!
 * \brief ks.micro over `kb` k values of one tile in runs of ks.sum_k(), each run summed from zero and added
 *        to the total so far: c_out = ((c_in + run 0) + run 1) + ... (c_in null: from run 0), the bits of
 *        one micro-kernel call per run with the total carried through c_in. a and b are packed panels.
 */
inline void micro_runs(const KernelSet& ks, int64_t kb, const uint8_t* a, const uint8_t* b, const float* c_in,
                       int64_t ldc_in, float* c_out, int64_t ldc_out) {
  const int64_t run = ks.sum_k();
  for (int64_t s0 = 0; s0 < kb; s0 += run) {
    // Packed panels store k in order: the run at k offset s0 starts s0 * rows elements in.
    ks.micro(std::min(run, kb - s0), a + s0 * ks.mr * ks.elem_bytes, b + s0 * ks.nr * ks.elem_bytes,
             s0 == 0 ? c_in : c_out, s0 == 0 ? ldc_in : ldc_out, c_out, ldc_out);
  }
}

/*! \brief FP8 value of each of the 256 bit patterns, as float (exact). */
const float* fp8_to_float_table(DType dtype);

/*! \brief bf16 bits of the magnitude of each 7-bit FP8 pattern (sign cleared), 128 entries. */
const uint16_t* fp8_magnitude_bf16_table(DType dtype);

KernelSet generic_kernels();
/*! \brief AVX2 fp32-FMA path (gemm_cpu_avx2.cpp); call only when the CPU has AVX2, FMA and F16C. */
KernelSet avx2_kernels();
/*! \brief AVX-512F fp32-FMA path (gemm_cpu_avx512.cpp); call only when the CPU has it. */
KernelSet avx512_kernels();
/*!
 * \brief store_tile compiled with AVX-512 (gemm_cpu_avx512.cpp), for the AVX-512 kernel sets; with the
 *        streaming entries when `streaming`.
 */
StoreTiles avx512_store_tiles(bool streaming = false);
/*! \brief AVX512_BF16 vdpbf16ps path (gemm_cpu_avx512.cpp); call only when the CPU has it. */
KernelSet avx512_bf16_kernels();

/*!
 * \brief Whether AMX-BF16 tiles can be used: the CPU has them, the kernel grants this
 *        process the tile state, and the environment does not say TL_CPU_AMX=0.
 */
bool amx_usable();
/*! \brief AMX-BF16 (tdpbf16ps) path of the avx512_bf16 ISA (gemm_cpu_amx_avx512.cpp). */
KernelSet amx_kernels();

/*! \brief The kernel set of the path `isa` on this CPU (AMX tiles where usable on avx512_bf16). */
KernelSet kernels_for(Isa isa);

/*! \brief The micro-kernel path `isa` runs on this CPU, e.g. "vdpbf16ps" or "amx-bf16". */
const char* kernel_name(Isa isa);

/*!
 * \brief Best wall time (seconds) of one small single-threaded FP8 GEMM on each of `paths`,
 *        over `rounds` rounds that take the paths in turn (after one warm-up round).
 */
std::vector<double> time_paths(const std::vector<Isa>& paths, int rounds);

/*! \brief "MxNxK" of the GEMM time_paths() runs. */
std::string probe_shape();

/*!
 * \brief Writes rows [r0, r1) of a GEMM's A (all K columns) before the GEMM first reads them: the
 *        fused forward's cast of those rows from the high-precision input (quantize_gemm_cpu.cpp).
 */
using FillRows = std::function<void(int64_t r0, int64_t r1)>;

/*!
 * \brief fp8_gemm() with A written as it goes: `fill_a` is called once for each row of A, a block
 *        of rows at a time, by the thread that packs those rows first, just before it packs them
 *        (where the rows' block is cut among threads, every row first, by all threads). Ranges run
 *        at once on several threads never overlap. `p.a` must be row-major; `p.a_scale_inv` is read
 *        before the first call.
 */
void fp8_gemm_filling_a(const GemmParams& p, const FillRows& fill_a);

/*!
 * \brief Pack bf16 pairs (kpack = 2) with `groups` k-pairs per panel, >= ceil(kc / 2);
 *        the groups past kc are zero.
 */
void pack_bf16_pairs_padded(const Operand& src, int64_t rows, int64_t kc, int r, int64_t groups,
                            void* dst);

/*! \brief Pack bf16 with kpack = 32: each panel row holds 32 consecutive k (an AMX A-tile row). */
void pack_bf16_k32(const Operand& src, int64_t rows, int64_t kc, int r, void* dst);

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
