// CPU NVFP4 quantize (portable): element math in quantize_nvfp4_cpu.h.
//
// The input is walked in bands of 16 rows by chunks of columns, in parallel. Each band
// chunk is loaded once into float32 scratch: the rowwise copy takes its 1x16 blocks
// (or 16x16 tiles) from the rows, the columnwise copy its 1x16 blocks from the columns
// (16 values of a column are one block of a row of output_t), after the Hadamard
// transform with `rht`. With 16x16 tiles the columnwise copy is the rowwise codes and
// tile scales written transposed. Random bits are a function of each element's index in
// its output, so results do not depend on the band size or the thread count.
// On the AVX2 and AVX-512 paths the per-block work runs in vector kernels
// (quantize_nvfp4_cpu_vec.h) that compute the same bits as the portable code here.
#include <algorithm>
#include <optional>
#include <vector>

#include "../common/backend_nvfp4.h"
#include "cpu_features.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "quantize_nvfp4_cpu.h"
#include "quantize_nvfp4_cpu_amax.h"
#include "quantize_nvfp4_cpu_vec.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace {

using namespace nvfp4;

// Columns per band chunk: 16 rows x 256 columns of float32 (16 KiB) stay in L1.
constexpr int64_t kChunkCols = 256;
// Bands a chunk of columns is walked down before the next chunk, where there is a columnwise copy: a band
// writes 8 bytes (and one scale) of each of the chunk's 256 rows of output_t, so 16 bands in a row fill
// two whole lines of each while they are in L1, where a walk across the band first would leave each line
// a partial write, to be fetched again for the next band (2.1 -> 2.9 GB/s with the Hadamard transform
// and stochastic rounding, 4.0 -> 6.3 GB/s without, float32 16M elements, AMX Xeon, 2 threads; 8 and 32
// bands a little slower than 16).
constexpr int64_t kColumnwiseBands = 16;
// Bands of columnwise blocks ColumnStage gathers before writing them out (8 bytes of codes each): one group
// of the walk down a chunk.
constexpr int64_t kStageBands = kColumnwiseBands;
// Input bytes per group of rows that the global amax pass walks backward (as the
// tensorwise amax pass, csrc/cpu/quantize_cpu.cpp).
constexpr int64_t kAmaxChunkBytes = kClaimChunkBytes;

struct Scratch {
  std::vector<float> tile;      // kBlock x chunk columns, row-major
  std::vector<uint8_t> codes;   // kBlock x chunk columns of 16x16 codes
  std::vector<uint32_t> bits;   // random bits of one block or one tile row
  std::vector<uint8_t> stage_data, stage_scale;  // ColumnStage's buffers
};

// The columnwise blocks of a run of consecutive bands of one chunk, gathered per column and written to
// output_t as one run of bytes a row (and one of scales) when the run ends.
//
// A band tile puts 8 bytes of codes and a scale byte into each of its chunk's 256 rows of output_t. Written
// there directly, these were 16 stores a vector to lines far apart (output_t's rows are M / 2 bytes
// long), which cost a third of a columnwise quantize (4096 x 4096 bfloat16, one AMX Xeon core: 15.9 ms
// against 10.0 with the stores sent to a small buffer instead). Gathered here, they land in one 36 KiB
// buffer that stays in L1 (the thread's Scratch), and output_t gets whole runs of 16 bands (two lines a
// row), streamed past the caches for a large copy: 13.4 ms plain, 10.6 ms streamed (8 bands a run: 15.0 ms
// plain).
class ColumnStage {
 public:
  /*! \brief Gathers in `s`'s stage buffers; `streaming`: writes runs with non-temporal stores (then call
   *         stream_fence before the work is handed on). */
  ColumnStage(Scratch& s, bool streaming) : streaming_(streaming) {
    s.stage_data.resize(kChunkCols * kStageBands * 8);
    s.stage_scale.resize(kChunkCols * kStageBands);
    data_ = s.stage_data.data(), scale_ = s.stage_scale.data();
  }

