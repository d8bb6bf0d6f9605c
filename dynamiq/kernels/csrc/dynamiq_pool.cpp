// The local work of the pooled DynamiQ codec's prologue (dynamiq/codecs/_dynamiq_pool.py):
// each rank's per-span demand and the budgets every rank derives from the agreed demand.
// Bit-exact with the PyTorch reference there (tests/kernels/test_dynamiq_pool_native.py):
//
//   * dq_dyn_pool_levels: one pass over the values: each group's largest finite |x| (NaN
//     and ±Inf count as 0), its level floor(k log2 absmax) and the histogram of the live
//     groups' levels weighted by their sizes. The level is the count of thresholds <= the
//     absmax's bits: the smallest fp32 bit patterns at which the reference's own
//     floor(k * log2(a)) (torch, fp32) reaches each level, found from torch and checked by
//     cpu_native._level_thresholds, so the kernel computes no logarithm.
//   * dq_dyn_pool_demand: each span's demand (bits) at the threshold tau the reference's
//     search found on that histogram: the sum over its live groups of count[d] * size, d
//     = tau - 8 L - min Q clamped to the table.
//   * dq_dyn_pool_distribute: _dynamiq_pool._distribute, integer arithmetic in its order.

#include <cstdint>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && !defined(DQ_PORTABLE)
#include <immintrin.h>
#define DQ_POOL_AVX2 1
#endif

namespace {

#ifdef DQ_POOL_AVX2
// the largest finite magnitude bits of the 16 fp32 values at p (what the portable loop gives)
inline uint32_t finite_absmax16(const float* p) {
  const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)p), mag);
  __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p + 8)), mag);
  a = _mm256_and_si256(a, _mm256_cmpgt_epi32(inf, a));  // (magnitudes: signed compares)
  b = _mm256_and_si256(b, _mm256_cmpgt_epi32(inf, b));
  const __m256i c = _mm256_max_epi32(a, b);
  __m128i d = _mm_max_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  d = _mm_max_epi32(d, _mm_shuffle_epi32(d, 0x4E));
  d = _mm_max_epi32(d, _mm_shuffle_epi32(d, 0xB1));
  return (uint32_t)_mm_cvtsi128_si32(d);
}
#endif

constexpr int16_t DEAD_LEVEL = INT16_MIN;  // a group whose finite absmax is 0
constexpr int KT = 8;                      // thresholds per binade in the table (padded)

// the level of positive finite magnitude bits a: l_min plus the thresholds <= a, from the
// binade's row of the table (normal numbers) or a search of all of them (subnormals)
struct Levels {
  const uint32_t* row;  // [256 * KT] each binade's thresholds, padded with 0x7FFFFFFF
  const int32_t* base;  // [256] l_min + the thresholds below the binade
  const uint32_t* all;  // [n_all] every threshold, ascending
  int64_t n_all;
  int32_t l_min;

  int32_t operator()(uint32_t a) const {
    const uint32_t e = a >> 23;
    if (e == 0) {
      const uint32_t* end = std::upper_bound(all, all + n_all, a);
      return l_min + (int32_t)(end - all);
    }
    const uint32_t* r = row + e * KT;
    int32_t c = 0;
    for (int i = 0; i < KT; i++) c += a >= r[i] ? 1 : 0;
    return base[e] + c;
  }
};

// the largest finite magnitude bits of the groups [g0, g1) of G (> 0) or g values into m
// (each group's values in one vectorizable loop; the buffer's short last group on its own)
template <int G, int KIND>
void finite_absmax_bits(const void* x, int64_t g_, int64_t n, int64_t g0, int64_t g1,
                        uint32_t* __restrict m) {
  const int64_t g = G > 0 ? G : g_;
  const int64_t whole = std::max(g0, std::min(g1, n / g));
  int64_t gi = g0;
#ifdef DQ_POOL_AVX2
  if (G == 16 && KIND == 0)
    for (; gi < whole; gi++) m[gi - g0] = finite_absmax16((const float*)x + gi * 16);
#endif
  for (; gi < whole; gi++) {
    uint32_t top = 0;
    for (int64_t i = 0; i < g; i++) {
      const uint32_t a = f2u(load_value<KIND>(x, gi * g + i)) & 0x7FFFFFFFu;
      top = std::max(top, a < 0x7F800000u ? a : 0u);
    }
    m[gi - g0] = top;
  }
  for (; gi < g1; gi++) {  // the buffer's short last group
    uint32_t top = 0;
    for (int64_t i = gi * g; i < n; i++) {
      const uint32_t a = f2u(load_value<KIND>(x, i)) & 0x7FFFFFFFu;
      top = std::max(top, a < 0x7F800000u ? a : 0u);
    }
    m[gi - g0] = top;
  }
}

