// Row attention: every query row attends over its own list of cache slots, in one fixed order.
//
// A row's result is a function of its query and its keys only (each query head's scores in slot order, each a
// dot product in one fixed order; the softmax's maximum and sum in slot order; the weighted values in slot
// order), so it never depends on the other rows of the call, their count or the thread count: a verify row and a
// plain decode step of the same token get the same bits by construction. What rows share is work, not
// arithmetic: the rows of one sequence (the same slot list) and the query heads of one KV head read each key and
// value once per call, 16 keys at a time transposed in registers, and the next keys are prefetched. The bits are
// those of the earlier one-key-at-a-time kernel (16-lane multiply-adds, then _mm512_reduce_add_ps's tree), which
// the int8_sq engines' greedy texts depend on: their per-token activation rounding turns any last-bit change
// of attention into different texts. Python side and the numbers: pipeline/reference/row_attention.py.
//
// The source builds twice: with AVX-512 (the kernel above, ops row_attention and write_and_attend) and with AVX2
// only (ops row_attention_avx2 and write_and_attend_avx2), for CPUs such as AMD Zen3. The AVX2 kernel has its own
// arithmetic, fixed just the same: each score a dot product over 8-lane fma chains then a fixed horizontal sum, the
// softmax's maximum and sum in slot order, the weighted values in slot order; the rows of one sequence and the
// query heads of one KV head read each key once (every pair's scores for a block of 8 keys while it is in L1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exp_approx.h"
#include "shared_items.h"
#include "row_items.h"

namespace {

#ifdef __AVX512F__
#define OP_NAME(name) name
#else
#define OP_NAME(name) name "_avx2"
#endif

constexpr int LANES = 16;
constexpr int MAX_HEAD_SIZE = 256;

#ifdef __AVX512F__
// out[t][d] = rows[d][t]: 16 x 16 floats in registers (unpack, shuffle, then two 128-bit lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

constexpr int QK_PAIRS = 4;  // pairs per score block: 4 x 4 partial sums of 16 keys
constexpr int PV_PAIRS = 6;  // pairs per value block: 6 x 4 accumulators + 4 value registers

// Scores of P pairs over 16 transposed keys kt [D][16] (keys t >= nk, outside mask, are not stored), each with the
// arithmetic of a dot product over 16-lane chunks: lane l sums q[16c + l] * k[16c + l] over the chunks c in order
// by fused multiply-adds from 0, then the 16 lane sums add up in _mm512_reduce_add_ps's tree (lane l + lane l + 8,
// then + 4, then + 2, then + 1), then times scale.
template <int P>
void qk_block(const float* const* q, const float* kt, int64_t chunks, float scale, __mmask16 mask, float* const* s) {
  // lanes l and l + 8 of every pair at once: one load of each transposed key column serves the P pairs, and the
  // 2P chains (each lane's sums over the chunks in order, from 0) keep the FMA units busy
  auto two_lanes = [&](int l, __m512* sum) {
    __m512 a[P], b[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) a[p] = _mm512_setzero_ps(), b[p] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 ka = _mm512_load_ps(kt + (c * LANES + l) * LANES), kb = _mm512_load_ps(kt + (c * LANES + l + 8) * LANES);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        a[p] = _mm512_fmadd_ps(_mm512_set1_ps(q[p][c * LANES + l]), ka, a[p]);
        b[p] = _mm512_fmadd_ps(_mm512_set1_ps(q[p][c * LANES + l + 8]), kb, b[p]);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) sum[p] = _mm512_add_ps(a[p], b[p]);
  };
  // quarter i = (lane i + lane i + 8) + (lane i + 4 + lane i + 12); the sum = (quarter 0 + quarter 2) + (quarter 1 + quarter 3)
  auto quarter = [&](int i, __m512* out) {
    __m512 x[P], y[P];
    two_lanes(i, x);
    two_lanes(i + 4, y);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) out[p] = _mm512_add_ps(x[p], y[p]);
  };
  __m512 q0[P], q2[P], s02[P];
  quarter(0, q0);
  quarter(2, q2);
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) s02[p] = _mm512_add_ps(q0[p], q2[p]);
  quarter(1, q0);
  quarter(3, q2);
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const __m512 sum = _mm512_add_ps(s02[p], _mm512_add_ps(q0[p], q2[p]));
    _mm512_mask_storeu_ps(s[p], mask, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
  }
}