  // Where band tile (r0, [c0, c1)) puts its blocks: the slot after the run's last band, if the tile
  // continues the run (same chunk, the next band, room left); else the run is written out first.
  ColumnsOut slot(const QuantizeNvfp4Params& p, int64_t r0, int64_t c0, int64_t c1) {
    if (bands_ > 0 && (c0 != c0_ || r0 != r0_ + bands_ * kBlock || bands_ == kStageBands)) flush(p);
    if (bands_ == 0) c0_ = c0, c1_ = c1, r0_ = r0;
    const int64_t b = bands_++;
    return ColumnsOut{data_ + b * 8, kStageBands * 8, scale_ + b, kStageBands};
  }

  // Writes the run out: column c's bands to output_t from t_pos(c, r0) (consecutive bands of a column
  // are consecutive there).
  void flush(const QuantizeNvfp4Params& p) {
    if (bands_ == 0) return;
    uint8_t* out = p.output_t.ptr<uint8_t>();
    uint8_t* scale = static_cast<uint8_t*>(p.scale_t.data);
    for (int64_t c = c0_; c < c1_; ++c) {
      const int64_t pos = p.t_pos(c, r0_), j = c - c0_;
      if (streaming_) {
        stream_copy<ColumnStage>(data_ + j * kStageBands * 8, bands_ * 8, out + pos / 2);
        stream_copy<ColumnStage>(scale_ + j * kStageBands, bands_, scale + pos / kBlock);
      } else {
        std::memcpy(out + pos / 2, data_ + j * kStageBands * 8, bands_ * 8);
        std::memcpy(scale + pos / kBlock, scale_ + j * kStageBands, bands_);
      }
    }
    bands_ = 0;
  }

 private:
  bool streaming_;
  uint8_t* data_;   // column j's band b: 8 bytes at data_ + (j * kStageBands + b) * 8
  uint8_t* scale_;  // and its scale at scale_[j * kStageBands + b]
  int64_t c0_ = 0, c1_ = 0, r0_ = 0, bands_ = 0;
};

class Nvfp4Quantizer {
 public:
  Nvfp4Quantizer(const QuantizeNvfp4Params& p, const VecKernels* vec) : p_(p), vec_(vec) {}

  // Rows [r0, r1) x columns [c0, c1) of the input as float32 into `tile` (ld = c1 - c0).
  template <typename In>
  void load(int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* tile) const {
    const auto* x = p_.input.ptr<const typename In::storage>();
    const int64_t w = c1 - c0;
    for (int64_t r = r0; r < r1; ++r) {
      const auto* row = x + r * p_.k + c0;
      for (int64_t c = 0; c < w; ++c) tile[(r - r0) * w + c] = In::load(row[c]);
    }
  }

  // Codes of one block of 16 values (in place of nothing: `codes` gets 16 codes).
  void round_block(const float* v, float factor, uint32_t usage, uint64_t first, uint8_t* codes,
                   Scratch& s) const {
    if (p_.stochastic_rounding) {
      random_bits(p_.seed, p_.offset, usage, first, kBlock, s.bits.data());
      for (int i = 0; i < kBlock; ++i) codes[i] = e2m1_stochastic(v[i] * factor, s.bits[i]);
    } else {
      for (int i = 0; i < kBlock; ++i) codes[i] = e2m1_rne(v[i] * factor);
    }
  }

  static void pack(const uint8_t* codes, uint8_t* out) {
    for (int i = 0; i < kBlock / 2; ++i) out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  }

