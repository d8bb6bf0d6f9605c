// The AVX2 code of the DynamiQ CPU kernel (dynamiq_kernels.cpp includes it inside its anonymous
// namespace, after DynJob, on machines with AVX2, BMI2 and F16C but not AVX-512): a full group
// of G % 8 == 0 values, 8 at a time. The same results as the portable loops, operation for
// operation (tests/kernels/test_cpu_native_dynamiq.py checks them on such a machine).
//
// Decode: the codes of 8 values of width w are w bytes, spread to the low w bits of 8 bytes
// (pdep); widths 0..5 (the common ones) look their levels up in four registers (permutes, the
// width a run-time value: neighbouring groups' widths vary at random), widths 6..8 gather them.
// Encode (nearest rounding): y = x / s clamped to [-1, 1]; widths 1..5 count the round-up
// thresholds <= y by a branch-free descent of the 5-level search tree of the width's
// thresholds padded with +inf (cpu_native._eytzinger_rows, depth 5) held in four registers;
// width 6 the same with its own 6-level tree in eight registers; widths 7 and 8 gather the
// reference's cell tables (base[cell] + (key[cell] <= y)). The codes are
// gathered from the low w bits of 8 bytes (pext) into w bytes.

#pragma once

#include <immintrin.h>

// v[i] of a table of 2^B fp32 entries (B in 3..5) held in 2^(B - 3) registers, by the low B
// bits of each lane of i
template <int B>
inline __m256 lookup8(const __m256* t, __m256i i) {
  static_assert(B >= 3 && B <= 5, "tables of 8 to 32 entries");
  if constexpr (B == 3) {
    return _mm256_permutevar8x32_ps(t[0], i);
  } else {
    constexpr int H = 1 << (B - 4);  // registers of each half
    const __m256 a = lookup8<B - 1>(t, i), b = lookup8<B - 1>(t + H, i);
    // bit B - 1 of each lane to its sign bit: blendv's selector
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 32 - B)));
  }
}

inline uint64_t byte_mask8(int w) { return 0x0101010101010101ull * ((1u << w) - 1); }

// the largest of 8 uint32 lanes
inline uint32_t hmax_epu32(__m256i m) {
  __m128i a = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  a = _mm_max_epu32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_max_epu32(a, _mm_shuffle_epi32(a, 0xB1));
  return (uint32_t)_mm_cvtsi128_si32(a);
}

// 8 values from i on, as fp32 (exact; an fp16 NaN stays NaN)
template <int KIND>
inline __m256 load8(const void* src, int64_t i) {
  if constexpr (KIND == 0) {
    return _mm256_loadu_ps((const float*)src + i);
  } else {
    const __m128i raw = _mm_loadu_si128((const __m128i*)((const uint16_t*)src + i));
    if constexpr (KIND == 1) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    } else {
      return _mm256_cvtph_ps(raw);
    }
  }
}

// 8 codes of width w from the w bytes at b (8 bytes readable at b)
inline __m256i unpack8(const uint8_t* b, uint64_t mask) {
  uint64_t word;
  std::memcpy(&word, b, 8);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)_pdep_u64(word, mask)));
}

// the low bytes of 8 lanes (0..255), lane 0 in the low byte
inline uint64_t bytes_of(__m256i v) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(v, pick);  // 4 bytes at the start of each half
  const __m256i low2 = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);  // those two dwords first
  const __m256i both = _mm256_permutevar8x32_epi32(bytes, low2);
  return (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(both));
}

// 8 codes (0..255) of width w to the w bytes at b: an 8-byte store whose bytes past the codes
// are zero, overwritten by the next group's (the groups are stored in order)
inline void pack8(__m256i codes, uint8_t* b, uint64_t mask) {
  const uint64_t word = _pext_u64(bytes_of(codes), mask);
  std::memcpy(b, &word, 8);
}

// scale_codes for falling candidates cand[0 .. 15], 8 groups at a time (of the n groups of
// absmax bits gm): e, the count of the codes 1..15 whose scale is >= the absmax (a group of
// zeros: 15), and the scale s = cand[e]; returns the groups done (a multiple of 8)
inline int64_t scale_codes_avx2(const float* cand, const uint32_t* gm, int64_t n, uint8_t* e,
                                float* s) {
  __m256 cv[E_MAX + 1];
  for (int ee = 0; ee <= E_MAX; ee++) cv[ee] = _mm256_set1_ps(cand[ee]);
  const __m256 ct[2] = {_mm256_loadu_ps(cand), _mm256_loadu_ps(cand + 8)};
  int64_t gi = 0;
  for (; gi + 8 <= n; gi += 8) {
    const __m256i bits = _mm256_loadu_si256((const __m256i*)(gm + gi));
    const __m256 a = _mm256_castsi256_ps(bits);
    __m256i c = _mm256_setzero_si256();
    for (int ee = 1; ee <= E_MAX; ee++)  // -1 where cand[ee] >= a (never for a NaN)
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(cv[ee], a, _CMP_GE_OQ)));
    const __m256i zero = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
    c = _mm256_blendv_epi8(c, _mm256_set1_epi32(E_MAX), zero);
    _mm256_storeu_ps(s + gi, lookup8<4>(ct, c));
    const uint64_t codes = bytes_of(c);
    std::memcpy(e + gi, &codes, 8);
  }
  return gi;
}

