// The K passes of one NC block of the blocked CPU GEMMs (tensorwise, block
// scaled, NVFP4), run by a team of threads with no barrier between passes.
//
// A blocked GEMM walks K in chunks (passes). Each pass packs its chunk of B
// once for all threads, then every unit of work (a block of A rows, or a slice
// of one) adds that chunk's products into its own tiles; a unit's passes must
// run in order (its partial sums carry over, and the order fixes the bits).
// Ending each pass with a barrier makes every thread wait for the slowest one
// once per pass: on a machine shared with another busy process the OS
// deschedules a thread for milliseconds now and then, and its sibling idled at
// every barrier (two threads beside a busy process lost 40-50% of their quiet
// rate, where fp32 torch.mm lost about a quarter). Here each unit carries its own
// next pass, and a thread takes whichever free unit is furthest behind, so a
// descheduled thread holds back only the one unit it holds. The chunks of B
// live in a ring of kPassSlots buffers: chunk p is packed into slot
// p % slots once every unit has finished pass p - slots, which bounds how far
// the fastest unit may run ahead (and the memory) without a barrier.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>

#include "gemm_cpu.h"
#include "memory_cpu.h"
#include "parallel.h"

namespace tl {
namespace cpu {
namespace gemm {

/*! \brief Buffers of packed B chunks a multi-threaded NC block cycles through. */
constexpr int64_t kPassSlots = 4;

/*!
 * \brief Threads for an M x N x K GEMM: the call's count (tl::get_num_threads()), or one for tiny
 *        products (tens of microseconds), where waking the others would cost more than it saves.
 */
inline int gemm_threads(int64_t m, int64_t n, int64_t k) {
  constexpr double kMinParallelFlops = 1 << 22;
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) < kMinParallelFlops
             ? 1
             : get_num_threads();
}

/*! \brief Packed-B chunk buffers run_passes uses: one for one thread (passes run in turn). */
inline int64_t pass_slots(int threads, int64_t passes) {
  return threads <= 1 ? 1 : std::min(passes, kPassSlots);
}

/*!
 * \brief Columns of one NC block: the kernel's `kernel_nc`, narrowed (to a multiple of `nr`) so a
 *        multi-pass GEMM's fp32 partial sums (`m_pad` x NC) stay within 64 MiB.
 */
inline int64_t nc_block(int64_t kernel_nc, int64_t nr, int64_t n, int64_t m_pad, bool multi_pass) {
  int64_t nc = std::min(kernel_nc, (n + nr - 1) / nr * nr);
  if (multi_pass) {
    const int64_t budget_cols = (int64_t{16} << 20) / m_pad;
    nc = std::max(nr, std::min(nc, budget_cols / nr * nr));
  }
  return nc;
}

/*!
 * \brief How the M x (B panels of one NC block) work of a pass is cut into run_passes' units:
 *        blocks of A rows, each split into slices of the B panels where there are fewer A blocks
 *        than threads (small M; each slice then packs its own copy of the small A block).
 */
struct UnitGrid {
  /*! \brief One unit: A rows [row, row + rows) against B panels [panel_begin, panel_end). */
  struct Unit {
    int64_t row, rows, panel_begin, panel_end;
  };

  /*! \brief Units for M rows and `b_panels` panels: as many A blocks of at most about `kernel_mc`
   *         rows (a multiple of `mr`) as make a multiple of `threads`. */
  UnitGrid(int64_t m, int64_t kernel_mc, int64_t mr, int64_t b_panels, int threads) : m_(m), b_panels_(b_panels) {
    const auto ceil_div = [](int64_t x, int64_t d) { return (x + d - 1) / d; };
    const int64_t blocks = ceil_div(ceil_div(m, kernel_mc), threads) * threads;
    mc = ceil_div(ceil_div(m, blocks), mr) * mr;
    m_blocks = ceil_div(m, mc);
    n_splits = std::min<int64_t>(b_panels, ceil_div(threads, m_blocks));
  }

  int64_t units() const { return m_blocks * n_splits; }

  Unit unit(int64_t w) const {
    const int64_t row = (w / n_splits) * mc, split = w % n_splits;
    return Unit{row, std::min(mc, m_ - row), split * b_panels_ / n_splits, (split + 1) * b_panels_ / n_splits};
  }

  int64_t mc;        //!< rows of A per block (a multiple of mr)
  int64_t m_blocks;  //!< blocks of A rows
  int64_t n_splits;  //!< slices of the B panels per A block

