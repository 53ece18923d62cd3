// Thread counts of the CPU kernels: per call, per calling thread (parallel.h).
#include "parallel.h"

#include <omp.h>

#include <algorithm>

#include "transformer_linear/check.h"

namespace tl {
namespace {

// The count of the call in progress on this thread (0: none in progress).
thread_local int t_call_threads = 0;

// OpenMP's thread count of the calling thread (its nthreads ICV, which
// omp_set_num_threads sets for that thread only).
int openmp_threads() { return std::max(1, omp_get_max_threads()); }

}  // namespace

void set_num_threads(int n) {
  TL_CHECK(n >= 1, "set_num_threads: expected a thread count >= 1, got ", n);
  omp_set_num_threads(n);
}

int get_num_threads() { return t_call_threads >= 1 ? t_call_threads : openmp_threads(); }

namespace cpu {

int call_threads(const char* op, Stream launch) {
  TL_CHECK(launch <= static_cast<Stream>(kMaxThreads), op,
           ": on the CPU the launch argument is the thread count, expected 0 (OpenMP's count) to ",
           kMaxThreads, ", got ", launch);
  return launch == 0 ? openmp_threads() : static_cast<int>(launch);
}

ThreadCountScope::ThreadCountScope(int threads) : previous_(t_call_threads) {
  t_call_threads = std::max(threads, 1);
}

ThreadCountScope::~ThreadCountScope() { t_call_threads = previous_; }

}  // namespace cpu
}  // namespace tl
