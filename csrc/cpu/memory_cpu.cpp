#include "memory_cpu.h"

#include <algorithm>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "transformer_linear/check.h"

namespace tl {
namespace cpu {

Buffer aligned_buffer(size_t bytes, const char* op) {
  const size_t rounded = (std::max<size_t>(bytes, 64) + 63) / 64 * 64;
  Buffer buffer(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
  TL_CHECK(buffer != nullptr, op, ": out of memory allocating ", bytes, " bytes");
  return buffer;
}

void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): above it every
  // allocation is a mapping of its own.
  constexpr size_t kOwnMapping = size_t{32} << 20;
  if (data == nullptr || bytes < kOwnMapping) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  // Advice only: a failure (THP compiled out, an unusual mapping) leaves the pages as they were.
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

void advise_huge_pages(std::initializer_list<TensorDesc> outputs) {
  for (const TensorDesc& out : outputs) {
    if (out.defined()) advise_huge_pages(out.data, static_cast<size_t>(out.numel()) * element_size(out.dtype));
  }
}

}  // namespace cpu
}  // namespace tl
