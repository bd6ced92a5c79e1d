// Row attention over a bf16 KV cache (csrc/bf16_kv.h's layout) with AVX512-BF16's vdpbf16ps: the row attention of
// row_attention.cpp for KVCache's kv_dtype "BF16", with the same work items (row_items.h) and the same guarantee: a
// row's result is a function of its query and its keys alone, so a verify row and a plain decode step of the same
// token get the same bits whatever else the call holds and on any thread count.
//
// Per (row, query head) pair: the query rounded to bf16 (to nearest even); its scores, each the float32 sum of
// vdpbf16ps over the dim pairs in order, times scale; the softmax's maximum and sum in float32 in key order; the
// probabilities rounded to bf16 and the weighted values summed by vdpbf16ps over key pairs in order, divided by
// the float32 sum (as flash attention kernels round P). What the pairs of an item share is the loads: 16 keys' two
// dims in one register (no transposes, half the bytes of float32) and two keys' values in one. A pair takes
// weight 0 for the keys of its item past its own (exact zeros: its sums do not change).
// The AVX2 build of this source (ops with the suffix _bf16_avx2, for CPUs without AVX512-BF16 such as AMD Zen3)
// does each vdpbf16ps as its two fused multiply-adds in the instruction's order, the odd element's product first
// (bf16 products are exact in float32, so each rounds once, as vdpbf16ps does), 8 lanes a register: the same bits
// as the AVX512-BF16 build wherever no sum or input is subnormal (vdpbf16ps flushes those to zero;
// tests/test_bf16_kv_cache.py compares the two builds).
// Numbers: docs/benchmarks.md ("A bf16 KV cache"). Python side: pipeline/reference/row_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_kv.h"
#include "exp_approx.h"
#include "shared_items.h"
#include "row_items.h"

#ifdef __AVX512BF16__
#define OP_NAME(name) name "_bf16"
#else
#define OP_NAME(name) name "_bf16_avx2"
#endif

namespace {

constexpr int LANES = 16;  // keys per group of the cache's layout (bf16_kv.h)
#ifdef __AVX512BF16__
constexpr int QK_PAIRS = 6;  // pairs per score block: 6 accumulators of 16 keys
constexpr int PV_PAIRS = 6;  // pairs per value block: 6 x 4 accumulators + 4 value registers
constexpr int64_t PAIR_WORDS = 1;  // uint32 words of a bf16 pair in the queries' and numerators' scratch: its two bf16

// Scores of P pairs over one group of 16 keys `kb` ([D / 2][16] uint32, each two bf16 dims of one key): lane l
// sums the dim pairs of key l in order from 0 by vdpbf16ps, then times scale; stored for the group's first nk keys.
template <int P>
void qk_group(const uint32_t* const* q, const uint32_t* kb, int64_t dim_pairs, float scale, int64_t nk,
              float* const* s) {
  const __mmask16 mask = nk >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << nk) - 1);
  __m512 acc[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim_pairs; ++i) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + i * LANES);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[p] = _mm512_dpbf16_ps(acc[p], (__m512bh)_mm512_set1_epi32(int(q[p][i])), k);
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) _mm512_mask_storeu_ps(s[p], mask, _mm512_mul_ps(acc[p], _mm512_set1_ps(scale)));
}

