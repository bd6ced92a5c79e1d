// e^x for the row attention kernels' softmax (row_attention.cpp, row_attention_bf16.cpp), one approximation for
// every build: the AVX2 build's exp8 uses the same polynomial. cpp_ops inlines this file into the sources that
// include it.
#pragma once

#include <immintrin.h>

// 2^f for |f| <= 1/2 by its Taylor polynomial of degree 7, Horner's order: ln(2)^k / k!, k = 7 .. 0
constexpr float EXP2_TAYLOR[8] = {1.5252733804059840e-5f, 1.5403530393381609e-4f, 1.3333558146428443e-3f,
                                  9.6181291076284772e-3f, 5.5504108664821580e-2f, 2.4022650695910071e-1f,
                                  6.9314718055994531e-1f, 1.0f};

#ifdef __AVX512F__
// e^x on 16 lanes for x <= 0: x log2(e) = n + f with |f| <= 1/2, 2^f by its Taylor polynomial of degree 7
// (relative error below 2e-9, under float32's rounding), times 2^n by vscalefps. Below -87 it returns e^-87.
inline __m512 exp_ps(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
  return _mm512_scalef_ps(p, n);
}
#else  // AVX2

// e^x on 8 lanes for x <= 0, as exp_ps: the same polynomial in f, times 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));  // n >= -126: a normal power of two
}
#endif  // __AVX512F__
