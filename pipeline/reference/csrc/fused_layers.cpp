// Decoder layers in one call, for forwards on the row attention kernel (decode steps, short chains):
// - `dense_layers`: every layer of a small float32 model (a draft). A draft forward of one token per request runs
//   20-30 small ops per layer, 2-40 us each from Python (the RMSNorm alone is five ATen ops), for arithmetic that
//   takes a few microseconds at a draft's widths. Each layer is RMSNorm -> qkv GEMM (+ bias) -> RoPE -> KV write and
//   row attention -> o GEMM -> residual -> RMSNorm -> gate_up GEMM -> SiLU * up -> down GEMM -> residual, then the
//   final RMSNorm; the GEMMs of up to 4 rows on a small weight run the project's GEMVs (`draft_linear`), the others
//   at::linear (the eager path's F.linear; `linear` splits one-row GEMVs over the threads). The results are close
//   to the eager layers', not bit-equal (the GEMVs and the RMSNorm sum in their own order; tests/test_fused_layers.py).
// - `int8_sq_layers`: every layer of an int8_sq model (W8A8, per-token activations): the same layer with each GEMM
//   input multiplied by its SmoothQuant 1/smoother and divided by its row's max |x| (`scale_rows`), the GEMM the
//   project's int8 kernel named by `gemm` (pipeline/reference/int8_grid_gemm.py), its output multiplied back by the
//   row scale. Between its four GEMMs a layer ran five inductor-compiled regions and five Python calls of custom ops
//   (pipeline/reference/compiled.py), 4-17 us each, about 2 ms of a SmolLM2 decode step. Every row is computed
//   alone, in the same order whatever the row count: batch-invariant (tests/test_fused_layers.py).
// The attention is the row attention op named by `attention` (its AVX-512 or AVX2 build, pipeline/reference/
// row_attention.py); everything else plain loops over the rows. Python side: pipeline/reference/fused_layers.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bf16_kv.h"
#include "shared_items.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// The row-wise work (norms, RoPE, SiLU, the int8 GEMMs' row scaling) in AVX-512, AVX2 and baseline x86-64 clones,
// picked at load by the CPU (GCC's target_clones): the library itself builds for any x86-64 (SSE2), where these
// loops ran 4 lanes wide and the rows' max |x| one element at a time. The build's -ffp-contract=off keeps every clone's
// arithmetic per element what the source says (no fused multiply-adds), and the max is exact in any order, so every
// clone gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ROW_CLONES
#endif

constexpr int64_t TENSORS_PER_LAYER = 7;  // input norm, post norm, qkv weight, qkv bias (empty: none), o, gate_up, down

// f(t) for every row t < T, the rows split over torch's threads (a row's arithmetic and bits do not depend on the
// thread that runs it); a single row runs inline. A 6-token verify's elementwise work ran on one thread while the
// other waited: about 2 ms of its 12.6 (perf).
template <typename F>
void each_row(int64_t T, const F& f) {
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

// Thrown out of Team::wait_for on the threads that a failed thread left waiting.
struct Abandoned {};

// The threads of one parallel region that runs a whole forward (`run_team`). Each phase (a GEMM, the attention, the
// row-wise work between them) is a set of items the threads take from a shared counter (shared_items.h); a thread
// that finds none left waits, spinning, until every item is finished, then goes on to the next phase. Separate
// parallel regions per phase cost a forward 150-300 OpenMP fork/joins, and under OMP_WAIT_POLICY=PASSIVE (as served:
// idle OpenMP threads sleep) each one wakes a sleeping thread: after 450 cached tokens SmolLM2's one-token step took
// 11.4 ms on two threads that way and 7.8 as a team, a 6-token verify 22.1 and 10.0 (docs/benchmarks.md). A team's
// threads spin only inside a forward, and a thread that lost its core to another process (the server's and client's,
// on a small host) holds up a phase by at most the item it holds: the others take the rest, where a barrier would
// wait for it.
class Team {
 public:
  // Return once every item of the phase is finished; throws Abandoned where a thread failed. Until then the thread
  // runs idle() (a short task: true while it has more) between checks, then pauses; after SPINS pauses it yields its
  // core at every check.
  template <typename F>
  void wait_for(const SharedItems& items, const F& idle) const {
    constexpr int64_t SPINS = 1 << 14;
    bool busy = true;
    for (int64_t spins = 0; !items.finished(); ++spins) {
      if (failed_.load(std::memory_order_acquire)) throw Abandoned{};
      if (busy) {
        busy = idle();
        continue;
      }
      if (spins >= SPINS) std::this_thread::yield();
#if defined(__x86_64__) || defined(__i386__)
      else _mm_pause();
#endif
    }
  }

  void fail() { failed_.store(true, std::memory_order_release); }

 private:
  std::atomic<bool> failed_{false};
};

// body(team, threads) on every thread of one parallel region of torch's thread count, with the caller's thread-local
// state (inference mode and the like). The first exception of any thread releases the others from Team::wait_for and
// is rethrown here.
template <typename F>
void run_team(const F& body) {
  Team team;
  const at::ThreadLocalState caller;
  std::exception_ptr error;
  std::mutex error_lock;
#pragma omp parallel
  {
    const at::ThreadLocalStateGuard as_caller(caller);
    try {
      body(team, omp_get_num_threads());
    } catch (const Abandoned&) {
    } catch (...) {
      const std::lock_guard<std::mutex> guard(error_lock);
      if (!error) error = std::current_exception();
      team.fail();
    }
  }
  if (error) std::rethrow_exception(error);
}

constexpr int64_t SQUARE_LANES = 16;  // inv_rms' partial sums

// 1 / sqrt(mean(r^2) + eps) of a row r [n]: its squares summed in SQUARE_LANES partial sums (lane j: the elements
// i = j mod SQUARE_LANES of the whole blocks, in order), then the rest and the partial sums in order. Every clone
// computes each lane's sum in the same order, so the bits do not depend on the CPU's vector width. One sum in order
// was a chain of dependent additions: about 1 us for SmolLM2's 576 inputs, 60 of them a row in a forward (perf: the
// rows' scaling +0.42 ms in a 6-row verify).
inline float inv_rms(const float* r, int64_t n, double eps) {
  float lanes[SQUARE_LANES] = {};
  const int64_t whole = n / SQUARE_LANES * SQUARE_LANES;
  for (int64_t i = 0; i < whole; i += SQUARE_LANES)
    for (int64_t j = 0; j < SQUARE_LANES; ++j) lanes[j] += r[i + j] * r[i + j];
  float squares = 0.f;
  for (int64_t i = whole; i < n; ++i) squares += r[i] * r[i];
  for (const float lane : lanes) squares += lane;
  return 1.f / std::sqrt(squares / float(n) + float(eps));
}

// One row r [n] -> o = r / sqrt(mean(r^2) + eps) * w (HF's order: normalise, then scale)
ROW_CLONES void norm_row(const float* r, int64_t n, const float* w, double eps, float* o) {
  const float inv = inv_rms(r, n, eps);
  for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (r[i] * inv);
}

// x float32 [T, n] -> `norm_row` of every row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  each_row(T, [&](int64_t t) { norm_row(xp + t * n, n, wp, eps, op + t * n); });
  return out;
}