  // 1x16 rowwise blocks of rows [r0, r1), columns [c0, c1) (tile as loaded).
  void rowwise_1d(const float* tile, int64_t r0, int64_t r1, int64_t c0, int64_t c1, Scratch& s) const {
    const int64_t w = c1 - c0;
    uint8_t* out = p_.output.ptr<uint8_t>();
    uint8_t* scale = static_cast<uint8_t*>(p_.scale.data);
    uint8_t codes[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; c += kBlock) {
        const float* v = tile + (r - r0) * w + (c - c0);
        float amax = 0.0f;
        for (int i = 0; i < kBlock; ++i) amax = fp8::amax_update(amax, v[i]);
        const uint8_t sb = block_scale_bits(amax, p_.s_enc);
        scale[r * (p_.k / kBlock) + c / kBlock] = sb;
        round_block(v, block_encode_factor(sb, p_.s_enc), 0, static_cast<uint64_t>(r * p_.k + c), codes, s);
        pack(codes, out + (r * p_.k + c) / 2);
      }
    }
  }

  // 1x16 columnwise blocks: column c of rows [r0, r0 + 16) is a block of output_t's row c, put at out_t.
  void columnwise_1d(const float* tile, int64_t r0, int64_t c0, int64_t c1, const ColumnsOut& out_t,
                     Scratch& s) const {
    const int64_t w = c1 - c0;
    float v[kBlock];
    uint8_t codes[kBlock];
    for (int64_t c = c0; c < c1; ++c) {
      for (int i = 0; i < kBlock; ++i) v[i] = tile[i * w + (c - c0)];
      if (p_.rht) hadamard16(v);
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = fp8::amax_update(amax, v[i]);
      const uint8_t sb = block_scale_bits(amax, p_.s_enc_t);
      out_t.scale[(c - c0) * out_t.scale_ld] = sb;
      round_block(v, block_encode_factor(sb, p_.s_enc_t), 1, static_cast<uint64_t>(c * p_.m + r0), codes, s);
      pack(codes, out_t.data + (c - c0) * out_t.data_ld);
    }
  }

  // 16x16 tiles of rows [r0, r1) (r1 - r0 <= 16), columns [c0, c1): rowwise and/or transposed (to out_t).
  void tiles_2d(const float* tile, int64_t r0, int64_t r1, int64_t c0, int64_t c1, const ColumnsOut& out_t,
                Scratch& s) const {
    const int64_t w = c1 - c0, h = r1 - r0;
    uint8_t* codes = s.codes.data();
    for (int64_t c = c0; c < c1; c += kBlock) {
      float amax = 0.0f;
      for (int64_t r = 0; r < h; ++r) {
        for (int i = 0; i < kBlock; ++i) amax = fp8::amax_update(amax, tile[r * w + (c - c0) + i]);
      }
      const uint8_t sb = block_scale_bits(amax, p_.s_enc);
      const float factor = block_encode_factor(sb, p_.s_enc);
      for (int64_t r = 0; r < h; ++r) {
        round_block(tile + r * w + (c - c0), factor, 0, static_cast<uint64_t>((r0 + r) * p_.k + c),
                    codes + r * w + (c - c0), s);
      }
      if (p_.output.defined()) {
        uint8_t* scale = static_cast<uint8_t*>(p_.scale.data);
        for (int64_t r = r0; r < r1; ++r) {
          scale[r * (p_.k / kBlock) + c / kBlock] = sb;
          pack(codes + (r - r0) * w + (c - c0), p_.output.ptr<uint8_t>() + (r * p_.k + c) / 2);
        }
      }
      if (p_.output_t.defined()) {  // h == 16 here: M % 16 == 0 was checked
        uint8_t column[kBlock];
        for (int64_t j = 0; j < kBlock; ++j) {
          out_t.scale[(c - c0 + j) * out_t.scale_ld] = sb;
          for (int i = 0; i < kBlock; ++i) column[i] = codes[i * w + (c - c0) + j];
          pack(column, out_t.data + (c - c0 + j) * out_t.data_ld);
        }
      }
    }
  }

  template <typename In>
  void run() const {
    const int64_t all_bands = (p_.m + kBlock - 1) / kBlock;
    const int64_t band0 = p_.band_end < 0 ? 0 : p_.band_begin;
    const int64_t bands = (p_.band_end < 0 ? all_bands : p_.band_end) - band0;
    const int64_t chunks = (p_.k + kChunkCols - 1) / kChunkCols;
    // Threads claim runs of tiles (at most 512K elements, about four per thread) one at a time: a
    // thread the OS deschedules holds back only its run (parallel_for_claimed).
    const int threads = std::max(get_num_threads(), 1);
    const int64_t run = claim_chunk(bands * chunks, threads, 1, kClaimRunElems / (kBlock * kChunkCols));
    // Tile t: groups of `group` bands, each walked chunk by chunk, and down its bands within a chunk.
    const int64_t group = p_.output_t.defined() ? kColumnwiseBands : 1;
    const auto tile_at = [&](int64_t t, int64_t& r0, int64_t& c0) {
      const int64_t g = t / (group * chunks), in_group = std::min(group, bands - g * group);
      const int64_t rem = t - g * group * chunks;
      r0 = (band0 + g * group + rem % in_group) * kBlock;
      c0 = rem / in_group * kChunkCols;
    };
    const int64_t esize = element_size(p_.input.dtype);
    const bool stream_t = p_.output_t.defined() && static_cast<size_t>(p_.output_t.numel()) >= kStreamOutputBytes;
    const char* input = static_cast<const char*>(p_.input.data);
    parallel_for_claimed(threads, bands * chunks, run, /*from_end=*/false, [&](int64_t t0, int64_t t1) {
      thread_local Scratch s;
      s.tile.resize(kBlock * kChunkCols);
      s.codes.resize(kBlock * kChunkCols);
      s.bits.resize(kBlock);
      // Written out by the end of the claim: no bytes stay staged past the work a thread claimed.
      std::optional<ColumnStage> stage;
      if (p_.output_t.defined()) stage.emplace(s, stream_t);
      for (int64_t t = t0; t < t1; ++t) {
        int64_t r0, c0;
        tile_at(t, r0, c0);
        const int64_t r1 = std::min(p_.m, r0 + kBlock), c1 = std::min(p_.k, c0 + kChunkCols);
        if (t + 1 < t1) {
          // The next tile into L2 while this one is worked on: a band's 16 row streams are more than the
          // hardware prefetchers follow.
          int64_t nr0, nc0;
          tile_at(t + 1, nr0, nc0);
          const int64_t nr1 = std::min(p_.m, nr0 + kBlock), nbytes = (std::min(p_.k, nc0 + kChunkCols) - nc0) * esize;
          for (int64_t r = nr0; r < nr1; ++r) {
            const char* row = input + (r * p_.k + nc0) * esize;
            for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(row + off, 0, 2);
          }
        }
        if (!vec_ || !vec_->load_tile(p_, r0, r1, c0, c1, s.tile.data())) load<In>(r0, r1, c0, c1, s.tile.data());
        if (p_.keep_end >= 0) {  // rows of other groups: +0, as the masked copy holds them
          for (int64_t r = r0; r < r1; ++r) {
            if (r < p_.keep_begin || r >= p_.keep_end) std::fill_n(s.tile.data() + (r - r0) * (c1 - c0), c1 - c0, 0.0f);
          }
        }
        const ColumnsOut out_t = stage ? stage->slot(p_, r0, c0, c1) : ColumnsOut{};
        if (vec_) {
          if (p_.scaling_2d) {
            vec_->tiles_2d(p_, s.tile.data(), r0, r1, c0, c1, out_t);
            continue;
          }
          if (p_.output.defined()) vec_->rows_1d(p_, s.tile.data(), r0, r1, c0, c1);
          if (p_.output_t.defined()) vec_->columns_1d(p_, s.tile.data(), r0, c0, c1, out_t);
          continue;
        }
        if (p_.scaling_2d) {
          tiles_2d(s.tile.data(), r0, r1, c0, c1, out_t, s);
          continue;
        }
        if (p_.output.defined()) rowwise_1d(s.tile.data(), r0, r1, c0, c1, s);
        if (p_.output_t.defined()) columnwise_1d(s.tile.data(), r0, c0, c1, out_t, s);
      }
      if (stage) stage->flush(p_);
      if (stream_t) stream_fence();
    });
  }

 private:
  const QuantizeNvfp4Params& p_;
  const VecKernels* vec_;  // null on the portable path
};

}  // namespace