// groups [g0, g1): their absmax bits (into m, a scratch of g1 - g0), levels and histogram;
// returns their largest absmax bits
template <int G, int KIND>
uint32_t levels_of(const void* x, int64_t g_, int64_t n, int64_t g0, int64_t g1,
                   const Levels& lv, uint32_t* m, int16_t* out, int64_t* hist) {
  const int64_t g = G > 0 ? G : g_;
  finite_absmax_bits<G, KIND>(x, g_, n, g0, g1, m);
  uint32_t top = 0;
  for (int64_t gi = g0; gi < g1; gi++) {
    const uint32_t a = m[gi - g0];
    top = std::max(top, a);
    if (a == 0) {
      out[gi] = DEAD_LEVEL;
      continue;
    }
    const int32_t l = lv(a);
    out[gi] = (int16_t)l;
    hist[l - lv.l_min] += std::min(g, n - gi * g);
  }
  return top;
}

template <int KIND>
uint32_t levels_kind(const void* x, int64_t g, int64_t n, int64_t g0, int64_t g1,
                     const Levels& lv, uint32_t* m, int16_t* out, int64_t* hist) {
  if (g == 16) return levels_of<16, KIND>(x, g, n, g0, g1, lv, m, out, hist);
  return levels_of<0, KIND>(x, g, n, g0, g1, lv, m, out, hist);
}

// _dynamiq_pool.LEVEL_STEPS: the water level's steps (1/LEVEL_STEPS bit a value)
constexpr int64_t LEVEL_STEPS = 256;

// one segment of dq_dyn_pool_distribute: spans [i0, i1), total bytes (the reference's
// _distribute_reference, one segment at a time)
void distribute_segment(const int64_t* demand, const int64_t* lens, int64_t i0, int64_t i1,
                        int64_t total, int64_t* out) {
  int64_t want = 0;
  for (int64_t i = i0; i < i1; i++) want += demand[i];
  auto live = [&](int64_t i) { return want == 0 || demand[i] > 0; };
  if (want > 8 * total) {  // the demand does not fit: shares in proportion to it
    for (int64_t i = i0; i < i1; i++) out[i] = demand[i] * total / want;
  } else {  // a water level
    auto bytes = [&](int64_t i, int64_t delta) -> int64_t {  // _level_bytes
      if (!live(i)) return 0;
      const int64_t num = LEVEL_STEPS * demand[i] + delta * lens[i];
      return num <= 0 ? 0 : std::min(num / (8 * LEVEL_STEPS), lens[i]);
    };
    auto fits = [&](int64_t delta) {
      int64_t sum = 0;
      for (int64_t i = i0; i < i1; i++) sum += bytes(i, delta);
      return sum <= total;
    };
    int64_t lo = -8 * LEVEL_STEPS, hi = 8 * LEVEL_STEPS + 1;  // lo fits, hi does not
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;  // = floor((lo + hi) / 2), as the reference
      if (fits(mid)) lo = mid;
      else hi = mid;
    }
    for (int64_t i = i0; i < i1; i++) out[i] = bytes(i, lo);
  }
  int64_t left = total;
  for (int64_t i = i0; i < i1; i++) left -= out[i];
  while (left > 0) {  // one byte each, in span order, to the live spans below their cap
    bool gave = false;
    for (int64_t i = i0; i < i1 && left > 0; i++) {
      if (!live(i) || out[i] >= lens[i]) continue;
      out[i]++;
      left--;
      gave = true;
    }
    if (!gave) break;
  }
}

}  // namespace

