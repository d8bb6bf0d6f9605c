// The CPU fast path of the DynamiQ codec: encode, decode and the fused reduce (decode the
// incoming span, add the local slice in fp32, recompute the super-group scales, group codes
// and widths, round, pack), one span at a time per thread, no fp32 tensor in memory beyond a
// span-sized scratch per thread.
//
// Bit-exact with the PyTorch reference, DynamiqCodec in dynamiq/codecs/dynamiq_codec.py (its
// module docstring defines the wire format; tests/kernels/test_cpu_native_dynamiq.py checks
// every knob against it):
//   * the fp32 tables are the reference's own (levels, rounding cells and keys, the lower
//     neighbours and gaps of stochastic rounding, the 16 group-scale steps and powers, the
//     integer priorities Q), passed in by dynamiq/kernels/cpu_native.py;
//   * every fp32 operation is the reference's, in its order: the group scale
//     (S * step[e]) * power[e], y = x / s clamped to [-1, 1], the cell (int)((y + 1) * 1024),
//     the rounding fraction (y - lower) / gap, level * s, then + local; the correlated dither
//     (stratum + v) / H with H rounded to fp32 (torch's CPU division by a Python int);
//     compiled with -ffp-contract=off (no FMA), without -ffast-math;
//   * a level index is the count of the width's rounding keys below y (nearest: the round-up
//     thresholds, <=; stochastic: the levels, <), which is what the reference's cell lookup
//     base[cell] + (key[cell] <= y) computes (no two keys share a cell and its margins): the
//     portable loops use the cell tables, the vector code a search over the keys;
//   * maxima are integer maxima of the magnitude bits (NaN > Inf > finite, never dropped);
//     the bf16 scale rounds those bits up to a multiple of 2^16, NaN gives 0xFFFF;
//   * the widths come from integer arithmetic only: the smallest threshold tau in the
//     reference's range whose cost fits the budget (a histogram of the span's group levels,
//     its suffix sums, and a search: the cost never rises with tau), then the leftover
//     bits to the groups whose next bit is worth tau - 1, in index order.
//
// Threads take whole spans (a span's widths depend on all of its scales), so the bytes do not
// depend on the thread count. Per span: (reduce) the incoming header and widths, then the
// decoded values plus the local ones into a span-sized scratch with each group's absmax;
// the scales, codes and widths; then rounding and packing, group by group.
//
// Bytes moved per value (fused reduce, the default codec: spans and super-groups of 256,
// groups of 16, 4.62 bits on average, the spans' budgets pooled by the prologue): payload in
// 4.62/8 + 2/256 + 0.5/16 (~0.62), local 4 (fp32) or 2 (bf16/fp16), payload out the same
// ~0.62. The span's values stay in the per-thread scratch (1 KiB at the default span; 256 KiB
// for the first version's spans of 65536) between the statistics pass and the rounding pass.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

// AVX-512 (with BMI2's pdep/pext): the full groups of 16, 32 or 64 values run as vector code
// with in-register tables (no gathers); AVX2 without AVX-512: full groups of a multiple of 8
// values (dynamiq_avx2.h); everything else, and other machines, run the portable loops below
// (the same results: tests/kernels/test_cpu_native_dynamiq.py builds and checks both).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__BMI2__) && !defined(DQ_PORTABLE)
#define DQ_VECTOR 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__BMI2__) && defined(__F16C__) && !defined(DQ_PORTABLE)
#define DQ_AVX2 1  // the same with 8 lanes (dynamiq_avx2.h)
#endif

namespace {

constexpr int MAX_W = 8;
constexpr int ROW = (1 << MAX_W) + 1;  // row stride of the level tables (_ROW)
constexpr int CELLS = 1024;            // cells per unit of [-1, 1] (_CELLS)
constexpr int NCELL = 2 * CELLS + 1;   // row stride of the cell tables
constexpr int E_MAX = 15;              // group codes are 4 bits
constexpr int32_t DEAD = INT32_MIN;    // the level of a group that gets no bits
constexpr int PAIRS = MAX_W * (E_MAX + 1);  // (width, group code) pairs (widths_one_sg)

enum { ROUND_NEAREST = 0, ROUND_STOCHASTIC = 1, ROUND_CORRELATED = 2 };

// what every span of one dq_dyn_run call shares
struct DynJob {
  int op, in_kind, rounding, k, pooled;
  int64_t n, span, sg, g, per_sg;
  int64_t bud_in[2], bud_out[2];  // budgets (bits) of a full span and of the short last one
  // pooled budgets (pooling="bucket"): each span's budget (bits) and its payload's offset
  // (bytes) less off_*_base; null: every span has the budgets above, at multiples of the full
  // span's size
  const int64_t *bud_in_of, *bud_out_of, *off_in, *off_out;
  int64_t off_in_base, off_out_base;
  uint32_t key0, key1, skey0, skey1;
  uint64_t offset, hop, num_hops;
  float hf;  // num_hops as fp32
  const float *levels, *key, *lower, *gap;
  const int32_t* base;
  const float* eyt;   // [9 * 256] each width's rounding keys as a search tree (vector code)
  const float* eyt5;  // [9 * 32] widths 1..5: the same padded with +inf to 5 levels
  int32_t q[MAX_W], q_lo, q_hi;  // the priorities Q[w], their range
  int32_t q_falls;               // Q never rises with w (every built-in table: widths_one_sg)
  // by d = tau - 8 L - q_lo clamped to [0, d_max]: the width of a group of level L at
  // threshold tau (how many Q[w] >= tau - 8 L) and whether its next bit is worth tau - 1
  int32_t d_max, pad;  // pad: how far the widths' cost looks past the levels (in levels)
  uint8_t w_of_d[256], r_of_d[256];
  // the pairs (w, e) by falling priority Q[w] - 8 e (ties: any order): e and the priority
  uint8_t pair_e[PAIRS];
  int32_t pair_p[PAIRS];
  float steps[E_MAX + 1], powers[E_MAX + 1];
  const void* x;
  const uint8_t* in;
  uint8_t* out;
  float* out_values;
};

// the layout of one span of len values
struct Geo {
  int64_t len, n_sg, n_g, n_gp, sb, eb, last;  // last: values in the last group
};

inline Geo geometry(const DynJob& j, int64_t len) {
  Geo G;
  G.len = len;
  G.n_sg = (len + j.sg - 1) / j.sg;
  G.n_g = (len + j.g - 1) / j.g;
  G.n_gp = G.n_sg * j.per_sg;  // groups up to whole super-groups (the padding: no bits)
  G.sb = 2 * G.n_sg;
  G.eb = (G.n_g * 4 + 7) / 8;
  G.last = len - (G.n_g - 1) * j.g;
  return G;
}

inline int64_t span_bytes(const Geo& G, int64_t budget) { return G.sb + G.eb + (budget + 7) / 8; }

// the group scale of super-group scale S and code e: (S * step[e]) * power[e]
inline float group_scale(const DynJob& j, float S, int e) { return (S * j.steps[e]) * j.powers[e]; }

// the 8 bytes of a container of nbytes bytes at byte off, as one little-endian word (bytes
// at or past nbytes read as 0)
inline uint64_t load_word(const uint8_t* body, int64_t nbytes, int64_t off) {
  uint64_t w = 0;
  if (off + 8 <= nbytes) std::memcpy(&w, body + off, 8);
  else if (off < nbytes) std::memcpy(&w, body + off, (size_t)(nbytes - off));
  return w;
}

// per-thread scratch, sized for a full span
struct Scratch {
  std::vector<float> vals;       // the span's values, zero-padded to whole super-groups
  std::vector<uint32_t> gmax;    // each group's absmax (magnitude bits)
  std::vector<uint8_t> e, w;     // group codes and widths
  std::vector<int32_t> sgl;      // super-group levels k floor(log2 S) (DEAD: no bits)
  std::vector<uint8_t> emin, emax;  // the range of the group codes of each super-group
  std::vector<uint8_t> rise;     // groups whose next bit is worth tau - 1
  std::vector<float> S, s;       // super-group scales, group scales
  std::vector<int32_t> hist;     // level histogram (suffix sums), padded (widths)
  std::vector<uint8_t> body;     // the span's packed codes (with slack)
  std::vector<uint32_t> codes;   // one group's codes
  std::vector<float> u;          // one group's dither

