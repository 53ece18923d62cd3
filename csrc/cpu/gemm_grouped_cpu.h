// Internal interface between the grouped-GEMM entry points (common/gemm_grouped.cpp) and the CPU
// kernel (cpu/gemm_grouped_cpu.cpp). Everything here is validated, except the values of `offs`,
// which the kernel checks where it reads them.
#pragma once

#include <cstdint>

#include "../common/backend_block.h"
#include "transformer_linear/tensor.h"

namespace tl {

struct GroupedGemmParams {
  // Forward: a (total, k), b (groups, n, k), d (total, n), bias (groups, n) or undefined.
  // Weight gradient (wgrad): a = grad (total, n), b = x (total, k), d (groups, n, k).
  TensorDesc a, a_scale_inv, b, b_scale_inv, offs, bias, d;
  // a's scales over all (total) rows; b's per group (b_scale_inv holds groups of them).
  BlockLayout a_block, b_block;
  int64_t total, groups, n, k;
  bool wgrad;
};

namespace cpu {
void fp8_grouped_gemm(const GroupedGemmParams& p);
}  // namespace cpu

}  // namespace tl