// out[p][c0 * 16 ...] for up to 4 chunks of 16 dims from c0: P pairs' bf16 probability pairs e[p][jj] times the
// values of key pairs jj < key_pairs (`value_pair(jj)`: [D] uint32, two keys' bf16 per dim), in key order, times
// the pairs' inverse sums. odd_tail: the last pair's second key is past every row's keys (its value may be
// anything; its bf16 is zeroed, so 0 x value is 0).
template <int P, typename ValuePair>
void pv_block(const uint32_t* const* e, const float* inv_sum, const ValuePair& value_pair, int64_t key_pairs,
              bool odd_tail, int64_t c0, int64_t cn, float* const* out) {
  __m512 acc[P][4];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_setzero_ps();
  const __mmask16 m[4] = {__mmask16(cn > 0 ? 0xFFFF : 0), __mmask16(cn > 1 ? 0xFFFF : 0), __mmask16(cn > 2 ? 0xFFFF : 0),
                          __mmask16(cn > 3 ? 0xFFFF : 0)};
  for (int64_t jj = 0; jj < key_pairs; ++jj) {
    const uint32_t* row = value_pair(jj) + c0 * LANES;
    __m512i vc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      vc[c] = _mm512_maskz_loadu_epi32(m[c], row + c * LANES);
      if (odd_tail && jj == key_pairs - 1) vc[c] = _mm512_and_si512(vc[c], _mm512_set1_epi32(0xFFFF));
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(e[p][jj]));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], w, (__m512bh)vc[c]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)  // constant indices: a runtime one would keep acc in memory
      if (c < cn) _mm512_storeu_ps(out[p] + (c0 + c) * LANES, _mm512_mul_ps(acc[p][c], _mm512_set1_ps(inv_sum[p])));
}

// The softmax of one pair's scores x [length]: returns 1 / the float32 sum of e^(x - max), summed in 16 lanes (lane l:
// keys l mod 16 in order), and stores the numerators rounded to bf16 as pairs of keys e [key_pairs] (0 past length).
float probabilities(const float* x, int64_t length, int64_t key_pairs, uint32_t* e) {
  auto first = [](int64_t left) {
    return left >= LANES ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  };
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < length; j += LANES)
    best = _mm512_mask_max_ps(best, first(length - j), best, _mm512_maskz_loadu_ps(first(length - j), x + j));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < 2 * key_pairs; j += 2 * LANES) {
    const __mmask16 ma = first(length - j), mb = first(length - j - LANES);
    const __m512 a = _mm512_maskz_mov_ps(ma, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(ma, x + j), top)));
    const __m512 b = _mm512_maskz_mov_ps(mb, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mb, x + j + LANES), top)));
    sum = _mm512_add_ps(sum, a);
    sum = _mm512_add_ps(sum, b);
    // keys j .. j + 31 as bf16 in order: (j, j + 1) is pair j / 2, low half first
    _mm512_storeu_si512(e + j / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// A query row x [D] float32 -> y [D / 2]: its dim pairs as bf16 (rounded to nearest even), low half first.
void query_pairs(const float* x, int64_t D, uint32_t* y) {
  for (int64_t d = 0; d < D; d += LANES)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + d)));
}

#else  // AVX2
constexpr int QK_PAIRS = 4;  // pairs per score block: 4 x 2 accumulators of 8 keys + 4 key registers
constexpr int PV_PAIRS = 4;  // pairs per value block: 4 x 2 accumulators of 8 dims + 4 value registers
// uint32 words of a bf16 pair in the queries' and numerators' scratch: each bf16 as the float32 it is (its bits << 16),
// the even element first, so a broadcast needs no widening
constexpr int64_t PAIR_WORDS = 2;

// The two float32 halves of 8 uint32 lanes, each two bf16: the low (even) elements and the high (odd) ones.
inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// acc + a . b over one lane's bf16 pair (a_even, a_odd: the pair's broadcast floats, b: 8 lanes' pairs), as vdpbf16ps
// adds it: the odd elements' product first, then the even ones'.
inline __m256 dot_pair(__m256 acc, __m256 a_even, __m256 a_odd, __m256i b) {
  return _mm256_fmadd_ps(a_even, even_bf16(b), _mm256_fmadd_ps(a_odd, odd_bf16(b), acc));
}

// Word w of a scratch row (`PAIR_WORDS`) on every lane.
inline __m256 broadcast_word(const uint32_t* row, int64_t w) {
  return _mm256_castsi256_ps(_mm256_set1_epi32(int(row[w])));
}