  bool init(const DynJob& j) {
    const Geo G = geometry(j, std::min(j.n, j.span));
    const int64_t padded = G.n_gp * j.g;
    int64_t max_body = std::max((j.bud_in[0] + 7) / 8, (j.bud_out[0] + 7) / 8);
    if (j.bud_in_of || j.bud_out_of) max_body = std::max(max_body, j.span);  // <= 8 bits a value
    try {
      vals.resize((size_t)padded);
      gmax.resize((size_t)G.n_gp);
      e.resize((size_t)G.n_gp);
      w.resize((size_t)G.n_gp);
      sgl.resize((size_t)G.n_sg);
      emin.resize((size_t)G.n_sg);
      emax.resize((size_t)G.n_sg);
      rise.resize((size_t)G.n_gp);
      S.resize((size_t)G.n_sg);
      s.resize((size_t)G.n_gp);
      hist.resize((size_t)(j.k * 300 + 64 + 2 * j.pad));  // any range of levels
      body.resize((size_t)(max_body + j.g + 16));
      codes.resize((size_t)j.g + 8);
      u.resize((size_t)j.g);
    } catch (...) {
      return false;
    }
    return true;
  }
};

#ifdef DQ_AVX2
#include "dynamiq_avx2.h"
#endif

// -- widths -----------------------------------------------------------------------------------

// widths() for a span of one live super-group of full groups (the default span of 256): the
// priorities 8 L + Q[w] less the super-group's 8 k floor(log2 S) are Q[w] - 8 e. With every
// group the same size g, a threshold t fits the budget iff at most K = budget / g priorities
// are >= t, so tau is the smallest such t: one more than the (K + 1)-th largest priority (with
// K at least all of them, the search's floor q_lo - 8 E_MAX: every width 8, nothing rises, as
// the reference's tau = the least gives). The priorities are the pairs (w, e) weighted by the
// count of groups of code e, so the (K + 1)-th largest is found by walking the job's pairs in
// falling priority (j.pair_e, j.pair_p) and summing those counts. With Q falling, a group's
// width is its count of priorities >= tau and its next bit is worth tau - 1 iff one of its
// priorities is tau - 1 (w_of_d, r_of_d at d = tau + 8 e - q_lo); the leftover bits take the
// first left / g rising groups. false: not such a span (the general code runs).
bool widths_one_sg(const DynJob& j, const Geo& G, int64_t budget, Scratch& sc) {
  if (!j.pooled || !j.q_falls || G.n_sg != 1 || G.last != j.g) return false;
  const float S = sc.S[0];
  if (!(std::isfinite(S) && S > 0.0f)) return false;
  const int64_t n_g = G.n_g;
  const uint8_t* __restrict e = sc.e.data();
  if (n_g > 255) return false;
  // the count of groups of each code: bytes of two words (adds of registers, not of memory:
  // neighbouring groups often share a code, and a histogram in memory would wait on itself)
  uint64_t c_lo = 0, c_hi = 0;
  for (int64_t gi = 0; gi < n_g; gi++) {
    const uint64_t one = 1ull << (8 * (e[gi] & 7)), hi = 0 - (uint64_t)(e[gi] >> 3);
    c_hi += one & hi;
    c_lo += one & ~hi;
  }
  uint8_t count[E_MAX + 1];
  std::memcpy(count, &c_lo, 8);
  std::memcpy(count + 8, &c_hi, 8);
  const int64_t K = budget / j.g;
  int32_t tau = j.q_lo - 8 * E_MAX;  // K >= every priority: the floor
  if (K < n_g * MAX_W) {
    int64_t seen = 0;
    for (int i = 0; i < PAIRS; i++) {
      seen += count[j.pair_e[i]];
      if (seen > K) {
        tau = j.pair_p[i] + 1;
        break;
      }
    }
  }
  uint8_t* __restrict w = sc.w.data();
  uint8_t* __restrict rise = sc.rise.data();
  int64_t used = 0, rising = 0;
  for (int64_t gi = 0; gi < n_g; gi++) {
    const int32_t d = std::min(std::max(tau + 8 * (int32_t)e[gi] - j.q_lo, 0), j.d_max);
    w[gi] = j.w_of_d[d];
    rise[gi] = j.r_of_d[d];
    used += w[gi];
    rising += rise[gi];
  }
  int64_t take = std::min<int64_t>(rising, (budget - used * j.g) / j.g);
  for (int64_t gi = 0; take > 0; gi++) {
    w[gi] += rise[gi];
    take -= rise[gi];
  }
  std::memset(w + n_g, 0, (size_t)(j.per_sg - n_g));
  return true;
}

// The widths w[0 .. n_gp) of a span from its super-group scales sc.S (as read: NaN, Inf or
// negative possible) and group codes sc.e, for a container of budget bits (_widths_rows).
// The groups of a super-group share k floor(log2 S), so each pass works per super-group.
void widths(const DynJob& j, const Geo& G, int64_t budget, Scratch& sc) {
  if (widths_one_sg(j, G, budget, sc)) return;
  const int64_t g = j.g, n_g = G.n_g, per = j.per_sg;
  uint8_t* __restrict w = sc.w.data();
  const uint8_t* __restrict e = sc.e.data();
  int32_t* __restrict sgl = sc.sgl.data();  // per super-group: L0 = k floor(log2 S), or DEAD
  uint8_t* __restrict emin = sc.emin.data();
  uint8_t* __restrict emax = sc.emax.data();
  // group levels L = L0 - e of the live groups (S finite and > 0; not padding): their range
  int32_t lmin = INT32_MAX, lmax = INT32_MIN;
  for (int64_t sgi = 0; sgi < G.n_sg; sgi++) {
    const float S = sc.S[sgi];
    const int64_t g0 = sgi * per, g1 = std::min(g0 + per, n_g);
    if (!(std::isfinite(S) && S > 0.0f)) {
      sgl[sgi] = DEAD;
      continue;
    }
    const int32_t L0 = j.k * exponent_of(f2u(S));
    uint32_t lo = E_MAX, hi = 0;
    for (int64_t gi = g0; gi < g1; gi++) {
      lo = std::min<uint32_t>(lo, e[gi]);
      hi = std::max<uint32_t>(hi, e[gi]);
    }
    sgl[sgi] = L0;
    emin[sgi] = (uint8_t)lo;
    emax[sgi] = (uint8_t)hi;
    lmin = std::min(lmin, L0 - (int32_t)hi);
    lmax = std::max(lmax, L0 - (int32_t)lo);
  }
  if (!j.pooled || lmin > lmax) {  // the ablation (one width for every live group); no live
    const int flat = !j.pooled ? (int)std::min<int64_t>(MAX_W, budget / G.len) : 0;
    for (int64_t sgi = 0; sgi < G.n_sg; sgi++) {
      const int64_t g0 = sgi * per, g1 = std::min(g0 + per, n_g);
      const uint8_t v = sgl[sgi] != DEAD ? (uint8_t)flat : 0;
      std::memset(w + g0, v, (size_t)(g1 - g0));
      std::memset(w + g1, 0, (size_t)(g0 + per - g1));
    }
    return;
  }
  // suffix sums of the live groups' sizes by level: suf[i] = elements with L >= lmin + i,
  // for i in [-pad, nb + pad] (suf[i] = suf[0] below 0, 0 from nb on): every index the cost
  // below takes, so it needs no clamps
  const int32_t nb = lmax - lmin + 1, pad = j.pad, stride = nb + 2 * pad + 1;
  if ((size_t)stride > sc.hist.size()) sc.hist.resize((size_t)stride);
  int32_t* const suf = sc.hist.data() + pad;
  std::fill(suf - pad, suf + nb + pad + 1, 0);
  for (int64_t sgi = 0; sgi < G.n_sg; sgi++) {
    if (sgl[sgi] == DEAD) continue;
    const int64_t g0 = sgi * per, g1 = std::min(g0 + per, n_g);
    int32_t* const at = suf + (sgl[sgi] - lmin);  // at[-e]: the bin of code e
    for (int64_t gi = g0; gi < g1; gi++) at[-(int32_t)e[gi]] += (int32_t)g;
  }
  const int64_t last_sg = (n_g - 1) / per;
  if (sgl[last_sg] != DEAD) suf[sgl[last_sg] - e[n_g - 1] - lmin] -= (int32_t)(g - G.last);
  for (int32_t i = nb - 1; i >= 0; i--) suf[i] += suf[i + 1];
  for (int32_t i = -pad; i < 0; i++) suf[i] = suf[0];
  // cost(t): the bits taken at threshold t; a group of level L takes its bit w iff
  // 8 L + Q[w] >= t, i.e. L >= ceil((t - Q[w]) / 8) = lmin + ((t + 7 - Q[w] - 8 lmin) >> 3)
  int64_t c7[MAX_W];
  for (int ww = 0; ww < MAX_W; ww++) c7[ww] = 7 - (int64_t)j.q[ww] - 8 * (int64_t)lmin;
  auto cost = [&](int64_t t) {
    int64_t c = 0;
    for (int ww = 0; ww < MAX_W; ww++) c += suf[(t + c7[ww]) >> 3];
    return c;
  };
  // the smallest tau in [lo, hi] with cost(tau) <= budget (cost(hi) = 0; cost never rises)
  // (three independent costs a step while the range is long: a quarter of it is left)
  int64_t lo = 8 * (int64_t)lmin + j.q_lo, hi = 8 * (int64_t)lmax + j.q_hi + 1;
  while (hi - lo >= 4) {
    const int64_t q = (hi - lo) >> 2, m1 = lo + q, m2 = lo + 2 * q, m3 = lo + 3 * q;
    const bool f1 = cost(m1) <= budget, f2 = cost(m2) <= budget, f3 = cost(m3) <= budget;
    // the first that fits bounds tau above; the last that does not, below
    hi = f1 ? m1 : f2 ? m2 : f3 ? m3 : hi;
    lo = f1 ? lo : f2 ? m1 + 1 : f3 ? m2 + 1 : m3 + 1;
  }
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;  // floor
    const bool fits = cost(mid) <= budget;
    hi = fits ? mid : hi;
    lo = fits ? lo : mid + 1;
  }
  const int64_t tau = lo;
  // the groups' widths (how many Q[w] >= tau - 8 L) and whether their next bit is worth
  // tau - 1, from the job's tables by d = tau - 8 L - min Q, through a 16-entry table of
  // each super-group by code (L = L0 - e)
  uint8_t* __restrict rise = sc.rise.data();
  int32_t sum = 0;
  for (int64_t sgi = 0; sgi < G.n_sg; sgi++) {
    const int64_t g0 = sgi * per, g1 = std::min(g0 + per, n_g);
    alignas(16) uint8_t wsg[E_MAX + 1] = {0}, rsg[E_MAX + 1] = {0};
    if (sgl[sgi] != DEAD) {
      const int64_t d0 = tau - 8 * (int64_t)sgl[sgi] - j.q_lo;
      for (uint32_t v = emin[sgi]; v <= emax[sgi]; v++) {
        const int64_t d = std::min<int64_t>(std::max<int64_t>(d0 + 8 * (int64_t)v, 0), j.d_max);
        wsg[v] = j.w_of_d[d];
        rsg[v] = j.r_of_d[d];
      }
    }
    int64_t gi = g0;
#ifdef DQ_VECTOR
    {  // 64 groups at a time: byte shuffles of the 16-entry tables
      const __m512i tw = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)wsg));
      const __m512i tr = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)rsg));
      __m512i acc = _mm512_setzero_si512();
      for (; gi + 64 <= g1; gi += 64) {
        const __m512i idx = _mm512_loadu_si512((const void*)(e + gi));
        const __m512i wv = _mm512_shuffle_epi8(tw, idx);
        _mm512_storeu_si512((void*)(w + gi), wv);
        _mm512_storeu_si512((void*)(rise + gi), _mm512_shuffle_epi8(tr, idx));
        acc = _mm512_add_epi64(acc, _mm512_sad_epu8(wv, _mm512_setzero_si512()));
      }
      sum += (int32_t)_mm512_reduce_add_epi64(acc);
    }