// One row of qkv [(H + 2 KVH) * D] -> RoPE'd q [H, D], k [KVH, D] and v [KVH, D]; c, s [D] the row's cos and sin (sin
// signed: rotate_half(x) * sin == roll(x, D / 2) * signed sin)
ROW_CLONES void rope_row(const float* row, const float* c, const float* s, int64_t H, int64_t KVH, int64_t D, float* q,
                         float* k, float* v) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H + KVH; ++h) {
    const float* x = row + h * D;
    float* o = h < H ? q + h * D : k + (h - H) * D;
    // roll(x, D / 2) in two loops, which vectorize (a modulo index kept the loop scalar: 0.44 -> 0.13 us a row)
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] + x[d + half] * s[d];
    for (int64_t d = half; d < D; ++d) o[d] = x[d] * c[d] + x[d - half] * s[d];
  }
  std::memcpy(v, row + (H + KVH) * D, KVH * D * sizeof(float));
}

// qkv [T, (H + 2 KVH) * D] -> RoPE'd q [T, H, D], k [T, KVH, D] and v [T, KVH, D]; cos, sin [T, 1, D] (`rope_row`)
void rope_split(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  const int64_t T = qkv.size(0), D = cos.size(2), width = qkv.size(1);
  q = at::empty({T, H, D}, qkv.options());
  k = at::empty({T, KVH, D}, qkv.options());
  v = at::empty({T, KVH, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  each_row(T, [&](int64_t t) {
    rope_row(in + t * width, cp + t * D, sp + t * D, H, KVH, D, qp + t * H * D, kp + t * KVH * D, vp + t * KVH * D);
  });
}

// 2^t for t in [-125, 125]: t = n + f (n the nearest integer, |f| <= 1/2), 2^f by its Taylor polynomial of degree 7
// in Horner's order, times 2^n set in the exponent bits (relative error about 1e-7). Plain arithmetic, so a loop of
// it vectorizes, with the same bits on every x86-64 host.
inline float exp2_taylor(float t) {
  constexpr float TAYLOR[8] = {1.5252733804059840e-5f, 1.5403530393381609e-4f, 1.3333558146428443e-3f,
                               9.6181291076284772e-3f, 5.5504108664821580e-2f, 2.4022650695910071e-1f,
                               6.9314718055994531e-1f, 1.0f};
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: (t + ROUND) - ROUND is t rounded to the nearest integer
  const float n = (t + ROUND) - ROUND, f = t - n;
  float p = TAYLOR[0];
  for (int i = 1; i < 8; ++i) p = p * f + TAYLOR[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// o[i] = SiLU(g) * u = g / (1 + e^-g) * u, g = y[i] * s, u = y[inter + i] * s: a gate_up GEMM's output row
// [2 * inter] (unscaled) -> the down GEMM's input [inter]. Two loops that the compiler vectorizes (a clamp inside
// the second kept it scalar): -g log2(e), clamped, into o; then the rest. std::exp per element took 9 us of a
// 1536-wide row.
ROW_CLONES void silu_mul_row(const float* y, int64_t inter, float s, float* o) {
  for (int64_t i = 0; i < inter; ++i) {
    const float t = -(y[i] * s) * 1.44269504088896341f;
    o[i] = t < -125.f ? -125.f : (t > 125.f ? 125.f : t);
  }
  for (int64_t i = 0; i < inter; ++i) {
    const float g = y[i] * s;
    o[i] = g / (1.f + exp2_taylor(o[i])) * (y[inter + i] * s);
  }
}

// gate_up [T, 2 I] -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  each_row(T, [&](int64_t t) { silu_mul_row(in + t * 2 * I, I, 1.f, op + t * I); });
  return out;
}

// x += y (same shape, contiguous)
void add_(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
}

constexpr int64_t SPLIT_ALIGN = 16;  // output channels per 64 bytes: every part starts on a cache line

// x [R, in] @ w [out, in]^T (+ bias) -> [R, out], bit for bit at::linear's result on one thread. MKL runs a one-row
// GEMV on one thread whatever torch's thread count on the AMD hosts (a 4096 x 128 output layer 50-64 us, SmolLM2's
// 49152 x 576 one 6.8-10 ms on one thread or two; on an Intel AMX host it split a 300 x 1000 weight's sums over two
// threads, other bits), so for one row and a weight of split_min_bytes or more (linear.py's ONE_ROW_SPLIT_BYTES) the
// output channels are split over torch's threads, each part the same MKL GEMV on its channels (a channel's sum does
// not depend on the others: 38 us and 3.4 ms on two threads, docs/benchmarks.md). Several rows, or a call inside a
// parallel region, run at::linear as it is.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t split_min_bytes) {
  const int64_t N = w.size(0), threads = at::get_num_threads();
  if (x.size(0) != 1 || threads < 2 || w.numel() * w.element_size() < split_min_bytes || at::in_parallel_region())
    return at::linear(x, w, bias);
  auto out = at::empty({1, N}, x.options());
  const int64_t part = (N / threads + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
  const at::ThreadLocalState caller;  // inference mode and the like, for the ATen calls on the other threads
  at::parallel_for(0, threads, 1, [&](int64_t p0, int64_t p1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = std::min(N, p * part), n = std::min(N, n0 + part) - n0;
      if (n == 0) continue;
      at::Tensor o = out.narrow(1, n0, n);
      const at::Tensor wt = w.narrow(0, n0, n).t();
      if (bias) at::addmm_out(o, bias->narrow(0, n0, n), x, wt);  // as at::linear: addmm with the bias
      else at::mm_out(o, x, wt);
    }
  });
  return out;
}

constexpr int64_t GEMV_MAX_ROWS = 4;  // dense_layers' GEMMs of up to this many rows run `draft_linear`'s GEMV
constexpr int64_t GEMV_BLOCK = 64;    // output channels a wide-layout GEMV sums at once (four 16-lane registers)

// One row x [K] times w [N, K] stored row-major (a channel's weights contiguous) -> out [N]: four channels at a time,
// each a vectorized sum over k (omp simd: the lanes' partial sums, then across them; the order follows the clone's
// vector width, which a draft's proposals may: the target verifies them).
ROW_CLONES void gemv_rows_major(const float* x, int64_t K, const float* w, int64_t N, float* out) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < K; ++k) s0 += x[k] * w0[k], s1 += x[k] * w1[k], s2 += x[k] * w2[k], s3 += x[k] * w3[k];
    out[n] = s0, out[n + 1] = s1, out[n + 2] = s2, out[n + 3] = s3;
  }
  for (; n < N; ++n) {
    const float* wn = w + n * K;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += x[k] * wn[k];
    out[n] = s;
  }
}