extern "C" {

// Pass 1 of a rank's demand over x (n values, kind 0 fp32, 1 bf16, 2 fp16) cut into groups of
// g from 0 (the last may be short): levels[gi] (DEAD_LEVEL for a group of finite absmax 0),
// hist[l - l_min] += the group's size, *top = the largest finite magnitude bits. hist has
// n_all + 1 entries, zeroed here. 0: done; 1: out of memory / thread failure.
int dq_dyn_pool_levels(const void* x, int32_t kind, int64_t n, int64_t g, const uint32_t* row,
                       const int32_t* base, const uint32_t* all, int64_t n_all, int32_t l_min,
                       int16_t* levels, int64_t* hist, uint32_t* top, int32_t nthreads) {
  const int64_t nh = n_all + 1;
  std::fill(hist, hist + nh, 0);
  *top = 0;
  if (n <= 0 || g <= 0) return 0;
  const Levels lv{row, base, all, n_all, l_min};
  const int64_t groups = (n + g - 1) / g, tile = 4096, ntiles = (groups + tile - 1) / tile;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, ntiles));
  std::vector<int64_t> hists;
  std::vector<uint32_t> tops, scratch;
  try {
    hists.assign((size_t)(nt * nh), 0);
    tops.assign((size_t)nt, 0);
    scratch.resize((size_t)(nt * tile));
  } catch (...) {
    return 1;
  }
  auto work = [&](int64_t t0, int64_t t1, int t) -> bool {
    const int64_t g0 = t0 * tile, g1 = std::min(groups, t1 * tile);
    int64_t* h = hists.data() + t * nh;
    uint32_t* m = scratch.data() + t * tile;
    for (int64_t a = g0; a < g1; a += tile) {  // a tile at a time through the scratch
      const int64_t b = std::min(g1, a + tile);
      uint32_t top;
      if (kind == 1) top = levels_kind<1>(x, g, n, a, b, lv, m, levels, h);
      else if (kind == 2) top = levels_kind<2>(x, g, n, a, b, lv, m, levels, h);
      else top = levels_kind<0>(x, g, n, a, b, lv, m, levels, h);
      tops[t] = std::max(tops[t], top);
    }
    return true;
  };
  if (!parallel_tiles(ntiles, nt, work)) return 1;
  for (int t = 0; t < nt; t++) {
    for (int64_t i = 0; i < nh; i++) hist[i] += hists[t * nh + i];
    *top = std::max(*top, tops[t]);
  }
  return 0;
}

// Pass 2: the demand (bits) of every span of every region [regions[2r], regions[2r + 1]) (each
// starting on a multiple of g; spans of `span` values from its start, the last maybe short),
// in order, into demand: each live group of the span takes count[clamp(tau - 8 L - q_lo, 0,
// n_count - 1)] bits a value. Never fails.
int dq_dyn_pool_demand(const int16_t* levels, int64_t n, int64_t g, const int64_t* regions,
                       int64_t n_regions, int64_t span, int64_t tau, const int64_t* count,
                       int64_t n_count, int64_t q_lo, int64_t* demand) {
  int64_t s = 0;
  for (int64_t r = 0; r < n_regions; r++) {
    const int64_t a = regions[2 * r], b = regions[2 * r + 1];
    for (int64_t s0 = a; s0 < b; s0 += span, s++) {
      const int64_t s1 = std::min(b, s0 + span);
      int64_t bits = 0;
      for (int64_t gi = s0 / g; gi * g < s1; gi++) {
        const int32_t l = levels[gi];
        if (l == DEAD_LEVEL) continue;
        const int64_t d = std::min(std::max<int64_t>(tau - 8 * (int64_t)l - q_lo, 0), n_count - 1);
        bits += count[d] * std::min(g, n - gi * g);
      }
      demand[s] = bits;
    }
  }
  return 0;
}

// _dynamiq_pool._distribute: the bytes of each of the n spans (out) when each segment's
// total (segment s: spans [first[s], first[s + 1])) is shared among its spans by a water
// level (each live span its demand plus the same bits a value), or in proportion to the
// demand where it exceeds the total, at most lens[i] each.
// Integer arithmetic (every division's operands >= 0). Never fails.
int dq_dyn_pool_distribute(const int64_t* demand, const int64_t* lens, int64_t n,
                           const int64_t* first, const int64_t* total, int64_t n_seg,
                           int64_t* out) {
  (void)n;
  for (int64_t s = 0; s < n_seg; s++)
    distribute_segment(demand, lens, first[s], first[s + 1], total[s], out);
  return 0;
}

}  // extern "C"
