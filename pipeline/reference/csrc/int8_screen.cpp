// The output layer for rows that only need their argmax (Int8Screen, pipeline/reference/int8_screen.py), on AVX2 +
// FMA + F16C: approximate logits from int8 weights, and the exact logit of every token that could be the row's top,
// bit for bit the exact layer's: the fp16 kernel's (Float16Weights) or, in the AVX-512 build, ScreenedOutputLayer's.
//
// Per row x [K] (float32) and token c, with the fp16 weights w_c the exact layer reads:
//   exact_c  = the fp16 kernel's float32 fma chain x[0] w_c[0], ..., x[K-1] w_c[K-1] in order, from 0; or
//              fp32(x . w_c summed in float64), ScreenedOutputLayer's (exact_logit.h), within 2^-24 |x . w_c| + tiny
//              of the true sum: below the chain's bound, so the bound below covers both
//   approx_c = (x^ . w^_c)(1 + d), |d| <= 3 * 2^-24   x^ = n r: x on the row's symmetric 16-bit grid (n int16,
//                                                     r = max|x| / levels); w^_c = q_c * s_c: int8 q_c, channel
//                                                     scale s_c; the sum exact in int32, three float roundings
//   |approx_c - exact_c| <= bound_c = (||x|| a_c + ||x - x^|| b_c)(1 + 2^-10) + 2^-20 |approx_c|
// where a_c = ||w_c - w^_c|| + gamma_K ||w_c|| (gamma_K: K float32 additions' relative error, the exact chain's)
// and b_c = ||w^_c|| (Cauchy-Schwarz; the slack factors cover the float arithmetic of the bound itself). So
// low = max_c (approx_c - bound_c) is at most the largest exact logit, and a token with approx_c + bound_c < low
// cannot be the argmax: every other token (a candidate) gets its exact logit. The returned row's argmax is the exact
// row's (the first of equal maxima too: a non-candidate lies strictly below); the rest is approximate. SmolLM2's
// answers: 2 candidates per row (median), 18 at p99 (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "int8_avx2_groups.h"
#ifdef __AVX512F__
#include "exact_logit.h"
#endif

namespace {

constexpr int64_t FP16_GROUP = 8;  // fp16_weight_gemm.pack: [ceil(N / 8), K, 8]

// y[c] = the fp16 kernel's logit of each channel c of cs: its float32 fma chain over its packed weights (stride 8), the
// same bits, 8 channels at a time (lane j runs channel j's chain), each weight gathered as the aligned 32-bit
// word that holds it. One chain alone waits on its own fma (about 0.7 us for 576 inputs), and a row of flat logits
// can have hundreds of candidates.
void chain_logits(const float* x, int64_t K, const uint16_t* w16, const std::vector<int32_t>& cs, float* y) {
  const int32_t* words = reinterpret_cast<const int32_t*>(w16);
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  for (size_t i = 0; i < cs.size(); i += 8) {
    alignas(32) int32_t word[8], shift[8];
    for (int j = 0; j < 8; ++j) {
      const int64_t c = cs[std::min(i + j, cs.size() - 1)];  // the last chunk repeats its last channel
      const int64_t half = (c / FP16_GROUP) * K * FP16_GROUP + c % FP16_GROUP;  // k = 0
      word[j] = int32_t(half / 2), shift[j] = int32_t(half % 2 * 16);
    }
    const __m256i base = _mm256_load_si256(reinterpret_cast<const __m256i*>(word));
    const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {  // a channel's next weight is FP16_GROUP halves on: FP16_GROUP / 2 words
      const __m256i w = _mm256_srlv_epi32(
          _mm256_i32gather_epi32(words, _mm256_add_epi32(base, _mm256_set1_epi32(int32_t(k * FP16_GROUP / 2))), 4),
          bits);
      const __m256i low = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, order), 0x08);  // 8 halves in order
      acc = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), _mm256_cvtph_ps(_mm256_castsi256_si128(low)), acc);
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, acc);
    for (size_t j = 0; j < 8 && i + j < cs.size(); ++j) y[cs[i + j]] = out[j];
  }
}