// The same for w stored [K, N] (linear.py's wide layout: an input's weights for every channel contiguous): GEMV_BLOCK
// channels at a time, each channel's sum in k order.
ROW_CLONES void gemv_wide(const float* x, int64_t K, const float* w, int64_t N, float* out) {
  for (int64_t b = 0; b < N; b += GEMV_BLOCK) {
    const int64_t m = std::min(GEMV_BLOCK, N - b);
    float acc[GEMV_BLOCK] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[k], *wk = w + k * N + b;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) acc[j] += a * wk[j];
    }
    std::memcpy(out + b, acc, m * sizeof(float));
  }
}

// x [R, in] @ w [out, in]^T (+ bias) -> [R, out] for the draft's layers (dense_layers): up to GEMV_MAX_ROWS rows
// and a weight below split_min_bytes (in the caches: a small draft's) run the GEMVs above on one thread, on w as it is
// stored (row-major or wide layout); anything else runs `linear`. A draft step's four at::linear calls cost 3-8 us
// each around a few microseconds of arithmetic (the ATen dispatch, the transposed views, MKL's entry); the GEMVs'
// sums are in another order than MKL's (close, not bit-equal).
at::Tensor draft_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t split_min_bytes) {
  const int64_t R = x.size(0), N = w.size(0), K = w.size(1);
  const bool rows_major = w.stride(1) == 1 && w.stride(0) == K, wide = w.stride(0) == 1 && w.stride(1) == N;
  if (R > GEMV_MAX_ROWS || w.numel() * w.element_size() >= split_min_bytes || !(rows_major || wide) ||
      !x.is_contiguous())
    return linear(x, w, bias, split_min_bytes);
  auto out = at::empty({R, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    if (rows_major) gemv_rows_major(xp + r * K, K, wp, N, op + r * N);
    else gemv_wide(xp + r * K, K, wp, N, op + r * N);
  if (bias) {
    const float* bp = bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) op[r * N + n] += bp[n];
  }
  return out;
}

// write_and_attend(q, k_new, v_new, new_slots, k, v, slots, starts, lengths, scale) -> [T, H * D]
using AttendSignature = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor, double);
using AttendOp = c10::TypedOperatorHandle<AttendSignature>;

// The op registered as `name`, looked up in the dispatcher once per name (not once per forward)
c10::OperatorHandle find_op(const std::string& name) {
  static std::mutex lock;
  static std::unordered_map<std::string, c10::OperatorHandle> ops;
  std::lock_guard<std::mutex> guard(lock);
  auto found = ops.find(name);
  if (found == ops.end()) found = ops.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")).first;
  return found->second;
}

// The write_and_attend op registered as `name`
AttendOp attend_op(const std::string& name) { return find_op(name).typed<AttendSignature>(); }

// x float32 [T, hidden] (the embeddings) through every layer and the final norm -> [T, hidden]. weights: 7 per layer
// (TENSORS_PER_LAYER; float32, matrices in any layout at::linear takes); k, v: the caches [layers, slots, KVH, D];
// new_slots [T] where the new tokens' KV goes; (slots, starts, lengths): the rows' keys as the row attention op
// takes them.
at::Tensor dense_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> weights,
                        at::Tensor k, at::Tensor v, at::Tensor new_slots, at::Tensor slots,
                        at::Tensor starts, at::Tensor lengths, at::Tensor final_norm, int64_t heads, int64_t kv_heads,
                        double eps, double scale, std::string attention, int64_t split_min_bytes) {
  const int64_t L = k.size(0);
  TORCH_CHECK(int64_t(weights.size()) == L * TENSORS_PER_LAYER && v.size(0) == L,
              "dense_layers: ", TENSORS_PER_LAYER, " weights per layer of the caches k, v [layers, slots, KVH, D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && cos.dim() == 3 && cos.size(0) == x.size(0)
              && sin.sizes() == cos.sizes(), "dense_layers: x must be float32 [T, hidden], cos and sin [T, 1, D]");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.numel() == 0 || (w.scalar_type() == at::kFloat && (w.dim() == 2 || w.is_contiguous())),
                "dense_layers: weights must be float32 (norms and biases contiguous)");
  const AttendOp attend = attend_op(attention);
  x = x.contiguous().clone();  // the residual stream, updated in place
  cos = cos.contiguous(), sin = sin.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * TENSORS_PER_LAYER;
    const std::optional<at::Tensor> bias = w[3].numel() ? std::optional<at::Tensor>(w[3]) : std::nullopt;
    const at::Tensor qkv = draft_linear(rms_norm(x, w[0], eps), w[2], bias, split_min_bytes);
    at::Tensor q, kn, vn;
    rope_split(qkv, cos, sin, heads, kv_heads, q, kn, vn);
    at::Tensor attn = attend.call(q, kn, vn, new_slots, k.select(0, l), v.select(0, l), slots, starts, lengths,
                                  scale);  // [T, H * D]
    add_(x, draft_linear(attn, w[4], std::nullopt, split_min_bytes));
    add_(x, draft_linear(silu_mul(draft_linear(rms_norm(x, w[1], eps), w[5], std::nullopt, split_min_bytes)), w[6],
                         std::nullopt, split_min_bytes));
  }
  return rms_norm(x, final_norm, eps);
}


