// ScreenedOutputLayer's approximate GEMM on AVX512-BF16 (AMD Zen4, Intel Cooper Lake and later without AMX):
// bf16 rows xb [M, K] times bf16 weights [N, K], float32 sums, float32 out.
//
// Each output (row, channel) is one chain of vdpbf16ps over the k pairs (0, 1), (2, 3), ... in order: a pair's two
// products (exact in float32) are added to the running sum in the instruction's fixed order, whatever the row count
// or the thread count, so a row's result does not depend on the rest of the call (batch-invariant, tested). The
// weights are read once per call: each group of 64 channels (K x 128 bytes, kept in L2) serves every block of up
// to 6 rows. Two bf16 products per lane and instruction: twice the multiply-adds of float32 fma, and no widening of
// fp16 weights (the fp16 kernel's vcvtph2ps), so it runs where Float16Weights' kernel is compute-bound (several
// rows; docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exact_logit.h"

namespace {

constexpr int64_t GROUP = 64;    // output channels per packed group: 4 zmm accumulators of 16 float32
constexpr int BLOCKS = 4;        // GROUP / 16
constexpr int MAX_ROWS = 6;      // rows per register block: 6 x 4 accumulators + 4 weight registers + 1 broadcast
constexpr int64_t PREFETCH = 32; // k pairs ahead (8 KB of the group's stream), as int8_grid_gemm.cpp

// R rows [R, Kp] bf16 times one group's weights [K2, 64, 2] bf16 -> out[r, n0 .. n0 + 64) (channels past N skipped).
// Every loop over rows and blocks is unrolled by pragma: gcc 12 otherwise kept the accumulators on the stack.
template <int R>
void group_rows(const uint16_t* xb, int64_t Kp, const uint16_t* w, int64_t K2, float* out, int64_t N, int64_t n0) {
  __m512 acc[R][BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* wk = w + k2 * GROUP * 2;
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH * GROUP * 2 + 32 * b), _MM_HINT_T0);
    __m512bh wv[BLOCKS];
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wk + 32 * b);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // the row's two bf16 values of this k pair
      std::memcpy(&pair, xb + r * Kp + 2 * k2, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], a, wv[b]);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t j = n0 + 16 * b;
    if (j >= N) break;
    const __mmask16 mask = N - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - j)) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * N + j, mask, acc[r][b]);
  }
}

}  // namespace

// x rounded to bf16 (round to nearest even, as torch's float -> bfloat16)
inline float bf16_round(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// ScreenedOutputLayer's screening of one row's approximate logits lr [V] (float32, in place), its input xr [H]
// (float32), the exact weights w [V, H] (fp16): the bound on |approx - exact| (ScreenedOutputLayer._bound, from the
// norms of x and of its bf16 rounding error, the weights' norms, the fp32 sums' error and the largest |approx|), then
// every token whose approx lies within 2 * bound of the row's largest gets its exact logit (`exact_logit`). One pass
// over the logits for their extremes, one for the candidates (AVX-512 compares). xd: scratch [H].
void screen_row(const float* xr, float* lr, const at::Half* w, int64_t H, int64_t V, double max_norm,
                double max_rounding_norm, double gamma, double flushed, double output_rounding, double* xd) {
  double squares = 0, rounding_squares = 0;
  for (int64_t i = 0; i < H; ++i) {
    const double d = double(xr[i]) - double(bf16_round(xr[i]));
    squares += double(xr[i]) * xr[i];
    rounding_squares += d * d;
    xd[i] = xr[i];
  }
  const double norm = std::sqrt(squares), rounding_norm = std::sqrt(rounding_squares);
  __m512 hi = _mm512_set1_ps(-INFINITY), lo = _mm512_set1_ps(INFINITY);
  for (int64_t c = 0; c < V; c += 16) {
    const __mmask16 m = V - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - c)) - 1);
    hi = _mm512_mask_max_ps(hi, m, hi, _mm512_maskz_loadu_ps(m, lr + c));
    lo = _mm512_mask_min_ps(lo, m, lo, _mm512_maskz_loadu_ps(m, lr + c));
  }
  const float top = _mm512_reduce_max_ps(hi), magnitude = std::max(std::fabs(top), std::fabs(_mm512_reduce_min_ps(lo)));
  const double weights = norm * max_rounding_norm + rounding_norm * max_norm
                         + gamma * (norm + rounding_norm) * max_norm;
  const double bound = weights * 1.01 + magnitude * (output_rounding * 1.01 + std::ldexp(1.0, -22)) + flushed;
  const __m512 t = _mm512_set1_ps(float(double(top) - 2 * bound));
  for (int64_t c0 = 0; c0 < V; c0 += 16) {
    const __mmask16 m = V - c0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - c0)) - 1);
    __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, lr + c0), t, _CMP_GE_OQ);
    for (; hit; hit &= hit - 1) {
      const int64_t c = c0 + __builtin_ctz(hit);
      lr[c] = exact_logit(xd, w + c * H, H);
    }
  }
}

