// CPU grouped FP8 GEMM: one GEMM per group (mixture-of-experts experts), all of them in one
// parallel loop.
//
// Reuses the packing and register-tiled micro-kernels of the tensorwise GEMM (gemm_cpu.h) and
// the per-K-block promotion and folding of the block-scaled GEMM (gemm_block_cpu.h): power-of-two
// block scales fold into the packed panels, others are promoted (the micro-kernel's fp32 sum over
// one K-block into the fp32 total, with the two block scales). The work items are (group, chunk of
// its rows, tile of columns) over every group at once, the largest claimed first, so a skewed
// routing (one group holding most rows) still spreads over every thread, and an empty group costs
// nothing. Each item packs its B panel once per KC chunk for all of its rows (the dense GEMM's
// loop order) and keeps its fp32 totals on the thread.
//
// Two forms share the driver. Forward (m-grouped): group g multiplies its rows of `a` by b[g].
// Weight gradient (k-grouped): group g contracts its rows, d[g] = grad_g^T x_g, which is a GEMM of
// the transposed views (a column-major operand for the packing routines, which take any strides),
// or, from grouped columnwise copies, of row-major (n, tokens) and (k, tokens) operands whose
// token blocks restart at the group's first token.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "gemm_block_cpu.h"
#include "gemm_cpu.h"
#include "gemm_grouped_cpu.h"
#include "memory_cpu.h"
#include "parallel.h"
#include "transformer_linear/block_math.h"
#include "transformer_linear/check.h"
#include "transformer_linear/dispatch.h"

namespace tl {
namespace cpu {
namespace {

using gemm::KernelSet;
using gemm::Operand;
using gemm::store_tile;
using gemm::sub_operand;

constexpr int64_t kWhole = std::numeric_limits<int64_t>::max();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// The scale_inv of element (row, k) of one operand: block (row / rows, col0 + k / cols) of a
// row-major grid with grid_cols columns, float32 or E8M0 bits (col0: a group's first token block
// in a grouped columnwise copy's grid, else 0).
struct ScaleSource {
  const void* data;
  bool e8m0;
  int64_t rows, cols, grid_cols;
  int64_t col0 = 0;