 private:
  int64_t m_, b_panels_;
};

/*!
 * \brief Calls `tile(q, ir, b_panel)` for each mr x nr tile of unit `u` in one pass: B panel `q`
 *        (its packed data `b_panel`, in the chunk `b_chunk`) outer, the A panel of the unit's row
 *        `ir` inner, so a B panel stays in L1 across the A panels; with `prefetch`, each tile
 *        call is preceded by the prefetch of its slice of the next B panel (prefetch_slice).
 */
template <typename Tile>
void for_each_tile(const UnitGrid::Unit& u, const uint8_t* b_chunk, size_t b_panel_bytes, int64_t mr, bool prefetch,
                   Tile&& tile) {
  const int64_t a_panels = (u.rows + mr - 1) / mr;
  for (int64_t q = u.panel_begin; q < u.panel_end; ++q) {
    const uint8_t* b_panel = b_chunk + q * b_panel_bytes;
    const uint8_t* next_b = prefetch && q + 1 < u.panel_end ? b_panel + b_panel_bytes : nullptr;
    for (int64_t ir = 0; ir < u.rows; ir += mr) {
      if (next_b) prefetch_slice(next_b, b_panel_bytes, ir / mr, a_panels);
      tile(q, ir, b_panel);
    }
  }
}

/*!
 * \brief Where a multi-pass NC block keeps each tile's fp32 partial sums between passes: tile after
 *        tile in the order for_each_tile visits them (the A panels of one B panel in turn), each mr x nr
 *        tile one contiguous run (leading dimension nr).
 *
 * The partial sums of a large block (m x NC floats, many MiB) leave the caches between passes. Stored
 * as rows NC floats apart, a tile's mr rows were mr separate lines on as many pages, fetched on demand
 * when the micro-kernel added them at its end (about a tenth of a vdpbf16ps micro-kernel's time on
 * AMD Zen 4); one run a tile, in visiting order, is a stream the hardware prefetchers follow.
 */
class PartialTiles {
 public:
  /*! \brief `totals`: m_pad x NC floats (PassBuffers::totals), or nullptr for a one-pass GEMM. */
  PartialTiles(float* totals, int64_t m_pad, int mr, int nr)
      : totals_(totals), m_tiles_(m_pad / mr), mr_(mr), tile_floats_(int64_t{mr} * nr) {}

  /*! \brief The partial sums of the tile of A rows [i, i + mr) (i a multiple of mr) against B panel `q`
   *         of the NC block; nullptr for a one-pass GEMM. */
  float* at(int64_t q, int64_t i) const {
    return totals_ ? totals_ + (q * m_tiles_ + i / mr_) * tile_floats_ : nullptr;
  }

 private:
  float* totals_;
  int64_t m_tiles_;
  int mr_;
  int64_t tile_floats_;
};

/*!
 * \brief The memory of one blocked GEMM call: its ring of packed-B chunks and, for a multi-pass
 *        GEMM, its fp32 partial sums; kept per calling thread (ScratchCache) across calls and
 *        across the three drivers, which never run nested on one thread.
 */
class PassBuffers {
 public:
  /*! \throws tl::Error naming `op` where the memory cannot be had. */
  PassBuffers(int64_t slots, size_t b_chunk_bytes, size_t total_floats, const char* op)
      : b_chunk_bytes_(b_chunk_bytes) {
    thread_local ScratchCache b_cache, totals_cache;
    b_packed_ = b_cache.get(static_cast<size_t>(slots) * b_chunk_bytes, b_owned_, op);
    totals_ = total_floats ? reinterpret_cast<float*>(totals_cache.get(total_floats * sizeof(float), totals_owned_, op))
                           : nullptr;
  }

  /*! \brief The packed-B chunk in ring slot `slot`. */
  uint8_t* b_chunk(int64_t slot) const { return b_packed_ + static_cast<size_t>(slot) * b_chunk_bytes_; }
  /*! \brief The partial sums, or nullptr for a one-pass GEMM. */
  float* totals() const { return totals_; }