// out[p][c0 * 16 ...] for up to 4 chunks from c0: P pairs' probabilities e[p][j] (j < len[p]) times the values,
// in slot order, divided by the pairs' sums.
template <int P>
void pv_block(const float* const* e, const int64_t* len, const float* inv_sum, const float* v, const int64_t* slots,
              int64_t kv_stride, int64_t c0, int64_t cn, float* const* out) {
  int64_t shortest = len[0], longest = len[0];
  for (int p = 1; p < P; ++p) shortest = std::min(shortest, len[p]), longest = std::max(longest, len[p]);
  __m512 acc[P][4];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_setzero_ps();
  const __mmask16 m[4] = {__mmask16(cn > 0 ? 0xFFFF : 0), __mmask16(cn > 1 ? 0xFFFF : 0), __mmask16(cn > 2 ? 0xFFFF : 0),
                          __mmask16(cn > 3 ? 0xFFFF : 0)};
  // key j's values into the pairs that take it (`takes(p)`)
  auto add_key = [&](int64_t j, auto takes) {
    const float* vj = v + slots[j] * kv_stride + c0 * LANES;
    __m512 vc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) vc[c] = _mm512_maskz_loadu_ps(m[c], vj + c * LANES);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      if (!takes(p)) continue;
      const __m512 w = _mm512_set1_ps(e[p][j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_fmadd_ps(w, vc[c], acc[p][c]);
    }
  };
  // every pair takes keys [0, shortest): no per-pair test in that loop (the accumulators stay in registers)
  for (int64_t j = 0; j < shortest; ++j) add_key(j, [](int) { return true; });
  for (int64_t j = shortest; j < longest; ++j) add_key(j, [&](int p) { return j < len[p]; });  // the longer rows' last keys
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)  // constant indices: a runtime one would keep acc in memory
      if (c < cn) _mm512_storeu_ps(out[p] + (c0 + c) * LANES, _mm512_mul_ps(acc[p][c], _mm512_set1_ps(inv_sum[p])));
}

// n (row, query head) pairs over one KV head: pair p's query q[p] [D] attends over the keys at slots[0 : len[p]],
// its result goes to out[p] [D]. A pair's arithmetic is its own (its scores, its softmax's maximum and sum, its
// weighted values, each in slot order); the pairs share only the loads of the keys and values.
// s: scratch [n][longest rounded up to 16]; kt: scratch [D][16], 64-byte aligned.
void kv_head(int64_t n, const float* const* q, const int64_t* len, float* const* out, const float* k, const float* v,
             const int64_t* slots, int64_t kv_stride, int64_t D, float scale, float* s, int64_t s_stride, float* kt) {
  int64_t longest = 0;
  for (int64_t p = 0; p < n; ++p) longest = std::max(longest, len[p]);
  const int64_t chunks = D / LANES;
  std::vector<float*> sp(n), sj(n);  // each pair's scores; from the current key block on
  for (int64_t p = 0; p < n; ++p) sp[p] = s + p * s_stride;
  for (int64_t j0 = 0; j0 < longest; j0 += LANES) {  // scores, 16 keys at a time
    const int64_t nk = std::min<int64_t>(LANES, longest - j0);
    const __mmask16 mask = nk == LANES ? __mmask16(0xFFFF) : __mmask16((1u << nk) - 1);
    // the next block's keys and this block's values on their way in (a plain step's keys come from memory: the
    // weights streamed through the caches since the layer's last step; measured 0.4-1.3 ms a SmolLM2 step). Into
    // L2, not L1 (_MM_HINT_T0): SmolLM2's 30 layers of one row over 600 / 900 keys took 1.46 / 2.79 ms with the
    // keys prefetched into L1, 1.18 / 1.83 ms into L2 (Zen4, docs/benchmarks.md); equal at 300 keys.
    for (int64_t t = j0 + LANES; t < std::min(longest, j0 + 2 * LANES); ++t)
      for (int64_t c = 0; c < chunks; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(k + slots[t] * kv_stride + c * LANES), _MM_HINT_T1);
    for (int64_t t = j0; t < j0 + nk; ++t)
      for (int64_t c = 0; c < chunks; ++c) _mm_prefetch(reinterpret_cast<const char*>(v + slots[t] * kv_stride + c * LANES), _MM_HINT_T1);
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 r[LANES];
      for (int t = 0; t < LANES; ++t)
        r[t] = t < nk ? _mm512_loadu_ps(k + slots[j0 + t] * kv_stride + c * LANES) : _mm512_setzero_ps();
      transpose16(r);
      for (int d = 0; d < LANES; ++d) _mm512_store_ps(kt + (c * LANES + d) * LANES, r[d]);
    }
    for (int64_t p = 0; p < n; ++p) sj[p] = sp[p] + j0;
    for (int64_t p0 = 0; p0 < n; p0 += QK_PAIRS) {
      float* const* so = sj.data() + p0;
      const float* const* qo = q + p0;
      switch (std::min<int64_t>(QK_PAIRS, n - p0)) {
        case 1: qk_block<1>(qo, kt, chunks, scale, mask, so); break;
        case 2: qk_block<2>(qo, kt, chunks, scale, mask, so); break;
        case 3: qk_block<3>(qo, kt, chunks, scale, mask, so); break;
        default: qk_block<4>(qo, kt, chunks, scale, mask, so); break;
      }
    }
  }
  std::vector<float> inv_sum(n);
  for (int64_t p = 0; p < n; ++p) {  // softmax numerators in place, their sum
    float* e = sp[p];
    const int64_t length = len[p];
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < length; j += LANES) {
      const __mmask16 m = length - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
      best = _mm512_mask_max_ps(best, m, best, _mm512_maskz_loadu_ps(m, e + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j += LANES) {
      const __mmask16 m = length - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
      const __m512 x = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, e + j), top));
      _mm512_mask_storeu_ps(e + j, m, x);
      sum = _mm512_mask_add_ps(sum, m, sum, x);
    }
    inv_sum[p] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {  // weighted values, 4 chunks of up to 6 pairs at a time
    const int64_t cn = std::min<int64_t>(4, chunks - c0);
    for (int64_t p0 = 0; p0 < n; p0 += PV_PAIRS) {
      const float* const* eo = sp.data() + p0;
      float* const* oo = out + p0;
      switch (std::min<int64_t>(PV_PAIRS, n - p0)) {
        case 1: pv_block<1>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
        case 2: pv_block<2>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
        case 3: pv_block<3>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
        case 4: pv_block<4>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
        case 5: pv_block<5>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
        default: pv_block<6>(eo, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0, cn, oo); break;
      }
    }
  }
}

