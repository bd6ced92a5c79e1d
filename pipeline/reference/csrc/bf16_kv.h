// The bf16 KV cache's layout (KVCache with kv_dtype "BF16", pipeline/reference/kv_cache.py, which documents it
// for Python): one layer's slots in groups of 16 (slot s in group s / 16 at place s % 16), each group holding per
// KV head a chunk of 16 * D bf16:
//   keys   [groups][KVH][D / 2][16][2]: dims (2i, 2i + 1) of the group's 16 keys side by side, so one 16-lane
//          vdpbf16ps gives 16 keys' partial scores for two dims, with no transpose;
//   values [groups][KVH][8][D][2]: the values of slots (2j, 2j + 1) side by side, so one vdpbf16ps adds two keys'
//          weighted values.
// Stores round float32 to nearest even, as torch's .to(torch.bfloat16). cpp_ops inlines this file into the sources
// that include it.
#pragma once

#include <cstdint>
#include <cstring>

namespace bf16_kv {

// float32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN), as torch's conversion; branch-free, so a
// loop of it vectorizes.
inline uint16_t round_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// Offsets, in bf16 elements from a layer's start, of slot s's KV head h chunk (16 * D elements per group and head).
inline int64_t chunk(int64_t s, int64_t h, int64_t KVH, int64_t D) { return (s / 16 * KVH + h) * 16 * D; }

// Store slot s's key and value rows k, v [KVH, D] (float32) into one layer's keys and values: each row rounded in
// one contiguous pass, then placed.
inline void store(uint16_t* keys, uint16_t* values, int64_t s, int64_t KVH, int64_t D, const float* k, const float* v) {
  const int64_t place = s % 16;
  uint16_t kr[256], vr[256];  // head_size <= 256 (the kernels' bound)
  for (int64_t h = 0; h < KVH; ++h) {
    for (int64_t d = 0; d < D; ++d) kr[d] = round_to_bf16(k[h * D + d]), vr[d] = round_to_bf16(v[h * D + d]);
    uint32_t* kc = reinterpret_cast<uint32_t*>(keys + chunk(s, h, KVH, D)) + place;  // dim pair i at kc[16 i]
    uint16_t* vc = values + chunk(s, h, KVH, D) + (place / 2) * 2 * D + place % 2;  // dim d at vc[2 d]
    for (int64_t i = 0; i < D / 2; ++i) kc[i * 16] = uint32_t(kr[2 * i]) | uint32_t(kr[2 * i + 1]) << 16;
    for (int64_t d = 0; d < D; ++d) vc[d * 2] = vr[d];
  }
}

}  // namespace bf16_kv