void quantize_nvfp4(const QuantizeNvfp4Params& p) {
  if (p.m == 0 || p.k == 0) return;
  VecKernels vec{};
  const Isa isa = current_isa();
  if (isa == Isa::kAvx2) vec = avx2_vec_kernels();
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) vec = avx512_vec_kernels();
  const Nvfp4Quantizer q(p, isa == Isa::kGeneric ? nullptr : &vec);
  dispatch_high_precision(p.input.dtype, "quantize_nvfp4: argument 'x'", [&](auto tag) {
    q.template run<decltype(tag)>();
  });
}

namespace nvfp4 {

AmaxKernels portable_amax_kernels() { return make_amax_kernels<4>(); }

void nvfp4_amaxes(const TensorDesc& x, int64_t k, const AmaxRange& range, float* amax, float* amax_rht) {
  const Isa isa = current_isa();
  const AmaxKernels kernels = isa == Isa::kAvx2                                   ? avx2_amax_kernels()
                              : isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 ? avx512_amax_kernels()
                                                                               : portable_amax_kernels();
  const int threads = std::max(get_num_threads(), 1);
  // One partial result per thread (omp_get_thread_num() < threads), reduced in a fixed order.
  std::vector<AbsMax> plain(threads), rht(threads);
  // The plain amax rides along the transform's pass when the bands hold exactly the rows.
  const bool fused = amax != nullptr && amax_rht != nullptr && range.band_begin * kBlock <= range.row_begin &&
                     range.band_end * kBlock >= range.row_end;
  // Threads claim groups of rows (about kAmaxChunkBytes, or fewer for about four per thread) one at
  // a time from the end, so that a thread the OS deschedules holds back only its group, and a tensor
  // just written has its end in cache, where this pass starts; the quantize that follows reads
  // forward from the beginning, which this pass read last. AbsMax does not depend on the order.
  const int64_t row_bytes = std::max<int64_t>(1, k * element_size(x.dtype));
  const int64_t chunk_rows = std::max<int64_t>(kBlock, kAmaxChunkBytes / row_bytes / kBlock * kBlock);
  if (amax_rht != nullptr) {
    const int64_t bands = range.band_end - range.band_begin;
    const int64_t group = claim_chunk(bands, threads, 1, chunk_rows / kBlock);
    parallel_for_claimed(threads, bands, group, /*from_end=*/true, [&](int64_t b0, int64_t b1) {
      const int t = omp_get_thread_num();
      AbsMax p;
      rht[t].add(kernels.bands(x, k, range, range.band_begin + b0, range.band_begin + b1, fused ? &p : nullptr));
      plain[t].add(p);
    });
  }
  if (amax != nullptr && !fused) {
    const int64_t rows = range.row_end - range.row_begin;
    const int64_t group = claim_chunk(rows, threads, 16, chunk_rows);
    parallel_for_claimed(threads, rows, group, /*from_end=*/true, [&](int64_t i0, int64_t i1) {
      plain[omp_get_thread_num()].add(kernels.rows(x, k, range.row_begin + i0, range.row_begin + i1));
    });
  }
  AbsMax total, total_rht;
  for (int t = 0; t < threads; ++t) {
    total.add(plain[t]);
    total_rht.add(rht[t]);
  }
  if (amax != nullptr) *amax = total.value();
  if (amax_rht != nullptr) *amax_rht = total_rht.nan ? std::nanf("") : total_rht.max * 0.25f;
}

}  // namespace nvfp4

}  // namespace cpu
}  // namespace tl
