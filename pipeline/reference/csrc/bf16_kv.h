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

// float32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN), as torch's conversion.
inline uint16_t round_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Offsets, in bf16 elements from a layer's start, of slot s's KV head h chunk (16 * D elements per group and head).
inline int64_t chunk(int64_t s, int64_t h, int64_t KVH, int64_t D) { return (s / 16 * KVH + h) * 16 * D; }

// Store slot s's key and value rows k, v [KVH, D] (float32) into one layer's keys and values.
inline void store(uint16_t* keys, uint16_t* values, int64_t s, int64_t KVH, int64_t D, const float* k, const float* v) {
  const int64_t place = s % 16;
  for (int64_t h = 0; h < KVH; ++h) {
    uint16_t* kc = keys + chunk(s, h, KVH, D) + place * 2;
    uint16_t* vc = values + chunk(s, h, KVH, D) + (place / 2) * 2 * D + place % 2;
    for (int64_t d = 0; d < D; ++d) {
      kc[(d / 2) * 32 + d % 2] = round_to_bf16(k[h * D + d]);
      vc[d * 2] = round_to_bf16(v[h * D + d]);
    }
  }
}

}  // namespace bf16_kv