// Decode a full group of width w (its codes at b, 8 bytes readable at each 8 codes' bytes):
// d = level * s (+ local); returns the absmax bits of d. Width 0 reads no bits: level 0 * s.
template <int G, int KIND, bool ADD>
uint32_t decode_group_avx2(const DynJob& j, int w, const uint8_t* b, float s, const void* local,
                           float* d) {
  const float* row = j.levels + ROW * w;
  const uint64_t mask = byte_mask8(w);
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m = _mm256_setzero_si256();
  if (w <= 5) {
    const __m256 t[4] = {_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8),
                         _mm256_loadu_ps(row + 16), _mm256_loadu_ps(row + 24)};
    for (int c = 0; c < G / 8; c++) {
      const __m256i code = unpack8(b + w * c, mask);  // width 0: mask 0, code 0
      __m256 x = _mm256_mul_ps(lookup8<5>(t, code), vs);
      if constexpr (ADD) x = _mm256_add_ps(x, load8<KIND>(local, 8 * c));
      _mm256_storeu_ps(d + 8 * c, x);
      m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(x), mag));
    }
  } else {
    for (int c = 0; c < G / 8; c++) {
      __m256 x = _mm256_mul_ps(_mm256_i32gather_ps(row, unpack8(b + w * c, mask), 4), vs);
      if constexpr (ADD) x = _mm256_add_ps(x, load8<KIND>(local, 8 * c));
      _mm256_storeu_ps(d + 8 * c, x);
      m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(x), mag));
    }
  }
  return hmax_epu32(m);
}

// y = x / s clamped to [-1, 1] (the reference's clamp; a no-op for a live group)
inline __m256 scaled8(const float* v, __m256 vs) {
  const __m256 y = _mm256_div_ps(_mm256_loadu_ps(v), vs);
  return _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-1.0f)), _mm256_set1_ps(1.0f));
}

// one level of the descent: k = 2k + (node[k] <= y)
inline __m256i descend8(__m256 node, __m256 y, __m256i k) {
  const __m256i right = _mm256_castps_si256(_mm256_cmp_ps(node, y, _CMP_LE_OQ));  // -1: yes
  return _mm256_sub_epi32(_mm256_add_epi32(k, k), right);
}

// Round (nearest) and pack a full live group of width w >= 1 to its bytes b.
template <int G>
void encode_group_avx2(const DynJob& j, int w, const float* v, float s, uint8_t* b) {
  const uint64_t mask = byte_mask8(w);
  const __m256 vs = _mm256_set1_ps(s);
  if (w <= 5) {
    const float* tree = j.eyt5 + 32 * w;  // node k at tree[k], k in 1..31
    const __m256 t[4] = {_mm256_loadu_ps(tree), _mm256_loadu_ps(tree + 8),
                         _mm256_loadu_ps(tree + 16), _mm256_loadu_ps(tree + 24)};
    for (int c = 0; c < G / 8; c++) {
      const __m256 y = scaled8(v + 8 * c, vs);
      __m256i k = _mm256_set1_epi32(1);
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // nodes 1
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // 2..3
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // 4..7
      k = descend8(_mm256_permutevar8x32_ps(t[1], k), y, k);  // 8..15
      k = descend8(lookup8<4>(t + 2, k), y, k);               // 16..31
      pack8(_mm256_sub_epi32(k, _mm256_set1_epi32(32)), b + w * c, mask);
    }
    return;
  }
  if (w == 6) {  // the 6-level tree of the 63 thresholds, in eight registers
    const float* tree = j.eyt + 256 * 6;
    __m256 t[8];
    for (int r = 0; r < 8; r++) t[r] = _mm256_loadu_ps(tree + 8 * r);
    for (int c = 0; c < G / 8; c++) {
      const __m256 y = scaled8(v + 8 * c, vs);
      __m256i k = _mm256_set1_epi32(1);
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // nodes 1
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // 2..3
      k = descend8(_mm256_permutevar8x32_ps(t[0], k), y, k);  // 4..7
      k = descend8(_mm256_permutevar8x32_ps(t[1], k), y, k);  // 8..15
      k = descend8(lookup8<4>(t + 2, k), y, k);               // 16..31
      k = descend8(lookup8<5>(t + 4, k), y, k);               // 32..63
      pack8(_mm256_sub_epi32(k, _mm256_set1_epi32(64)), b + w * c, mask);
    }
    return;
  }
  const int32_t* base = j.base + w * NCELL;
  const float* key = j.key + w * NCELL;
  for (int c = 0; c < G / 8; c++) {
    const __m256 y = scaled8(v + 8 * c, vs);
    const __m256 cf = _mm256_mul_ps(_mm256_add_ps(y, _mm256_set1_ps(1.0f)),
                                    _mm256_set1_ps((float)CELLS));
    const __m256i cell = _mm256_cvttps_epi32(cf);
    const __m256i lo = _mm256_i32gather_epi32(base, cell, 4);
    const __m256 kv = _mm256_i32gather_ps(key, cell, 4);
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(kv, y, _CMP_LE_OQ));
    pack8(_mm256_sub_epi32(lo, up), b + w * c, mask);
  }
}