#elif defined(DQ_AVX2)
    {  // 16 groups at a time: byte shuffles of the 16-entry tables
      const __m128i tw = _mm_load_si128((const __m128i*)wsg);
      const __m128i tr = _mm_load_si128((const __m128i*)rsg);
      for (; gi + 16 <= g1; gi += 16) {
        const __m128i idx = _mm_loadu_si128((const __m128i*)(e + gi));
        const __m128i wv = _mm_shuffle_epi8(tw, idx);
        _mm_storeu_si128((__m128i*)(w + gi), wv);
        _mm_storeu_si128((__m128i*)(rise + gi), _mm_shuffle_epi8(tr, idx));
        const __m128i s2 = _mm_sad_epu8(wv, _mm_setzero_si128());
        sum += _mm_cvtsi128_si32(s2) + _mm_extract_epi16(s2, 4);
      }
    }
#endif
    for (; gi < g1; gi++) {
      w[gi] = wsg[e[gi]];
      rise[gi] = rsg[e[gi]];
      sum += wsg[e[gi]];
    }
    std::memset(w + g1, 0, (size_t)(g0 + per - g1));
  }
  const int64_t used = (int64_t)sum * g - (int64_t)w[n_g - 1] * (g - G.last);
  // leftover bits: the rising groups in index order, while they fit (8 flags at a time: all
  // 8 at once while they fit, as one add of bytes; their widths are < 8, so nothing carries)
  const int64_t left = budget - used;
  int64_t cum = 0;
  for (int64_t b0 = 0; b0 < n_g; b0 += 8) {
    const int64_t nbk = std::min<int64_t>(8, n_g - b0);
    uint64_t m = 0;
    std::memcpy(&m, rise + b0, (size_t)nbk);
    if (!m) continue;
    const int64_t take = (int64_t)__builtin_popcountll(m) * g;
    if (b0 + nbk < n_g && cum + take <= left) {  // (the last group may be short)
      uint64_t wv;
      std::memcpy(&wv, w + b0, 8);
      wv += m;
      std::memcpy(w + b0, &wv, 8);
      cum += take;
      continue;
    }
    while (m) {
      const int64_t gi = b0 + (__builtin_ctzll(m) >> 3);
      m &= m - 1;  // the flag is 1: its byte's only bit
      cum += gi == n_g - 1 ? G.last : g;
      if (cum > left) return;  // the sum only grows: no later group fits
      w[gi]++;
    }
  }
}

// -- scales -----------------------------------------------------------------------------------

#ifdef DQ_VECTOR
// scale_codes for falling candidates cand[0 .. 15], 16 groups at a time (of the n groups of
// absmax bits gm), as scale_codes_avx2 (dynamiq_avx2.h) does 8: e, the count of the codes
// 1..15 whose scale is >= the absmax (never for a NaN; a group of zeros: 15), and the scale
// s = cand[e]; returns the groups done (a multiple of 16)
inline int64_t scale_codes_512(const float* cand, const uint32_t* gm, int64_t n, uint8_t* e,
                               float* s) {
  __m512 cv[E_MAX + 1];
  for (int ee = 0; ee <= E_MAX; ee++) cv[ee] = _mm512_set1_ps(cand[ee]);
  const __m512 ct = _mm512_loadu_ps(cand);
  const __m512i one = _mm512_set1_epi32(1);
  int64_t gi = 0;
  for (; gi + 16 <= n; gi += 16) {
    const __m512i bits = _mm512_loadu_si512((const void*)(gm + gi));
    const __m512 a = _mm512_castsi512_ps(bits);
    __m512i c = _mm512_setzero_si512();
    for (int ee = 1; ee <= E_MAX; ee++)
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(cv[ee], a, _CMP_GE_OQ), c, one);
    c = _mm512_mask_mov_epi32(c, _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512()),
                              _mm512_set1_epi32(E_MAX));
    _mm512_storeu_ps(s + gi, _mm512_permutexvar_ps(c, ct));
    _mm_storeu_si128((__m128i*)(e + gi), _mm512_cvtepi32_epi8(c));
  }
  return gi;
}
#endif

