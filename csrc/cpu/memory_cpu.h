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
