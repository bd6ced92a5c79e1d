// Int8PerToken's GEMM on AVX512-VNNI and AMX: x_unit [M, K] float32 in [-1, 1] rounded on the fixed uint8
// grid, times int8 per-channel weights with exact int32 sums, times (grid step * channel scale).
//
// Bit for bit what fbgemm's `quantized::linear_with_input_q_dq_qweight_dq_output_fp32` returns on a VNNI
// CPU (tests/test_int8_grid_gemm.py): the same rounding (`round_on_grid`), exact sums (uint8 x int8 into
// int32 with no 16-bit saturation, on either path), and the same epilogue, float(sum - zero_point * column
// sum) * float(step * scale). A row's result depends on that row alone, whichever path ran it. What
// differs is the cost: the weights are read once per call whatever the row count, where fbgemm's cost
// grows with the rows. Calls of fewer than `amx_min_rows` rows run in AVX512-VNNI register blocks of up to
// 6 rows over a 64-channel group while it sits in L1/L2; larger ones on AMX tiles of 16 rows, whose cost
// hardly grows up to 16 rows (docs/benchmarks.md has the measurements behind the threshold).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <vector>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include "shared_items.h"

namespace {

constexpr int64_t GROUP = 64;   // output channels per group: 4 zmm accumulators of 16 int32
constexpr int BLOCKS = 4;       // GROUP / 16
constexpr int MAX_ROWS = 6;     // rows per register block: 6 x 4 accumulators + 4 weight registers
constexpr int64_t AMX_ROWS = 16;  // rows per AMX block
// The AMX loop prefetches the weights this many 4 KB k-chunks ahead (8 KB, as the VNNI loop does): without it,
// on a host whose memory answered slowly (2026-12-02 19:20), SmolLM2's 120 layer matrices took 26 ms on AMX
// against 12-13 on VNNI at one row; with it 15.5 (distance 1: the same, 4: +0.5 ms, 8: +1.5; docs/benchmarks.md)
constexpr int64_t AMX_PREFETCH = 2;

// Rows [R, Kp] uint8 times one group's weights [K4, 64, 4] int8 -> sums [R, 64], exact int32 sums.
// The loops over rows and blocks are unrolled by pragma: without it gcc 12 kept the accumulator array in memory as
// well as in registers and stored all 4R accumulators to the stack on every k quad (24 stores and 48 moves per 24
// dot products at 6 rows), so a 6-row call ran at 66-73 GMAC/s where 3 rows reached 95 (one Zen4 core, SmolLM2's
// gate_up; docs/benchmarks.md).
template <int R>
void group_sums(const uint8_t* xq, int64_t Kp, const int8_t* w, int64_t K4, int32_t* sums) {
  __m512i acc[R][BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_setzero_si512();
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    const int8_t* wk = w + k4 * GROUP * 4;
    // 32 k quads (8 KB) ahead: 8.7-8.8 ms over SmolLM2's layer matrices at one row against 9.1-9.2 for 16 quads,
    // 8.8-8.9 for 48-64 and 10.4 without software prefetch (one thread, cold cache, Intel). Into L2, not L1: on AMD
    // Zen4 the 120 matrices took 0.92-0.95 of the time on two threads at 1 and 5 rows (four interleaved runs;
    // distances 12-64 alike), an L2 miss queue longer than L1's keeping more of the stream in flight
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) _mm_prefetch(reinterpret_cast<const char*>(wk + 32 * GROUP * 4 + 64 * b), _MM_HINT_T1);
    __m512i wv[BLOCKS];
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) wv[b] = _mm512_loadu_si512(wk + 64 * b);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;  // the row's 4 grid values of this k quad
      std::memcpy(&quad, xq + r * Kp + k4 * 4, 4);
      const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], a, wv[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < BLOCKS; ++b) _mm512_store_si512(sums + r * GROUP + 16 * b, acc[r][b]);
}

