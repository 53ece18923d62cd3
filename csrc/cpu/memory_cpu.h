// Memory for the CPU kernels: aligned scratch buffers, huge pages and non-temporal stores for large
// outputs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>

#include "transformer_linear/tensor.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tl {
namespace cpu {

/*!
 * \brief Outputs of at least this many bytes are written with non-temporal stores (stream_copy): the GEMM's
 *        (store_tile_streaming) and the NVFP4 quantize's columnwise copy (quantize_nvfp4_cpu.cpp).
 *
 * An output tile's rows are lines the GEMM writes once, in full, and never reads back. Plain stores
 * first fetch each line (read-for-ownership) into L2, where the lines of a large output evict the packed
 * A block and B panel the AMX micro-kernel streams from there: on one AMX core, a loop of micro-kernel
 * calls (K = 1024) that also wrote each 32 x 32 tile to a 16 MiB bf16 output ran at 0.65x the rate of
 * the loop alone, and at 0.85x with non-temporal stores; the FP8 GEMMs of 2048 x 4096 x 1024 and
 * 4096 x 4096 x 1024 (bf16 out, two threads) went 10-18% faster. Smaller outputs may stay in the
 * caches for the op that reads them (a 2048 x 2048 NVFP4 columnwise copy was written no faster streamed).
 */
constexpr size_t kStreamOutputBytes = size_t{8} << 20;

/*!
 * \brief dst[0, count) = src[0, count): the whole 64-byte lines of dst with non-temporal stores (x86; one
 *        64-byte store a line where the file is compiled for AVX-512), its ragged ends with plain ones.
 *        `IsaTag`: a type of the calling file's own (as gemm_cpu.h's store_tile takes), so each
 *        instruction-set file compiles its own copy.
 */
template <typename IsaTag, typename T>
inline void stream_copy(const T* src, int64_t count, T* dst) {
  const size_t bytes = static_cast<size_t>(count) * sizeof(T);
  auto* out = reinterpret_cast<uint8_t*>(dst);
  const auto* in = reinterpret_cast<const uint8_t*>(src);
#if defined(__x86_64__) || defined(__i386__)
  const size_t head = std::min<size_t>(bytes, (64 - (reinterpret_cast<uintptr_t>(out) & 63)) & 63);
  if (head) std::memcpy(out, in, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), _mm512_loadu_si512(in + i));
#else
    for (size_t v = 0; v < 64; v += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i + v),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i + v)));
    }
#endif
  }
  if (i < bytes) std::memcpy(out + i, in + i, bytes - i);
#else
  std::memcpy(out, in, bytes);
#endif
}

/*!
 * \brief Orders the non-temporal stores of stream_copy before the stores that follow (they are not ordered
 *        with the plain store that tells another thread the work is done).
 */
inline void stream_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#endif
}

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