// The super-group scales (written to the header hdr and sc.S) and the group codes and scales
// (sc.e, sc.s) of a span from its group absmax bits sc.gmax.
void scale_codes(const DynJob& j, const Geo& G, uint8_t* hdr, Scratch& sc) {
  const int64_t per = j.per_sg;
  for (int64_t sgi = 0; sgi < G.n_sg; sgi++) {
    const uint32_t* __restrict gm = sc.gmax.data() + sgi * per;
    uint8_t* __restrict e = sc.e.data() + sgi * per;
    float* __restrict s = sc.s.data() + sgi * per;
    uint32_t am = 0;
    for (int64_t gi = 0; gi < per; gi++) am = std::max(am, gm[gi]);
    // the smallest bf16 >= absmax (NaN: the pattern 0xFFFF)
    const uint32_t b16 = am > 0x7F800000u ? 0xFFFFu : (am + 0xFFFFu) >> 16;
    hdr[2 * sgi] = (uint8_t)b16;
    hdr[2 * sgi + 1] = (uint8_t)(b16 >> 8);
    const float S = u2f(b16 << 16);
    sc.S[sgi] = S;
    float cand[E_MAX + 1];
    bool falls = true;  // the candidates never rise (always, for a bf16 S; checked anyway)
    for (int ee = 0; ee <= E_MAX; ee++) {
      cand[ee] = group_scale(j, S, ee);
      if (ee > 0 && cand[ee] > cand[ee - 1]) falls = false;
    }
    // e: the largest code whose scale is still >= the group absmax (0 if none: NaN); a
    // group of zeros: 15. With falling candidates, the count of the codes 1..15 that fit.
    if (falls) {
      int64_t gi = 0;
#if defined(DQ_VECTOR)
      gi = scale_codes_512(cand, gm, per, e, s);
#elif defined(DQ_AVX2)
      gi = scale_codes_avx2(cand, gm, per, e, s);
#endif
      for (; gi < per; gi++) {
        const float a = u2f(gm[gi]);
        int32_t c = 0;
        for (int ee = 1; ee <= E_MAX; ee++) c += cand[ee] >= a ? 1 : 0;
        e[gi] = (uint8_t)(gm[gi] == 0 ? E_MAX : c);
        s[gi] = cand[e[gi]];
      }
    } else {
      for (int64_t gi = 0; gi < per; gi++) {
        const float a = u2f(gm[gi]);
        int best = 0;
        for (int ee = 0; ee <= E_MAX; ee++) best = cand[ee] >= a ? ee : best;
        e[gi] = (uint8_t)(gm[gi] == 0 ? E_MAX : best);
        s[gi] = cand[e[gi]];
      }
    }
  }
  // the codes, two to a byte (the first in the low nibble)
  uint8_t* eb = hdr + G.sb;
  const uint8_t* e = sc.e.data();
  const int64_t pairs = G.n_g >> 1;
  for (int64_t i = 0; i < pairs; i++) eb[i] = (uint8_t)(e[2 * i] | e[2 * i + 1] << 4);
  if (G.n_g & 1) eb[pairs] = e[G.n_g - 1];
}

// -- vector code (AVX-512) ------------------------------------------------------------------
//
// A full group of G % 16 == 0 values, 16 at a time, with its width's tables in registers
// (permutes, no gathers). The codes of 16 values of width w are 2w bytes: two 8w-bit words,
// spread to (pdep) or gathered from (pext) the low w bits of 8 bytes each. Rounding counts
// the thresholds below y by a branch-free descent of a search tree in Eytzinger order. Widths
// 0..5, the common ones, take one code path with the width a run-time value (the widths of
// neighbouring groups vary at random: a branch on them would be mispredicted): tables of 32
// entries in two registers, and a tree of 5 levels over the thresholds padded with +inf (which
// never count). Widths 6..8 have a code path each.

#ifdef DQ_VECTOR

// v[i] of a table of 2^B fp32 entries (B in 4..8) held in 2^(B - 4) registers, by the low B
// bits of each lane of i
template <int B>
inline __m512 lookup(const __m512* t, __m512i i) {
  static_assert(B >= 4 && B <= 8, "tables of 16 to 256 entries");
  if constexpr (B == 4) {
    return _mm512_permutexvar_ps(i, t[0]);
  } else if constexpr (B == 5) {
    return _mm512_permutex2var_ps(t[0], i, t[1]);
  } else {
    constexpr int H = 1 << (B - 5);  // registers of each half
    const __m512 a = lookup<B - 1>(t, i), b = lookup<B - 1>(t + H, i);
    const __mmask16 up = _mm512_test_epi32_mask(i, _mm512_set1_epi32(1 << (B - 1)));
    return _mm512_mask_blend_ps(up, a, b);
  }
}

// the first 2^B entries (B >= 4) of a table row, in registers
template <int B>
struct Lut {
  __m512 t[1 << (B - 4)];
  explicit Lut(const float* row) {
    for (int r = 0; r < (1 << (B - 4)); r++) t[r] = _mm512_loadu_ps(row + 16 * r);
  }
  __m512 get(__m512i i) const { return lookup<B>(t, i); }
};

// How many of the 2^D - 1 ascending thresholds of a search tree in Eytzinger order (node k
// at row[k], children 2k and 2k + 1; row[0] unused; registers t) are <= y (LE) or < y: D
// levels of k = 2k + (row[k] <= y), level l's nodes [2^(l-1), 2^l) looked up in registers.
template <int L, int D, bool LE>
inline void descend(const __m512* t, __m512 y, __m512i& k) {
  if constexpr (L <= D) {
    __m512 node;
    if constexpr (L <= 4) node = lookup<4>(t, k);
    else node = lookup<L - 1>(t + (1 << (L - 5)), k);
    const __mmask16 right = _mm512_cmp_ps_mask(node, y, LE ? _CMP_LE_OQ : _CMP_LT_OQ);
    const __m512i k2 = _mm512_add_epi32(k, k);
    k = _mm512_mask_add_epi32(k2, right, k2, _mm512_set1_epi32(1));
    descend<L + 1, D, LE>(t, y, k);
  }
}

template <int D, bool LE>
inline __m512i count_below(const __m512* t, __m512 y) {
  __m512i k = _mm512_set1_epi32(1);
  descend<1, D, LE>(t, y, k);
  return _mm512_sub_epi32(k, _mm512_set1_epi32(1 << D));
}

inline uint64_t byte_mask(int w) { return 0x0101010101010101ull * ((1u << w) - 1); }

// 16 codes of width w from 2w bytes at b (8 bytes readable at b and at b + w)
inline __m512i unpack16(const uint8_t* b, int w, uint64_t mask) {
  uint64_t w0, w1;
  std::memcpy(&w0, b, 8);
  std::memcpy(&w1, b + w, 8);
  const __m128i bytes = _mm_set_epi64x((long long)_pdep_u64(w1, mask),
                                       (long long)_pdep_u64(w0, mask));
  return _mm512_cvtepu8_epi32(bytes);
}

// 16 codes of width w to 2w bytes at b: 8-byte stores at b and at b + w whose bytes past the
// codes are zero, overwritten by the next group's (the groups are stored in order)
inline void pack16(__m512i codes, uint8_t* b, int w, uint64_t mask) {
  const __m128i bytes = _mm512_cvtepi32_epi8(codes);
  const uint64_t w0 = _pext_u64((uint64_t)_mm_cvtsi128_si64(bytes), mask);
  const uint64_t w1 = _pext_u64((uint64_t)_mm_extract_epi64(bytes, 1), mask);
  std::memcpy(b, &w0, 8);
  std::memcpy(b + w, &w1, 8);
}

// 16 values from i on, as fp32 (exact)
template <int KIND>
inline __m512 load16(const void* src, int64_t i) {
  if constexpr (KIND == 0) {
    return _mm512_loadu_ps((const float*)src + i);
  } else {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)((const uint16_t*)src + i));
    const __m512i h = _mm512_cvtepu16_epi32(raw);
    if constexpr (KIND == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    else return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));  // exact (a NaN stays NaN)
  }
}

// m = max(m, magnitude bits of x), lane by lane
inline void absmax16(__m512 x, __m512i& m) {
  const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  m = _mm512_max_epu32(m, mag);
}

// y = x / s clamped to [-1, 1] (the reference's clamp; a no-op for a live group)
inline __m512 scaled16(const float* v, __m512 vs) {
  const __m512 y = _mm512_div_ps(_mm512_loadu_ps(v), vs);
  return _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
}