// out[r, n0 + j] = float(sums[r, j] - offset[n0 + j]) * multiplier[n0 + j] for R rows of one group's 64 channels
// (sums [R, 64] int32; channels past N skipped): fbgemm's epilogue.
void epilogue(const int32_t* sums, int64_t R, const int32_t* offset, const float* multiplier, float* out, int64_t N,
              int64_t n0) {
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t j = n0 + 16 * b;
    if (j >= N) break;
    const __mmask16 mask = N - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - j)) - 1);
    const __m512i off = _mm512_maskz_loadu_epi32(mask, offset + j);
    const __m512 mul = _mm512_maskz_loadu_ps(mask, multiplier + j);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 raw = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sums + r * GROUP + 16 * b), off));
      _mm512_mask_storeu_ps(out + r * N + j, mask, _mm512_mul_ps(raw, mul));
    }
  }
}

// R rows of one group on AVX512-VNNI registers, then the epilogue.
template <int R>
void group_rows(const uint8_t* xq, int64_t Kp, const int8_t* w, int64_t K4, const int32_t* offset,
                const float* multiplier, float* out, int64_t N, int64_t n0) {
  alignas(64) int32_t sums[R * GROUP];
  group_sums<R>(xq, Kp, w, K4, sums);
  epilogue(sums, R, offset, multiplier, out, N, n0);
}

// x [M, K] -> uint8 [M, Kp] as fbgemm rounds its input (measured on every column, its scalar tail too):
// fma(x, 1 / step, zero point) with one rounding, clamped to [0, 255], then to the nearest integer (ties
// to even). Padding columns hold the zero point (their weights are 0).
void round_on_grid(const float* x, int64_t M, int64_t K, int64_t Kp, float step, int32_t zero_point, uint8_t* q) {
  const __m512 inv = _mm512_set1_ps(1.0f / step), zp = _mm512_set1_ps(float(zero_point));
  const __m512 lo = _mm512_set1_ps(0.0f), hi = _mm512_set1_ps(255.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    uint8_t* qr = q + m * Kp;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, xr + k), inv, zp), lo), hi);
      _mm_mask_storeu_epi8(qr + k, mask, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));  // rounds to nearest even
    }
    std::fill(qr + K, qr + Kp, uint8_t(zero_point));
  }
}


struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux keeps AMX's tile data off until a process asks (once per process).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// R (<= 16) rows [R, Kp] uint8 times one group's weights on AMX tiles: tmm0-3 the 4 channel blocks' sums,
// tmm4 the rows' 64 columns, tmm5-7 the weights' [16 k quads, 16 channels x 4]; then the epilogue.
void amx_group_rows(int64_t R, const uint8_t* xq, int64_t Kp, const int8_t* w, const int32_t* offset,
                    const float* multiplier, float* out, int64_t N, int64_t n0) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kc = 0; kc < Kp / 64; ++kc) {
    const int8_t* wk = w + kc * 16 * GROUP * 4;
    for (int line = 0; line < 16 * GROUP * 4 / 64; ++line)  // the 64 cache lines of a later k-chunk
      _mm_prefetch(reinterpret_cast<const char*>(wk + AMX_PREFETCH * 16 * GROUP * 4 + 64 * line), _MM_HINT_T0);
    _tile_loadd(4, xq + kc * 64, Kp);
    _tile_loadd(5, wk, GROUP * 4);
    _tile_dpbusd(0, 4, 5);
    _tile_loadd(6, wk + 64, GROUP * 4);
    _tile_dpbusd(1, 4, 6);
    _tile_loadd(7, wk + 128, GROUP * 4);
    _tile_dpbusd(2, 4, 7);
    _tile_loadd(5, wk + 192, GROUP * 4);
    _tile_dpbusd(3, 4, 5);
  }
  alignas(64) int32_t sums[AMX_ROWS * GROUP];
  _tile_stored(0, sums, GROUP * 4);
  _tile_stored(1, sums + 16, GROUP * 4);
  _tile_stored(2, sums + 32, GROUP * 4);
  _tile_stored(3, sums + 48, GROUP * 4);
  epilogue(sums, R, offset, multiplier, out, N, n0);
}