  float at(int64_t row, int64_t k) const {
    const int64_t index = (row / rows) * grid_cols + col0 + k / cols;
    return e8m0 ? fp8::float_from_e8m0_bits(static_cast<const uint8_t*>(data)[index])
                : static_cast<const float*>(data)[index];
  }
};

ScaleSource scale_source(const TensorDesc& scale, const BlockLayout& l, int64_t group) {
  const int64_t offset = group * l.grid_rows * l.grid_cols;
  const void* data = l.e8m0 ? static_cast<const void*>(scale.ptr<uint8_t>() + offset)
                            : static_cast<const void*>(scale.ptr<float>() + offset);
  return ScaleSource{data, l.e8m0, l.rows, l.cols, l.grid_cols};
}

// One group's GEMM: d[i, j] = sum_k A(i, k) B(j, k) * sa(a_row0 + i, k) * sb(j, k) [+ bias[j]].
struct Problem {
  Operand a, b;
  int64_t m, n, k;
  ScaleSource sa, sb;
  int64_t a_row0;  // row of A's first row in its scale grid
  int64_t d_offset, ldd;  // elements
  int64_t bias_offset;  // -1: no bias
};

// A chunk of one group's rows (all of them unless several threads need more items, or the
// fp32 totals would pass their budget) times one tile of columns.
struct WorkItem {
  int64_t problem, i0, rows, j0;
};

// offs read once, where the kernel uses it: group g is rows [starts[g], starts[g + 1]).
std::vector<int64_t> group_starts(const GroupedGemmParams& p, const char* op) {
  const int32_t* offs = p.offs.ptr<int32_t>();
  std::vector<int64_t> starts(p.groups + 1, 0);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t end = offs[g];
    TL_CHECK(end >= starts[g], op, ": argument 'offs' must be non-decreasing and non-negative, got offs[",
             g, "] = ", end, (g == 0 ? std::string() : ", after offs[" + std::to_string(g - 1) + "] = " +
                                                       std::to_string(starts[g])));
    TL_CHECK(end <= p.total, op, ": argument 'offs' must not pass the ", p.total,
             " rows of the tokens, got offs[", g, "] = ", end);
    starts[g + 1] = end;
  }
  return starts;
}

std::vector<Problem> problems(const GroupedGemmParams& p, const std::vector<int64_t>& starts) {
  std::vector<Problem> out;
  out.reserve(p.groups);
  const uint8_t* a = p.a.ptr<uint8_t>();
  const uint8_t* b = p.b.ptr<uint8_t>();
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t r0 = starts[g], rows = starts[g + 1] - r0;
    Problem q{};
    if (p.token_blocks) {
      // d[g] (n, k) = grad_t[:, tokens of g] @ x_t[:, tokens of g]^T: both row-major along the
      // tokens; group g's token blocks start at its first token, in scale column r0 / block + g.
      if (rows == 0 || p.n == 0 || p.k == 0) continue;
      q.a = Operand{a + r0, p.total, 1, p.a.dtype};
      q.b = Operand{b + r0, p.total, 1, p.b.dtype};
      q.m = p.n;
      q.n = p.k;
      q.k = rows;
      q.a_row0 = 0;
      q.sa = scale_source(p.a_scale_inv, p.a_block, 0);
      q.sb = scale_source(p.b_scale_inv, p.b_block, 0);
      const int64_t col0 = (p.token_block == kWhole ? 0 : r0 / p.token_block) + g;
      q.sa.col0 = col0;
      q.sb.col0 = col0;
      q.d_offset = g * p.n * p.k;
      q.ldd = p.k;
      q.bias_offset = -1;
    } else if (p.wgrad) {
      // d[g] (n, k) = grad_g^T (n x rows) @ x_g (rows x k): A = grad^T, B = x^T, both column-major.
      // A group without rows has been zeroed (fp8_grouped_gemm).
      if (rows == 0 || p.n == 0 || p.k == 0) continue;
      q.a = Operand{a + r0 * p.n, 1, p.n, p.a.dtype};
      q.b = Operand{b + r0 * p.k, 1, p.k, p.b.dtype};
      q.m = p.n;
      q.n = p.k;
      q.k = rows;
      q.a_row0 = 0;
      q.sa = scale_source(p.a_scale_inv, p.a_block, 0);
      q.sb = scale_source(p.b_scale_inv, p.b_block, 0);
      q.d_offset = g * p.n * p.k;
      q.ldd = p.k;
      q.bias_offset = -1;
    } else {
      if (rows == 0 || p.n == 0) continue;
      q.a = Operand{a + r0 * p.k, p.k, 1, p.a.dtype};
      q.b = Operand{b + g * p.n * p.k, p.k, 1, p.b.dtype};
      q.m = rows;
      q.n = p.n;
      q.k = p.k;
      q.a_row0 = r0;
      q.sa = scale_source(p.a_scale_inv, p.a_block, 0);
      q.sb = scale_source(p.b_scale_inv, p.b_block, g);
      q.d_offset = r0 * p.n;
      q.ldd = p.n;
      q.bias_offset = p.bias.defined() ? g * p.n : -1;
    }
    out.push_back(q);
  }
  return out;
}

// The K-block width promoted at once: the smaller block width, or the whole K (tensorwise, rowwise).
int64_t k_block(const GroupedGemmParams& p) {
  const int64_t g = std::min(p.a_block.cols, p.b_block.cols);
  return g == kWhole ? kWhole : std::max<int64_t>(1, g);
}

// Folding (as the block GEMM, gemm_block_cpu.cpp): power-of-two scales multiply the decoded
// operands exactly while packing, so the panels are a plain GEMM's and the micro-kernel sums all of
// K with no promotion per K-block (at most gemm_block::kMaxFoldExps exponents a panel).
using gemm_block::kMaxFoldExps;

// The K-block of each operand's scales, clamped to the problem's K.
int64_t a_bk(const Problem& q) { return std::min(q.sa.cols, std::max<int64_t>(q.k, 1)); }
int64_t b_bk(const Problem& q) { return std::min(q.sb.cols, std::max<int64_t>(q.k, 1)); }

// Whether scale `index` of `src` is a power of two 2^e (its exponent in *e) whose products with
// every nonzero finite value of `fp8` are normal floats (e4m3 magnitudes lie in [2^-9, 2^9),
// e5m2 in [2^-16, 2^16)), as the block GEMM requires for folding.
bool fold_exponent(const ScaleSource& src, int64_t index, DType fp8, int* e) {
  const int lo = fp8 == DType::kFloat8E4M3 ? -117 : -110;
  const int hi = fp8 == DType::kFloat8E4M3 ? 118 : 111;
  if (src.e8m0) {
    *e = static_cast<int>(static_cast<const uint8_t*>(src.data)[index]) - fp8::kE8M0Bias;
  } else {
    const uint32_t bits = fp8::bits_of(static_cast<const float*>(src.data)[index]);
    const uint32_t biased = bits >> 23;  // a set sign bit makes this >= 256
    if ((bits & 0x7fffffu) != 0 || biased == 0 || biased >= 255) return false;
    *e = static_cast<int>(biased) - fp8::kE8M0Bias;
  }
  return *e >= lo && *e <= hi;
}

// The exponent of a scale foldable() accepted.
int32_t scale_exponent(const ScaleSource& src, int64_t index) {
  if (src.e8m0) return static_cast<int32_t>(static_cast<const uint8_t*>(src.data)[index]) - fp8::kE8M0Bias;
  return static_cast<int32_t>(fp8::bits_of(static_cast<const float*>(src.data)[index]) >> 23) - fp8::kE8M0Bias;
}

// Whether every scale of both operands folds, and the blocks suit the packing (KC chunks and
// packing groups never cross a K-block).
bool foldable(const GroupedGemmParams& p, const KernelSet& ks, int64_t contraction) {
  for (const BlockLayout* l : {&p.a_block, &p.b_block}) {
    if (!(l->cols >= contraction || (ks.kc % l->cols == 0 && l->cols % ks.k_align == 0))) return false;
  }
  const int64_t min_bk = std::max<int64_t>(1, std::min({p.a_block.cols, p.b_block.cols, contraction}));
  if ((ceil_div(ks.kc, min_bk) + 1) * std::max(ks.mr, ks.nr) > kMaxFoldExps) return false;
  const auto all_fold = [](const TensorDesc& scale, const BlockLayout& l, int64_t grids, DType fp8) {
    const ScaleSource src = scale_source(scale, l, 0);
    int e;
    for (int64_t index = 0; index < grids * l.grid_rows * l.grid_cols; ++index) {
      if (!fold_exponent(src, index, fp8, &e)) return false;
    }
    return true;
  };
  const bool b_per_group = !p.wgrad;
  return all_fold(p.a_scale_inv, p.a_block, 1, p.a.dtype) &&
         all_fold(p.b_scale_inv, p.b_block, b_per_group ? p.groups : 1, p.b.dtype);
}

// Fold the scales of panel rows [row0, row0 + min(r, rows)) (their scale-grid rows) into one packed
// panel of the K chunk [pc, pc + kb); rows past the edge are zeros and keep exponent 0.
void fold_panel(gemm_block::FoldFn fold, const KernelSet& ks, int kpack, uint8_t* panel, const ScaleSource& src,
                int64_t row0, int64_t rows, int r, int64_t pc, int64_t kb, int64_t block_k) {
  int32_t exps[kMaxFoldExps];
  int64_t row_index[64];  // the scale-grid offset of each panel row (r <= 64)
  for (int i = 0; i < r; ++i) row_index[i] = ((row0 + i) / src.rows) * src.grid_cols + src.col0;
  const int64_t first = pc / block_k, blocks = ceil_div(pc + kb, block_k) - first;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t col = ((first + b) * block_k) / src.cols;
    for (int i = 0; i < r; ++i) exps[b * r + i] = i < rows ? scale_exponent(src, row_index[i] + col) : 0;
  }
  fold(panel, ks.elem_bytes, kb, r, kpack, exps, block_k);
}

