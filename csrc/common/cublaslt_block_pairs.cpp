#include "cublaslt_block_pairs.h"

namespace tl {
namespace {

bool sm90(int major, int /*minor*/) { return major == 9; }
bool sm100_and_newer(int major, int /*minor*/) { return major >= 10; }

// 1x128 / 128x128 blocks and outer (row) vectors arrived with cuBLAS 12.9 for Hopper only;
// MXFP8's 1x32 E8M0 blocks with 12.8, for Blackwell and newer.
constexpr int64_t kCublas12_8 = 120800;
constexpr int64_t kCublas12_9 = 120900;

}  // namespace

std::optional<BlockScaling> parse_block_scaling(const std::string& name) {
  if (name == "RowWise") return BlockScaling::kRowWise;
  if (name == "BlockWise1x128") return BlockScaling::kBlock1x128;
  if (name == "BlockWise128x128") return BlockScaling::kBlock128x128;
  if (name == "BlockWise1x32") return BlockScaling::kBlock1x32;
  return std::nullopt;
}

std::optional<CublasLtBlockPair> cublaslt_block_pair(BlockScaling a, BlockScaling b) {
  switch (a) {
    case BlockScaling::kRowWise:
      if (b == BlockScaling::kRowWise) return CublasLtBlockPair{kCublas12_9, sm90};
      break;
    case BlockScaling::kBlock1x128:
      if (b == BlockScaling::kBlock1x128 || b == BlockScaling::kBlock128x128) return CublasLtBlockPair{kCublas12_9, sm90};
      break;
    case BlockScaling::kBlock128x128:
      if (b == BlockScaling::kBlock1x128) return CublasLtBlockPair{kCublas12_9, sm90};
      break;
    case BlockScaling::kBlock1x32:
      if (b == BlockScaling::kBlock1x32) return CublasLtBlockPair{kCublas12_8, sm100_and_newer};
      break;
  }
  return std::nullopt;
}

bool cublaslt_block_pair_runs(const std::string& a_scaling, const std::string& b_scaling, int major, int minor,
                              int64_t cublas_version) {
  const std::optional<BlockScaling> a = parse_block_scaling(a_scaling), b = parse_block_scaling(b_scaling);
  if (!a || !b) return false;
  const std::optional<CublasLtBlockPair> pair = cublaslt_block_pair(*a, *b);
  return pair && cublas_version >= pair->min_cublas_version && pair->runs_on(major, minor);
}

}  // namespace tl
