// The work items of one row attention call, its two entry points and write_and_attend's checks of the new tokens, for
// the kernels over a float32 cache (row_attention.cpp) and over a bf16 one (row_attention_bf16.cpp): the same plan
// whatever the cache holds. cpp_ops inlines this file into the
// sources that include it, one level deep: they include shared_items.h first.
//
// An item is up to ROWS_PER_ITEM consecutive rows with the same start (a sequence's new tokens) times one KV head
// (or part of its query heads, below); an item's pairs share their key and value loads. A prefill's rows split into
// many items, so its score scratch stays in the cache, a row computes no scores past its own keys' block, and every
// thread gets work.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

constexpr int64_t ROWS_PER_ITEM = 16;  // rows of one sequence per work item (a verify's rows: one item)

struct RowItems {
  at::Tensor q, slots, starts, lengths;
  int64_t R, H, D, KVH, group;
  std::vector<int64_t> first;  // first row of each row group, then R
  std::vector<int64_t> order;  // the items, longest keys first (a prefill's later rows cost more)
  int64_t parts, heads_per_part, per_group, items;

  // One item's rows [row_begin, row_end), its KV head and its query heads [h0, h1).
  struct Item {
    int64_t row_begin, row_end, kv_head, h0, h1;
  };

  // q float32 [R, H, D] over a cache of `num_slots` slots of `kv_heads` KV heads of size D; row r attends over the
  // keys at slots[starts[r] : starts[r] + lengths[r]] (int64); the items planned for `threads` threads. `op` names
  // the caller in errors.
  RowItems(at::Tensor q_, int64_t kv_heads, int64_t head_size, int64_t num_slots, at::Tensor slots_,
           at::Tensor starts_, at::Tensor lengths_, int64_t threads, const char* op)
      : q(q_.contiguous()), slots(slots_.contiguous()), starts(starts_.contiguous()), lengths(lengths_.contiguous()) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, op, ": q must be float32 [rows, heads, head_size]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong
                && lengths.scalar_type() == at::kLong, op, ": slots, starts and lengths must be int64");
    R = q.size(0), H = q.size(1), D = q.size(2), KVH = kv_heads;
    TORCH_CHECK(head_size == D && D % 16 == 0 && D <= 256, op, ": head_size ", D,
                " must match the cache and be a multiple of 16, at most 256");
    TORCH_CHECK(H % KVH == 0, op, ": ", H, " query heads over ", KVH, " KV heads");
    TORCH_CHECK(starts.numel() == R && lengths.numel() == R, op, ": one start and one length per row");
    group = H / KVH;
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    const int64_t* ln = lengths.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, op, ": slot ", sp[i], " is not in the cache");
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(ln[r] > 0 && st[r] >= 0 && st[r] + ln[r] <= slots.numel(), op, ": row ", r,
                  "'s keys are out of range");
    for (int64_t r = 0; r < R; ++r)
      if (r == 0 || st[r] != st[r - 1] || r - first.back() == ROWS_PER_ITEM) first.push_back(r);
    first.push_back(R);
    // A verify of one or two sequences gives fewer items than twice the threads (SmolLM2: 3 KV heads on 2 threads,
    // one thread idle a third of the time): then a KV head's query heads split into parts, each an item. A part
    // re-reads its KV head's keys, which paid for verify rows and not for a single row (docs/benchmarks.md); a pair's
    // result does not depend on the other pairs of its item, so the bits stay.
    const int64_t row_groups = int64_t(first.size()) - 1;
    const int64_t wanted = row_groups * KVH >= 2 * threads || R == row_groups ? 1
                           : std::min(group, (2 * threads + row_groups * KVH - 1) / (row_groups * KVH));
    heads_per_part = (group + wanted - 1) / wanted, parts = (group + heads_per_part - 1) / heads_per_part;
    per_group = KVH * parts;  // items per row group
    items = row_groups * per_group;
    // handed out one at a time, longest keys first: which thread computes a row never changes its bits
    order.resize(items);
    for (int64_t u = 0; u < items; ++u) order[u] = u;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return ln[first[a / per_group + 1] - 1] > ln[first[b / per_group + 1] - 1];
    });
  }

  // The i-th item handed out.
  Item item(int64_t i) const {
    const int64_t u = order[i], gi = u / per_group, g = u % per_group / parts, part = u % parts;
    const int64_t h0 = g * group + part * heads_per_part;
    return {first[gi], first[gi + 1], g, h0, std::min((g + 1) * group, h0 + heads_per_part)};
  }
};

// The two entry points of a kernel whose Call (a RowItems with `work(items, out)`) is built from (q, k, v, slots,
// starts, lengths, scale, threads, op): `op` names the caller in errors.
// attend_rows: the call on torch's threads -> [R, H * D].
template <typename Call>
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                       const at::Tensor& starts, const at::Tensor& lengths, double scale, const char* op) {
  const int64_t threads = at::get_num_threads();
  const Call call(q, k, v, slots, starts, lengths, scale, threads, op);
  const at::Tensor out = at::empty({call.R, call.H * call.D}, call.q.options());
  int64_t tickets[8] = {};  // this call's shared items (shared_items.h)
  at::parallel_for(0, std::min<int64_t>(call.items, threads), 1,
                   [&](int64_t, int64_t) { call.work(SharedItems{tickets}, out.data_ptr<float>()); });
  return out;
}

// attend_rows_into: into out [R, H * D] by the threads of a team of `threads` (csrc/fused_layers.cpp), each calling
// it with the same arguments: every caller plans the same work items and takes them from the phase `phase` of
// `tickets` (shared_items.h); a row's bits do not depend on which thread computes it.
template <typename Call>
void attend_rows_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                      const at::Tensor& starts, const at::Tensor& lengths, double scale, const at::Tensor& out,
                      const at::Tensor& tickets, int64_t phase, int64_t threads, const char* op) {
  const SharedItems items = SharedItems::of(tickets, phase, op);
  if (items.exhausted()) return;  // the other threads took every item
  const Call call(q, k, v, slots, starts, lengths, scale, threads, op);
  SharedItems::check_output(out, call.R, call.H * call.D, op);
  call.work(items, out.data_ptr<float>());
}

// write_and_attend's new tokens, checked before the cache changes: their keys and values k_new, v_new float32
// [T, KVH, D] (each row contiguous, rows at any stride) and their slots new_slots int64 [T] in a cache of `num_slots`
// slots. -> new_slots, contiguous.
inline at::Tensor checked_new_tokens(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& new_slots,
                                     int64_t KVH, int64_t D, int64_t num_slots, const char* op) {
  const int64_t T = new_slots.numel();
  for (const at::Tensor& x : {k_new, v_new})
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(0) == T && x.size(1) == KVH && x.size(2) == D
                && x.stride(2) == 1 && x.stride(1) == D, op, ": k_new and v_new must be float32 [new_slots, kv_heads, "
                "head_size], each row contiguous");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.dim() == 1, op, ": new_slots must be int64 [T]");
  at::Tensor slots = new_slots.contiguous();
  const int64_t* ns = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ns[t] >= 0 && ns[t] < num_slots, op, ": slot ", ns[t], " is not in the cache");
  return slots;
}
