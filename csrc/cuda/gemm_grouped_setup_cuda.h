// Host-side launcher of gemm_grouped_setup_cuda.cu (no device code here, so gemm_grouped_cuda.cpp can include it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_utils.h"

namespace tl {
namespace cuda {

/*! \brief What the setup kernel reads (the operands, offs) and writes (cuBLASLt's per-group device arrays). */
struct GroupedSetup {
  const int32_t* offs;
  int groups;
  int64_t m, n, k, d_elem_bytes;
  const uint8_t* a;
  const uint8_t* b;
  uint8_t* d;
  const float* a_scale_inv;
  const void** a_ptrs;  // cuBLAS's A (our b[g]), B (our a's rows of g), D
  const void** b_ptrs;
  void** d_ptrs;
  int64_t* k_array;
  int64_t* n_array;
  int64_t* m_array;
  float* a_scales;  // a_scale_inv repeated per group (PER_BATCH_SCALAR scales)
};

/*! \brief Fills the per-group arrays of `s` on `stream`. */
void grouped_setup(const GroupedSetup& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace tl