// This thread's tile shapes (palette 1): tmm0-4 R rows of 64 bytes, tmm5-7 16 rows (k quads) of 64 bytes.
void amx_configure(int64_t R) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) { config.rows[t] = uint8_t(t < 5 ? R : 16); config.colsb[t] = 64; }
  // gcc 12's _tile_loadconfig declares a read of the config's first 8 bytes only, so the compiler may drop the stores
  // to the rest (a prototype's ldtilecfg then loaded garbage: SIGSEGV, or no tiles: SIGILL); this asm reads all 64
  asm volatile("ldtilecfg %0" : : "m"(config));
}

// Groups [g0, g1) of a call's output channels: xq [Mp, Kp] the rows rounded on the grid (Mp: M, or M padded to
// whole AMX tiles where `amx`), wp the packed weight, out [M, N].
void gemm_groups(const uint8_t* qp, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* off, const float* mul,
                 float* op, int64_t N, int64_t g0, int64_t g1, bool amx) {
  const int64_t K4 = Kp / 4;
  if (amx) {  // whole 16-row tiles (xq's padding rows hold the zero point; their sums are not stored)
    amx_configure(AMX_ROWS);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < M; m += AMX_ROWS)
        amx_group_rows(std::min(AMX_ROWS, M - m), qp + m * Kp, Kp, wp + g * K4 * GROUP * 4, off, mul, op + m * N, N, g * GROUP);
    _tile_release();
    return;
  }
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* w = wp + g * K4 * GROUP * 4;
    for (int64_t m = 0; m < M; m += MAX_ROWS) {
      const uint8_t* xr = qp + m * Kp;
      float* orow = op + m * N;
      switch (std::min<int64_t>(MAX_ROWS, M - m)) {
        case 1: group_rows<1>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
        case 2: group_rows<2>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
        case 3: group_rows<3>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
        case 4: group_rows<4>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
        case 5: group_rows<5>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
        default: group_rows<6>(xr, Kp, w, K4, off, mul, orow, N, g * GROUP); break;
      }
    }
  }
}

// One call's input checked and rounded on the grid: xq [Mp, Kp] uint8, and whether the call runs on AMX tiles.
struct Rounded {
  at::Tensor xq;
  bool amx;
};

// One call's input checked: float32 [rows, in_features] for the packed weight -> contiguous.
at::Tensor checked_input(at::Tensor x, const at::Tensor& packed, const at::Tensor& offset, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "grid_gemm: x must be float32 [rows, in]");
  x = x.contiguous();
  const int64_t K = x.size(1), N = offset.size(0), Kp = packed.size(1) * 4;
  TORCH_CHECK(K == in_features && Kp >= K && packed.size(0) * GROUP >= N, "grid_gemm: x has ", K, " columns, the weight ",
              in_features);
  return x;
}

Rounded round_input(at::Tensor x, const at::Tensor& packed, const at::Tensor& offset, int64_t in_features, double step,
                    int64_t zero_point, int64_t amx_min_rows) {
  x = checked_input(x, packed, offset, in_features);
  const int64_t M = x.size(0), K = x.size(1), Kp = packed.size(1) * 4;
  const bool amx = amx_min_rows > 0 && M >= amx_min_rows && amx_permitted();
  const int64_t Mp = amx ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;  // AMX reads whole 16-row tiles
  auto xq = at::empty({Mp, Kp}, x.options().dtype(at::kByte));
  round_on_grid(x.data_ptr<float>(), M, K, Kp, float(step), int32_t(zero_point), xq.data_ptr<uint8_t>());
  std::fill(xq.data_ptr<uint8_t>() + M * Kp, xq.data_ptr<uint8_t>() + Mp * Kp, uint8_t(zero_point));
  return {xq, amx};
}

}  // namespace