// Scores of P pairs over one group of 16 keys `kb`: as the AVX512-BF16 build's qk_group, 8 keys a register.
template <int P>
void qk_group(const uint32_t* const* q, const uint32_t* kb, int64_t dim_pairs, float scale, int64_t nk,
              float* const* s) {
  __m256 acc[P][2];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim_pairs; ++i) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + i * LANES));
    const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + i * LANES + 8));
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m256 even = broadcast_word(q[p], 2 * i), odd = broadcast_word(q[p], 2 * i + 1);
      acc[p][0] = dot_pair(acc[p][0], even, odd, k0);
      acc[p][1] = dot_pair(acc[p][1], even, odd, k1);
    }
  }
  alignas(32) float row[LANES];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    _mm256_store_ps(row, _mm256_mul_ps(acc[p][0], _mm256_set1_ps(scale)));
    _mm256_store_ps(row + 8, _mm256_mul_ps(acc[p][1], _mm256_set1_ps(scale)));
    std::memcpy(s[p], row, sizeof(float) * std::min<int64_t>(nk, LANES));
  }
}

// As the AVX512-BF16 build's pv_block, each chunk of 16 dims as two registers of 8, one chunk at a time.
template <int P, typename ValuePair>
void pv_block(const uint32_t* const* e, const float* inv_sum, const ValuePair& value_pair, int64_t key_pairs,
              bool odd_tail, int64_t c0, int64_t cn, float* const* out) {
  for (int64_t c = c0; c < c0 + cn; ++c) {
    __m256 acc[P][2];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < key_pairs; ++jj) {
      const uint32_t* row = value_pair(jj) + c * LANES;
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8));
      if (odd_tail && jj == key_pairs - 1) {
        v0 = _mm256_and_si256(v0, _mm256_set1_epi32(0xFFFF));
        v1 = _mm256_and_si256(v1, _mm256_set1_epi32(0xFFFF));
      }
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256 even = broadcast_word(e[p], 2 * jj), odd = broadcast_word(e[p], 2 * jj + 1);
        acc[p][0] = dot_pair(acc[p][0], even, odd, v0);
        acc[p][1] = dot_pair(acc[p][1], even, odd, v1);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      _mm256_storeu_ps(out[p] + c * LANES, _mm256_mul_ps(acc[p][0], _mm256_set1_ps(inv_sum[p])));
      _mm256_storeu_ps(out[p] + c * LANES + 8, _mm256_mul_ps(acc[p][1], _mm256_set1_ps(inv_sum[p])));
    }
  }
}

// 8 lanes' float32 -> bf16 bits in each lane's low half, rounded to nearest even (finite inputs: the softmax's
// numerators, which are normal or 0, as vcvtne2ps2bf16 rounds them).
inline __m256i round_lanes_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// As the AVX512-BF16 build's probabilities: the sum in the same 16 lanes (two registers of 8) and reduced in the
// order of _mm512_reduce_add_ps (the upper 8 lanes onto the lower, then 4, 2, 1), so the same bits; the numerators
// stored as PAIR_WORDS words a pair, one a key.
float probabilities(const float* x, int64_t length, int64_t key_pairs, uint32_t* e) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto first = [&](int64_t left) {  // lanes < left
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<int64_t>(left, 0, 8))), lane);
  };
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < length; j += 8) {
    const __m256 m = _mm256_castsi256_ps(first(length - j));
    best = _mm256_blendv_ps(best, _mm256_max_ps(best, _mm256_maskload_ps(x + j, first(length - j))), m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();  // the 16 lanes' 0-7 and 8-15
  auto numerators = [&](int64_t j) {  // keys j .. j + 7: e^(x - top), 0 past length
    const __m256i m = first(length - j);
    return _mm256_and_ps(_mm256_castsi256_ps(m), exp8(_mm256_sub_ps(_mm256_maskload_ps(x + j, m), top)));
  };
  for (int64_t j = 0; j < 2 * key_pairs; j += 2 * LANES) {
    const __m256 a0 = numerators(j), a1 = numerators(j + 8), b0 = numerators(j + 16), b1 = numerators(j + 24);
    sum_lo = _mm256_add_ps(_mm256_add_ps(sum_lo, a0), b0);
    sum_hi = _mm256_add_ps(_mm256_add_ps(sum_hi, a1), b1);
    const __m256 keys[4] = {a0, a1, b0, b1};  // keys j .. j + 31
    for (int g = 0; g < 4; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + j + 8 * g),
                          _mm256_slli_epi32(round_lanes_to_bf16(keys[g]), 16));
  }
  const __m256 eight = _mm256_add_ps(sum_hi, sum_lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return 1.0f / (_mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 0, 0, 1))));
}

