// Process-wide CPU settings: the thread count. (The instruction-set path is
// chosen in isa_select.cpp.)
#include <atomic>

#include "transformer_linear/check.h"
#include "transformer_linear/runtime.h"

namespace tl {
namespace {

std::atomic<int> g_num_threads{1};

}  // namespace

void set_num_threads(int n) {
  TL_CHECK(n >= 1, "set_num_threads: expected a thread count >= 1, got ", n);
  g_num_threads.store(n, std::memory_order_relaxed);
}

int get_num_threads() { return g_num_threads.load(std::memory_order_relaxed); }

bool built_with_cuda() {
#ifdef TL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace tl
