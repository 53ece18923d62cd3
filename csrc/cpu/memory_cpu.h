// Memory for the CPU kernels: aligned scratch buffers, and huge pages for large outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>

#include "transformer_linear/tensor.h"

namespace tl {
namespace cpu {

/*! \brief Frees what aligned_buffer allocated. */
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

/*! \brief An owned, 64-byte-aligned byte buffer. */
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

/*!
 * \brief A 64-byte-aligned buffer of at least `bytes` bytes (uninitialized).
 * \throws tl::Error naming `op` when the allocation fails.
 */
Buffer aligned_buffer(size_t bytes, const char* op);

/*!
 * \brief A 64-byte-aligned scratch buffer that only grows. Kept `thread_local` by a kernel, each of
 *        its threads packs into the same memory call after call instead of faulting in fresh pages.
 */
class GrowingBuffer {
 public:
  /*!
   * \brief At least `bytes` bytes (contents unspecified; earlier contents are not kept on growth).
   * \throws tl::Error naming `op` when the allocation fails.
   */
  uint8_t* get(size_t bytes, const char* op) {
    if (bytes > capacity_) {
      buffer_.reset();  // the old buffer goes first: peak memory is the new size
      buffer_ = aligned_buffer(bytes, op);
      capacity_ = bytes;
    }
    return buffer_.get();
  }

 private:
  Buffer buffer_;
  size_t capacity_ = 0;
};

/*!
 * \brief Scratch the calling thread keeps for its next calls (as a `thread_local`), up to kMaxBytes:
 *        freshly allocated, megabytes of packed operands and partial sums cost a page fault per 4 KiB
 *        page on every call (a quarter of a 1024^3 GEMM's time). A larger request gets a buffer of its
 *        own, freed with `owned` after the call (its faults are small next to a kernel that large).
 */
class ScratchCache {
 public:
  static constexpr size_t kMaxBytes = size_t{16} << 20;

  /*! \brief At least `bytes` bytes, valid while `owned` and this cache live; \throws tl::Error naming `op`. */
  uint8_t* get(size_t bytes, Buffer& owned, const char* op) {
    if (bytes > kMaxBytes) {
      owned = aligned_buffer(bytes, op);
      return owned.get();
    }
    return kept_.get(bytes, op);
  }

 private:
  GrowingBuffer kept_;
};

/*!
 * \brief Ask the kernel to back an output about to be written for the first time with
 *        transparent huge pages, where it is large enough to be a mapping of its own.
 *
 * A kernel's output is usually a fresh torch.empty: an allocation of 32 MiB or more is always
 * its own mmap in glibc (above its largest mmap threshold), so each step's output takes a page
 * fault per 4 KiB page as the kernel first writes it (the 64 MiB weight gradient of a grouped
 * GEMM: 16384 faults, about 40 ms). With MADV_HUGEPAGE a fault maps 2 MiB at once. Smaller
 * outputs are left alone: they may share a heap mapping with other allocations, which the
 * advice would split. Linux only (elsewhere, and where the kernel's THP setting is "never",
 * it does nothing); the advice changes how pages are backed, never their contents.
 */
void advise_huge_pages(void* data, size_t bytes);

/*!
 * \brief advise_huge_pages for each defined descriptor among `outputs` (all its numel() elements):
 *        the outputs a CPU kernel is about to write.
 */
void advise_huge_pages(std::initializer_list<TensorDesc> outputs);

}  // namespace cpu
}  // namespace tl