#else  // AVX2

// The 8 lanes' sum in one fixed tree: halves, then pairs, then the last two.
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes [0, n) of 8 set (n may exceed 8).
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

constexpr int PV_PAIRS = 3;  // pairs per value block: 3 x 4 accumulators, 3 weights and a value register

// out[p][c0 * 8 ...] for C chunks of 8 from c0: P pairs' probabilities e[p][j] (j < len[p]) times the values, in
// slot order from 0 by fmas, times the pair's inverse sum. The pairs share each value load: a KV head's values are
// read once per C chunks for up to 3 pairs, where a pair at a time re-read them from L2 for each query head
// (SmolLM2's 600 keys: 154 KB a KV head; half of a row's attention time, perf).
template <int P, int C>
void pv_block(const float* const* e, const int64_t* len, const float* inv_sum, const float* v, const int64_t* slots,
              int64_t kv_stride, int64_t c0, float* const* out) {
  int64_t shortest = len[0], longest = len[0];
  for (int p = 1; p < P; ++p) shortest = std::min(shortest, len[p]), longest = std::max(longest, len[p]);
  __m256 acc[P][C];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[p][c] = _mm256_setzero_ps();
  // key j's values into the pairs that take it (`takes(p)`)
  auto add_key = [&](int64_t j, auto takes) {
    const float* vj = v + slots[j] * kv_stride + c0 * 8;
    __m256 w[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) w[p] = _mm256_broadcast_ss(e[p] + j);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256 vc = _mm256_loadu_ps(vj + c * 8);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        if (takes(p)) acc[p][c] = _mm256_fmadd_ps(w[p], vc, acc[p][c]);
    }
  };
  // every pair takes keys [0, shortest): no per-pair test in that loop (the accumulators stay in registers)
  for (int64_t j = 0; j < shortest; ++j) add_key(j, [](int) { return true; });
  // the longer rows' last keys
  for (int64_t j = shortest; j < longest; ++j) add_key(j, [&](int p) { return j < len[p]; });
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(out[p] + (c0 + c) * 8, _mm256_mul_ps(acc[p][c], _mm256_set1_ps(inv_sum[p])));
}

// pv_block for pn <= PV_PAIRS pairs.
template <int C>
void pv_pairs(int64_t pn, const float* const* e, const int64_t* len, const float* inv_sum, const float* v,
              const int64_t* slots, int64_t kv_stride, int64_t c0, float* const* out) {
  if (pn == 1) pv_block<1, C>(e, len, inv_sum, v, slots, kv_stride, c0, out);
  else if (pn == 2) pv_block<2, C>(e, len, inv_sum, v, slots, kv_stride, c0, out);
  else pv_block<3, C>(e, len, inv_sum, v, slots, kv_stride, c0, out);
}