// Decode a full group of width w (its codes at b, 8 bytes readable past them): d = level * s
// (+ local); returns the absmax bits. Width 0 reads no bits: level 0 times s. B: the table
// registers (5 for any w <= 5, else w).
template <int G, int B, int KIND, bool ADD>
uint32_t decode_group_vec(const DynJob& j, int w, const uint8_t* b, float s, const void* local,
                          float* d) {
  const Lut<B> lut(j.levels + ROW * w);
  const uint64_t mask = byte_mask(w);
  const __m512 vs = _mm512_set1_ps(s);
  __m512i m = _mm512_setzero_si512();
  for (int c = 0; c < G / 16; c++) {
    __m512 x = _mm512_mul_ps(lut.get(unpack16(b + 2 * w * c, w, mask)), vs);
    if constexpr (ADD) x = _mm512_add_ps(x, load16<KIND>(local, 16 * c));
    _mm512_storeu_ps(d + 16 * c, x);
    absmax16(x, m);
  }
  return _mm512_reduce_max_epu32(m);
}

// Round and pack a full live group of width w >= 1 to its bytes b: nearest, the count of
// round-up thresholds <= y; stochastic and correlated, the upper neighbour hi (the count of
// levels < y, clamped to 1 .. 2^w - 1), then up with probability (y - lower[hi]) / gap[hi]
// (u < frac). D: the depth of the search tree and its table registers (5 for any w <= 5).
template <int G, int D>
void encode_group_vec(const DynJob& j, int w, const float* v, float s, const float* u,
                      uint8_t* b) {
  const Lut<D> tree(D == 5 ? j.eyt5 + 32 * w : j.eyt + 256 * w);
  const uint64_t mask = byte_mask(w);
  const __m512 vs = _mm512_set1_ps(s);
  if (j.rounding == ROUND_NEAREST) {
    for (int c = 0; c < G / 16; c++)
      pack16(count_below<D, true>(tree.t, scaled16(v + 16 * c, vs)), b + 2 * w * c, w, mask);
    return;
  }
  const Lut<D> lower(j.lower + ROW * w), gap(j.gap + ROW * w);
  const __m512 lv0 = _mm512_set1_ps(j.levels[ROW * w]);
  const __m512i one = _mm512_set1_epi32(1), top = _mm512_set1_epi32((1 << w) - 1);
  for (int c = 0; c < G / 16; c++) {
    const __m512 y = scaled16(v + 16 * c, vs);
    __m512i hi = count_below<D, false>(tree.t, y);  // the levels 1 .. 2^w - 1 below y
    hi = _mm512_mask_add_epi32(hi, _mm512_cmp_ps_mask(lv0, y, _CMP_LT_OQ), hi, one);
    hi = _mm512_min_epi32(_mm512_max_epi32(hi, one), top);
    const __m512 frac = _mm512_div_ps(_mm512_sub_ps(y, lower.get(hi)), gap.get(hi));
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_loadu_ps(u + 16 * c), frac, _CMP_LT_OQ);
    const __m512i below = _mm512_sub_epi32(hi, one);
    pack16(_mm512_mask_add_epi32(below, up, below, one), b + 2 * w * c, w, mask);
  }
}

// the width dispatch of the above (w in 0..8; encode: 1..8)
template <int G, int KIND, bool ADD>
inline uint32_t decode_group(const DynJob& j, int w, const uint8_t* b, float s,
                             const void* local, float* d) {
  if (w <= 5) return decode_group_vec<G, 5, KIND, ADD>(j, w, b, s, local, d);
  if (w == 6) return decode_group_vec<G, 6, KIND, ADD>(j, w, b, s, local, d);
  if (w == 7) return decode_group_vec<G, 7, KIND, ADD>(j, w, b, s, local, d);
  return decode_group_vec<G, 8, KIND, ADD>(j, w, b, s, local, d);
}

template <int G>
inline void encode_group(const DynJob& j, int w, const float* v, float s, const float* u,
                         uint8_t* b) {
  if (w <= 5) encode_group_vec<G, 5>(j, w, v, s, u, b);
  else if (w == 6) encode_group_vec<G, 6>(j, w, v, s, u, b);
  else if (w == 7) encode_group_vec<G, 7>(j, w, v, s, u, b);
  else encode_group_vec<G, 8>(j, w, v, s, u, b);
}

#endif  // DQ_VECTOR

// -- decoding -----------------------------------------------------------------------------------

// the header of the span at p: scales S, codes e (padding groups: 15), then the widths
void read_header(const DynJob& j, const Geo& G, const uint8_t* p, int64_t budget, Scratch& sc) {
  for (int64_t i = 0; i < G.n_sg; i++) {
    const uint32_t b16 = (uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8;
    sc.S[i] = u2f(b16 << 16);
  }
  const uint8_t* eb = p + G.sb;
  uint8_t* __restrict e = sc.e.data();
  const int64_t pairs = G.n_g >> 1;
  for (int64_t i = 0; i < pairs; i++) {
    e[2 * i] = eb[i] & 15;
    e[2 * i + 1] = eb[i] >> 4;
  }
  if (G.n_g & 1) e[G.n_g - 1] = eb[pairs] & 15;
  for (int64_t gi = G.n_g; gi < G.n_gp; gi++) e[gi] = E_MAX;
  widths(j, G, budget, sc);
}

// the N codes (width wv >= 1) of a group of N % 8 == 0 codes from the container bytes at b
// (byte-aligned: every 8 codes are wv whole bytes; avail bytes left in the container)
template <int N>
inline void unpack_aligned(const uint8_t* __restrict b, int64_t avail, int wv,
                           uint32_t* __restrict c) {
  const uint64_t mask = (1u << wv) - 1;
  for (int ch = 0; ch < N / 8; ch++) {
    const uint64_t word = load_word(b, avail, (int64_t)ch * wv);
    for (int jj = 0; jj < 8; jj++) c[8 * ch + jj] = (uint32_t)((word >> (wv * jj)) & mask);
  }
}

// the same with 8 bytes readable at every word
template <int N>
inline void unpack_aligned_fast(const uint8_t* __restrict b, int wv, uint32_t* __restrict c) {
  const uint64_t mask = (1u << wv) - 1;
  for (int ch = 0; ch < N / 8; ch++) {
    uint64_t word;
    std::memcpy(&word, b + ch * wv, 8);
    for (int jj = 0; jj < 8; jj++) c[8 * ch + jj] = (uint32_t)((word >> (wv * jj)) & mask);
  }
}

// the g codes of a group of any size (width wv >= 1, from bit `bit` of the container)
inline void unpack_any(const uint8_t* body, int64_t nbytes, int64_t bit, int64_t g, int wv,
                       uint32_t* __restrict c) {
  const uint64_t mask = (1u << wv) - 1;
  if (g % 8 == 0) {
    const int64_t b0 = bit >> 3;
    for (int64_t ch = 0; ch < g / 8; ch++) {
      const uint64_t word = load_word(body, nbytes, b0 + ch * wv);
      for (int jj = 0; jj < 8; jj++) c[8 * ch + jj] = (uint32_t)((word >> (wv * jj)) & mask);
    }
    return;
  }
  for (int64_t i = 0; i < g; i++) {  // a code spans at most two bytes
    const int64_t p = bit + wv * i;
    c[i] = (uint32_t)((load_word(body, nbytes, p >> 3) >> (p & 7)) & mask);
  }
}

// d[i] = level[c[i]] * s (+ local[i] with ADD) for the n (N > 0: N) values of a group;
// returns the absmax bits of the results (with ADD)
template <int N, int KIND, bool ADD>
inline uint32_t decode_values(const uint32_t* __restrict c, const float* __restrict lv, float s,
                              const void* __restrict local, float* __restrict d, int64_t n_) {
  const int64_t n = N > 0 ? N : n_;
  uint32_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    float x = lv[c[i]] * s;
    if (ADD) x = x + load_value<KIND>(local, i);
    d[i] = x;
    m = std::max(m, f2u(x) & 0x7FFFFFFFu);
  }
  return m;
}

