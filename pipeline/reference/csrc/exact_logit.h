// The exact logit ScreenedOutputLayer computes for a token (and Int8Screen where its exact layer is that one): shared
// by bf16_weight_gemm.cpp and int8_screen.cpp so that both give the same bits. AVX-512F; included after
// <ATen/ATen.h> and <immintrin.h>.

namespace {

// fp32(x . w summed in float64): xd [H] the row in float64, w [H] the token's fp16 weights. Each product is exact in
// float64 (11 x 24 significant bits), so only the sum's order moves its last float64 bits, which the final rounding
// to float32 hides (tested against torch's sum, a different order): 8 float64 lanes per fused multiply-add, two
// chains, then the lanes' sum. One scalar loop through at::Half's conversion took about 1 us a candidate; SmolLM2's
// rows have 5-100.
inline float exact_logit(const double* xd, const at::Half* w, int64_t H) {
  __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 wf = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    acc[0] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(wf)), _mm512_loadu_pd(xd + i), acc[0]);
    acc[1] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wf), 1))),
                             _mm512_loadu_pd(xd + i + 8), acc[1]);
  }
  double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1]));
  for (; i < H; ++i) sum += double(float(w[i])) * xd[i];
  return float(sum);
}

}  // namespace
