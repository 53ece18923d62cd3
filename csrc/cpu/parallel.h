// Threading for the CPU kernels: OpenMP, sized by the thread count of the
// current call.
//
// Each entry point (csrc/common/*.cpp) reads the caller's count once and
// installs it for the calling thread with a ThreadCountScope; the kernels read
// it back with tl::get_num_threads(). The count is thread-local, so another
// Python thread calling torch.set_num_threads() cannot change it in the
// middle of a call (per-thread scratch sized from it stays large enough).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>

#include "transformer_linear/runtime.h"
#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {

/*! \brief Largest thread count a call may ask for. */
constexpr int kMaxThreads = 1 << 12;

/*!
 * \brief The thread count a CPU call carries in its launch argument (the
 *        `stream` of the entry points): 0 means OpenMP's count of the
 *        calling thread (tl::set_num_threads()); above kMaxThreads is a
 *        ValueError naming `op`.
 */
int call_threads(const char* op, Stream launch);

/*!
 * \brief Installs `threads` (clamped to >= 1) as the calling thread's count for
 *        the lifetime of the scope; the previous value comes back on exit.
 */
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int threads);
  ~ThreadCountScope();
  ThreadCountScope(const ThreadCountScope&) = delete;
  ThreadCountScope& operator=(const ThreadCountScope&) = delete;

 private:
  int previous_;
};

/*!
 * \brief Run fn(begin, end) over [0, n) split into contiguous chunks, at most
 *        one per thread of `threads`, with at least `grain` items per chunk.
 *
 * omp_get_thread_num() inside fn is below `threads`, so per-thread scratch of
 * `threads` entries, allocated before the call, suffices. An exception thrown
 * by fn is caught inside the parallel region (one escaping it would terminate
 * the process) and the first one is rethrown here after the region ends.
 */
template <typename Fn>
void parallel_for(int threads, int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  const int64_t max_chunks = std::max<int64_t>(1, (n + grain - 1) / std::max<int64_t>(grain, 1));
  threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), max_chunks));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t begin = std::min(n, t * chunk);
    const int64_t end = std::min(n, begin + chunk);
    try {
      if (begin < end) fn(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

/*!
 * \brief Run fn(lo, hi) over [begin, end) in chunks whose bounds are multiples
 *        of `chunk` (clipped to the range), the last chunk first.
 *
 * For a pass over data that was last written or read front to back (by the
 * op that produced it, or a kernel's own first pass): what the caches still
 * hold of it is its end, so starting there reads from cache what a forward
 * walk would fetch from memory, and leaves the beginning in cache for a
 * forward pass after it. Each chunk is walked forward by fn, which the
 * hardware prefetchers follow best; each jump back costs their ramp-up, so
 * chunks should span megabytes.
 */
template <typename Fn>
void for_chunks_backward(int64_t begin, int64_t end, int64_t chunk, Fn&& fn) {
  chunk = std::max<int64_t>(chunk, 1);
  for (int64_t hi = end; hi > begin;) {
    const int64_t lo = std::max(begin, (hi - 1) / chunk * chunk);
    fn(lo, hi);
    hi = lo;
  }
}

/*! \brief parallel_for with the current call's thread count (tl::get_num_threads()). */
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  parallel_for(get_num_threads(), n, grain, std::forward<Fn>(fn));
}

}  // namespace cpu
}  // namespace tl