template <typename Out>
void run(const GroupedGemmParams& p, const std::vector<Problem>& probs, const KernelSet& ks,
         gemm_block::PromoteFn promote, gemm_block::FoldFn fold) {
  using T = typename Out::storage;
  T* d = p.d.ptr<T>();
  const T* bias = p.bias.defined() ? p.bias.ptr<T>() : nullptr;
  const int mr = ks.mr, nr = ks.nr;
  TL_CHECK(mr <= 64 && nr <= 64, "fp8_grouped_gemm: register tile ", mr, "x", nr, " above 64x64");
  const int64_t g = k_block(p);

  double flops = 0;
  int64_t rows_total = 0;
  for (const Problem& q : probs) {
    flops += 2.0 * q.m * q.n * std::max<int64_t>(q.k, 1);
    rows_total += q.m;
  }
  constexpr double kMinParallelFlops = 1 << 22;
  const int threads = flops < kMinParallelFlops ? 1 : get_num_threads();
  const gemm::StoreTileFn<Out> store = ks.store.get<Out>(static_cast<size_t>(p.d.numel()) * sizeof(T));

  // The loops of the dense GEMM (gemm_cpu.cpp), per group: each KC chunk of a column tile of b[g]
  // is packed once per work item and serves every row block of it; each row block of `a` is packed
  // once per column tile (which is the whole N up to NC). Repacking b[g] per small row tile would
  // cost as much as the skewed groups' GEMMs. The fp32 totals of an item (rows x nt) stay within a
  // budget; items get fewer rows only so that every thread has some (a skewed group is split).
  const int64_t n_all = p.wgrad ? p.k : p.n;  // the columns of every problem
  int64_t nt = round_up(std::min<int64_t>(std::max<int64_t>(ks.nc / nr * nr, nr), n_all), nr);
  const int64_t mt = std::max<int64_t>(round_up(std::min<int64_t>(ks.mc, 512), mr), mr);
  constexpr int64_t kTotalsBudget = int64_t{4} << 20;  // floats: 16 MiB
  int64_t chunk = std::max<int64_t>(mt, kTotalsBudget / nt / mt * mt);
  if (threads > 1) chunk = std::min(chunk, std::max<int64_t>(mt, round_up(ceil_div(rows_total, 4 * threads), mt)));
  const auto count_items = [&](int64_t cols) {
    int64_t items = 0;
    for (const Problem& q : probs) items += ceil_div(q.m, chunk) * ceil_div(q.n, cols);
    return items;
  };
  while (nt > nr && count_items(nt) < threads) nt = round_up(nt / 2, nr);
  std::vector<WorkItem> items;
  items.reserve(count_items(nt));
  for (int64_t w = 0; w < static_cast<int64_t>(probs.size()); ++w) {
    for (int64_t i0 = 0; i0 < probs[w].m; i0 += chunk) {
      for (int64_t j0 = 0; j0 < probs[w].n; j0 += nt) {
        items.push_back(WorkItem{w, i0, std::min(chunk, probs[w].m - i0), j0});
      }
    }
  }
  // The largest items first, each thread claiming the next: a descheduled thread or a skewed
  // group holds the others up by one item at most.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
    return x.rows * probs[x.problem].k > y.rows * probs[y.problem].k;
  });
  int64_t rows_max = 0;
  for (const WorkItem& item : items) rows_max = std::max(rows_max, item.rows);
  const int64_t item_count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};

  const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, item_count)));
  parallel_for(workers, workers, 1, [&](int64_t, int64_t) {
    const int64_t kc_max = ks.kc;
    Buffer a_buffer = aligned_buffer(ceil_div(mt, mr) * ks.panel_bytes(kc_max, mr), "fp8_grouped_gemm");
    Buffer b_buffer = aligned_buffer(ceil_div(nt, nr) * ks.panel_bytes(kc_max, nr), "fp8_grouped_gemm");
    // Not initialized: each K chunk but the first adds to what the one before wrote.
    Buffer totals_buffer =
        aligned_buffer(static_cast<size_t>(round_up(rows_max, mr) * nt) * sizeof(float), "fp8_grouped_gemm");
    float* totals = reinterpret_cast<float*>(totals_buffer.get());
    alignas(64) float part[64 * 64];  // mr * nr <= 64 * 64 for every KernelSet
    // The scales of one KC chunk, looked up once per chunk rather than per micro-tile: the
    // rows of a row block (and the columns of the tile) for each promotion step, 0 past the edge.
    const int64_t steps_max = std::max<int64_t>(1, ceil_div(ks.kc, std::min<int64_t>(g, ks.sum_k())));
    const int64_t mt_pad = round_up(mt, mr), nt_pad = round_up(nt, nr);
    std::vector<float> sa_table(static_cast<size_t>(steps_max * mt_pad));
    std::vector<float> sb_table(static_cast<size_t>(steps_max * nt_pad));
    for (int64_t w = next++; w < item_count; w = next++) {
      const WorkItem& item = items[w];
      const Problem& q = probs[item.problem];
      const int64_t rows = item.rows, nb = std::min(nt, q.n - item.j0);
      // Partial sums are promoted every `step` k: each K-block, or every run of the kernel's sum_k()
      // when one block covers K (tensorwise, rowwise, the tensorwise weight gradient).
      // Folded (power-of-two scales multiplied into the packed panels): unit scales, one sum over K.
      const bool folded = fold != nullptr;
      const bool whole_k = folded || g >= q.k;
      const int64_t step = whole_k ? std::min<int64_t>(std::max<int64_t>(q.k, 1), ks.sum_k()) : g;
      const int64_t kc = ks.kc / step * step;
      const T* tile_bias = q.bias_offset >= 0 ? bias + q.bias_offset + item.j0 : nullptr;
      for (int64_t pc = 0; pc < q.k; pc += kc) {
        const int64_t kb = std::min(kc, q.k - pc);
        const bool last = pc + kb == q.k;
        const size_t a_panel_bytes = ks.panel_bytes(kb, mr), b_panel_bytes = ks.panel_bytes(kb, nr);
        ks.pack_b(sub_operand(q.b, item.j0, pc), nb, kb, nr, b_buffer.get());
        const int64_t steps = ceil_div(kb, step);
        std::fill(sb_table.begin(), sb_table.end(), 0.0f);
        for (int64_t t = 0; t < steps; ++t) {
          for (int64_t j = 0; j < nb; ++j) {
            sb_table[t * nt_pad + j] = folded ? 1.0f : q.sb.at(item.j0 + j, pc + t * step);
          }
        }
        for (int64_t jr = 0; folded && jr < nb; jr += nr) {
          fold_panel(fold, ks, ks.kpack_b(), b_buffer.get() + (jr / nr) * b_panel_bytes, q.sb, item.j0 + jr, nb - jr,
                     nr, pc, kb, b_bk(q));
        }
        for (int64_t ic = 0; ic < rows; ic += mt) {
          const int64_t mb = std::min(mt, rows - ic);
          const int64_t i0 = item.i0 + ic;  // the block's first row in the group
          ks.pack_a(sub_operand(q.a, i0, pc), mb, kb, mr, a_buffer.get());
          std::fill(sa_table.begin(), sa_table.end(), 0.0f);
          for (int64_t t = 0; t < steps; ++t) {
            for (int64_t i = 0; i < mb; ++i) {
              sa_table[t * mt_pad + i] = folded ? 1.0f : q.sa.at(q.a_row0 + i0 + i, pc + t * step);
            }
          }
          for (int64_t ir = 0; folded && ir < mb; ir += mr) {
            fold_panel(fold, ks, ks.kpack_a(), a_buffer.get() + (ir / mr) * a_panel_bytes, q.sa, q.a_row0 + i0 + ir,
                       mb - ir, mr, pc, kb, a_bk(q));
          }
          if (ks.prepare) ks.prepare();
          for (int64_t jr = 0; jr < nb; jr += nr) {
            const uint8_t* b_panel = b_buffer.get() + (jr / nr) * b_panel_bytes;
            const T* panel_bias = tile_bias ? tile_bias + jr : nullptr;
            for (int64_t ir = 0; ir < mb; ir += mr) {
              const uint8_t* a_panel = a_buffer.get() + (ir / mr) * a_panel_bytes;
              // The tile's fp32 total: in `totals` across K chunks; the last chunk's tile goes
              // from the stack (or from `totals`, still in cache) straight to d.
              float* acc = totals + (ic + ir) * nt + jr;
              int64_t ld_acc = nt;
              if (whole_k) {
                // One scale over all of K: the micro-kernel accumulates the chunks' sums in place
                // (as the dense GEMM does), and the last chunk's tile is scaled once on its way out.
                const float* c_in = pc == 0 ? nullptr : acc;
                if (!last) {
                  micro_runs(ks, kb, a_panel, b_panel, c_in, nt, acc, nt);
                  continue;
                }
                micro_runs(ks, kb, a_panel, b_panel, c_in, nt, part, nr);
                promote(part, nr, sa_table.data() + ir, sb_table.data() + jr, mr, nr, true, part, nr);
                acc = part;
                ld_acc = nr;
              } else {
                for (int64_t t = 0; t < steps; ++t) {
                  // Packed panels store k in order: a sub-panel at k offset s0 starts s0 * rows
                  // elements in (step is a multiple of the kernel's k_align, see fp8_grouped_gemm).
                  const int64_t s0 = t * step;
                  ks.micro(std::min(step, kb - s0), a_panel + s0 * mr * ks.elem_bytes,
                           b_panel + s0 * nr * ks.elem_bytes, nullptr, 0, part, nr);
                  promote(part, nr, sa_table.data() + t * mt_pad + ir, sb_table.data() + t * nt_pad + jr, mr, nr,
                          pc == 0 && t == 0, acc, nt);
                }
              }
              if (last) {
                store(acc, ld_acc, std::min<int64_t>(mr, mb - ir), std::min<int64_t>(nr, nb - jr), 1.0f,
                      panel_bias, false, d + q.d_offset + (i0 + ir) * q.ldd + item.j0 + jr, q.ldd);
              }
            }
          }
        }
      }
      if (q.k == 0) {  // an empty contraction: d = bias (or 0)
        std::fill(totals, totals + rows * nt, 0.0f);
        store_tile<Out>(totals, nt, rows, nb, 1.0f, tile_bias, false, d + q.d_offset + item.i0 * q.ldd + item.j0,
                        q.ldd);
      }
    }
  });
}

}  // namespace