// As the AVX512-BF16 build's query_pairs, PAIR_WORDS words a pair, one a dim (the same bits but for subnormal inputs,
// which vcvtneps2bf16 flushes to zero).
void query_pairs(const float* x, int64_t D, uint32_t* y) {
  for (int64_t d = 0; d < D; ++d) y[d] = uint32_t(bf16_kv::round_to_bf16(x[d])) << 16;
}
#endif  // __AVX512BF16__

// n (row, query head) pairs over KV head h of one layer's bf16 cache (keys, values): pair p's query q[p] (D / 2 bf16
// pairs, PAIR_WORDS words each) attends over the keys at slots[0 : len[p]] (whole aligned groups of 16 slots, checked
// by the caller); its result goes to out[p] [D]. s: score scratch [n][s_stride], e: probability scratch
// [n][s_stride / 2 * PAIR_WORDS]; s_stride the longest length rounded up to 32.
void kv_head(int64_t n, const uint32_t* const* q, const int64_t* len, float* const* out, const uint16_t* keys,
             const uint16_t* values, const int64_t* slots, int64_t h, int64_t KVH, int64_t D, float scale, float* s,
             uint32_t* e, int64_t s_stride) {
  int64_t longest = 0;
  for (int64_t p = 0; p < n; ++p) longest = std::max(longest, len[p]);
  const int64_t chunk_bytes = 16 * D * 2;
  auto chunk = [&](const uint16_t* layer, int64_t j) { return layer + bf16_kv::chunk(slots[j], h, KVH, D); };
  std::vector<float*> sp(n), sj(n);
  std::vector<uint32_t*> ep(n);
  for (int64_t p = 0; p < n; ++p) sp[p] = s + p * s_stride, ep[p] = e + p * (s_stride / 2 * PAIR_WORDS);
  for (int64_t j0 = 0; j0 < longest; j0 += LANES) {  // scores, one group of 16 keys at a time
    const int64_t nk = std::min<int64_t>(LANES, longest - j0);
    // the next group's keys and this group's values on their way in, to L2 (as row_attention.cpp)
    for (int64_t b = 0; b < chunk_bytes; b += 64) {
      if (j0 + LANES < longest) _mm_prefetch(reinterpret_cast<const char*>(chunk(keys, j0 + LANES)) + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(chunk(values, j0)) + b, _MM_HINT_T1);
    }
    const uint32_t* kb = reinterpret_cast<const uint32_t*>(chunk(keys, j0));
    for (int64_t p = 0; p < n; ++p) sj[p] = sp[p] + j0;
    for (int64_t p0 = 0; p0 < n; p0 += QK_PAIRS) {
      float* const* so = sj.data() + p0;
      const uint32_t* const* qo = q + p0;
      switch (std::min<int64_t>(QK_PAIRS, n - p0)) {
        case 1: qk_group<1>(qo, kb, D / 2, scale, nk, so); break;
        case 2: qk_group<2>(qo, kb, D / 2, scale, nk, so); break;
        case 3: qk_group<3>(qo, kb, D / 2, scale, nk, so); break;
        case 4: qk_group<4>(qo, kb, D / 2, scale, nk, so); break;
        case 5: qk_group<5>(qo, kb, D / 2, scale, nk, so); break;
        default: qk_group<6>(qo, kb, D / 2, scale, nk, so); break;
      }
    }
  }
  const int64_t key_pairs = (longest + 1) / 2;
  std::vector<float> inv_sum(n);
  for (int64_t p = 0; p < n; ++p) inv_sum[p] = probabilities(sp[p], len[p], key_pairs, ep[p]);
  const bool odd_tail = longest % 2 == 1;
  const auto value_pair = [&](int64_t jj) {
    return reinterpret_cast<const uint32_t*>(chunk(values, 2 * jj) + (2 * jj % LANES / 2) * 2 * D);
  };
  const int64_t chunks = D / LANES;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {  // weighted values, 4 chunks of up to 6 pairs at a time
    const int64_t cn = std::min<int64_t>(4, chunks - c0);
    for (int64_t p0 = 0; p0 < n; p0 += PV_PAIRS) {
      const uint32_t* const* eo = ep.data() + p0;
      float* const* oo = out + p0;
      const float* io = inv_sum.data() + p0;
      switch (std::min<int64_t>(PV_PAIRS, n - p0)) {
        case 1: pv_block<1>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
        case 2: pv_block<2>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
        case 3: pv_block<3>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
        case 4: pv_block<4>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
        case 5: pv_block<5>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
        default: pv_block<6>(eo, io, value_pair, key_pairs, odd_tail, c0, cn, oo); break;
      }
    }
  }
}

