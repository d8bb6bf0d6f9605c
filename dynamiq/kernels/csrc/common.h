// Helpers shared by the native CPU kernels (cpu_kernels.cpp: INT and MX codecs;
// dynamiq_kernels.cpp: the DynamiQ codec): fp32 bit patterns, input conversion to fp32, the
// thread helper and the counter hash. Header-only (inline functions and templates in an
// anonymous namespace: each translation unit has its own copy).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

// The fields every kernel's argument structure starts with, in this order (mirrored by
// _COMMON_FIELDS in cpu_native.py): the operation, the values' type, the buffers and the
// number of values.
#define DQ_COMMON_ARGS                                                        \
  int32_t op;         /* 0 encode, 1 reduce (fused), 2 decode */              \
  int32_t in_kind;    /* values / local slice: 0 fp32, 1 bf16, 2 fp16 */      \
  const void* x;      /* values (encode) or the local slice (reduce) */       \
  const uint8_t* in;  /* incoming payload (reduce, decode) */                 \
  uint8_t* out;       /* outgoing payload (encode, reduce) */                 \
  float* out_values;  /* decoded values (decode) */                           \
  int64_t n;          /* number of values */

// The layout of an argument structure, so that cpu_native.py checks its ctypes mirror when the
// library loads (a mismatch is an error there, not a wrong argument here): DQ_LAYOUT writes
// sizeof and then the offset of every field in declaration order, and returns how many.
#define DQ_OFF(T, F) (int64_t) offsetof(T, F)
#define DQ_COMMON_OFFSETS(T) \
  DQ_OFF(T, op), DQ_OFF(T, in_kind), DQ_OFF(T, x), DQ_OFF(T, in), DQ_OFF(T, out), \
      DQ_OFF(T, out_values), DQ_OFF(T, n)

namespace {

template <size_t N>
inline int64_t dq_layout(int64_t* out, int64_t cap, const int64_t (&v)[N]) {
  for (size_t i = 0; i < N && (int64_t)i < cap; i++) out[i] = v[i];
  return (int64_t)N;
}


// -- fp32 bit patterns ----------------------------------------------------------------------

// (the loops below are written so that GCC vectorizes them: no branches, 32-bit lanes)

inline uint32_t f2u(float x) { return __builtin_bit_cast(uint32_t, x); }

inline float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }

// floor(log2(m)) for 1 <= m < 2^24 (exact int -> float conversion); 0 for m = 0
inline int32_t floor_log2_small(uint32_t m) {
  return (int32_t)(f2u((float)(int32_t)(m | 1u)) >> 23) - 127;
}

// formats.exponent_of of fp32 magnitude bits a: floor(log2), 0 -> -150, NaN/Inf -> 128
inline int32_t exponent_of(uint32_t a) {
  int32_t e = (int32_t)(a >> 23);
  int32_t sub = floor_log2_small(a & 0x7FFFFFu) - 149;
  int32_t out = e > 0 ? e - 127 : sub;
  return a == 0 ? -150 : out;
}

// fp16 bits -> fp32 bits, exact (NaN keeps sign and payload)
inline uint32_t f16_to_f32_bits(uint32_t h) {
  uint32_t sign = (h >> 15) << 31;
  uint32_t e = (h >> 10) & 0x1F;
  uint32_t m = h & 0x3FF;
  uint32_t normal = ((e + 112) << 23) | (m << 13);
  uint32_t sub = f2u((float)(int32_t)m) - (24u << 23);  // m * 2^-24, m < 2^10
  uint32_t special = 0x7F800000u | (m << 13);
  uint32_t mag = e == 0x1F ? special : (e > 0 ? normal : (m > 0 ? sub : 0));
  return sign | mag;
}

// -- value buffers (KIND: 0 fp32, 1 bf16, 2 fp16) -> fp32 -----------------------------------

// value i of a buffer, as fp32 (exact)
template <int KIND>
inline float load_value(const void* __restrict src, int64_t i) {
  if (KIND == 0) return ((const float*)src)[i];
  const uint32_t h = ((const uint16_t*)src)[i];
  return KIND == 1 ? u2f(h << 16) : u2f(f16_to_f32_bits(h));
}

template <int KIND>
void load_values(const void* src, int64_t start, int64_t cnt, float* __restrict dst) {
  if (KIND == 0) {
    std::memcpy(dst, (const float*)src + start, (size_t)cnt * 4);
  } else if (KIND == 1) {
    const uint16_t* s = (const uint16_t*)src + start;
    for (int64_t i = 0; i < cnt; i++) dst[i] = u2f((uint32_t)s[i] << 16);
  } else {
    const uint16_t* s = (const uint16_t*)src + start;
    for (int64_t i = 0; i < cnt; i++) dst[i] = u2f(f16_to_f32_bits(s[i]));
  }
}

inline void load_values_any(int kind, const void* src, int64_t start, int64_t cnt, float* dst) {
  if (kind == 0) load_values<0>(src, start, cnt, dst);
  else if (kind == 1) load_values<1>(src, start, cnt, dst);
  else load_values<2>(src, start, cnt, dst);
}

// -- threads --------------------------------------------------------------------------------

// fn(tile0, tile1, thread) over [0, ntiles) split into at most nthreads contiguous ranges,
// each non-empty (tile0 < tile1): callers compute byte counts such as (tile1 - tile0) * size
// from them. With ceil(ntiles / nthreads) tiles a range, fewer ranges than threads may cover
// the tiles (5 tiles on 4 threads: 2 + 2 + 1), so the thread count is that of the ranges.
template <class F>
bool parallel_tiles(int64_t ntiles, int nthreads, F fn) {
  nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles));
  const int64_t per = (ntiles + nthreads - 1) / nthreads;
  nthreads = (int)std::max<int64_t>(1, (ntiles + per - 1) / per);
  if (nthreads == 1) return fn(0, ntiles, 0);
  std::vector<char> ok(nthreads, 0);
  std::vector<std::thread> pool;
  try {
    for (int t = 1; t < nthreads; t++) {
      int64_t a = std::min<int64_t>(ntiles, t * per), b = std::min<int64_t>(ntiles, a + per);
      pool.emplace_back([&ok, &fn, a, b, t]() { ok[t] = fn(a, b, t) ? 1 : 0; });
    }
  } catch (...) {
    for (auto& th : pool) th.join();
    return false;
  }
  ok[0] = fn(0, std::min<int64_t>(ntiles, per), 0) ? 1 : 0;
  for (auto& th : pool) th.join();
  for (char c : ok)
    if (!c) return false;
  return true;
}

// -- the counter hash (dynamiq/codecs/hashing.py) -------------------------------------------

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

}  // namespace