// x_unit float32 [M, K] -> float32 [M, N]; packed = int8 [ceil(N / 64), ceil(K / 64) * 16, 64, 4] (int8_grid_gemm.pack);
// offset = zero_point * column sums (int32 [N]),
// multiplier = float(step * channel scale) ([N]).
at::Tensor grid_gemm(at::Tensor x, at::Tensor packed, at::Tensor offset, at::Tensor multiplier,
                     int64_t in_features, double step, int64_t zero_point, int64_t amx_min_rows) {
  const Rounded in = round_input(x, packed, offset, in_features, step, zero_point, amx_min_rows);
  const int64_t M = x.size(0), N = offset.size(0), Kp = packed.size(1) * 4;
  auto out = at::empty({M, N}, x.options());
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    gemm_groups(in.xq.data_ptr<uint8_t>(), M, Kp, packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                multiplier.data_ptr<float>(), out.data_ptr<float>(), N, g0, g1, in.amx);
  });
  return out;
}

// grid_gemm into out [M, N] by the threads of a team (csrc/fused_layers.cpp), each calling it with the same
// arguments: they take the output channel groups from the phase `phase` of `tickets` (shared_items.h, `take_ranges`:
// each thread its own contiguous range first), each thread rounding the input itself before its first group; calls of
// many rows split the rows instead (`SharedItems::splits_rows`: chunks of rows, each with every group, each thread
// rounding only its own). A result does not depend on which thread computes it, nor with which rows (exact sums).
void grid_gemm_into(at::Tensor x, at::Tensor packed, at::Tensor offset, at::Tensor multiplier, int64_t in_features,
                    double step, int64_t zero_point, int64_t amx_min_rows, at::Tensor out, at::Tensor tickets,
                    int64_t phase) {
  const SharedItems items = SharedItems::of(tickets, phase, "grid_gemm_into");
  const int64_t M = x.size(0), N = offset.size(0), Kp = packed.size(1) * 4, G = packed.size(0);
  SharedItems::check_output(out, M, N, "grid_gemm_into");
  if (items.exhausted()) return;  // the other threads took every group
  if (SharedItems::splits_rows(M, amx_min_rows)) {  // every group of the rows this thread takes, rounded by it alone
    const at::Tensor xc = checked_input(x, packed, offset, in_features);
    const int64_t K = xc.size(1);
    std::vector<uint8_t> xq(SharedItems::ROW_CHUNK * Kp);  // one chunk's rows on the grid, reused for each
    items.take_rows(M, amx_min_rows, omp_get_thread_num(), omp_get_num_threads(), [&](int64_t m0, int64_t m1) {
      round_on_grid(xc.data_ptr<float>() + m0 * K, m1 - m0, K, Kp, float(step), int32_t(zero_point), xq.data());
      gemm_groups(xq.data(), m1 - m0, Kp, packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                  multiplier.data_ptr<float>(), out.data_ptr<float>() + m0 * N, N, 0, G, false);
    });
    return;
  }
  const Rounded in = round_input(x, packed, offset, in_features, step, zero_point, amx_min_rows);
  items.take_ranges(G, 1, omp_get_thread_num(), omp_get_num_threads(), [&](int64_t g0, int64_t g1) {
    gemm_groups(in.xq.data_ptr<uint8_t>(), M, Kp, packed.data_ptr<int8_t>(), offset.data_ptr<int32_t>(),
                multiplier.data_ptr<float>(), out.data_ptr<float>(), N, g0, g1, in.amx);
  });
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("int8_grid_gemm(Tensor x, Tensor packed, Tensor offset, Tensor multiplier, int in_features, float step, int zero_point, int amx_min_rows) -> Tensor",
        &grid_gemm);
  m.def("int8_grid_gemm_into(Tensor x, Tensor packed, Tensor offset, Tensor multiplier, int in_features, float step, "
        "int zero_point, int amx_min_rows, Tensor(a!) out, Tensor(b!) tickets, int phase) -> ()", &grid_gemm_into);
}