// One layer's bf16 cache k [groups, KVH, D / 2, 16, 2], v [groups, KVH, 8, D, 2] (bf16_kv.h), checked; passed
// through.
const at::Tensor& checked_cache(const at::Tensor& k, const at::Tensor& v, const char* op) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.dim() == 5 && v.dim() == 5
              && k.is_contiguous() && v.is_contiguous() && k.size(3) == 16 && k.size(4) == 2 && v.size(2) == 8
              && v.size(4) == 2 && v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(3) == 2 * k.size(2),
              op, ": k and v must be one layer's bf16 cache, contiguous k [groups, kv_heads, head_size / 2, 16, 2] "
              "and v [groups, kv_heads, 8, head_size, 2]");
  return k;
}

// One call: its inputs checked (every row's keys in whole groups of 16 slots, bf16_kv.h), and its work items.
struct Call : RowItems {
  at::Tensor k, v;
  double scale;

  Call(at::Tensor q_, at::Tensor k_, at::Tensor v_, at::Tensor slots_, at::Tensor starts_, at::Tensor lengths_,
       double scale_, int64_t threads, const char* op)
      : RowItems(q_, checked_cache(k_, v_, op).size(1), 2 * k_.size(2), 16 * k_.size(0), slots_, starts_, lengths_,
                 threads, op),
        k(k_), v(v_), scale(scale_) {
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    const int64_t* ln = lengths.data_ptr<int64_t>();
    // each run of rows with one start: its longest row's keys, a group of 16 at a time, by the group's first and
    // last slot (every thread of a fused forward's team plans the call: this runs once a layer on each)
    for (int64_t r = 0, end = 0; r < R; r = end) {
      int64_t longest = 0;
      for (end = r; end < R && st[end] == st[r]; ++end) longest = std::max(longest, ln[end]);
      for (int64_t j = 0; j < longest; j += LANES) {
        const int64_t* group = sp + st[r] + j;
        const int64_t last = std::min<int64_t>(LANES, longest - j) - 1;
        TORCH_CHECK(group[0] % LANES == 0 && group[last] == group[0] + last, op, ": row ", r, "'s keys must fill "
                    "groups of 16 slots in order (a block table of blocks of a multiple of 16 tokens); keys ", j,
                    "-", j + last, " are slots ", group[0], "-", group[last]);
      }
    }
  }

