// Threading for the CPU kernels: OpenMP, sized by tl::get_num_threads(),
// which the Python layer keeps equal to torch.get_num_threads().
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "transformer_linear/runtime.h"

namespace tl {
namespace cpu {

/*!
 * \brief Run fn(begin, end) over [0, n) split into contiguous chunks, one per
 *        thread, with at least `grain` items per chunk. fn must not throw.
 */
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  const int64_t max_chunks = std::max<int64_t>(1, (n + grain - 1) / std::max<int64_t>(grain, 1));
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), max_chunks));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t begin = std::min(n, t * chunk);
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end);
  }
}

}  // namespace cpu
}  // namespace tl
