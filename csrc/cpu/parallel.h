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
#include <atomic>
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
 * \brief Run fn(begin, end) over [0, n) in chunks of `chunk` items (the last one shorter) that the
 *        threads of a team of up to `threads` claim one at a time: from the start, or from the end
 *        where `from_end`.
 *
 * For passes whose chunks combine in any order (elementwise outputs; a maximum each thread keeps
 * in its slot). parallel_for fixes each thread's share up front, so a thread the OS deschedules (on
 * a machine shared with another busy process) keeps the others waiting for its whole share; here
 * it holds back only the chunk it is in. omp_get_thread_num() inside fn is below `threads`; one
 * thread runs the chunks in the same order. Exceptions as in parallel_for: the others stop
 * claiming, the first is rethrown after the region.
 */
template <typename Fn>
void parallel_for_claimed(int threads, int64_t n, int64_t chunk, bool from_end, Fn&& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = n / chunk + (n % chunk != 0);
  const auto run_chunk = [&](int64_t c) {
    const int64_t i = from_end ? chunks - 1 - c : c;
    fn(i * chunk, std::min(n, (i + 1) * chunk));
  };
  threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), chunks));
  if (threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) run_chunk(c);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
  {
    try {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed);
           c < chunks && !failed.load(std::memory_order_relaxed); c = next.fetch_add(1, std::memory_order_relaxed)) {
        run_chunk(c);
      }
    } catch (...) {
      failed.store(true, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

/*!
 * \brief Largest chunk of input bytes a pass over a tensor claims at a time (parallel_for_claimed):
 *        walked backward, pieces of 256 KiB measured 2-6% slower than one forward walk on an input
 *        not in cache (the prefetchers ramp up again at each piece), 2 MiB as fast.
 */
constexpr int64_t kClaimChunkBytes = 2 << 20;
/*! \brief Largest run of elements of tiles a tiled pass (block and NVFP4 quantize) claims at a time. */
constexpr int64_t kClaimRunElems = 512 * 1024;

/*!
 * \brief Items per chunk for parallel_for_claimed over `n` items: about `per_thread` chunks per
 *        thread, so a descheduled thread's chunk is a small part of the work (one thread: one
 *        chunk), but at least `grain` items (below it a chunk costs more to hand out than to run)
 *        and at most `max_chunk`.
 */
inline int64_t claim_chunk(int64_t n, int threads, int64_t grain, int64_t max_chunk, int64_t per_thread = 4) {
  const int64_t parts = threads <= 1 ? 1 : int64_t{threads} * std::max<int64_t>(per_thread, 1);
  return std::max<int64_t>(1, std::max(grain, std::min(max_chunk, n / parts + (n % parts != 0))));
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
