// Int8PerToken's GEMM on AVX2 (CPUs without AVX512-VNNI, such as AMD Zen3): x_unit [M, K] float32 in [-1, 1]
// rounded on the fixed uint8 grid, times int8 per-channel weights with exact int32 sums, times
// (grid step * channel scale).
//
// The same bits as the AVX512-VNNI kernel (int8_grid_gemm.cpp) and as fbgemm on a VNNI CPU: the same rounding,
// exact sums, the same epilogue. fbgemm's own AVX2 path is not exact: it multiplies uint8 x int8 pairs with
// vpmaddubsw, whose 16-bit pair sums saturate (a grid value of 254 times two weights of 127 is 64516); here both
// sides are widened to 16 bits first and multiplied with vpmaddwd, whose pair sums land in 32 bits exactly.
// The weights are read once per call whatever the row count: each 8-channel group's weights (K * 8 bytes, in L1
// after the first block of rows) are widened in registers and applied to up to 6 rows at once, a call's rows split
// into blocks of as equal sizes as 6 allows (8 rows: 4 + 4, not 6 + 2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

#include <omp.h>

#include "shared_items.h"

#include "int8_avx2_groups.h"

namespace {

// x [M, K] -> int16 [M, Kp] grid values as fbgemm rounds its input: fma(x, 1 / step, zero point) with one
// rounding, clamped to [0, 255], then to the nearest integer (ties to even). Padding columns hold the zero
// point (their weights are 0).
void round_on_grid(const float* x, int64_t M, int64_t K, int64_t Kp, float step, int32_t zero_point, int16_t* q) {
  const __m256 inv = _mm256_set1_ps(1.0f / step), zp = _mm256_set1_ps(float(zero_point));
  const __m256 lo = _mm256_set1_ps(0.0f), hi = _mm256_set1_ps(255.0f);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) int32_t rounded[8];
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int16_t* qr = q + m * Kp;
    for (int64_t k = 0; k < K; k += 8) {
      const int64_t n = std::min<int64_t>(8, K - k);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n)), lanes);
      const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(_mm256_maskload_ps(xr + k, mask), inv, zp), lo), hi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), _mm256_cvtps_epi32(v));  // rounds to nearest even
      for (int64_t j = 0; j < n; ++j) qr[k + j] = int16_t(rounded[j]);
    }
    std::fill(qr + K, qr + Kp, int16_t(zero_point));
  }
}

// One call's input checked: float32 [rows, in_features] for the packed weight -> contiguous.
at::Tensor checked_input(at::Tensor x, const at::Tensor& packed, const at::Tensor& offset, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "grid_gemm: x must be float32 [rows, in]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 4, "grid_gemm: packed for groups of ",
              packed.size(2), " channels, this kernel takes ", GROUP);
  x = x.contiguous();
  const int64_t K = x.size(1), N = offset.size(0), Kp = packed.size(1) * 4;
  TORCH_CHECK(K == in_features && Kp >= K && packed.size(0) * GROUP >= N, "grid_gemm: x has ", K, " columns, the weight ",
              in_features);
  return x;
}

// One call's input checked and rounded on the grid: int16 [M, Kp]
at::Tensor round_input(at::Tensor x, const at::Tensor& packed, const at::Tensor& offset, int64_t in_features,
                       double step, int64_t zero_point) {
  x = checked_input(x, packed, offset, in_features);
  const int64_t M = x.size(0), K = x.size(1), Kp = packed.size(1) * 4;
  auto xs = at::empty({M, Kp}, x.options().dtype(at::kShort));
  round_on_grid(x.data_ptr<float>(), M, K, Kp, float(step), int32_t(zero_point), xs.data_ptr<int16_t>());
  return xs;
}

}  // namespace

// x_unit float32 [M, K] -> float32 [M, N]; packed = int8 [ceil(N / 8), ceil(K / 4), 8, 4] (int8_grid_gemm.pack);
// offset = zero_point * column sums (int32 [N]), multiplier = float(step * channel scale) ([N]).
at::Tensor grid_gemm_avx2(at::Tensor x, at::Tensor packed, at::Tensor offset, at::Tensor multiplier,
                          int64_t in_features, double step, int64_t zero_point) {
  const at::Tensor xs = round_input(x, packed, offset, in_features, step, zero_point);
  const int64_t M = x.size(0), N = offset.size(0);
  auto out = at::empty({M, N}, x.options());
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    gemm_groups(xs.data_ptr<int16_t>(), M, xs.size(1), packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                multiplier.data_ptr<float>(), out.data_ptr<float>(), N, g0, g1);
  });
  return out;
}

// grid_gemm_avx2 into out [M, N] by the threads of a team (csrc/fused_layers.cpp), each calling it with the same
// arguments: they take the output channel groups, 16 chunks of them, from the phase `phase` of `tickets`
// (shared_items.h), each thread rounding the input itself before its first chunk; calls of many rows split the rows
// instead (`SharedItems::splits_rows`), as the VNNI build's.
void grid_gemm_avx2_into(at::Tensor x, at::Tensor packed, at::Tensor offset, at::Tensor multiplier, int64_t in_features,
                         double step, int64_t zero_point, at::Tensor out, at::Tensor tickets, int64_t phase) {
  const SharedItems items = SharedItems::of(tickets, phase, "grid_gemm_into");
  const int64_t M = x.size(0), N = offset.size(0), G = packed.size(0);
  SharedItems::check_output(out, M, N, "grid_gemm_into");
  if (items.exhausted()) return;  // the other threads took every group
  if (SharedItems::splits_rows(M, 0)) {  // every group of the rows this thread takes, rounded by it alone
    const at::Tensor xc = checked_input(x, packed, offset, in_features);
    const int64_t K = xc.size(1), Kp = packed.size(1) * 4;
    std::vector<int16_t> xs(SharedItems::ROW_CHUNK * Kp);  // one chunk's rows on the grid, reused for each
    items.take_rows(M, 0, omp_get_thread_num(), omp_get_num_threads(), [&](int64_t m0, int64_t m1) {
      round_on_grid(xc.data_ptr<float>() + m0 * K, m1 - m0, K, Kp, float(step), int32_t(zero_point), xs.data());
      gemm_groups(xs.data(), m1 - m0, Kp, packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                  multiplier.data_ptr<float>(), out.data_ptr<float>() + m0 * N, N, 0, G);
    });
    return;
  }
  const at::Tensor xs = round_input(x, packed, offset, in_features, step, zero_point);
  // 8-channel groups: a chunk of them per claim
  items.take_ranges(G, (G + 15) / 16, omp_get_thread_num(), omp_get_num_threads(), [&](int64_t g0, int64_t g1) {
    gemm_groups(xs.data_ptr<int16_t>(), M, xs.size(1), packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                multiplier.data_ptr<float>(), out.data_ptr<float>(), N, g0, g1);
  });
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("int8_grid_gemm_avx2(Tensor x, Tensor packed, Tensor offset, Tensor multiplier, int in_features, float step, int zero_point) -> Tensor",
        &grid_gemm_avx2);
  m.def("int8_grid_gemm_avx2_into(Tensor x, Tensor packed, Tensor offset, Tensor multiplier, int in_features, "
        "float step, int zero_point, Tensor(a!) out, Tensor(b!) tickets, int phase) -> ()", &grid_gemm_avx2_into);
}