// As the AVX-512 kv_head: n (row, query head) pairs over one KV head, pair p over the keys at slots[0 : len[p]].
// Scores 8 keys at a time (each block read once for every pair), then each pair's softmax, then the weighted values
// (pv_block: up to 3 pairs share each value load).
void kv_head(int64_t n, const float* const* q, const int64_t* len, float* const* out, const float* k, const float* v,
             const int64_t* slots, int64_t kv_stride, int64_t D, float scale, float* s, int64_t s_stride, float*) {
  int64_t longest = 0;
  for (int64_t p = 0; p < n; ++p) longest = std::max(longest, len[p]);
  const int64_t chunks = D / 8;
  alignas(32) static thread_local float zeros[MAX_HEAD_SIZE] = {};  // the keys past the longest row's
  for (int64_t j0 = 0; j0 < longest; j0 += 8) {  // scores, 8 keys at a time
    const float* kj[8];
    for (int t = 0; t < 8; ++t) kj[t] = j0 + t < longest ? k + slots[j0 + t] * kv_stride : zeros;
    for (int64_t t = j0 + 8; t < std::min(longest, j0 + 16); ++t)  // the next block's keys on their way in, to L2
      for (int64_t d = 0; d < D; d += 16)
        _mm_prefetch(reinterpret_cast<const char*>(k + slots[t] * kv_stride + d), _MM_HINT_T1);
    for (int64_t p = 0; p < n; ++p) {
      if (j0 >= len[p]) continue;
      // key t's dot product: lane l sums q[8c + l] * k_t[8c + l] over the chunks c in order, by fmas from the first
      // product; then the 8 keys' lanes add up in one hadd tree, which puts key t's sum in lane t
      __m256 acc[8];
      const __m256 q0 = _mm256_loadu_ps(q[p]);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[t]));
      for (int64_t c = 1; c < chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(q[p] + c * 8);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj[t] + c * 8), acc[t]);
      }
      const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
      // all 8 lanes: a row's scratch holds whole blocks, and the softmax reads only the pair's own keys (a masked
      // store, vmaskmovps, is microcoded on AMD Zen: about 8% of a row's attention time)
      _mm256_storeu_ps(s + p * s_stride + j0, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
  }
  std::vector<float*> sp(n);  // each pair's scores, then its softmax numerators
  std::vector<float> inv_sum(n);
  for (int64_t p = 0; p < n; ++p) {
    float* e = sp[p] = s + p * s_stride;
    const int64_t length = len[p];
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < length; j += 8)
      best = _mm256_blendv_ps(best, _mm256_max_ps(best, _mm256_maskload_ps(e + j, first_lanes(length - j))),
                              _mm256_castsi256_ps(first_lanes(length - j)));
    const __m256 top = _mm256_set1_ps(hmax8(best));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < length; j += 8) {
      const __m256i m = first_lanes(length - j);
      const __m256 x = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(e + j, m), top)), _mm256_castsi256_ps(m));
      _mm256_storeu_ps(e + j, x);  // zeros past the pair's keys, inside its scratch
      sum = _mm256_add_ps(sum, x);
    }
    inv_sum[p] = 1.0f / hsum8(sum);
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += 4)  // weighted values, 4 chunks (or the last 2) of up to 3 pairs at a time
    for (int64_t p0 = 0; p0 < n; p0 += PV_PAIRS) {
      const auto block = chunks - c0 >= 4 ? pv_pairs<4> : pv_pairs<2>;  // chunks is even (head_size a multiple of 16)
      block(std::min<int64_t>(PV_PAIRS, n - p0), sp.data() + p0, len + p0, inv_sum.data() + p0, v, slots, kv_stride, c0,
            out + p0);
    }
}

#endif  // __AVX512F__

}  // namespace


// One layer's cache k, v: contiguous float32 [slots, KVH, D] of the same shape.
static void check_cache(const at::Tensor& k, const at::Tensor& v, const char* op) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes()
              && k.is_contiguous() && v.is_contiguous(), op, ": k and v must be float32 [slots, kv_heads, head_size], contiguous");
}

// A layer's cache k, v checked (`check_cache`), passed through.
static const at::Tensor& checked_cache(const at::Tensor& k, const at::Tensor& v, const char* op) {
  check_cache(k, v, op);
  return k;
}

// One call of the row attention: its inputs checked, and its work items (row_items.h).
struct Call : RowItems {
  at::Tensor k, v;
  double scale;

