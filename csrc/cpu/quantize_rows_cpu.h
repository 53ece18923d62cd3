// A tensorwise quantize split in two, for a caller that casts rows where it
// reads them: the scale first (current scaling's amax pass), then the
// row-major cast a range of rows at a time, on the caller's threads. The fused
// forward (quantize_gemm_cpu.cpp) casts each block of the GEMM's A rows just
// before packing it, so the FP8 copy is read back from cache.
#pragma once

#include <atomic>
#include <cstdint>

#include "../common/backend.h"

namespace tl {
namespace cpu {

/*! \brief The row-major cast of a QuantizeParams with `output` only (no transpose, no bias gradient). */
class RowCast {
 public:
  /*!
   * \brief Sets the scale (current scaling: from the amax pass over the input, also written to
   *        `p.scale`) and writes `p.scale_inv`. `p` must outlive the RowCast.
   */
  explicit RowCast(const QuantizeParams& p);

  /*! \brief Casts rows [r0, r1) into `p.output`; disjoint ranges may run on several threads at once. */
  void cast_rows(int64_t r0, int64_t r1);

  /*! \brief Writes `p.amax` (where given): current scaling's, or the maximum over the rows cast. */
  void finish() const;

 private:
  using CastFn = float (*)(const QuantizeParams& p, float scale, int64_t begin, int64_t end, bool want_amax);

  const QuantizeParams& p_;
  CastFn cast_ = nullptr;
  float scale_ = 1.0f;
  float known_amax_ = 0.0f;       // current scaling's
  std::atomic<float> amax_{0.0f};  // delayed scaling's, over the rows cast so far
};

}  // namespace cpu
}  // namespace tl
