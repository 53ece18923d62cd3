// What the Python layer asks the CUDA build about: toolkit and driver
// versions, the architectures compiled in, and which GEMM path ran. Plain
// C++ (no CUDA headers), so the bindings can include it.
#pragma once

#include <cstdint>
#include <string>

namespace tl {
namespace cuda {

/*! \brief GEMMs run by each path since the last reset (process-wide), and the algorithm cache size. */
struct GemmPathCounts {
  uint64_t cublaslt = 0;  // cuBLASLt FP8 matmul
  uint64_t fallback = 0;  // the tiled kernel of gemm_fallback_cuda.cu
  uint64_t padded = 0;    // of the cuBLASLt runs, those on zero-padded operand copies
  uint64_t cached_algos = 0;  // entries in the (bounded) cuBLASLt algorithm cache
  uint64_t cublaslt_block = 0;  // block-scaled GEMMs run by cuBLASLt (gemm_block_cuda.cpp)
};

GemmPathCounts gemm_path_counts();
void reset_gemm_path_counts();

/*! \brief CUDA runtime version this build links (e.g. 13000 for 13.0). */
int runtime_version();
/*! \brief Highest CUDA version the installed driver supports; 0 when no driver is installed. */
int driver_version();
/*! \brief The CMake architecture list compiled in, e.g. "80;90-real;100-real;120-real". */
std::string built_archs();

}  // namespace cuda
}  // namespace tl
