// Row attention: every query row attends over its own list of cache slots, alone, in one fixed order.
//
// A row's result is computed by one thread from its query and its keys only (scores in slot order, the
// softmax's maximum and sum in slot order, the weighted values in slot order), so it never depends on the
// other rows of the call, their count or the thread count: a verify row and a plain decode step of the same
// token get the same bits by construction. Python side and the numbers: pipeline/reference/row_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int LANES = 16;
constexpr int MAX_HEAD_SIZE = 256;  // head_size / 16 zmm accumulators per query head
constexpr int MAX_GROUP = 8;        // query heads per KV head

// e^x on 16 lanes for x <= 0: x log2(e) = n + f with |f| <= 1/2, 2^f by its Taylor polynomial of degree 7
// (relative error below 2e-9, under float32's rounding), times 2^n by vscalefps. Below -87 it returns e^-87.
inline __m512 exp_ps(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-5f);  // ln(2)^k / k!, k = 7 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row, one KV head: its `group` query heads q [group, D] over `length` keys at `slots`; out [group, D].
void row_head(const float* q, const float* k, const float* v, const int64_t* slots, int64_t length, int64_t kv_stride,
              int64_t group, int64_t D, float scale, float* scores, float* out) {
  const int64_t chunks = D / LANES;
  for (int64_t j = 0; j < length; ++j) {  // scores [group, length]: scale * q_h . k_j
    const float* kj = k + slots[j] * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + c * LANES), _mm512_loadu_ps(kj + c * LANES), acc);
      scores[h * length + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  float inv_sum[MAX_GROUP];
  for (int64_t h = 0; h < group; ++h) {  // softmax numerators in place, their sum
    float* s = scores + h * length;
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < length; j += LANES) {
      const __mmask16 m = length - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
      best = _mm512_mask_max_ps(best, m, best, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j += LANES) {
      const __mmask16 m = length - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    inv_sum[h] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[MAX_GROUP][MAX_HEAD_SIZE / LANES];
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunks; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {  // sum_j p_hj v_j
    const float* vj = v + slots[j] * kv_stride;
    for (int64_t h = 0; h < group; ++h) {
      const __m512 p = _mm512_set1_ps(scores[h * length + j]);
      for (int64_t c = 0; c < chunks; ++c) acc[h][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + c * LANES), acc[h][c]);
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(out + h * D + c * LANES, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv_sum[h])));
}

}  // namespace

// q float32 [R, H, D]; k, v: one layer's cache, float32 [slots, KVH, D]; row r attends over the keys at
// slots[starts[r] : starts[r] + lengths[r]] (int64). Query head h reads KV head h / (H / KVH). -> [R, H * D].
at::Tensor row_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor starts,
                         at::Tensor lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "row_attention: q must be float32 [rows, heads, head_size]");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes(),
              "row_attention: k and v must be float32 [slots, kv_heads, head_size]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "row_attention: k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "row_attention: slots, starts and lengths must be int64");
  q = q.contiguous();
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && D % LANES == 0 && D <= MAX_HEAD_SIZE, "row_attention: head_size ", D,
              " must match the cache and be a multiple of 16, at most 256");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= MAX_GROUP, "row_attention: ", H, " query heads over ", KVH, " KV heads");
  TORCH_CHECK(starts.numel() == R && lengths.numel() == R, "row_attention: one start and one length per row");
  const int64_t group = H / KVH, kv_stride = KVH * D;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  slots = slots.contiguous(), starts = starts.contiguous(), lengths = lengths.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(0), "row_attention: slot ", sp[i], " is not in the cache");
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ln[r] > 0 && st[r] >= 0 && st[r] + ln[r] <= slots.numel(), "row_attention: row ", r, "'s keys are out of range");
    longest = std::max(longest, ln[r]);
  }
  auto out = at::empty({R, H * D}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R * KVH, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scores(group * longest);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / KVH, g = u % KVH;
      row_head(qp + (r * H + g * group) * D, kp + g * D, vp + g * D, sp + st[r], ln[r], kv_stride, group, D, float(scale),
               scores.data(), op + r * H * D + g * group * D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor lengths, float scale) -> Tensor",
        &row_attention);
}