// The output layer x [R, hidden] -> logits [R, vocab] as the draft's Python output layer runs it
// (pipeline/reference/linear.py): BFloat16Weights, the bf16 kernel on its packed weight (`bf16`, empty: none);
// Float16Weights, the fp16 kernel on its packed weight (`fp16`, empty: none); for both `weight` gives only the row
// count. Else DenseLinear, oneDNN's GEMM on the weight prepacked for it (`packed`, empty: none) for min_rows <= R <=
// max_rows (`onednn_linear`: 2 rows run as 3, the third zero, which oneDNN computes faster), else `linear` on `weight`
// (MKL: the one-row F.linear, split over the threads). With 8 requests SmolLM2's 4-layer draft proposed 4 tokens in
// 162 ms on at::linear against 94 forward by forward on oneDNN.
at::Tensor output_layer(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bf16, const at::Tensor& fp16,
                        const at::Tensor& packed, int64_t min_rows, int64_t max_rows, int64_t split_min_bytes) {
  if (bf16.numel() > 0 || fp16.numel() > 0) {
    const bool is_bf16 = bf16.numel() > 0;  // the op looked up where used: the bf16 build needs AVX512-BF16
    std::vector<c10::IValue> stack{is_bf16 ? x.to(at::kBFloat16) : x.contiguous(), is_bf16 ? bf16 : fp16,
                                   weight.size(0)};
    find_op(is_bf16 ? "specdeploy::bf16_weight_gemm" : "specdeploy::fp16_weight_gemm").callBoxed(stack);
    return stack[0].toTensor();
  }
  if (packed.numel() == 0 || x.size(0) < min_rows || x.size(0) > max_rows)
    return linear(x, weight, std::nullopt, split_min_bytes);
  static const c10::OperatorHandle onednn = find_op("mkldnn::_linear_pointwise");
  const int64_t rows = x.size(0), padded_rows = 2;  // linear.py's ONEDNN_PADDED_ROWS
  const at::Tensor in = rows == padded_rows ? at::cat({x, x.new_zeros({1, x.size(1)})}) : x.contiguous();
  std::vector<c10::IValue> stack{in, packed, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  onednn.callBoxed(stack);
  return rows == padded_rows ? stack[0].toTensor().narrow(0, 0, rows) : stack[0].toTensor();
}

// A view of `values` as an int64 tensor (no copy: valid while `values` is unchanged)
at::Tensor long_view(const std::vector<int64_t>& values) {
  return at::from_blob(const_cast<int64_t*>(values.data()), {int64_t(values.size())}, at::kLong);
}

// table [n, ...] (contiguous) -> its rows at `indices` [indices.size(), ...]: index_select without an index tensor
// and its dispatch (a draft forward gathered its embeddings, cos and sin in three index_select calls of about 6 us
// each). LlamaModel keeps its embedding and RoPE tables contiguous (a row of the wide layout was a cache line per
// value).
at::Tensor gather_rows(const at::Tensor& table, const std::vector<int64_t>& indices, const char* name) {
  TORCH_CHECK(table.is_contiguous(), name, ": the table must be contiguous (LlamaModel.embed, rope_cos and "
              "rope_signed_sin are)");
  auto sizes = table.sizes().vec();
  const int64_t n = sizes[0], bytes = table.numel() / std::max<int64_t>(n, 1) * table.element_size();
  sizes[0] = int64_t(indices.size());
  auto out = at::empty(sizes, table.options());
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < indices.size(); ++i) {
    TORCH_CHECK(indices[i] >= 0 && indices[i] < n, name, ": index ", indices[i], " out of range [0, ", n, ")");
    std::memcpy(dst + i * bytes, src + indices[i] * bytes, bytes);
  }
  return out;
}

// The plan of a forward on the row attention kernel, as _AttentionPlan.for_row_attention builds it in Python: the rows'
// tokens and positions, the cache slots their KV goes to, and each row's keys (its sequence's slots from starts[t],
// lengths[t] of them: up to its own). `add` appends `rows` rows of one sequence from position `first`, its block
// table `table` holding them, row r's token token_of(r).
struct RowPlan {
  std::vector<int64_t> tokens, positions, new_slots, key_slots, starts, lengths;

  template <typename TokenOf>
  void add(const int64_t* table, int64_t first, int64_t rows, int64_t block_size, const TokenOf& token_of) {
    const int64_t start = key_slots.size();
    for (int64_t j = 0; j <= (first + rows - 1) / block_size; ++j)  // the sequence's slots up to its last row's
      for (int64_t o = 0; o < block_size; ++o) key_slots.push_back(table[j] * block_size + o);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = first + r;
      tokens.push_back(token_of(r));
      positions.push_back(p);
      new_slots.push_back(table[p / block_size] * block_size + p % block_size);
      starts.push_back(start);
      lengths.push_back(p + 1);
    }
  }

  void clear() {
    for (auto* list : {&tokens, &positions, &new_slots, &key_slots, &starts, &lengths}) list->clear();
  }

  // The forward's inputs: the tokens' embeddings [T, hidden], their positions' cos and sin [T, 1, D], and views of
  // the index lists (valid while the plan is unchanged)
  struct Inputs {
    at::Tensor x, cos, sin, new_slots, key_slots, starts, lengths;
  };
  Inputs inputs(const at::Tensor& embed, const at::Tensor& rope_cos, const at::Tensor& rope_signed_sin) const {
    return {gather_rows(embed, tokens, "embed (a token id)"),
            gather_rows(rope_cos, positions, "rope_cos (a position)").unsqueeze(1),
            gather_rows(rope_signed_sin, positions, "rope_signed_sin (a position)").unsqueeze(1),
            long_view(new_slots), long_view(key_slots), long_view(starts), long_view(lengths)};
  }
};