  // Compute items into out [R, H * D] until none is left, each taken from `shared`.
  void work(const SharedItems& shared, float* op) const {
    const float* qp = q.data_ptr<float>();
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    const int64_t* ln = lengths.data_ptr<int64_t>();
    std::vector<float> scores;
    std::vector<uint32_t> probs, qbf;
    std::vector<const uint32_t*> qs;
    std::vector<float*> os;
    std::vector<int64_t> lens;
    shared.take(items, 1, [&](int64_t i, int64_t) {
      const Item it = item(i);
      os.clear(), lens.clear();
      int64_t longest_here = 0;
      for (int64_t r = it.row_begin; r < it.row_end; ++r) longest_here = std::max(longest_here, ln[r]);
      const int64_t n = (it.row_end - it.row_begin) * (it.h1 - it.h0);
      qbf.resize(n * D / 2 * PAIR_WORDS);
      qs.resize(n);
      int64_t p = 0;
      for (int64_t r = it.row_begin; r < it.row_end; ++r)
        for (int64_t h = it.h0; h < it.h1; ++h, ++p) {
          uint32_t* y = qbf.data() + p * D / 2 * PAIR_WORDS;
          query_pairs(qp + (r * H + h) * D, D, y);
          qs[p] = y;
          os.push_back(op + (r * H + h) * D);
          lens.push_back(ln[r]);
        }
      const int64_t s_stride = (longest_here + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
      scores.resize(n * s_stride);
      probs.resize(n * s_stride / 2 * PAIR_WORDS);
      kv_head(n, qs.data(), lens.data(), os.data(), kp, vp, sp + st[it.row_begin], it.kv_head, KVH, D, float(scale),
              scores.data(), probs.data(), s_stride);
    });
  }
};

// q float32 [R, H, D]; k, v: one layer's bf16 cache (checked_cache); row r attends over the keys at
// slots[starts[r] : starts[r] + lengths[r]] (int64). Query head h reads KV head h / (H / KVH). -> [R, H * D].
at::Tensor row_attention_bf16(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor starts,
                              at::Tensor lengths, double scale) {
  return attend_rows<Call>(q, k, v, slots, starts, lengths, scale, "row_attention_bf16");
}

// row_attention_bf16 into out [R, H * D] by the threads of a team (`attend_rows_into`).
void row_attention_into_bf16(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor starts,
                             at::Tensor lengths, double scale, at::Tensor out, at::Tensor tickets, int64_t phase,
                             int64_t threads) {
  attend_rows_into<Call>(q, k, v, slots, starts, lengths, scale, out, tickets, phase, threads,
                         "row_attention_into_bf16");
}

// The new tokens' keys and values k_new, v_new float32 [T, KVH, D] (each row contiguous) stored at new_slots [T] of
// one layer's bf16 cache k, v (rounded to nearest even), then row_attention_bf16.
at::Tensor write_and_attend_bf16(at::Tensor q, at::Tensor k_new, at::Tensor v_new, at::Tensor new_slots, at::Tensor k,
                                 at::Tensor v, at::Tensor slots, at::Tensor starts, at::Tensor lengths, double scale) {
  checked_cache(k, v, "write_and_attend_bf16");
  const int64_t KVH = k.size(1), D = 2 * k.size(2);
  new_slots = checked_new_tokens(k_new, v_new, new_slots, KVH, D, 16 * k.size(0), "write_and_attend_bf16");
  const int64_t T = new_slots.numel();
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  uint16_t* kp = reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>());
  uint16_t* vp = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t)
    bf16_kv::store(kp, vp, ns[t], KVH, D, k_new.data_ptr<float>() + t * k_new.stride(0),
                   v_new.data_ptr<float>() + t * v_new.stride(0));
  return row_attention_bf16(q, k, v, slots, starts, lengths, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def(OP_NAME("row_attention") "(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor lengths, "
        "float scale) -> Tensor", &row_attention_bf16);
  m.def(OP_NAME("write_and_attend") "(Tensor q, Tensor k_new, Tensor v_new, Tensor new_slots, Tensor(a!) k, "
        "Tensor(b!) v, Tensor slots, Tensor starts, Tensor lengths, float scale) -> Tensor", &write_and_attend_bf16);
  m.def(OP_NAME("row_attention_into") "(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor lengths, "
        "float scale, Tensor(a!) out, Tensor(b!) tickets, int phase, int threads) -> ()", &row_attention_into_bf16);
}