// `screen_row` of every row of approximate logits [R, V] (float32, in place) of rows x [R, H] (float32) with the exact
// weights weight16 [V, H] (fp16), the rows over torch's threads (a row's screening reads and writes its own row
// only). It replaces about 15 torch ops (0.5-0.6 ms of a SmolLM2 step on Zen4); after the vectorized exact logits
// and the threads, a row took 46-62 us instead of 94 alone, five 0.09-0.14 ms instead of 0.33 (docs/benchmarks.md).
void screen_logits(at::Tensor x, at::Tensor logits, at::Tensor weight16, double max_norm, double max_rounding_norm,
                   double gamma, double flushed, double output_rounding) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "screen_logits: x must be contiguous float32 [rows, in]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.size(0) == x.size(0),
              "screen_logits: logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(weight16.scalar_type() == at::kHalf && weight16.dim() == 2 && weight16.is_contiguous()
              && weight16.size(0) == logits.size(1) && weight16.size(1) == x.size(1),
              "screen_logits: weight16 must be contiguous float16 [vocab, in]");
  const int64_t H = x.size(1), V = logits.size(1);
  at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> xd(H);
    for (int64_t r = r0; r < r1; ++r)
      screen_row(x.data_ptr<float>() + r * H, logits.data_ptr<float>() + r * V, weight16.data_ptr<at::Half>(), H, V,
                 max_norm, max_rounding_norm, gamma, flushed, output_rounding, xd.data());
  });
}

// xb bf16 [M, K] -> float32 [M, N] = xb @ W^T, packed = the bf16 weight [ceil(N / 64), ceil(K / 2), 64, 2]
// (bf16_weight_gemm.pack): each group of 64 channels one stream of k pairs, zero-padded.
at::Tensor bf16_weight_gemm(at::Tensor xb, at::Tensor packed, int64_t out_features) {
  TORCH_CHECK(xb.scalar_type() == at::kBFloat16 && xb.dim() == 2, "bf16_weight_gemm: x must be bfloat16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 2
              && packed.size(0) * GROUP >= out_features, "bf16_weight_gemm: the weight must come from bf16_weight_gemm.pack");
  const int64_t M = xb.size(0), K = xb.size(1), N = out_features, G = packed.size(0), K2 = packed.size(1), Kp = 2 * K2;
  TORCH_CHECK((K + 1) / 2 == K2, "bf16_weight_gemm: x has ", K, " columns, the weight ", 2 * K2, " (padded)");
  // whole k pairs: an odd K gets a zero column (its weights are 0 too)
  at::Tensor x = Kp == K ? xb.contiguous() : at::constant_pad_nd(xb, {0, 1});
  auto out = at::empty({M, N}, xb.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* w = wp + g * K2 * GROUP * 2;
      for (int64_t m = 0; m < M; m += MAX_ROWS) {  // every block of rows while the group's weights sit in L2
        const uint16_t* xr = xp + m * Kp;
        float* orow = op + m * N;
        switch (std::min<int64_t>(MAX_ROWS, M - m)) {
          case 1: group_rows<1>(xr, Kp, w, K2, orow, N, g * GROUP); break;
          case 2: group_rows<2>(xr, Kp, w, K2, orow, N, g * GROUP); break;
          case 3: group_rows<3>(xr, Kp, w, K2, orow, N, g * GROUP); break;
          case 4: group_rows<4>(xr, Kp, w, K2, orow, N, g * GROUP); break;
          case 5: group_rows<5>(xr, Kp, w, K2, orow, N, g * GROUP); break;
          default: group_rows<6>(xr, Kp, w, K2, orow, N, g * GROUP); break;
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("bf16_weight_gemm(Tensor xb, Tensor packed, int out_features) -> Tensor", &bf16_weight_gemm);
  m.def("screen_logits(Tensor x, Tensor(a!) logits, Tensor weight16, float max_norm, float max_rounding_norm, "
        "float gamma, float flushed, float output_rounding) -> ()", &screen_logits);
}