// Greedy draft chains of a dense float32 model (a draft) in one call. Request b's first forward row set is its feed
// (feed_counts[b] tokens of the flat `feed`: the committed tokens its cache lacks, from position cached[b]); each
// further forward feeds its previous draft token, until it has counts[b] of them. A forward is dense_layers over the
// rows of every request still short, then the output layer (`output_layer`, as the eager path runs it) on each
// request's last row, and the argmax of those logits is its next draft token. From Python every draft forward paid
// about 0.1 ms in its plan's index tensors and op calls around 0.12 ms of arithmetic (a 1-layer, 128-wide draft).
// blocks: every request's cache blocks one after another, as int8_sq_chains takes them: request b's first
// ceil((cached + feed + counts - 1) / block_size), the blocks its chain writes. The lists come as int[] (the call made
// five index tensors in Python, 15-30 us).
// greedy: the op that takes the logits' argmax (specdeploy::greedy_tokens, the same index as at::argmax; empty:
// at::argmax). -> drafts [B, max counts] int64, -1 past a request's count.
at::Tensor dense_greedy_chains(std::vector<int64_t> feed, std::vector<int64_t> feed_counts, std::vector<int64_t> cached,
                               std::vector<int64_t> counts, std::vector<int64_t> blocks, int64_t block_size,
                               at::Tensor embed,
                               at::Tensor lm_head, at::Tensor lm_head_bf16, at::Tensor lm_head_fp16,
                               at::Tensor lm_head_packed,
                               int64_t packed_min_rows, int64_t packed_max_rows, at::Tensor rope_cos,
                               at::Tensor rope_signed_sin, std::vector<at::Tensor> weights, at::Tensor k, at::Tensor v,
                               at::Tensor final_norm, int64_t heads, int64_t kv_heads, double eps, double scale,
                               std::string attention, int64_t split_min_bytes, std::string greedy) {
  const int64_t B = counts.size(), positions = rope_cos.size(0);
  std::optional<c10::TypedOperatorHandle<at::Tensor(at::Tensor)>> argmax_op;  // greedy's op (empty: at::argmax)
  if (!greedy.empty()) argmax_op = find_op(greedy).typed<at::Tensor(at::Tensor)>();
  TORCH_CHECK(int64_t(feed_counts.size()) == B && int64_t(cached.size()) == B && block_size > 0,
              "dense_greedy_chains: feed_counts, cached and counts, one per request");
  const int64_t *fed = feed.data(), *fc = feed_counts.data(), *c0 = cached.data(), *n = counts.data();
  std::vector<int64_t> first_block(B);  // request b's blocks: blocks[first_block[b] ..]
  int64_t total = 0, longest = 0, taken = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(fc[b] >= 1 && n[b] >= 1 && c0[b] >= 0, "dense_greedy_chains: every request feeds a token and wants one");
    TORCH_CHECK(c0[b] + fc[b] + n[b] - 2 < positions, "dense_greedy_chains: request ", b, " runs past position ",
                positions - 1, " (max_position_embeddings)");
    const int64_t used = (c0[b] + fc[b] + n[b] - 1 + block_size - 1) / block_size;
    TORCH_CHECK(taken + used <= int64_t(blocks.size()), "dense_greedy_chains: request ", b, "'s blocks hold fewer "
                "than its cached + feed + counts - 1 tokens (", used, " blocks past those given)");
    first_block[b] = taken, taken += used;
    total += fc[b], longest = std::max(longest, n[b]);
  }
  TORCH_CHECK(int64_t(feed.size()) == total && int64_t(blocks.size()) == taken,
              "dense_greedy_chains: feed holds sum(feed_counts) tokens, blocks each request's used blocks and no more");
  auto drafts = at::full({B, longest}, -1, at::kLong);
  int64_t* dp = drafts.data_ptr<int64_t>();
  RowPlan plan;
  std::vector<int64_t> last_rows, row_request;
  for (int64_t s = 0; s < longest; ++s) {
    plan.clear(), last_rows.clear(), row_request.clear();
    for (int64_t b = 0, offset = 0; b < B; offset += fc[b], ++b) {
      if (n[b] <= s) continue;
      const int64_t first = s == 0 ? c0[b] : c0[b] + fc[b] - 1 + s, rows = s == 0 ? fc[b] : 1;
      plan.add(blocks.data() + first_block[b], first, rows, block_size,
               [&](int64_t r) { return s == 0 ? fed[offset + r] : dp[b * longest + s - 1]; });
      last_rows.push_back(int64_t(plan.tokens.size()) - 1);
      row_request.push_back(b);
    }
    const RowPlan::Inputs in = plan.inputs(embed, rope_cos, rope_signed_sin);
    const at::Tensor hidden = dense_layers(in.x, in.cos, in.sin, weights, k, v, in.new_slots, in.key_slots, in.starts,
                                           in.lengths, final_norm, heads, kv_heads, eps, scale, attention,
                                           split_min_bytes);  // [T, hidden]
    const at::Tensor rows = last_rows.size() == plan.tokens.size() ? hidden : gather_rows(hidden, last_rows, "hidden");
    const at::Tensor logits = output_layer(rows, lm_head, lm_head_bf16, lm_head_fp16, lm_head_packed, packed_min_rows,
                                           packed_max_rows, split_min_bytes);  // [requests, vocab]
    const at::Tensor next = argmax_op ? argmax_op->call(logits) : logits.argmax(-1);
    const int64_t* np = next.data_ptr<int64_t>();
    for (size_t i = 0; i < row_request.size(); ++i) dp[row_request[i] * longest + s] = np[i];
  }
  return drafts;
}

// A layer's phases in int8_sq_layers' team: the qkv GEMM, its rows (bias, RoPE, KV write), the attention, its rows
// (the o GEMM's input), the o GEMM, its rows (residual, post norm), the gate_up GEMM, its rows (SiLU), the down GEMM,
// its rows (residual, the next input norm)
constexpr int64_t PHASES_PER_LAYER = 10;
constexpr int64_t INT8_TENSORS_PER_LAYER = 19;  // input norm, post norm; 1/smoother of the qkv, o, gate_up and down
                                                // inputs; qkv bias; (packed, offset, multiplier) of qkv, o, gate_up, down
// A layer's phase -> the index of its GEMM's packed weight among the layer's tensors (-1: not a GEMM)
constexpr int64_t GEMM_WEIGHT[PHASES_PER_LAYER] = {7, -1, -1, -1, 10, -1, 13, -1, 16, -1};

// The packed weight of the forward's phase `phase` (phase 0: the first input norm, then PHASES_PER_LAYER per layer;
// weights: INT8_TENSORS_PER_LAYER per layer), or nullptr where that phase is not a GEMM.
const at::Tensor* gemm_weight(const std::vector<at::Tensor>& weights, int64_t phase) {
  if (phase == 0) return nullptr;
  const int64_t i = GEMM_WEIGHT[(phase - 1) % PHASES_PER_LAYER];
  return i < 0 ? nullptr : &weights[(phase - 1) / PHASES_PER_LAYER * INT8_TENSORS_PER_LAYER + i];
}

// The int8 GEMMs' packed weights, GEMM by GEMM in the order the forward reads them. A team's thread that waits for a
// phase's last items (the attention's third KV head, a one-row step's row-wise work, which one thread does) prefetches
// the range of the next GEMM's channel groups that it takes first (SharedItems::take_ranges), up to AHEAD / ranges
// bytes into it, so the coming GEMM reads that part from its own core's L2 instead of memory: whole forwards 2.5-3.5%
// faster at one row than without. Into L2 and each thread its own range: SmolLM2's one-row steps 2.0-4.3% faster
// than with one cursor the threads shared from the GEMM's first byte into L1, part of which the other core then read
// (22 rounds of steps in turns, at 28-55 GB/s; docs/benchmarks.md).
class WeightStream {
 public:
  static constexpr int64_t AHEAD = 1 << 20, CHUNK = 1024;  // bytes; CHUNK: prefetched between two checks of a phase

  WeightStream(const std::vector<at::Tensor>& weights, int64_t phases) : next_(phases) {
    for (int64_t phase = 0; phase < phases; ++phase)
      if (const at::Tensor* w = gemm_weight(weights, phase)) gemms_.push_back({w, phase});
    for (int64_t phase = 0, g = 0; phase < phases; ++phase) {  // the first GEMM of a later phase
      while (g < int64_t(gemms_.size()) && gemms_[g].phase <= phase) ++g;
      next_[phase] = g;
    }
  }

