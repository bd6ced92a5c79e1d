// The AVX2 int8 GEMM's inner kernel, shared by int8_grid_gemm_avx2.cpp (Int8PerToken's GEMM on the uint8 grid) and
// int8_screen.cpp (the output layer's screen on a 16-bit grid): 16-bit input values [M, Kp] times int8 weights packed
// in 8-channel groups [K4, 8, 4] (int8_grid_gemm.pack), exact int32 sums, then float(sum - offset) * multiplier per
// channel. vpmaddwd's pair sums land in 32 bits exactly; the caller keeps each output's sum of |x| * 127 below 2^31.
// Compiled with AVX512-VNNI and VL (int8_screen's AVX-512 build), vpdpwssd adds the same pair sums in one instruction
// and register blocks take 12 rows (32 ymm registers).
// Included after <ATen/ATen.h> and <immintrin.h>.
#include <algorithm>

namespace {

constexpr int64_t GROUP = 8;    // output channels per packed group: [K4, 8, 4] int8, 32 bytes per k quad
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI_YMM 1              // vpdpwssd on ymm, and the 32 ymm registers AVX-512 addresses
constexpr int MAX_ROWS = 12;    // 12 x 2 accumulators + 2 weight registers + 2 temporaries of 32 registers
#else
constexpr int MAX_ROWS = 6;     // rows per register block: 6 x 2 accumulators + 2 weight registers + 2 temporaries
                                // = all 16 ymm registers (see group_rows for how they stay there)
#endif
// Software prefetch this many bytes of the group's weights ahead (the hardware prefetchers see one sequential
// stream per group; measured in docs/benchmarks.md)
constexpr int64_t PREFETCH_BYTES = 1024;

// R rows of 16-bit grid values [R, Kp] times one group's weights [K4, 8, 4] -> out[r, n0 .. n0 + 8).
// acc[r][h] holds pair sums: lanes (channel 4h + c, k pair 0/1 of the quad) for c = 0..3, in two 128-bit halves
// (channels 4h, 4h + 1 | 4h + 2, 4h + 3); hadd then a 64-bit permute put the 8 channels' sums in order.
template <int R>
void group_rows(const int16_t* xs, int64_t Kp, const int8_t* w, const int32_t* offset, const float* multiplier,
                float* out, int64_t N, int64_t n0) {
  // the loops over rows unrolled by pragma, as in int8_grid_gemm.cpp: gcc 12 otherwise kept accumulators on the stack
  __m256i acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int64_t K4 = Kp / 4;
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    const int8_t* wk = w + k4 * GROUP * 4;
    if ((k4 & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH_BYTES), _MM_HINT_T0);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      // the row's 4 grid values of this quad, repeated for the 4 channels of a half
      const __m256i a = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(xs + r * Kp + k4 * 4));
#ifdef VNNI_YMM
      acc[r][0] = _mm256_dpwssd_epi32(acc[r][0], w0, a);  // vpmaddwd + vpaddd in one: the same exact sums
      acc[r][1] = _mm256_dpwssd_epi32(acc[r][1], w1, a);
#else
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, a));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, a));
#endif
      // From 4 rows, gcc 12 loaded every row's broadcast first and so kept 9 of 6 rows' 12 accumulators on the
      // stack (a store and a load per madd); this empty asm pins row r's adds before row r + 1's load, so the
      // loop holds all of them in registers: 6 rows' calls 1.3-1.5x faster on Zen3 (docs/benchmarks.md). Below
      // 4 rows nothing spilled and the pin only kept gcc from interleaving quads (1 row: 1.6x slower).
#ifdef VNNI_YMM
      if constexpr (R >= 4) __asm__ volatile("" : "+v"(acc[r][0]), "+v"(acc[r][1]));  // any of the 32 registers
#else
      if constexpr (R >= 4) __asm__ volatile("" : "+x"(acc[r][0]), "+x"(acc[r][1]));
#endif
    }
  }
  const int64_t valid = std::min<int64_t>(GROUP, N - n0);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(valid)), lanes);
  const __m256i off = _mm256_maskload_epi32(offset + n0, mask);
  const __m256 mul = _mm256_maskload_ps(multiplier + n0, mask);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    // hadd: (c0, c1, c4, c5 | c2, c3, c6, c7); the permute puts the 64-bit pairs in channel order
    const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8);
    // fbgemm's epilogue: float(sum - zero point * column sum) * float(step * scale)
    const __m256 result = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, off)), mul);
    _mm256_maskstore_ps(out + r * N + n0, mask, result);
  }
}

// Groups [g0, g1) of a call's output channels: xs [M, Kp] the rows' 16-bit grid values, wp the packed weight,
// out [M, N].
void gemm_groups(const int16_t* qp, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* off, const float* mul,
                 float* op, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* w = wp + g * Kp * GROUP;
    const int64_t blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
    for (int64_t b = 0, m = 0; b < blocks; ++b) {
      const int64_t rows = (M - m) / (blocks - b);
      const int16_t* xr = qp + m * Kp;
      float* orow = op + m * N;
      m += rows;
      switch (rows) {
        case 1: group_rows<1>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 2: group_rows<2>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 3: group_rows<3>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 4: group_rows<4>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 5: group_rows<5>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
#ifdef VNNI_YMM
        case 6: group_rows<6>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 7: group_rows<7>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 8: group_rows<8>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 9: group_rows<9>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 10: group_rows<10>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        case 11: group_rows<11>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
        default: group_rows<12>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
#else
        default: group_rows<6>(xr, Kp, w, off, mul, orow, N, g * GROUP); break;
#endif
      }
    }
  }
}

}  // namespace
