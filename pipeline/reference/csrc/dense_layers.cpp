// Dense decoder layers in one call: every layer of a small float32 model (a draft) for a few new rows.
//
// A draft forward of one token per request runs 20-30 small ops per layer, 2-40 us each from Python (the RMSNorm
// alone is five ATen ops), for arithmetic that takes a few microseconds at a draft's widths. Here each layer is
// RMSNorm -> qkv GEMM (+ bias) -> RoPE -> KV write and row attention -> o GEMM -> residual -> RMSNorm -> gate_up GEMM
// -> SiLU * up -> down GEMM -> residual, then the final RMSNorm: the GEMMs are at::linear (the eager path's F.linear),
// the attention is the row attention op named by `attention` (its AVX-512 or AVX2 build, pipeline/reference/
// row_attention.py), everything else plain loops over the rows. The results are close to the eager layers', not
// bit-equal (the RMSNorm sums in row order; tests/test_fused_layers.py).
// Python side: pipeline/reference/fused_layers.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t TENSORS_PER_LAYER = 7;  // input norm, post norm, qkv weight, qkv bias (empty: none), o, gate_up, down

// x float32 [T, n] -> x / sqrt(mean(x^2) + eps) * w, row by row (HF's order: normalise, then scale)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* r = xp + t * n;
    float* o = op + t * n;
    float squares = 0.f;
    for (int64_t i = 0; i < n; ++i) squares += r[i] * r[i];
    const float inv = 1.f / std::sqrt(squares / float(n) + float(eps));
    for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (r[i] * inv);
  }
  return out;
}

// qkv [T, (H + 2 KVH) * D] -> RoPE'd q [T, H, D], k [T, KVH, D] and v [T, KVH, D]; cos, sin [T, 1, D] (sin signed:
// rotate_half(x) * sin == roll(x, D / 2) * signed sin)
void rope_split(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  const int64_t T = qkv.size(0), D = cos.size(2), half = D / 2, width = qkv.size(1);
  q = at::empty({T, H, D}, qkv.options());
  k = at::empty({T, KVH, D}, qkv.options());
  v = at::empty({T, KVH, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * width;
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    for (int64_t h = 0; h < H + KVH; ++h) {
      const float* x = row + h * D;
      float* o = h < H ? q.data_ptr<float>() + (t * H + h) * D : k.data_ptr<float>() + (t * KVH + h - H) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = x[d] * c[d] + x[(d + half) % D] * s[d];
    }
    std::memcpy(v.data_ptr<float>() + t * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
  }
}

// gate_up [T, 2 I] -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = in[t * 2 * I + i];
      op[t * I + i] = g / (1.f + std::exp(-g)) * in[t * 2 * I + I + i];
    }
  return out;
}

// x += y (same shape, contiguous)
void add_(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] += yp[i];
}

// write_and_attend(q, k_new, v_new, new_slots, k, v, slots, starts, lengths, scale) -> [T, H * D]
using AttendSignature = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor, double);
using AttendOp = c10::TypedOperatorHandle<AttendSignature>;

// The write_and_attend op registered as `name`, looked up in the dispatcher once per name (not once per forward)
AttendOp attend_op(const std::string& name) {
  static std::mutex lock;
  static std::unordered_map<std::string, AttendOp> ops;
  std::lock_guard<std::mutex> guard(lock);
  auto found = ops.find(name);
  if (found == ops.end())
    found = ops.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")
                                  .typed<AttendSignature>()).first;
  return found->second;
}

// x float32 [T, hidden] (the embeddings) through every layer and the final norm -> [T, hidden]. weights: 7 per layer
// (TENSORS_PER_LAYER; float32, matrices in any layout at::linear takes); k, v: the caches [layers, slots, KVH, D];
// new_slots [T] where the new tokens' KV goes; (slots, starts, lengths): the rows' keys as the row attention op
// takes them.
at::Tensor dense_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> weights,
                        at::Tensor k, at::Tensor v, at::Tensor new_slots, at::Tensor slots,
                        at::Tensor starts, at::Tensor lengths, at::Tensor final_norm, int64_t heads, int64_t kv_heads,
                        double eps, double scale, std::string attention) {
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
    const at::Tensor qkv = at::linear(rms_norm(x, w[0], eps), w[2], bias);
    at::Tensor q, kn, vn;
    rope_split(qkv, cos, sin, heads, kv_heads, q, kn, vn);
    at::Tensor attn = attend.call(q, kn, vn, new_slots, k.select(0, l), v.select(0, l), slots, starts, lengths,
                                  scale);  // [T, H * D]
    add_(x, at::linear(attn, w[4]));
    add_(x, at::linear(silu_mul(at::linear(rms_norm(x, w[1], eps), w[5])), w[6]));
  }
  return rms_norm(x, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdeploy, m) {
  m.def("dense_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!) k, Tensor(b!) v, "
        "Tensor new_slots, Tensor slots, Tensor starts, Tensor lengths, Tensor final_norm, int heads, int kv_heads, "
        "float eps, float scale, str attention) -> Tensor", &dense_layers);
}