// width 0: level 0 times the scale (NaN for a NaN/Inf scale, -0 for a negative one)
template <int N, int KIND, bool ADD>
inline uint32_t decode_zero(float s, const void* __restrict local, float* __restrict d,
                            int64_t n_) {
  const int64_t n = N > 0 ? N : n_;
  const float z = 0.0f * s;
  uint32_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    float x = z;
    if (ADD) x = x + load_value<KIND>(local, i);
    d[i] = x;
    m = std::max(m, f2u(x) & 0x7FFFFFFFu);
  }
  return m;
}

// Decode the span at p (budget bits) into dst[0 .. len); with ADD, plus the local values
// (local: the span's first) and the group absmax bits into sc.gmax (padding groups: 0).
// G: the group size when it is a compile-time multiple of 8, else 0.
template <int G, int KIND, bool ADD>
void decode_span(const DynJob& j, const Geo& G_, const uint8_t* p, int64_t budget,
                 const void* local, float* dst, Scratch& sc) {
  const Geo& Gm = G_;
  read_header(j, Gm, p, budget, sc);
  const int64_t g = G > 0 ? G : j.g, nbytes = (budget + 7) / 8;
  const uint8_t* body = p + Gm.sb + Gm.eb;
  uint32_t* c = sc.codes.data();
  const int es = KIND == 0 ? 4 : 2;  // bytes per local value
  int64_t bit = 0;
  int64_t sgi = 0, sg_end = j.per_sg;  // the super-group of group gi, and its end
  for (int64_t gi = 0; gi < Gm.n_g; gi++) {
    const int wv = sc.w[gi];
    if (gi == sg_end) {
      sgi++;
      sg_end += j.per_sg;
    }
    const float s = group_scale(j, sc.S[sgi], sc.e[gi]);
    const int64_t cnt = gi == Gm.n_g - 1 ? Gm.last : g;
    const void* loc = ADD ? (const void*)((const uint8_t*)local + gi * g * es) : nullptr;
    float* d = dst + gi * g;
    uint32_t m;
    if (ADD) __builtin_prefetch((const void*)((uintptr_t)loc + 2048), 0, 0);  // local stream
#ifdef DQ_VECTOR
    if constexpr (G > 0 && G % 16 == 0) {
      const int64_t b0 = bit >> 3;
      if (cnt == G && b0 + 2 * wv * (G / 16 - 1) + wv + 8 <= nbytes) {  // 8 bytes readable
        m = decode_group<G, KIND, ADD>(j, wv, body + b0, s, loc, d);
        if (ADD) sc.gmax[gi] = m;
        bit += wv * G;
        continue;
      }
    }
#elif defined(DQ_AVX2)
    if constexpr (G > 0 && G % 8 == 0) {
      const int64_t b0 = bit >> 3;
      if (cnt == G && b0 + wv * (G / 8 - 1) + 8 <= nbytes) {  // 8 bytes readable
        m = decode_group_avx2<G, KIND, ADD>(j, wv, body + b0, s, loc, d);
        if (ADD) sc.gmax[gi] = m;
        bit += wv * G;
        continue;
      }
    }
#endif
    if (wv == 0) {
      m = G > 0 && cnt == G ? decode_zero<G, KIND, ADD>(s, loc, d, cnt)
                            : decode_zero<0, KIND, ADD>(s, loc, d, cnt);
    } else {
      const float* lv = j.levels + wv * ROW;
      if (G > 0 && cnt == G) {
        const int64_t b0 = bit >> 3;
        if (b0 + (G / 8 - 1) * wv + 8 <= nbytes) unpack_aligned_fast<G>(body + b0, wv, c);
        else unpack_aligned<G>(body + b0, nbytes - b0, wv, c);
        m = decode_values<G, KIND, ADD>(c, lv, s, loc, d, cnt);
      } else {
        unpack_any(body, nbytes, bit, g, wv, c);
        m = decode_values<0, KIND, ADD>(c, lv, s, loc, d, cnt);
      }
      bit += wv * g;
    }
    if (ADD) sc.gmax[gi] = m;
  }
  if (ADD)
    for (int64_t gi = Gm.n_g; gi < Gm.n_gp; gi++) sc.gmax[gi] = 0;
}

// -- encoding -----------------------------------------------------------------------------------

// the dither of the n values from global index idx0 into u (rounding != nearest)
inline void dither(const DynJob& j, uint64_t idx0, int64_t n, float* __restrict u) {
  const bool corr = j.rounding == ROUND_CORRELATED && j.num_hops > 1;
  for (int64_t i = 0; i < n; i++) {
    const uint64_t idx = idx0 + (uint64_t)i;
    const uint32_t lo = (uint32_t)idx, hi = (uint32_t)(idx >> 32);
    const uint32_t h = fmix32(fmix32(lo * 0x9E3779B1u + j.key0) ^ hi ^ j.key1);
    u[i] = (float)(int32_t)((h >> 9) * 2 + 1) * 5.9604644775390625e-08f;  // 2^-24
  }
  if (!corr) return;
  for (int64_t i = 0; i < n; i++) {
    // u = (stratum + v) / H, stratum = (per-coordinate shift + hop) mod H
    const uint64_t idx = idx0 + (uint64_t)i;
    const uint32_t lo = (uint32_t)idx, hi = (uint32_t)(idx >> 32);
    const uint32_t hs = fmix32(fmix32(lo * 0x9E3779B1u + j.skey0) ^ hi ^ j.skey1);
    const uint64_t stratum = ((uint64_t)hs % j.num_hops + j.hop) % j.num_hops;
    u[i] = ((float)stratum + u[i]) / j.hf;
  }
}

// the level indices of the n (N > 0: N) values v of a live group (scale s > 0 and finite,
// width wv >= 1): nearest (ties to the lower level), from the round-up thresholds
template <int N>
inline void quantize_nearest(const float* __restrict v, int64_t n_, float s,
                             const int32_t* __restrict base, const float* __restrict key,
                             uint32_t* __restrict c) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t i = 0; i < n; i++) {
    const float y = std::min(std::max(v[i] / s, -1.0f), 1.0f);
    const int32_t cell = (int32_t)((y + 1.0f) * (float)CELLS);
    c[i] = (uint32_t)(base[cell] + (key[cell] <= y ? 1 : 0));  // the thresholds <= y
  }
}

// stochastic: between the two neighbouring levels, up with probability frac (u < frac)
template <int N>
inline void quantize_stochastic(const float* __restrict v, int64_t n_, float s, int wv,
                                const int32_t* __restrict base, const float* __restrict key,
                                const float* __restrict lower, const float* __restrict gap,
                                const float* __restrict u, uint32_t* __restrict c) {
  const int64_t n = N > 0 ? N : n_;
  const int32_t top = (1 << wv) - 1;
  for (int64_t i = 0; i < n; i++) {
    const float y = std::min(std::max(v[i] / s, -1.0f), 1.0f);
    const int32_t cell = (int32_t)((y + 1.0f) * (float)CELLS);
    // the levels < y, then the upper neighbour hi in 1 .. 2^w - 1
    const int32_t hi = std::min(std::max(base[cell] + (key[cell] < y ? 1 : 0), 1), top);
    const float frac = (y - lower[hi]) / gap[hi];
    c[i] = (uint32_t)(hi - 1 + (u[i] < frac ? 1 : 0));
  }
}

// the codes of the n values of group gi (N > 0: N) into c (rounding as the job says)
template <int N>
inline void quantize(const DynJob& j, const float* __restrict v, int64_t n, float s, int wv,
                     uint64_t idx0, float* __restrict u, uint32_t* __restrict c) {
  const int32_t* base = j.base + wv * NCELL;
  const float* key = j.key + wv * NCELL;
  if (j.rounding == ROUND_NEAREST) {
    quantize_nearest<N>(v, n, s, base, key, c);
  } else {
    dither(j, idx0, N > 0 ? N : n, u);
    quantize_stochastic<N>(v, n, s, wv, base, key, j.lower + wv * ROW, j.gap + wv * ROW, u, c);
  }
}

// 8 codes of width wv as one word (wv whole bytes)
inline uint64_t word_of(const uint32_t* __restrict c, int wv) {
  uint64_t word = 0;
  for (int jj = 0; jj < 8; jj++) word |= (uint64_t)c[jj] << (wv * jj);
  return word;
}