// Row x [K] on its grid: q [Kp] int16 (padding 0); returns r and sets the norms ||x|| and ||x - n r|| (double).
float round_row(const float* x, int64_t K, int64_t Kp, int64_t levels, int16_t* q, double* norm, double* error) {
  float top = 0.0f;
  for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(x[k]));
  const float r = top / float(levels), inv = top > 0.0f ? float(levels) / top : 0.0f;
  double sq = 0.0, err = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const float n = std::min(float(levels), std::max(-float(levels), std::nearbyint(x[k] * inv)));
    q[k] = int16_t(n);
    const double d = double(x[k]) - double(n) * double(r);
    sq += double(x[k]) * x[k], err += d * d;
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = 0;
  *norm = std::sqrt(sq), *error = std::sqrt(err);
  return r;
}

// The exact layer's logits y[c] of row x [K] for the tokens cs: the fp16 kernel's chains over its packed weights
// (packed16, weight16 null) or ScreenedOutputLayer's float64 sums over weight16 [N, K] (AVX-512 builds).
struct ExactLayer {
  const uint16_t* packed16;
  const at::Half* weight16;

  void operator()(const float* x, int64_t K, const std::vector<int32_t>& cs, float* y) const {
    if (packed16 != nullptr) return chain_logits(x, K, packed16, cs, y);
#ifdef __AVX512F__
    std::vector<double> xd(x, x + K);
    for (const int32_t c : cs) y[c] = exact_logit(xd.data(), weight16 + c * K, K);
#endif
  }
};

// One row's screen over its approximate sums y [N] (float(sum) * s_c, scaled here by r): the candidates' exact logits.
void screen_row(const float* x, int64_t K, float* y, int64_t N, float r, double norm, double error, const float* a,
                const float* b, const ExactLayer& exact) {
  if (!std::isfinite(norm)) {  // an inf or NaN input: the whole row exactly (its NaNs where the exact layer has them)
    std::vector<int32_t> every(N);
    for (int64_t c = 0; c < N; ++c) every[c] = int32_t(c);
    exact(x, K, every, y);
    return;
  }
  const __m256 vr = _mm256_set1_ps(r), vn = _mm256_set1_ps(float(norm)), ve = _mm256_set1_ps(float(error));
  const __m256 slack = _mm256_set1_ps(1.0f + 0x1p-10f), rel = _mm256_set1_ps(0x1p-20f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  auto bound = [&](__m256 v, int64_t c) {
    const __m256 weights = _mm256_fmadd_ps(vn, _mm256_loadu_ps(a + c), _mm256_mul_ps(ve, _mm256_loadu_ps(b + c)));
    return _mm256_fmadd_ps(weights, slack, _mm256_mul_ps(rel, _mm256_andnot_ps(sign, v)));
  };
  const int64_t whole = N / 8 * 8;
  __m256 low8 = _mm256_set1_ps(-INFINITY);
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(y + c), vr);
    _mm256_storeu_ps(y + c, v);
    low8 = _mm256_max_ps(low8, _mm256_sub_ps(v, bound(v, c)));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, low8);
  float low = -INFINITY;
  for (float l : lanes) low = std::max(low, l);
  auto scalar_bound = [&](float v, int64_t c) {
    return (float(norm) * a[c] + float(error) * b[c]) * (1.0f + 0x1p-10f) + 0x1p-20f * std::fabs(v);
  };
  for (int64_t c = whole; c < N; ++c) {
    y[c] *= r;
    low = std::max(low, y[c] - scalar_bound(y[c], c));
  }
  const __m256 vlow = _mm256_set1_ps(low);
  std::vector<int32_t> candidates;
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 v = _mm256_loadu_ps(y + c);
    for (int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(v, bound(v, c)), vlow, _CMP_GE_OQ)); mask != 0;
         mask &= mask - 1)
      candidates.push_back(int32_t(c + __builtin_ctz(mask)));
  }
  for (int64_t c = whole; c < N; ++c)
    if (y[c] + scalar_bound(y[c], c) >= low) candidates.push_back(int32_t(c));
  exact(x, K, candidates, y);
}

}  // namespace