  // Prefetch the next CHUNK of thread `thread`'s range (of a team of `threads`) of the next GEMM after `phase`; false
  // once AHEAD / ranges bytes of it are taken, or where the thread has no range or no GEMM is left.
  bool prefetch(int64_t phase, int64_t thread, int64_t threads) {
    const int64_t g = next_[phase], ranges = SharedItems::ranges_for(threads);
    if (g == int64_t(gemms_.size()) || thread >= ranges) return false;
    Cursor& cursor = cursors_[thread];
    if (cursor.gemm != g) {  // the thread's range of this GEMM, worked out once
      const at::Tensor& w = *gemms_[g].weight;
      const int64_t groups = w.size(0), group_bytes = int64_t(w.nbytes()) / groups;
      const int64_t first = SharedItems::range_begin(groups, thread, ranges) * group_bytes;
      const int64_t end = SharedItems::range_begin(groups, thread + 1, ranges) * group_bytes;
      cursor = {g, first, std::min(first + AHEAD / ranges, end), static_cast<const char*>(w.data_ptr())};
    }
    const int64_t at = cursor.at;
    if (at >= cursor.last) return false;
    cursor.at += CHUNK;
#if defined(__x86_64__) || defined(__i386__)
    for (int64_t b = at; b < std::min(at + CHUNK, cursor.last); b += 64) _mm_prefetch(cursor.bytes + b, _MM_HINT_T1);
#endif
    return true;
  }

 private:
  struct Gemm {
    const at::Tensor* weight;
    int64_t phase;
  };
  struct alignas(64) Cursor {  // one thread's, on a cache line of its own
    int64_t gemm = -1, at = 0, last = 0;  // the GEMM it prefetches for, the next byte, the byte it stops at
    const char* bytes = nullptr;          // the GEMM's weight
  };
  std::vector<Gemm> gemms_;    // in phase order
  std::vector<int64_t> next_;  // phase -> the first GEMM of a later phase
  Cursor cursors_[SharedItems::RANGES];
};

// o[i] = y[i] * s + b[i] for i < n (b may be o: a residual added in place): an int8 GEMM's output row rescaled
ROW_CLONES void rescale_add_row(const float* y, float s, const float* b, int64_t n, float* o) {
  for (int64_t i = 0; i < n; ++i) o[i] = y[i] * s + b[i];
}

// A row r [n] -> o = a / s and s = max |a| (at least 1e-30), a = r * inv_smoother: the int8 GEMM's input row
// (`scale_rows`). With norm: a = rms_norm(r) * inv_smoother. One loop per case and the divisor in a local: with the
// branch inside one loop gcc kept the case without norm scalar, and dividing by *s (which may alias o) kept the
// division scalar (a 48-row verify 2-5% faster on Zen4). What a row still costs here is memory: its first read of
// rows another core wrote, its stores to lines another core read (docs/benchmarks.md).
ROW_CLONES void scale_row(const float* r, int64_t n, const float* norm, double eps, const float* inv_smoother, float* o,
                          float* s) {
  float top = 0.f;
  if (norm != nullptr) {
    const float inv = inv_rms(r, n, eps);
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) {
      o[i] = norm[i] * (r[i] * inv) * inv_smoother[i];
      top = std::max(top, std::fabs(o[i]));
    }
  } else {
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) {
      o[i] = r[i] * inv_smoother[i];
      top = std::max(top, std::fabs(o[i]));
    }
  }
  const float scale = std::max(top, 1e-30f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] /= scale;
  *s = scale;
}

// The int8 GEMM's `_into` op (VNNI or AVX2 build, by name): one thread's share of a GEMM, looked up once per name
using VnniSignature = void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, int64_t, int64_t,
                           at::Tensor, at::Tensor, int64_t);
using Avx2Signature = void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, int64_t, at::Tensor,
                           at::Tensor, int64_t);

struct Int8Gemm {
  c10::OperatorHandle op;
  bool vnni;  // the VNNI build takes amx_min_rows
  double step;
  int64_t zero_point, amx_min_rows;

  // out [T, out] (float32, unscaled) = x_unit [T, in] (rows already divided by their scale) times w's weight: the
  // channel groups this thread takes from phase `phase` of `tickets`
  void operator()(const at::Tensor& x_unit, const at::Tensor* w, const at::Tensor& out, const at::Tensor& tickets,
                  int64_t phase) const {
    if (vnni)
      op.typed<VnniSignature>().call(x_unit, w[0], w[1], w[2], x_unit.size(1), step, zero_point, amx_min_rows, out,
                                     tickets, phase);
    else
      op.typed<Avx2Signature>().call(x_unit, w[0], w[1], w[2], x_unit.size(1), step, zero_point, out, tickets, phase);
  }
};

// row_attention_into(q, k, v, slots, starts, lengths, scale, out, tickets, phase, threads): the items one thread takes
using AttendIntoSignature = void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                                 at::Tensor, at::Tensor, int64_t, int64_t);