 private:
  Buffer b_owned_, totals_owned_;
  size_t b_chunk_bytes_;
  uint8_t* b_packed_ = nullptr;
  float* totals_ = nullptr;
};

/*!
 * \brief A block of packed A rows for the unit a thread runs: grown once per thread and reused by
 *        every call (a thread runs one unit at a time). \throws tl::Error naming `op`.
 */
inline uint8_t* a_block_buffer(size_t bytes, const char* op) {
  thread_local GrowingBuffer a_block;
  return a_block.get(bytes, op);
}

/*!
 * \brief Runs `passes` K passes over `units` units of work on up to `threads` threads.
 *
 * `pack(pass, slot, panel)` packs panel `panel` (of `panels`) of the pass's B chunk into buffer
 * `slot` (below pass_slots(threads, passes)); every panel of a pass is packed before any unit runs
 * it. `run(pass, slot, unit)` runs one unit's share of a pass, reading the chunk in `slot`; each
 * unit's passes run in order, one thread at a time, and a unit's writes are visible to whichever
 * thread runs its next pass. One thread runs pass by pass, units in order (the passes' barriers
 * cost nothing there). Exceptions propagate as in parallel_for: a throwing thread marks the team
 * failed, the others stop taking work, and the first exception is rethrown.
 */
template <typename Pack, typename Run>
void run_passes(int threads, int64_t passes, int64_t panels, int64_t units, Pack&& pack, Run&& run) {
  if (passes <= 0 || units <= 0) return;
  threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), units));
  if (threads <= 1) {
    for (int64_t p = 0; p < passes; ++p) {
      for (int64_t q = 0; q < panels; ++q) pack(p, int64_t{0}, q);
      for (int64_t u = 0; u < units; ++u) run(p, int64_t{0}, u);
    }
    return;
  }
  const int64_t slots = pass_slots(threads, passes);
  // Per pass: panels claimed and packed, units finished. Per unit: 2 * next pass, + 1 while held.
  std::unique_ptr<std::atomic<int64_t>[]> claimed(new std::atomic<int64_t>[passes]);
  std::unique_ptr<std::atomic<int64_t>[]> packed(new std::atomic<int64_t>[passes]);
  std::unique_ptr<std::atomic<int64_t>[]> finished(new std::atomic<int64_t>[passes]);
  std::unique_ptr<std::atomic<int64_t>[]> state(new std::atomic<int64_t>[units]);
  for (int64_t p = 0; p < passes; ++p) claimed[p] = packed[p] = finished[p] = 0;
  for (int64_t u = 0; u < units; ++u) state[u] = 0;
  std::atomic<int64_t> remaining{passes * units};
  std::atomic<bool> failed{false};
  // A thread with nothing to take (every free unit waits on a slot or on a unit held elsewhere)
  // spins briefly, then yields its core: the thread it waits for may need that core to run.
  const auto wait_a_little = [](int& spins) {
    if (++spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  };
  parallel_for(threads, threads, 1, [&](int64_t, int64_t) {  // one chunk per thread: its work loop
    int spins = 0;
    try {
      while (remaining.load(std::memory_order_acquire) > 0 && !failed.load(std::memory_order_relaxed)) {
        // The free unit furthest behind whose chunk's slot is free (the lowest index among equals:
        // units then run in the order of one thread's loop, A rows in order against one chunk).
        int64_t unit = -1, pass = std::numeric_limits<int64_t>::max(), seen = 0;
        for (int64_t u = 0; u < units; ++u) {
          const int64_t s = state[u].load(std::memory_order_acquire);
          const int64_t p = s / 2;
          if ((s & 1) || p >= passes || p >= pass) continue;
          if (p >= slots && finished[p - slots].load(std::memory_order_acquire) < units) continue;
          unit = u, pass = p, seen = s;
        }
        if (unit < 0 || !state[unit].compare_exchange_strong(seen, seen + 1, std::memory_order_acq_rel)) {
          wait_a_little(spins);
          continue;
        }
        spins = 0;
        const int64_t slot = pass % slots;
        for (int64_t q = claimed[pass].fetch_add(1, std::memory_order_relaxed); q < panels;
             q = claimed[pass].fetch_add(1, std::memory_order_relaxed)) {
          pack(pass, slot, q);
          packed[pass].fetch_add(1, std::memory_order_release);
        }
        int wait_spins = 0;
        while (packed[pass].load(std::memory_order_acquire) < panels) {
          if (failed.load(std::memory_order_relaxed)) return;
          wait_a_little(wait_spins);
        }
        run(pass, slot, unit);
        finished[pass].fetch_add(1, std::memory_order_release);
        state[unit].store(2 * (pass + 1), std::memory_order_release);
        remaining.fetch_sub(1, std::memory_order_acq_rel);
      }
    } catch (...) {
      failed.store(true, std::memory_order_relaxed);
      throw;  // parallel_for keeps the first exception and rethrows it after the region
    }
  });
}

}  // namespace gemm
}  // namespace cpu
}  // namespace tl