// x float32 [M, K] -> logits float32 [M, N] whose argmax is the exact layer's (above). packed: int8 q [ceil(N / 8),
// Kp / 4, 8, 4] (int8_grid_gemm.pack); scales, a, b: float32 [N] (s_c, a_c, b_c above); zeros: int32 [N];
// exact: the exact layer's fp16 weights, as fp16_weight_gemm.pack packs them (int16 [ceil(N / 8), K, 8]: the fp16
// kernel's chains) or as ScreenedOutputLayer keeps them (float16 [N, K]: its float64 sums; AVX-512 builds only);
// levels: the grid's steps a side, with K * levels * 127 < 2^31 (the int32 sums).
at::Tensor int8_screen(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor zeros, at::Tensor a, at::Tensor b,
                       at::Tensor exact, int64_t levels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "int8_screen: x must be float32 [rows, in]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), Kp = packed.size(1) * 4;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 4
              && Kp >= K && packed.size(0) * GROUP >= N, "int8_screen: packed must come from int8_grid_gemm.pack for ",
              K, " inputs and ", N, " outputs");
  const bool chains = exact.scalar_type() == at::kShort;
  if (chains) {
    TORCH_CHECK(exact.dim() == 3 && exact.size(1) == K && exact.size(2) == FP16_GROUP
                && exact.size(0) * FP16_GROUP >= N,
                "int8_screen: exact int16 weights must come from fp16_weight_gemm.pack for the same weight");
  } else {
#ifndef __AVX512F__
    TORCH_CHECK(false, "int8_screen: this build (AVX2) takes exact weights from fp16_weight_gemm.pack only");
#endif
    TORCH_CHECK(exact.scalar_type() == at::kHalf && exact.dim() == 2 && exact.is_contiguous() && exact.size(0) == N
                && exact.size(1) == K, "int8_screen: exact must be fp16_weight_gemm.pack's int16 weights or "
                "contiguous float16 [", N, ", ", K, "]");
  }
  for (const at::Tensor& t : {scales, a, b})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == N, "int8_screen: scales, a and b "
                "must be float32 [", N, "]");
  TORCH_CHECK(zeros.scalar_type() == at::kInt && zeros.is_contiguous() && zeros.numel() == N,
              "int8_screen: zeros must be int32 [", N, "]");
  TORCH_CHECK(levels > 0 && levels <= INT16_MAX && double(Kp) * levels * 127 < 2147483648.0, "int8_screen: ", levels,
              " levels overflow the int32 sums of ", Kp, " inputs");
  auto qs = at::empty({M, Kp}, x.options().dtype(at::kShort));
  std::vector<float> r(M);
  std::vector<double> norm(M), error(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    r[m] = round_row(xp + m * K, K, Kp, levels, qs.data_ptr<int16_t>() + m * Kp, &norm[m], &error[m]);
  auto out = at::empty({M, N}, x.options());
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    gemm_groups(qs.data_ptr<int16_t>(), M, Kp, packed.data_ptr<int8_t>(), zeros.data_ptr<int32_t>(),
                scales.data_ptr<float>(), out.data_ptr<float>(), N, g0, g1);
  });
  const ExactLayer layer{chains ? reinterpret_cast<const uint16_t*>(exact.data_ptr<int16_t>()) : nullptr,
                         chains ? nullptr : exact.data_ptr<at::Half>()};
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      screen_row(xp + m * K, K, out.data_ptr<float>() + m * N, N, r[m], norm[m], error[m], a.data_ptr<float>(),
                 b.data_ptr<float>(), layer);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("int8_screen(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor a, Tensor b, Tensor exact, "
        "int levels) -> Tensor", &int8_screen);
}