// x float32 [T, hidden] (the embeddings) through every int8_sq layer and the final norm -> [T, hidden]. weights: 19 per
// layer (INT8_TENSORS_PER_LAYER; float32 and contiguous, the int8 GEMMs' packed weights, int32 offsets and float32
// multipliers as int8_grid_gemm.PackedInt8 holds them); k, v, new_slots, slots, starts, lengths: as dense_layers;
// attention: the row attention's `_into` op; gemm: the int8 GEMM's `_into` op with its grid (step, zero_point) and
// amx_min_rows (the VNNI build's). The whole forward is one team (`run_team`): its phases, each taken item by item by
// the threads, are each GEMM (output channel groups), the attention (work items) and the work between them (rows).
at::Tensor int8_sq_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> weights,
                          at::Tensor k, at::Tensor v, at::Tensor new_slots, at::Tensor slots, at::Tensor starts,
                          at::Tensor lengths, at::Tensor final_norm, int64_t heads, int64_t kv_heads, double eps,
                          double scale, std::string attention, std::string gemm, double step, int64_t zero_point,
                          int64_t amx_min_rows) {
  const int64_t L = k.size(0), T = x.size(0), hidden = x.size(1), D = cos.size(2), HD = heads * D;
  TORCH_CHECK(int64_t(weights.size()) == L * INT8_TENSORS_PER_LAYER && v.size(0) == L,
              "int8_sq_layers: ", INT8_TENSORS_PER_LAYER, " weights per layer of the caches k, v [layers, slots, KVH, D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && cos.dim() == 3 && cos.size(0) == T
              && sin.sizes() == cos.sizes(), "int8_sq_layers: x must be float32 [T, hidden], cos and sin [T, 1, D]");
  // a bf16 cache: csrc/bf16_kv.h's layout, k [layers, groups, KVH, D / 2, 16, 2], v [layers, groups, KVH, 8, D, 2]
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 ? k.dim() == 6 && v.scalar_type() == at::kBFloat16 && k.size(2) == kv_heads && 2 * k.size(3) == D
                     && k.size(4) == 16 && v.dim() == 6 && v.size(1) == k.size(1) && v.size(2) == kv_heads
                     && v.size(3) == 8 && v.size(4) == D
                   : k.scalar_type() == at::kFloat && k.dim() == 4 && v.sizes() == k.sizes()
                     && v.scalar_type() == at::kFloat && k.size(2) == kv_heads && k.size(3) == D,
              "int8_sq_layers: the caches k, v must be contiguous float32 [layers, slots, KVH, D] or a bf16 cache "
              "(csrc/bf16_kv.h)");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "int8_sq_layers: the caches k, v must be contiguous");
  const int64_t num_slots = bf16 ? 16 * k.size(1) : k.size(1);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < 7; ++i) {
      const at::Tensor& w = weights[l * INT8_TENSORS_PER_LAYER + i];
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), "int8_sq_layers: norms, 1/smoothers and the "
                  "qkv bias must be contiguous float32");
    }
  const int64_t inter = weights[5].numel(), qkv_width = weights[6].numel();
  TORCH_CHECK(qkv_width == (heads + 2 * kv_heads) * D && weights[2].numel() == hidden && weights[3].numel() == HD,
              "int8_sq_layers: the qkv bias must be (H + 2 KVH) * D wide, the qkv and o 1/smoothers hidden and H * D");
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous() && final_norm.numel() == hidden,
              "int8_sq_layers: the final norm must be contiguous float32 [hidden]");
  new_slots = new_slots.contiguous();
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.numel() == T,
              "int8_sq_layers: new_slots must be int64 [T]");
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // every slot checked before the cache changes
    TORCH_CHECK(ns[t] >= 0 && ns[t] < num_slots, "int8_sq_layers: slot ", ns[t], " is not in the cache");
  const auto attend = find_op(attention).typed<AttendIntoSignature>();
  const c10::OperatorHandle gemm_op = find_op(gemm);
  const Int8Gemm int8_gemm{gemm_op, gemm_op.schema().arguments().size() == 11, step, zero_point, amx_min_rows};
  x = x.contiguous().clone();  // the residual stream, updated in place
  cos = cos.contiguous(), sin = sin.contiguous();
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  auto s = at::empty({T}, x.options());  // the current GEMM input's row scales
  float* sp = s.data_ptr<float>();
  auto unit = at::empty({T * std::max({hidden, HD, inter})}, x.options());  // the current GEMM input [T, n], in [-1, 1]
  float* up = unit.data_ptr<float>();
  const at::Tensor in_hidden = unit.narrow(0, 0, T * hidden).view({T, hidden});
  const at::Tensor in_heads = unit.narrow(0, 0, T * HD).view({T, HD});
  const at::Tensor in_inter = unit.narrow(0, 0, T * inter).view({T, inter});
  // the GEMMs' outputs, then the row-wise results
  const at::Tensor y_qkv = at::empty({T, qkv_width}, x.options()), y_o = at::empty({T, hidden}, x.options());
  const at::Tensor y_gate_up = at::empty({T, 2 * inter}, x.options()), y_down = at::empty({T, hidden}, x.options());
  const at::Tensor qkv = at::empty({T, qkv_width}, x.options()), q = at::empty({T, heads, D}, x.options());
  const at::Tensor attn = at::empty({T, HD}, x.options()), act = at::empty({T, inter}, x.options());
  auto out = at::empty_like(x);
  // the phases' shared items (shared_items.h): the first input norm, then PHASES_PER_LAYER per layer
  const at::Tensor tickets = at::zeros({1 + PHASES_PER_LAYER * L, 8}, new_slots.options());
  int64_t* tickets_p = tickets.data_ptr<int64_t>();
  std::vector<at::Tensor> k_layer, v_layer;
  for (int64_t l = 0; l < L; ++l) k_layer.push_back(k.select(0, l)), v_layer.push_back(v.select(0, l));
  float *qkv_p = qkv.data_ptr<float>(), *q_p = q.data_ptr<float>(), *ap = act.data_ptr<float>();
  const float* attn_p = attn.data_ptr<float>();
  const int64_t kv_row = kv_heads * D, layer_size = k.numel() / L;  // elements of one layer's k (and v)
  // a bf16 cache's new keys and values [T, 2, KVH, D] in float32, each stored (rounded) by its row's thread
  const at::Tensor kv_new = at::empty({bf16 ? T * 2 * kv_row : 0}, x.options());
  float* kv_new_p = kv_new.data_ptr<float>();
  WeightStream stream(weights, tickets.size(0));
  run_team([&](Team& team, int64_t threads) {
    int64_t phase = 0;
    const int64_t thread = omp_get_thread_num();
    // every thread passes the phases in order: it takes what items are left of each, then waits for the rest
    auto next_phase = [&] {
      team.wait_for(SharedItems{tickets_p + phase * 8}, [&] { return stream.prefetch(phase, thread, threads); });
      ++phase;
    };
    auto rows = [&](const auto& f) {  // f(t) for the rows this thread takes
      SharedItems{tickets_p + phase * 8}.take_rows(T, amx_min_rows, thread, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) f(t);
      });
      next_phase();
    };
    auto gemm = [&](const at::Tensor& input, const at::Tensor& y) {  // this phase's GEMM (`gemm_weight`)
      const at::Tensor* w = gemm_weight(weights, phase);
      TORCH_INTERNAL_ASSERT(w != nullptr, "int8_sq_layers: phase ", phase, " is not a GEMM");
      int8_gemm(input, w, y, tickets, phase);
      next_phase();
    };
    rows([&](int64_t t) {
      scale_row(xp + t * hidden, hidden, weights[0].data_ptr<float>(), eps, weights[2].data_ptr<float>(),
                up + t * hidden, sp + t);
    });
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = weights.data() + l * INT8_TENSORS_PER_LAYER;
      const float *post_norm = w[1].data_ptr<float>(), *o_in = w[3].data_ptr<float>(), *gate_up_in = w[4].data_ptr<float>();
      const float *down_in = w[5].data_ptr<float>(), *bias = w[6].data_ptr<float>();
      // qkv: rescale, + bias, RoPE into q and the cache's new slots; row attention
      gemm(in_hidden, y_qkv);
      rows([&](int64_t t) {
        const float* y = y_qkv.data_ptr<float>() + t * qkv_width;
        float* row = qkv_p + t * qkv_width;
        rescale_add_row(y, sp[t], bias, qkv_width, row);
        if (bf16) {
          float* kv_t = kv_new_p + t * 2 * kv_row;
          rope_row(row, cp + t * D, snp + t * D, heads, kv_heads, D, q_p + t * HD, kv_t, kv_t + kv_row);
          uint16_t* k_l = reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()) + l * layer_size;
          bf16_kv::store(k_l, reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()) + l * layer_size, ns[t],
                         kv_heads, D, kv_t, kv_t + kv_row);
        } else {
          rope_row(row, cp + t * D, snp + t * D, heads, kv_heads, D, q_p + t * HD,
                   k.data_ptr<float>() + l * layer_size + ns[t] * kv_row,
                   v.data_ptr<float>() + l * layer_size + ns[t] * kv_row);
        }
      });
      attend.call(q, k_layer[l], v_layer[l], slots, starts, lengths, scale, attn, tickets, phase, threads);  // [T, HD]
      next_phase();
      rows([&](int64_t t) { scale_row(attn_p + t * HD, HD, nullptr, eps, o_in, up + t * HD, sp + t); });
      // o: residual, post norm, gate_up
      gemm(in_heads, y_o);
      rows([&](int64_t t) {
        const float* y = y_o.data_ptr<float>() + t * hidden;
        rescale_add_row(y, sp[t], xp + t * hidden, hidden, xp + t * hidden);
        scale_row(xp + t * hidden, hidden, post_norm, eps, gate_up_in, up + t * hidden, sp + t);
      });
      // SiLU(gate) * up, down, residual, the next layer's input norm (after the last layer the final norm)
      gemm(in_hidden, y_gate_up);  // [T, 2 I]
      rows([&](int64_t t) {
        const float* y = y_gate_up.data_ptr<float>() + t * 2 * inter;
        silu_mul_row(y, inter, sp[t], ap + t * inter);
        scale_row(ap + t * inter, inter, nullptr, eps, down_in, up + t * inter, sp + t);
      });
      gemm(in_inter, y_down);
      const at::Tensor* next = l + 1 < L ? w + INT8_TENSORS_PER_LAYER : nullptr;
      rows([&](int64_t t) {
        const float* y = y_down.data_ptr<float>() + t * hidden;
        float* r = xp + t * hidden;
        rescale_add_row(y, sp[t], r, hidden, r);
        if (next != nullptr) {
          scale_row(r, hidden, next[0].data_ptr<float>(), eps, next[2].data_ptr<float>(), up + t * hidden, sp + t);
        } else {
          norm_row(r, hidden, final_norm.data_ptr<float>(), eps, out.data_ptr<float>() + t * hidden);
        }
      });
    }
    TORCH_INTERNAL_ASSERT(phase == tickets.size(0), "int8_sq_layers: ", phase, " phases run, ", tickets.size(0),
                          " planned");
  });
  return out;
}

