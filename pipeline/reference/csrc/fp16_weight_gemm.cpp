// Float16Weights' GEMM on AVX2 + F16C + FMA: x [M, K] float32 times fp16 weights [N, K], float32 sums.
//
// Each output (row, channel) is one float32 fma chain over k = 0, 1, ..., K - 1 in order, whatever the row count
// or the thread count, so a row's result does not depend on the rest of the call (batch-invariant, tested). The
// weights are read once per call: each chunk of 32 channels (K x 64 bytes, kept in L2) serves every block of up to
// 6 rows, widened to float32 in registers. fbgemm's fp16 GEMM, which it replaces on such CPUs, re-reads them per
// block of rows: over SmolLM2's output layer [49152, 576] it took 2.9 ms at one row and 6.2 ms at six
// (docs/benchmarks.md has this kernel's numbers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>

namespace {

constexpr int64_t GROUP = 8;     // channels per packed group: [K, 8] fp16, one ymm of float32 per k
constexpr int64_t CHUNK = 4;     // groups per chunk (32 channels): the unit of threading and of L2 reuse
constexpr int MAX_ROWS = 6;      // rows per register block: 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int64_t PREFETCH = 64; // k ahead (1 KB of each group's stream)

// R rows times C consecutive groups (C x 8 channels starting at group g): out[r, 8g .. 8(g + C)).
template <int R, int C>
void block(const float* x, int64_t K, const uint16_t* w, float* out, int64_t N, int64_t g) {
  // every loop over r and c fully unrolled: an accumulator indexed at run time would live in memory (measured: a
  // store per fma)
  __m256 acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint16_t* wg = w + g * K * GROUP;
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 3) == 0)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + (c * K + k + PREFETCH) * GROUP), _MM_HINT_T0);
    __m256 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      wv[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + (c * K + k) * GROUP)));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(a, wv[c], acc[r][c]);
    }
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (g + c) * GROUP;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(GROUP, N - n0))), lanes);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(out + r * N + n0, mask, acc[r][c]);
  }
}

// R rows times groups [g0, g1): 4 groups at a time for 1-2 rows (8 independent chains or more), else 2, then 1.
template <int R>
void rows_times_groups(const float* x, int64_t K, const uint16_t* w, float* out, int64_t N, int64_t g0, int64_t g1) {
  constexpr int C = R <= 2 ? 4 : 2;
  int64_t g = g0;
  for (; g + C <= g1; g += C) block<R, C>(x, K, w, out, N, g);
  for (; g < g1; ++g) block<R, 1>(x, K, w, out, N, g);
}

}  // namespace

// x float32 [M, K] -> float32 [M, N] = x @ W^T, packed = the fp16 weight's bits as int16
// [ceil(N / 8), K, 8] (fp16_weight_gemm.pack): each group of 8 channels one stream of k, zero-padded.
at::Tensor fp16_weight_gemm(at::Tensor x, at::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "fp16_weight_gemm: x must be float32 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 3 && packed.size(2) == GROUP &&
              packed.size(0) * GROUP >= out_features, "fp16_weight_gemm: the weight must come from fp16_weight_gemm.pack");
  TORCH_CHECK(x.size(1) == packed.size(1), "fp16_weight_gemm: x has ", x.size(1), " columns, the weight ", packed.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = (N + GROUP - 1) / GROUP;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (G + CHUNK - 1) / CHUNK, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t g0 = chunk * CHUNK, g1 = std::min(G, g0 + CHUNK);
      for (int64_t m = 0; m < M; m += MAX_ROWS) {  // every block of rows while the chunk's weights sit in L2
        const float* xr = xp + m * K;
        float* orow = op + m * N;
        switch (std::min<int64_t>(MAX_ROWS, M - m)) {
          case 1: rows_times_groups<1>(xr, K, wp, orow, N, g0, g1); break;
          case 2: rows_times_groups<2>(xr, K, wp, orow, N, g0, g1); break;
          case 3: rows_times_groups<3>(xr, K, wp, orow, N, g0, g1); break;
          case 4: rows_times_groups<4>(xr, K, wp, orow, N, g0, g1); break;
          case 5: rows_times_groups<5>(xr, K, wp, orow, N, g0, g1); break;
          default: rows_times_groups<6>(xr, K, wp, orow, N, g0, g1); break;
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("fp16_weight_gemm(Tensor x, Tensor packed, int out_features) -> Tensor", &fp16_weight_gemm);
}
