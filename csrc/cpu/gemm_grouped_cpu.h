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
  // Weight gradient (wgrad): a = grad (total, n), b = x (total, k), d (groups, n, k); with
  // token_blocks, a = grad_t (n, total) and b = x_t (k, total), grouped columnwise copies whose
  // scale grids (n or k, total / token_block + groups) restart their blocks at each group's start.
  TensorDesc a, a_scale_inv, b, b_scale_inv, offs, bias, d;
  // a's scales over all (total) rows; b's per group (b_scale_inv holds groups of them).
  BlockLayout a_block, b_block;
  int64_t total, groups, n, k;
  bool wgrad;
  bool token_blocks;  // wgrad from grouped columnwise copies
  int64_t token_block;  // their block of tokens (INT64_MAX: the whole group)
};

namespace cpu {
void fp8_grouped_gemm(const GroupedGemmParams& p);
}  // namespace cpu

}  // namespace tl