// int8_sq_layers over the new tokens of a forward of chains, with its plan (`RowPlan`), the tokens' embeddings and the
// rows' RoPE built here: sequence i brings counts[i] tokens of the flat `tokens` after cached[i] cached ones, and its
// blocks are the next ceil((cached[i] + counts[i]) / block_size) of the flat `blocks`. Built in Python, the plan's
// index tensors, the gathers and their calls took about 0.2 ms of a SmolLM2 decode step (docs/benchmarks.md).
// -> the final-norm output [T, hidden]
at::Tensor int8_sq_chains(std::vector<int64_t> tokens, std::vector<int64_t> counts, std::vector<int64_t> cached,
                          std::vector<int64_t> blocks, int64_t block_size, at::Tensor embed, at::Tensor rope_cos,
                          at::Tensor rope_signed_sin, std::vector<at::Tensor> weights, at::Tensor k, at::Tensor v,
                          at::Tensor final_norm, int64_t heads, int64_t kv_heads, double eps, double scale,
                          std::string attention, std::string gemm, double step, int64_t zero_point,
                          int64_t amx_min_rows) {
  TORCH_CHECK(counts.size() == cached.size() && block_size > 0, "int8_sq_chains: counts and cached, one per sequence");
  RowPlan plan;
  size_t t = 0, b = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t used = (cached[i] + counts[i] + block_size - 1) / block_size;
    TORCH_CHECK(counts[i] >= 1 && cached[i] >= 0 && t + counts[i] <= tokens.size() && b + used <= blocks.size(),
                "int8_sq_chains: sequence ", i, " needs ", counts[i], " tokens and ", used, " blocks past those given");
    plan.add(blocks.data() + b, cached[i], counts[i], block_size, [&](int64_t r) { return tokens[t + r]; });
    t += counts[i], b += used;
  }
  TORCH_CHECK(t == tokens.size() && b == blocks.size(), "int8_sq_chains: tokens or blocks left over");
  const RowPlan::Inputs in = plan.inputs(embed, rope_cos, rope_signed_sin);
  return int8_sq_layers(in.x, in.cos, in.sin, std::move(weights), k, v, in.new_slots, in.key_slots, in.starts,
                        in.lengths, final_norm, heads, kv_heads, eps, scale, std::move(attention), std::move(gemm),
                        step, zero_point, amx_min_rows);
}

// The op: `linear` for DenseLinear's one-row calls (pipeline/reference/linear.py)
at::Tensor dense_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias, int64_t split_min_bytes) {
  return linear(x, w, bias, split_min_bytes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("dense_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!) k, Tensor(b!) v, "
        "Tensor new_slots, Tensor slots, Tensor starts, Tensor lengths, Tensor final_norm, int heads, int kv_heads, "
        "float eps, float scale, str attention, int split_min_bytes) -> Tensor", &dense_layers);
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias, int split_min_bytes) -> Tensor", &dense_linear);
  m.def("dense_greedy_chains(int[] feed, int[] feed_counts, int[] cached, int[] counts, int[] blocks, "
        "int block_size, Tensor embed, Tensor lm_head, Tensor lm_head_bf16, Tensor lm_head_fp16, "
        "Tensor lm_head_packed, int packed_min_rows, int packed_max_rows, Tensor rope_cos, Tensor rope_signed_sin, "
        "Tensor[] weights, Tensor(a!) k, Tensor(b!) v, Tensor final_norm, int heads, int kv_heads, float eps, "
        "float scale, str attention, int split_min_bytes, str greedy) -> Tensor", &dense_greedy_chains);
  m.def("int8_sq_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!) k, Tensor(b!) v, "
        "Tensor new_slots, Tensor slots, Tensor starts, Tensor lengths, Tensor final_norm, int heads, int kv_heads, "
        "float eps, float scale, str attention, str gemm, float step, int zero_point, int amx_min_rows) -> Tensor",
        &int8_sq_layers);
  m.def("int8_sq_chains(int[] tokens, int[] counts, int[] cached, int[] blocks, int block_size, Tensor embed, "
        "Tensor rope_cos, Tensor rope_signed_sin, Tensor[] weights, Tensor(a!) k, Tensor(b!) v, Tensor final_norm, "
        "int heads, int kv_heads, float eps, float scale, str attention, str gemm, float step, int zero_point, "
        "int amx_min_rows) -> Tensor", &int8_sq_chains);
}