  // q float32 [R, H, D]; k, v: one layer's cache, float32 [slots, KVH, D]; row r attends over the keys at
  // slots[starts[r] : starts[r] + lengths[r]] (int64); the items planned for `threads` threads.
  Call(at::Tensor q_, at::Tensor k_, at::Tensor v_, at::Tensor slots_, at::Tensor starts_, at::Tensor lengths_,
       double scale_, int64_t threads, const char* op)
      : RowItems(q_, checked_cache(k_, v_, op).size(1), k_.size(2), k_.size(0), slots_, starts_, lengths_, threads, op),
        k(k_), v(v_), scale(scale_) {}

  // Compute items into out [R, H * D] until none is left, each taken from `items` (shared by every thread working on
  // this call).
  void work(const SharedItems& shared, float* op) const {
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    const int64_t* ln = lengths.data_ptr<int64_t>();
    std::vector<float> scores;
    alignas(64) float kt[MAX_HEAD_SIZE * LANES];
    std::vector<const float*> qs;
    std::vector<float*> os;
    std::vector<int64_t> lens;
    shared.take(items, 1, [&](int64_t i, int64_t) {
      const Item it = item(i);
      qs.clear(), os.clear(), lens.clear();
      int64_t longest_here = 0;
      for (int64_t r = it.row_begin; r < it.row_end; ++r) {
        longest_here = std::max(longest_here, ln[r]);
        for (int64_t h = it.h0; h < it.h1; ++h) {
          qs.push_back(qp + (r * H + h) * D);
          os.push_back(op + (r * H + h) * D);
          lens.push_back(ln[r]);
        }
      }
      const int64_t s_stride = (longest_here + LANES - 1) / LANES * LANES;
      scores.resize(qs.size() * s_stride);
      kv_head(int64_t(qs.size()), qs.data(), lens.data(), os.data(), kp + it.kv_head * D, vp + it.kv_head * D,
              sp + st[it.row_begin], KVH * D, D, float(scale), scores.data(), s_stride, kt);
    });
  }
};

// q float32 [R, H, D]; k, v: one layer's cache, float32 [slots, KVH, D]; row r attends over the keys at
// slots[starts[r] : starts[r] + lengths[r]] (int64). Query head h reads KV head h / (H / KVH). -> [R, H * D].
at::Tensor row_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor starts,
                         at::Tensor lengths, double scale) {
  return attend_rows<Call>(q, k, v, slots, starts, lengths, scale, "row_attention");
}

// row_attention into out [R, H * D] by the threads of a team (`attend_rows_into`).
void row_attention_into(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor starts,
                        at::Tensor lengths, double scale, at::Tensor out, at::Tensor tickets, int64_t phase,
                        int64_t threads) {
  attend_rows_into<Call>(q, k, v, slots, starts, lengths, scale, out, tickets, phase, threads, "row_attention_into");
}

// The new tokens' keys and values k_new, v_new float32 [T, KVH, D] (each row contiguous, rows at any stride) stored
// at new_slots [T] of one layer's cache k, v, then row_attention: a layer's KV write and attention in one call.
at::Tensor write_and_attend(at::Tensor q, at::Tensor k_new, at::Tensor v_new, at::Tensor new_slots, at::Tensor k,
                            at::Tensor v, at::Tensor slots, at::Tensor starts, at::Tensor lengths, double scale) {
  check_cache(k, v, "write_and_attend");
  new_slots = checked_new_tokens(k_new, v_new, new_slots, k.size(1), k.size(2), k.size(0), "write_and_attend");
  const int64_t T = new_slots.numel(), row = k.size(1) * k.size(2);
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* knp = k_new.data_ptr<float>();
  const float* vnp = v_new.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kp + ns[t] * row, knp + t * k_new.stride(0), row * sizeof(float));
    std::memcpy(vp + ns[t] * row, vnp + t * v_new.stride(0), row * sizeof(float));
  }
  return row_attention(q, k, v, slots, starts, lengths, scale);
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def(OP_NAME("row_attention") "(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor lengths, "
        "float scale) -> Tensor", &row_attention);
  m.def(OP_NAME("write_and_attend") "(Tensor q, Tensor k_new, Tensor v_new, Tensor new_slots, Tensor(a!) k, "
        "Tensor(b!) v, Tensor slots, Tensor starts, Tensor lengths, float scale) -> Tensor", &write_and_attend);
  m.def(OP_NAME("row_attention_into") "(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor lengths, "
        "float scale, Tensor(a!) out, Tensor(b!) tickets, int phase, int threads) -> ()", &row_attention_into);
}
