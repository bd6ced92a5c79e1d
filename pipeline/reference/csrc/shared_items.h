// Work items shared by the threads of a team (csrc/fused_layers.cpp runs a whole forward as one): the items of one
// phase (a GEMM's channel groups, the attention's work items, rows) are taken in chunks from a counter that every
// thread of the team reads, and counted when finished, so a thread that lost its core to another process delays a
// phase by at most the chunk it holds: the others take the rest. Which thread computes an item never changes a bit.
//
// A phase's counters are one 64-byte row of a team's int64 ticket tensor [phases, 8]: [0] the next item to take,
// [1] the items finished, [2] the phase's item count (every caller writes the same), [3..6] the items taken from the other
// threads' ranges (`take_ranges`; range 0 counts in [0]). cpp_ops inlines this file into
// the sources that include it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

struct SharedItems {
  static constexpr int64_t NEXT = 0, FINISHED = 1, COUNT = 2;
  int64_t* row;

  // The counters of phase `phase` in a team's tickets, checked (`op` names the caller in the error).
  static SharedItems of(const at::Tensor& tickets, int64_t phase, const char* op) {
    TORCH_CHECK(tickets.scalar_type() == at::kLong && tickets.is_contiguous() && tickets.dim() == 2
                && tickets.size(1) == 8 && 0 <= phase && phase < tickets.size(0), op, ": tickets must be contiguous "
                "int64 [phases, 8] with a row for phase ", phase);
    return {tickets.data_ptr<int64_t>() + phase * 8};
  }

  // A team op's output, which each thread writes its items into, checked: contiguous float32 [rows, cols].
  static void check_output(const at::Tensor& out, int64_t rows, int64_t cols, const char* op) {
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows
                && out.size(1) == cols, op, ": out must be contiguous float32 [", rows, ", ", cols, "]");
  }

  // f(begin, end) for chunks of up to `chunk` of the phase's `count` items until none is left, each counted as
  // finished after f returns: `take_ranges` with one range, the whole phase's.
  template <typename F>
  void take(int64_t count, int64_t chunk, const F& f) const {
    take_ranges(count, chunk, 0, 1, f);
  }

  // As `take`, for a GEMM's channel groups: thread `thread` of the team's `threads` (at most RANGES ranges) first takes
  // the items of its own contiguous range of the `count`, in order, then what is left of the others' ranges, each
  // range's items claimed from its own counter (range 0's in row[NEXT], range r's in row[2 + r]). Each core then
  // streams one long run of a weight, where one shared counter interleaved the threads' groups: SmolLM2's one-row
  // forward took 0.88x the time in the minutes when this host lets two cores read twice what one does, 0.96x in the
  // others (docs/benchmarks.md).
  static constexpr int64_t RANGES = 5;
  template <typename F>
  void take_ranges(int64_t count, int64_t chunk, int64_t thread, int64_t threads, const F& f) const {
    __atomic_store_n(row + COUNT, count, __ATOMIC_RELAXED);
    const int64_t ranges = ranges_for(threads);
    for (int64_t k = 0; k < ranges; ++k) {
      const int64_t r = (thread + k) % ranges;
      const int64_t first = range_begin(count, r, ranges), last = range_begin(count, r + 1, ranges);
      int64_t* taken = row + (r == 0 ? NEXT : 2 + r);
      for (int64_t begin = first + __atomic_fetch_add(taken, chunk, __ATOMIC_RELAXED); begin < last;
           begin = first + __atomic_fetch_add(taken, chunk, __ATOMIC_RELAXED)) {
        const int64_t end = begin + chunk < last ? begin + chunk : last;
        f(begin, end);
        __atomic_fetch_add(row + FINISHED, end - begin, __ATOMIC_RELEASE);
      }
    }
    if (ranges > 1) __atomic_store_n(row + NEXT, count, __ATOMIC_RELAXED);  // every item taken: `exhausted`
  }

  // f(begin, end) for the rows [begin, end) of a row phase of `rows` rows this thread takes: one row at a time where a
  // team's GEMMs split their channels over the threads, ROW_CHUNK rows at a time, each thread its own contiguous
  // range of chunks first (`take_ranges`), where they split their rows (`splits_rows`), so that a thread finds the
  // rows it works on in its own cache: the rows a GEMM of its gave it, and those it gives the next one.
  template <typename F>
  void take_rows(int64_t rows, int64_t amx_min_rows, int64_t thread, int64_t threads, const F& f) const {
    if (!splits_rows(rows, amx_min_rows)) return take(rows, 1, f);
    take_ranges((rows + ROW_CHUNK - 1) / ROW_CHUNK, 1, thread, threads, [&](int64_t c0, int64_t c1) {
      f(c0 * ROW_CHUNK, c1 * ROW_CHUNK < rows ? c1 * ROW_CHUNK : rows);
    });
  }

  // Whether a team's int8 GEMMs of `rows` rows split them over the threads in chunks of ROW_CHUNK (each thread reads
  // the whole weight for its rows: arithmetic, not the weight's bytes, bounds such a call), not their output channels,
  // which left every row of the next row phase half in the other core's cache: on AMD Zen4 a 326-token prompt 3-8%
  // faster, eight of them 7-9% (docs/benchmarks.md). Not where AMX tiles run (amx_min_rows > 0: its 16-row tiles
  // were not measured so).
  static constexpr int64_t ROW_CHUNK = 12, SPLIT_ROWS_FROM = 24;
  static bool splits_rows(int64_t rows, int64_t amx_min_rows) { return amx_min_rows == 0 && rows >= SPLIT_ROWS_FROM; }

  // How many ranges `take_ranges` splits a phase into for a team of `threads`; range r's first item of `count`.
  static int64_t ranges_for(int64_t threads) { return threads < 1 ? 1 : (threads < RANGES ? threads : RANGES); }
  static int64_t range_begin(int64_t count, int64_t r, int64_t ranges) { return count * r / ranges; }

  // Whether any item is left to take (a caller that finds none can skip its preparation).
  bool exhausted() const {
    const int64_t count = __atomic_load_n(row + COUNT, __ATOMIC_RELAXED);
    return count > 0 && __atomic_load_n(row + NEXT, __ATOMIC_RELAXED) >= count;
  }

  // Whether every item of the phase is finished, its results visible to this thread (a caller of `take` has set
  // the count).
  bool finished() const {
    return __atomic_load_n(row + FINISHED, __ATOMIC_ACQUIRE) == __atomic_load_n(row + COUNT, __ATOMIC_RELAXED);
  }
};