// Encode the span whose values v (zero-padded to whole super-groups) have the group absmax
// bits sc.gmax into the payload at p (budget bits); si: the span's index.
template <int G>
void encode_span(const DynJob& j, const Geo& Gm, int64_t si, int64_t budget, const float* v,
                 uint8_t* p, Scratch& sc) {
  const int64_t g = G > 0 ? G : j.g;
  scale_codes(j, Gm, p, sc);
  widths(j, Gm, budget, sc);
  // round and pack, group by group, into the body scratch (then copied: nbytes bytes)
  const int64_t nbytes = (budget + 7) / 8;
  if (nbytes == 0) return;
  uint8_t* body = sc.body.data();
  uint32_t* c = sc.codes.data();
  float* u = sc.u.data();
  const uint64_t idx0 = j.offset + (uint64_t)(si * j.span);
  const bool aligned = g % 8 == 0;
  int64_t bit = 0;
  uint64_t acc = 0;  // any group size: the nacc bits not yet stored, from byte opos on
  int nacc = 0;
  int64_t opos = 0;
  for (int64_t gi = 0; gi < Gm.n_g; gi++) {
    const int wv = sc.w[gi];
    if (wv == 0) continue;
    const int64_t cnt = gi == Gm.n_g - 1 ? Gm.last : g;
    const float* x = v + gi * g;
    const uint64_t ix = idx0 + (uint64_t)(gi * g);
#ifdef DQ_VECTOR
    if constexpr (G > 0 && G % 16 == 0) {
      if (cnt == G) {
        if (j.rounding != ROUND_NEAREST) dither(j, ix, G, u);
        encode_group<G>(j, wv, x, sc.s[gi], u, body + (bit >> 3));
        bit += wv * G;
        continue;
      }
    }
#elif defined(DQ_AVX2)
    if constexpr (G > 0 && G % 8 == 0) {
      if (cnt == G && j.rounding == ROUND_NEAREST) {
        encode_group_avx2<G>(j, wv, x, sc.s[gi], body + (bit >> 3));
        bit += wv * G;
        continue;
      }
    }
#endif
    if (G > 0 && cnt == G) {
      quantize<G>(j, x, cnt, sc.s[gi], wv, ix, u, c);
      uint8_t* b = body + (bit >> 3);
      for (int ch = 0; ch < G / 8; ch++) {
        // every 8 codes make wv whole bytes, stored as one word (its higher bytes are zero
        // and overwritten by the next store)
        const uint64_t word = word_of(c + 8 * ch, wv);
        std::memcpy(b + ch * wv, &word, 8);
      }
      bit += wv * G;
      continue;
    }
    quantize<0>(j, x, cnt, sc.s[gi], wv, ix, u, c);
    for (int64_t i = cnt; i < g; i++) c[i] = 0;  // the padding of a short last group
    if (aligned) {
      uint8_t* b = body + (bit >> 3);
      for (int64_t ch = 0; ch < g / 8; ch++) {
        const uint64_t word = word_of(c + 8 * ch, wv);
        std::memcpy(b + ch * wv, &word, 8);
      }
    } else {
      for (int64_t i = 0; i < g; i++) {
        acc |= (uint64_t)c[i] << nacc;
        nacc += wv;
        if (nacc >= 32) {
          const uint32_t lo = (uint32_t)acc;
          std::memcpy(body + opos, &lo, 4);
          opos += 4;
          acc >>= 32;
          nacc -= 32;
        }
      }
    }
    bit += wv * g;
  }
  if (!aligned && nacc > 0) std::memcpy(body + opos, &acc, 8);  // the last bits
  const int64_t used = (bit + 7) >> 3;  // bytes holding codes; the rest of the container is 0
  if (used < nbytes) std::memset(body + used, 0, (size_t)(nbytes - used));
  std::memcpy(p + Gm.sb + Gm.eb, body, (size_t)nbytes);
}

// the group absmax bits of the n_gp groups of v into sc.gmax
template <int G>
void group_absmax(const DynJob& j, const Geo& Gm, const float* __restrict v, Scratch& sc) {
  const int64_t g = G > 0 ? G : j.g;
  uint32_t* __restrict gm = sc.gmax.data();
  for (int64_t gi = 0; gi < Gm.n_gp; gi++) {
    uint32_t m = 0;
    for (int64_t i = 0; i < g; i++) m = std::max(m, f2u(v[gi * g + i]) & 0x7FFFFFFFu);
    gm[gi] = m;
  }
}

// spans [s0, s1) of one call
template <int G, int KIND>
bool run_spans(const DynJob& j, int64_t s0, int64_t s1) {
  Scratch sc;
  if (!sc.init(j)) return false;
  const int64_t full = j.n / j.span, rest = j.n % j.span;
  const Geo Gfull = geometry(j, j.span);
  const int64_t in_stride = span_bytes(Gfull, j.bud_in[0]);
  const int64_t out_stride = span_bytes(Gfull, j.bud_out[0]);
  const int es = KIND == 0 ? 4 : 2;
  for (int64_t si = s0; si < s1; si++) {
    const int last = si == full ? 1 : 0;
    const int64_t len = last ? rest : j.span;
    const Geo Gm = last ? geometry(j, len) : Gfull;
    const int64_t start = si * j.span, padded = Gm.n_gp * j.g;
    float* scratch = sc.vals.data();
    const float* v = scratch;
    const int64_t b_in = j.bud_in_of ? j.bud_in_of[si] : j.bud_in[last];
    const int64_t b_out = j.bud_out_of ? j.bud_out_of[si] : j.bud_out[last];
    const uint8_t* p_in = j.in + (j.off_in ? j.off_in[si] - j.off_in_base : si * in_stride);
    uint8_t* p_out = j.out + (j.off_out ? j.off_out[si] - j.off_out_base : si * out_stride);
    if (j.op == 2) {  // decode
      decode_span<G, 0, false>(j, Gm, p_in, b_in, nullptr, j.out_values + start, sc);
      continue;
    }
    const void* src = (const uint8_t*)j.x + start * es;
    if (j.op == 1) {  // reduce: the decoded incoming values plus the local ones
      decode_span<G, KIND, true>(j, Gm, p_in, b_in, src, scratch, sc);
      std::memset(scratch + len, 0, (size_t)(padded - len) * 4);  // the padding stays zero
    } else if (KIND == 0 && !last) {  // encode fp32 values where they are
      v = (const float*)src;
      group_absmax<G>(j, Gm, v, sc);
    } else {
      load_values<KIND>(j.x, start, len, scratch);
      std::memset(scratch + len, 0, (size_t)(padded - len) * 4);
      group_absmax<G>(j, Gm, v, sc);
    }
    encode_span<G>(j, Gm, si, b_out, v, p_out, sc);
  }
  return true;
}

template <int G>
bool run_spans_kind(const DynJob& j, int64_t s0, int64_t s1) {
  switch (j.in_kind) {
    case 1: return run_spans<G, 1>(j, s0, s1);
    case 2: return run_spans<G, 2>(j, s0, s1);
    default: return run_spans<G, 0>(j, s0, s1);
  }
}

// the largest finite |x| (magnitude bits; NaN and ±Inf count as 0) of each group [g0, g1) of
// G (> 0) or g values
template <int G, int KIND>
void finite_absmax(const void* x, int64_t g_, int64_t g0, int64_t g1, float* out) {
  const int64_t g = G > 0 ? G : g_;
  for (int64_t gi = g0; gi < g1; gi++) {
    uint32_t m = 0;
    for (int64_t i = 0; i < g; i++) {
      const uint32_t a = f2u(load_value<KIND>(x, gi * g + i)) & 0x7FFFFFFFu;
      m = std::max(m, a < 0x7F800000u ? a : 0u);
    }
    out[gi] = u2f(m);
  }
}

template <int KIND>
void finite_absmax_kind(const void* x, int64_t g, int64_t g0, int64_t g1, float* out) {
  if (g == 16) finite_absmax<16, KIND>(x, g, g0, g1, out);
  else finite_absmax<0, KIND>(x, g, g0, g1, out);
}

}  // namespace