void fp8_grouped_gemm(const GroupedGemmParams& p) {
  const char* op = p.wgrad ? "fp8_grouped_gemm_wgrad" : "fp8_grouped_gemm";
  const std::vector<int64_t> starts = group_starts(p, op);
  const size_t elem = static_cast<size_t>(element_size(p.d.dtype));
  advise_huge_pages(p.d.data, static_cast<size_t>(p.d.numel()) * elem);
  if (p.wgrad) {
    // Groups without rows (and every group when K or N is 0) are zeros: written here, the rest below.
    for (int64_t g = 0; g < p.groups; ++g) {
      if (starts[g + 1] == starts[g] && p.n * p.k > 0) {
        std::memset(static_cast<uint8_t*>(p.d.data) + g * p.n * p.k * elem, 0, p.n * p.k * elem);
      }
    }
  } else if (p.n > 0 && starts[p.groups] < p.total) {
    // Rows past the last group belong to none: zeros (torch._grouped_mm leaves them unspecified).
    std::memset(static_cast<uint8_t*>(p.d.data) + starts[p.groups] * p.n * elem, 0,
                (p.total - starts[p.groups]) * p.n * elem);
  }
  const std::vector<Problem> probs = problems(p, starts);
  if (probs.empty()) return;
  KernelSet ks = gemm::kernels_for(current_isa());
  // Sub-panels start at multiples of the K-block: it must keep whole k-groups of the packing.
  const int64_t g = k_block(p);
  const int64_t contraction = p.wgrad ? p.total : p.k;
  if (g < contraction && (g % ks.k_align != 0 || g > ks.kc)) ks = gemm::generic_kernels();
  gemm_block::PromoteFn promote = gemm_block::promote_generic;
  gemm_block::FoldFn fold = gemm_block::fold_generic;
  const Isa isa = current_isa();
  if (isa == Isa::kAvx2) {
    promote = gemm_block::promote_avx2();
    fold = gemm_block::fold_avx2();
  } else if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) {
    promote = gemm_block::promote_avx512();
    fold = gemm_block::fold_avx512();
  }
  dispatch_high_precision(p.d.dtype, "fp8_grouped_gemm: argument 'd'", [&](auto out_tag) {
    run<decltype(out_tag)>(p, probs, ks, promote, foldable(p, ks, contraction) ? fold : nullptr);
  });
}

}  // namespace cpu
}  // namespace tl