extern "C" {

// The largest finite |x| of each of the n / g groups of g values of x (n a multiple of g; kind:
// 0 fp32, 1 bf16, 2 fp16) into out, as fp32 (NaN and ±Inf count as 0): the pooled codec's
// prologue statistics (_dynamiq_pool._finite_absmax). 0: done; 1: thread failure.
int dq_dyn_group_absmax(const void* x, int32_t kind, int64_t n, int64_t g, float* out,
                        int32_t nthreads) {
  if (n <= 0 || g <= 0) return 0;
  const int64_t groups = n / g, tile = 4096;
  auto work = [&](int64_t t0, int64_t t1, int) -> bool {
    const int64_t g0 = t0 * tile, g1 = std::min(groups, t1 * tile);
    if (kind == 1) finite_absmax_kind<1>(x, g, g0, g1, out);
    else if (kind == 2) finite_absmax_kind<2>(x, g, g0, g1, out);
    else finite_absmax_kind<0>(x, g, g0, g1, out);
    return true;
  };
  return parallel_tiles((groups + tile - 1) / tile, (int)std::max(1, nthreads), work) ? 0 : 1;
}

// Arguments of dq_dyn_run (mirrored by a ctypes.Structure in cpu_native.py).
struct dq_dyn_args {
  DQ_COMMON_ARGS
  int64_t span, super_group, group;
  int32_t scale_steps, pooled, rounding, nthreads;
  // each payload's budgets (bits) of a full and of the short last span; [spans] or null: the
  // pooled budgets and each span's payload offset (bytes) plus offset_*_base (a chunk's
  // spans in tables of every span of the buffer). The incoming payload (decode, reduce: ctx)
  // first, then the outgoing one (encode, reduce: out_ctx).
  int64_t budget_in_full, budget_in_last;
  const int64_t* budget_in_of;
  const int64_t* offset_in_of;
  int64_t offset_in_base;
  int64_t budget_out_full, budget_out_last;
  const int64_t* budget_out_of;
  const int64_t* offset_out_of;
  int64_t offset_out_base;
  uint32_t key0, key1;                       // hash keys of the dither (out_ctx)
  uint32_t shift_key0, shift_key1;           // hash keys of the correlated shift
  uint64_t offset, hop, num_hops;            // out_ctx
  float num_hops_f32;
  const float* levels;  // [9 * 257]
  const int32_t* base;  // [9 * 2049]
  const float* key;     // [9 * 2049]
  const float* lower;   // [9 * 257]
  const float* gap;     // [9 * 257]
  const float* eyt;     // [9 * 256] each width's rounding keys (nearest: the round-up
                        // points; otherwise the levels 1 .. 2^w - 1) in Eytzinger order
  const float* eyt5;    // [9 * 32] widths 1..5: the same padded with +inf to 31 keys
  const int64_t* q;     // [8] priorities Q[w]
  const float* steps;   // [16]
  const float* powers;  // [16]
};

// 0: done; 1: out of memory / thread failure.
int dq_dyn_run(dq_dyn_args* a) {
  if (a->n <= 0) return 0;
  DynJob j;
  j.op = a->op;
  j.in_kind = a->in_kind;
  j.rounding = a->rounding;
  j.k = a->scale_steps;
  j.pooled = a->pooled;
  j.n = a->n;
  j.span = a->span;
  j.sg = a->super_group;
  j.g = a->group;
  j.per_sg = j.sg / j.g;
  j.bud_in[0] = a->budget_in_full;
  j.bud_in[1] = a->budget_in_last;
  j.bud_out[0] = a->budget_out_full;
  j.bud_out[1] = a->budget_out_last;
  j.bud_in_of = a->budget_in_of;
  j.bud_out_of = a->budget_out_of;
  j.off_in = a->offset_in_of;
  j.off_out = a->offset_out_of;
  j.off_in_base = a->offset_in_base;
  j.off_out_base = a->offset_out_base;
  j.key0 = a->key0;
  j.key1 = a->key1;
  j.skey0 = a->shift_key0;
  j.skey1 = a->shift_key1;
  j.offset = a->offset;
  j.hop = a->hop;
  j.num_hops = a->num_hops;
  j.hf = a->num_hops_f32;
  j.levels = a->levels;
  j.base = a->base;
  j.key = a->key;
  j.lower = a->lower;
  j.gap = a->gap;
  j.eyt = a->eyt;
  j.eyt5 = a->eyt5;
  for (int i = 0; i < MAX_W; i++) j.q[i] = (int32_t)a->q[i];
  j.q_lo = *std::min_element(j.q, j.q + MAX_W);
  j.q_hi = *std::max_element(j.q, j.q + MAX_W);
  j.q_falls = 1;
  for (int i = 1; i < MAX_W; i++) j.q_falls &= j.q[i] <= j.q[i - 1] ? 1 : 0;
  if (j.q_hi - j.q_lo + 2 > 255) return 1;  // (the tables of scale_steps <= 4 are smaller)
  j.d_max = j.q_hi - j.q_lo + 2;
  j.pad = ((j.q_hi - j.q_lo) >> 3) + 2;
  for (int32_t d = 0; d <= j.d_max; d++) {
    int cnt = 0;
    for (int ww = 0; ww < MAX_W; ww++) cnt += j.q[ww] >= j.q_lo + d ? 1 : 0;
    j.w_of_d[d] = (uint8_t)cnt;
    j.r_of_d[d] = cnt < MAX_W && j.q[cnt] == j.q_lo + d - 1 ? 1 : 0;
  }
  {
    int order[PAIRS];
    for (int i = 0; i < PAIRS; i++) order[i] = i;
    auto prio = [&](int i) { return j.q[i % MAX_W] - 8 * (i / MAX_W); };
    std::sort(order, order + PAIRS, [&](int x, int y) { return prio(x) > prio(y); });
    for (int i = 0; i < PAIRS; i++) {
      j.pair_e[i] = (uint8_t)(order[i] / MAX_W);
      j.pair_p[i] = prio(order[i]);
    }
  }
  for (int i = 0; i <= E_MAX; i++) {
    j.steps[i] = a->steps[i];
    j.powers[i] = a->powers[i];
  }
  j.x = a->x;
  j.in = a->in;
  j.out = a->out;
  j.out_values = a->out_values;

  const int64_t nspans = (j.n + j.span - 1) / j.span;
  auto work = [&](int64_t s0, int64_t s1, int) -> bool {
    switch (j.g) {
      case 8: return run_spans_kind<8>(j, s0, s1);
      case 16: return run_spans_kind<16>(j, s0, s1);
      case 32: return run_spans_kind<32>(j, s0, s1);
      case 64: return run_spans_kind<64>(j, s0, s1);
      default: return run_spans_kind<0>(j, s0, s1);
    }
  };
  const int nt = (int)std::max<int64_t>(1, a->nthreads);
  return parallel_tiles(nspans, nt, work) ? 0 : 1;
}

// The layout of dq_dyn_args (common.h, DQ_LAYOUT).
int64_t dq_dyn_args_layout(int64_t* out, int64_t cap) {
  using T = dq_dyn_args;
  return dq_layout(
      out, cap,
      {(int64_t)sizeof(T), DQ_COMMON_OFFSETS(T), DQ_OFF(T, span), DQ_OFF(T, super_group),
       DQ_OFF(T, group), DQ_OFF(T, scale_steps), DQ_OFF(T, pooled), DQ_OFF(T, rounding),
       DQ_OFF(T, nthreads), DQ_OFF(T, budget_in_full), DQ_OFF(T, budget_in_last),
       DQ_OFF(T, budget_in_of), DQ_OFF(T, offset_in_of), DQ_OFF(T, offset_in_base),
       DQ_OFF(T, budget_out_full), DQ_OFF(T, budget_out_last), DQ_OFF(T, budget_out_of),
       DQ_OFF(T, offset_out_of), DQ_OFF(T, offset_out_base), DQ_OFF(T, key0), DQ_OFF(T, key1),
       DQ_OFF(T, shift_key0), DQ_OFF(T, shift_key1), DQ_OFF(T, offset), DQ_OFF(T, hop),
       DQ_OFF(T, num_hops), DQ_OFF(T, num_hops_f32), DQ_OFF(T, levels), DQ_OFF(T, base),
       DQ_OFF(T, key), DQ_OFF(T, lower), DQ_OFF(T, gap), DQ_OFF(T, eyt), DQ_OFF(T, eyt5),
       DQ_OFF(T, q), DQ_OFF(T, steps), DQ_OFF(T, powers)});
}

}  // extern "C"
