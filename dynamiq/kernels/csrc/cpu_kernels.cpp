// The CPU fast path of the INT and MX codecs: encode, decode and the fused reduce (decompress
// the incoming payload, add the local slice in fp32, recompute block statistics, round, pack).
//
// Bit-exact with the PyTorch references in dynamiq/codecs/intq.py and dynamiq/codecs/mx.py
// (tests/kernels/test_cpu_fast_path_native.py):
//   * every float operation the reference does in fp32 is done here in fp32, in the same order
//     (code * scale, then + local; x / S), compiled with -ffp-contract=off (no FMA) and without
//     -ffast-math (IEEE division, subnormals kept);
//   * rounding to nearest-even is rintf under the default rounding mode (torch.round);
//   * block maxima are integer maxima of the magnitude bits (NaN > Inf > finite, never dropped);
//   * INT scales are computed exactly in integer arithmetic, as the Triton kernel does
//     (dynamiq/kernels/intq.py, _int_scale); MX elements are rounded from an exact fp32
//     scaling (mx_encode_element says why that is exact); bit packing and the counter hash of
//     stochastic rounding are integer operations.
//
// Built once per machine by dynamiq/kernels/cpu_native.py (g++ -O3 -march=native, cached on
// disk; one library with dynamiq_kernels.cpp, the DynamiQ codec's kernels, both including
// common.h) and called through ctypes; no Python or torch headers. Work is split into tiles of
// whole blocks whose codes fill whole bytes, so threads write disjoint bytes and the result
// does not depend on the number of threads.
//
// Bytes moved per value (fused reduce, int8 or mxfp8, blocks of 32): payload in 1 + 2/32
// (MX: 1/32), local 4 (fp32) or 2 (bf16/fp16), payload out 1 + 2/32 (MX: 1/32).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "common.h"

namespace {

// -- dense LSB-first bit packing (dynamiq/codecs/packing.py) ----------------------------------
// Group g of 8 consecutive codes occupies bytes [g * BITS, (g + 1) * BITS) of the stream.

// One group in a 64-bit word: the 8 BITS-bit codes packed LSB-first in its low 8 * BITS bits
// <-> one code in the low bits of each byte. Three shift-and-mask steps (32-, 16-, then 8-bit
// lanes) instead of eight shifts and byte stores, with whole 8-byte loads and stores where
// they stay inside the stream (unpack) or this call's bytes (pack); the same bits. Measured
// (16M values, one thread): the fused reduce 24-27 % faster for 3, 5 and 7 bits than with
// per-code loops and BITS-byte copies, as fast for 6 bits. (BMI2's pdep/pext, one
// instruction a group, measured 30-80 % slower than either here.)
template <int BITS>
inline uint64_t spread_group(uint64_t w) {
  constexpr uint64_t M4 = (uint64_t(1) << (4 * BITS)) - 1;
  constexpr uint64_t M2 = ((uint64_t(1) << (2 * BITS)) - 1) * 0x0000000100000001ull;
  constexpr uint64_t M1 = ((uint64_t(1) << BITS) - 1) * 0x0001000100010001ull;
  uint64_t x = (w & M4) | ((w >> (4 * BITS)) & M4) << 32;
  x = (x & M2) | ((x >> (2 * BITS)) & M2) << 16;
  return (x & M1) | ((x >> BITS) & M1) << 8;
}

template <int BITS>
inline uint64_t gather_group(uint64_t c) {
  constexpr uint64_t BYTES = ((uint64_t(1) << BITS) - 1) * 0x0101010101010101ull;
  c &= BYTES;
  uint64_t x = (c & 0x00FF00FF00FF00FFull) | ((c >> 8) & 0x00FF00FF00FF00FFull) << BITS;
  x = (x & 0x0000FFFF0000FFFFull) | ((x >> 16) & 0x0000FFFF0000FFFFull) << (2 * BITS);
  return (x & 0xFFFFFFFFull) | (x >> 32) << (4 * BITS);
}

// codes of groups [g0, g0 + ng) of a stream of nbytes bytes -> out[0 .. 8 * ng)
template <int BITS>
void unpack(const uint8_t* __restrict stream, int64_t nbytes, int64_t g0, int64_t ng,
            uint8_t* __restrict out) {
  if constexpr (BITS == 8) {
    int64_t avail = std::min<int64_t>(8 * ng, nbytes - 8 * g0);
    std::memcpy(out, stream + 8 * g0, (size_t)avail);
    std::memset(out + avail, 0, (size_t)(8 * ng - avail));
    return;
  }
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t b0 = g0 * BITS;  // the groups' bytes [b0, b0 + ng * BITS), those < nbytes
  const int64_t avail = std::max<int64_t>(0, std::min<int64_t>(ng * BITS, nbytes - b0));
  if constexpr (BITS == 2 || BITS == 4) {  // whole codes per byte
    constexpr int PER = 8 / BITS;
    for (int64_t k = 0; k < avail; k++) {
      const uint32_t byte = stream[b0 + k];
      for (int j = 0; j < PER; j++) out[k * PER + j] = (uint8_t)((byte >> (j * BITS)) & MASK);
    }
    std::memset(out + avail * PER, 0, (size_t)((ng * BITS - avail) * PER));
    return;
  }
  // 3, 5, 6, 7 bits: whole groups of BITS bytes, then the last group's bytes below nbytes
  constexpr uint64_t LOW = BITS < 8 ? (uint64_t(1) << (8 * (BITS % 8))) - 1 : ~uint64_t(0);
  const int64_t full = avail / BITS;
  // groups whose 8-byte load stays inside the stream read 8 bytes (a few beyond the group,
  // masked off): one load instead of a byte-by-byte BITS-byte copy
  // (C++ division truncates toward zero: fewer than 8 bytes left must give 0, not 1)
  const int64_t room = nbytes - b0 - 8;
  const int64_t wide = room < 0 ? 0 : std::min<int64_t>(full, room / BITS + 1);
  for (int64_t g = 0; g < wide; g++) {
    uint64_t w;
    std::memcpy(&w, stream + b0 + g * BITS, 8);
    const uint64_t codes = spread_group<BITS>(w & LOW);
    std::memcpy(out + 8 * g, &codes, 8);
  }
  for (int64_t g = wide; g < full; g++) {
    uint64_t w = 0;
    std::memcpy(&w, stream + b0 + g * BITS, BITS);
    const uint64_t codes = spread_group<BITS>(w);
    std::memcpy(out + 8 * g, &codes, 8);
  }
  int64_t done = 8 * full;
  if (full * BITS < avail) {
    uint64_t w = 0;
    std::memcpy(&w, stream + b0 + full * BITS, (size_t)(avail - full * BITS));
    const uint64_t codes = spread_group<BITS>(w);
    std::memcpy(out + done, &codes, 8);
    done += 8;
  }
  std::memset(out + done, 0, (size_t)(8 * ng - done));
}

// the low BITS bits of codes[0 .. 8 * ng) -> groups [g0, g0 + ng), bytes below nbytes only
template <int BITS>
void pack(const uint8_t* __restrict codes, int64_t g0, int64_t ng, uint8_t* __restrict stream,
          int64_t nbytes) {
  if constexpr (BITS == 8) {
    int64_t avail = std::min<int64_t>(8 * ng, nbytes - 8 * g0);
    std::memcpy(stream + 8 * g0, codes, (size_t)avail);
    return;
  }
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t b0 = g0 * BITS;  // the groups' bytes [b0, b0 + ng * BITS), those < nbytes
  const int64_t avail = std::min<int64_t>(ng * BITS, nbytes - b0);
  if constexpr (BITS == 2 || BITS == 4) {  // whole codes per byte
    constexpr int PER = 8 / BITS;
    for (int64_t k = 0; k < avail; k++) {
      uint32_t byte = 0;
      for (int j = 0; j < PER; j++) byte |= ((uint32_t)codes[k * PER + j] & MASK) << (j * BITS);
      stream[b0 + k] = (uint8_t)byte;
    }
    return;
  }
  // 3, 5, 6, 7 bits: whole groups, then the bytes of a partial group below nbytes
  // while 8 bytes fit below this call's last byte: one 8-byte store, whose bytes beyond the
  // group the next group's store overwrites (never bytes of another thread's tile)
  int64_t g = 0;
  for (; g * BITS + 8 <= avail; g++) {
    uint64_t c;
    std::memcpy(&c, codes + 8 * g, 8);
    const uint64_t w = gather_group<BITS>(c);
    std::memcpy(stream + b0 + g * BITS, &w, 8);
  }
  for (; g * BITS < avail; g++) {
    uint64_t c;
    std::memcpy(&c, codes + 8 * g, 8);
    const uint64_t w = gather_group<BITS>(c);
    if (avail - g * BITS >= BITS) std::memcpy(stream + b0 + g * BITS, &w, BITS);
    else std::memcpy(stream + b0 + g * BITS, &w, (size_t)(avail - g * BITS));
  }
}

void unpack_any(int bits, const uint8_t* s, int64_t nbytes, int64_t g0, int64_t ng, uint8_t* o) {
  switch (bits) {
    case 2: unpack<2>(s, nbytes, g0, ng, o); break;
    case 3: unpack<3>(s, nbytes, g0, ng, o); break;
    case 4: unpack<4>(s, nbytes, g0, ng, o); break;
    case 5: unpack<5>(s, nbytes, g0, ng, o); break;
    case 6: unpack<6>(s, nbytes, g0, ng, o); break;
    case 7: unpack<7>(s, nbytes, g0, ng, o); break;
    default: unpack<8>(s, nbytes, g0, ng, o); break;
  }
}

void pack_any(int bits, const uint8_t* c, int64_t g0, int64_t ng, uint8_t* s, int64_t nbytes) {
  switch (bits) {
    case 2: pack<2>(c, g0, ng, s, nbytes); break;
    case 3: pack<3>(c, g0, ng, s, nbytes); break;
    case 4: pack<4>(c, g0, ng, s, nbytes); break;
    case 5: pack<5>(c, g0, ng, s, nbytes); break;
    case 6: pack<6>(c, g0, ng, s, nbytes); break;
    case 7: pack<7>(c, g0, ng, s, nbytes); break;
    default: pack<8>(c, g0, ng, s, nbytes); break;
  }
}


// Software prefetch of the values 6 KB ahead of a block of 32 at x (pass 1 reads the values or
// local slice where they lie, straight from memory; measured: 2-5 % faster than the hardware
// prefetcher alone). A prefetch never faults, so it may point past the end.
inline void prefetch_ahead(const float* x) {
  __builtin_prefetch(x + 1536, 0, 3);
  __builtin_prefetch(x + 1536 + 16, 0, 3);
}

// -- INT codec (dynamiq/codecs/intq.py) -----------------------------------------------------

struct IntScale {
  float s;          // the scale as fp32 (NaN for a non-finite block)
  uint32_t stored;  // its bits in the scale format
  bool over;        // absmax > max_input_abs
};

// scale formats: 0 bf16, 1 fp16, 2 fp32, 3 e8m0; P significant bits, smallest value 2^GMIN
const int FMT_P[4] = {8, 11, 24, 1};
const int FMT_GMIN[4] = {-133, -24, -149, -127};
const int FMT_BYTES[4] = {2, 2, 4, 1};
const uint32_t FMT_NAN[4] = {0x7FC0u, 0x7E00u, 0x7FC00000u, 0xFFu};

// The smallest value S of the scale format with S * qmax >= absmax (absmax bits a), computed
// exactly in integer arithmetic (dynamiq/kernels/intq.py, _int_scale).
IntScale int_scale(uint32_t a, int64_t qmax, int kq, int fmt, uint32_t max_in_bits) {
  if (a >= 0x7F800000u) return {u2f(0x7FC00000u), FMT_NAN[fmt], false};
  if (a == 0) return {fmt == 3 ? u2f(1u << 22) : 0.0f, 0u, false};
  const int P = FMT_P[fmt], GMIN = FMT_GMIN[fmt];
  // absmax = m24 * 2^e2 exactly
  int32_t ef = (int32_t)(a >> 23);
  int64_t m24 = ef > 0 ? (int64_t)((a & 0x7FFFFFu) | 0x800000u) : (int64_t)(a & 0x7FFFFFu);
  int32_t e2 = std::max(ef, 1) - 150;
  int32_t eM = 63 - __builtin_clzll((uint64_t)m24);
  // fl = floor(log2(absmax / qmax)), compared exactly
  int32_t fl = eM + e2 - kq - ((m24 << kq) < (qmax << eM) ? 1 : 0);
  // spacing 2^ge of the format at absmax / qmax; S = ceil(r / 2^ge) * 2^ge = nn * 2^ge
  int32_t ge = std::max(fl - (P - 1), GMIN);
  int32_t sh = e2 - ge;
  int64_t num = m24 << std::max(sh, 0);
  int64_t den = qmax << std::min(std::max(-sh, 0), 40);
  // nn = ceil(num / den) through a double division (pipelined, unlike a 64-bit integer one),
  // exactly: num < 2^32 and den < 2^48 are exact doubles and the quotient is correctly
  // rounded, so its error is below num / den * 2^-53 < 1 / den, while a quotient that is not
  // an integer is at least 1 / den away from one: the rounded quotient has the same ceiling
  int64_t nn = (int64_t)std::ceil((double)num / (double)den);
  int32_t ln = 63 - __builtin_clzll((uint64_t)nn);
  int32_t ed = ge + ln;
  uint32_t man23 = (uint32_t)(((nn << 23) >> ln) & 0x7FFFFF);
  uint32_t sub32 = (uint32_t)(nn << std::min(std::max(ge + 149, 0), 31));
  uint32_t f32 = ed >= -126 ? ((uint32_t)(ed + 127) << 23) | man23 : sub32;
  uint32_t stored;
  if (fmt == 0) {
    stored = f32 >> 16;
  } else if (fmt == 1) {
    uint32_t man10 = (uint32_t)(((nn << 10) >> ln) & 0x3FF);
    uint32_t sub16 = (uint32_t)(nn << std::min(std::max(ge + 24, 0), 31));
    stored = ed >= -14 ? ((uint32_t)(ed + 15) << 10) | man10 : sub16;
  } else if (fmt == 2) {
    stored = f32;
  } else {
    stored = (uint32_t)(ed + 127);
  }
  return {u2f(f32), stored, a > max_in_bits};
}

inline float int_load_scale(const uint8_t* scales, int64_t blk, int fmt) {
  if (fmt == 0) {
    uint16_t r;
    std::memcpy(&r, scales + 2 * blk, 2);
    return u2f((uint32_t)r << 16);
  }
  if (fmt == 1) {
    uint16_t r;
    std::memcpy(&r, scales + 2 * blk, 2);
    return u2f(f16_to_f32_bits(r));
  }
  if (fmt == 2) {
    uint32_t r;
    std::memcpy(&r, scales + 4 * blk, 4);
    return u2f(r);
  }
  uint32_t r = scales[blk];
  return r == 0xFF ? u2f(0x7FC00000u) : u2f(r == 0 ? 1u << 22 : r << 23);
}

inline void int_store_scale(uint8_t* scales, int64_t blk, int fmt, uint32_t stored) {
  if (fmt == 3) {
    scales[blk] = (uint8_t)stored;
  } else if (fmt == 2) {
    std::memcpy(scales + 4 * blk, &stored, 4);
  } else {
    uint16_t r = (uint16_t)stored;
    std::memcpy(scales + 2 * blk, &r, 2);
  }
}

// The per-block loops take the block length as a template parameter BS: a compile-time 32
// (full blocks of the default size: straight-line vector code, no loop overhead), or 0 for
// the run-time length len_.

// v[i] = sext(code[i]) * s + v[i]   (the reference: code.float() * scale, then + local);
// returns the integer max of the magnitude bits of the new v (computed in the same loop: a
// second loop would reload what this one just stored)
template <int BS>
inline uint32_t int_decode_add(const uint8_t* __restrict c, int64_t len_, int bits, float s,
                               const float* __restrict src, float* __restrict v) {
  const int64_t len = BS > 0 ? BS : len_;
  const int sh = 8 - bits;
  uint32_t m = 0;
  for (int64_t i = 0; i < len; i++) {
    int32_t code = (int32_t)(int8_t)(uint8_t)(c[i] << sh) >> sh;
    float p = (float)code * s;
    float x = p + src[i];
    v[i] = x;
    m = std::max(m, f2u(x) & 0x7FFFFFFFu);
  }
  return m;
}

// v = src over a block and the integer max of its |v| bits (NaN > Inf > finite)
template <int BS>
inline uint32_t block_absmax_bits(const float* __restrict src, int64_t len_,
                                  float* __restrict v) {
  const int64_t len = BS > 0 ? BS : len_;
  uint32_t m = 0;
  for (int64_t i = 0; i < len; i++) {
    v[i] = src[i];
    m = std::max(m, f2u(src[i]) & 0x7FFFFFFFu);
  }
  return m;
}

// codes of v / S rounded to nearest, ties to even (torch.round), S finite and > 0
template <int BS>
inline void int_quantize_nearest(const float* __restrict v, int64_t len_, float S,
                                 uint8_t* __restrict c) {
  const int64_t len = BS > 0 ? BS : len_;
  for (int64_t i = 0; i < len; i++) {
    float q = v[i] / S;
    c[i] = (uint8_t)(int32_t)rintf(q);
  }
}

// floor(q) + [u < q - floor(q)], u from the counter hash of the global index
template <int BS>
inline void int_quantize_stochastic(const float* __restrict v, int64_t len_, float S,
                                    uint64_t idx0, uint32_t key0, uint32_t key1,
                                    uint8_t* __restrict c) {
  const int64_t len = BS > 0 ? BS : len_;
  // global index idx0 + i as 32-bit halves (len < 2^32: the high half carries at most once)
  const uint32_t lo0 = (uint32_t)idx0, hi0 = (uint32_t)(idx0 >> 32);
  for (int64_t i = 0; i < len; i++) {
    uint32_t lo = lo0 + (uint32_t)i;
    uint32_t hi = hi0 + (lo < lo0 ? 1u : 0u);
    uint32_t h = fmix32(lo * 0x9E3779B1u + key0);
    h = fmix32(h ^ hi ^ key1);
    float u = (float)(int32_t)((h >> 9) * 2 + 1) * 5.9604644775390625e-08f;  // 2^-24
    float q = v[i] / S;
    float fl = floorf(q);
    float code = fl + (u < q - fl ? 1.0f : 0.0f);
    c[i] = (uint8_t)(int32_t)code;
  }
}

// what every block of one dq_int_run call shares
struct IntJob {
  int op, bits, fmt, stochastic, kq;
  int64_t qmax, bs;
  uint32_t max_in_bits, key0, key1;
  uint64_t offset;
  const uint8_t* in_scales;
  uint8_t* out_scales;
};

// decode: out[i] = sext(code[i]) * scale
template <int BS>
inline void int_decode_block(const IntJob& j, int64_t b, int64_t len_,
                             const uint8_t* __restrict c, float* __restrict o) {
  const int64_t len = BS > 0 ? BS : len_;
  const int sh = 8 - j.bits;
  const float s = int_load_scale(j.in_scales, b, j.fmt);
  for (int64_t i = 0; i < len; i++) {
    int32_t code = (int32_t)(int8_t)(uint8_t)(c[i] << sh) >> sh;
    o[i] = (float)code * s;
  }
}

// Encoding a chunk of blocks takes three passes over it (in L1), so that the latency of one
// block's scale overlaps the work of the others: (1) the values (reduce: the decoded incoming
// codes c plus the local values v) and their absmax, (2) the scales, (3) the codes.

// pass 1 for block b: its values in v (from the values or local slice src) and the integer
// max of their magnitude bits
template <int BS>
inline uint32_t int_values_block(const IntJob& j, int64_t b, int64_t len,
                                 const float* __restrict src, float* __restrict v,
                                 const uint8_t* __restrict c) {
  prefetch_ahead(src);
  if (j.op != 1) return block_absmax_bits<BS>(src, len, v);
  return int_decode_add<BS>(c, len, j.bits, int_load_scale(j.in_scales, b, j.fmt), src, v);
}

// pass 3 for block b: its codes with scale S
template <int BS>
inline void int_codes_block(const IntJob& j, int64_t b, int64_t len, const float* __restrict v,
                            float S, uint8_t* __restrict c) {
  if (!(S > 0.0f)) {  // zero or NaN scale: codes 0
    std::memset(c, 0, (size_t)(BS > 0 ? BS : len));
  } else if (j.stochastic) {
    int_quantize_stochastic<BS>(v, len, S, j.offset + (uint64_t)(b * j.bs), j.key0, j.key1, c);
  } else {
    int_quantize_nearest<BS>(v, len, S, c);
  }
}

}  // namespace

extern "C" {

// Arguments of dq_int_run (mirrored by a ctypes.Structure in cpu_native.py).
struct dq_int_args {
  DQ_COMMON_ARGS
  int64_t block_size;
  int32_t bits;           // 2..8
  int32_t fmt;            // scale format: 0 bf16, 1 fp16, 2 fp32, 3 e8m0
  int32_t stochastic;     // 0 nearest, 1 stochastic
  uint32_t key0, key1;    // hash keys (stochastic)
  uint64_t offset;        // global index of value 0 (stochastic)
  uint32_t max_in_bits;   // fp32 bits of max_input_abs
  int32_t nthreads;
  uint32_t worst;         // out: largest finite absmax bits above max_in_bits (0: none)
};

// 0: done; 1: out of memory / thread failure.
int dq_int_run(dq_int_args* a) {
  const int64_t n = a->n, bs = a->block_size;
  if (n <= 0) return 0;
  const int bits = a->bits, fmt = a->fmt, sb = FMT_BYTES[fmt];
  const int64_t nblocks = (n + bs - 1) / bs;
  const int64_t nbytes = (n * bits + 7) / 8;
  const int64_t qmax = ((int64_t)1 << (bits - 1)) - 1;
  const int kq = 63 - __builtin_clzll((uint64_t)qmax);
  // a tile holds L whole blocks whose codes fill whole bytes; a chunk is a few tiles
  int64_t g8 = bs % 8 == 0 ? 8 : (bs % 4 == 0 ? 4 : (bs % 2 == 0 ? 2 : 1));
  const int64_t L = 8 / g8, T = L * bs;
  const int64_t ntiles = (nblocks + L - 1) / L;
  const int64_t per_chunk = std::max<int64_t>(1, 4096 / T);
  const uint8_t* in_scales = a->in;
  const uint8_t* in_stream = a->in ? a->in + nblocks * sb : nullptr;
  uint8_t* out_scales = a->out;
  uint8_t* out_stream = a->out ? a->out + nblocks * sb : nullptr;
  std::vector<uint32_t> worst(std::max(1, (int)a->nthreads), 0);
  const IntJob job{a->op,         bits,        fmt,     a->stochastic, kq,
                   qmax,          bs,          a->max_in_bits,         a->key0,
                   a->key1,       a->offset,   in_scales,              out_scales};

  // fp32 values are read where they are, and 8-bit codes read from the incoming stream and
  // written into the outgoing one directly (no staging copy: these loops overlap the memory
  // traffic with the arithmetic)
  const bool direct_x = a->in_kind == 0, direct_codes = bits == 8;
  auto work = [&](int64_t t0, int64_t t1, int th) -> bool {
    std::vector<float> vals, loaded, scale;
    std::vector<uint8_t> codes;
    std::vector<uint32_t> amax;
    try {
      vals.resize((size_t)(per_chunk * T));
      if (!direct_x) loaded.resize((size_t)(per_chunk * T));
      codes.resize((size_t)(per_chunk * T + 8));
      amax.resize((size_t)(per_chunk * L));
      scale.resize((size_t)(per_chunk * L));
    } catch (...) {
      return false;
    }
    for (int64_t tc = t0; tc < t1; tc += per_chunk) {
      const int64_t e0 = tc * T, e1 = std::min(n, std::min(t1, tc + per_chunk) * T);
      const int64_t cnt = e1 - e0, ng = (cnt + 7) / 8, b0 = e0 / bs, b1 = (e1 + bs - 1) / bs;
      if (a->op == 2) {  // decode: sext(code) * scale
        unpack_any(bits, in_stream, nbytes, e0 / 8, ng, codes.data());
        for (int64_t b = b0; b < b1; b++) {
          const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
          const uint8_t* c = codes.data() + s0;
          if (len == 32) int_decode_block<32>(job, b, len, c, a->out_values + b * bs);
          else int_decode_block<0>(job, b, len, c, a->out_values + b * bs);
        }
        continue;
      }
      const float* src = (const float*)a->x + e0;
      if (!direct_x) {
        load_values_any(a->in_kind, a->x, e0, cnt, loaded.data());
        src = loaded.data();
      }
      const uint8_t* cin = codes.data();
      if (a->op == 1 && direct_codes) cin = in_stream + e0;
      else if (a->op == 1) unpack_any(bits, in_stream, nbytes, e0 / 8, ng, codes.data());
      uint8_t* cout = direct_codes ? out_stream + e0 : codes.data();
      for (int64_t b = b0; b < b1; b++) {  // pass 1: values and block maxima
        const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
        float* v = vals.data() + s0;
        const float* x = src + s0;
        const uint8_t* c = cin + s0;
        amax[b - b0] = len == 32 ? int_values_block<32>(job, b, len, x, v, c)
                                 : int_values_block<0>(job, b, len, x, v, c);
      }
      for (int64_t b = b0; b < b1; b++) {  // pass 2: scales
        const uint32_t m = amax[b - b0];
        const IntScale sc = int_scale(m, qmax, kq, fmt, a->max_in_bits);
        if (sc.over) worst[th] = std::max(worst[th], m);
        int_store_scale(out_scales, b, fmt, sc.stored);
        scale[b - b0] = sc.s;
      }
      for (int64_t b = b0; b < b1; b++) {  // pass 3: codes
        const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
        const float* v = vals.data() + s0;
        uint8_t* c = cout + s0;
        if (len == 32) int_codes_block<32>(job, b, len, v, scale[b - b0], c);
        else int_codes_block<0>(job, b, len, v, scale[b - b0], c);
      }
      if (direct_codes) continue;
      std::memset(codes.data() + cnt, 0, (size_t)(8 * ng - cnt));
      pack_any(bits, codes.data(), e0 / 8, ng, out_stream, nbytes);
    }
    return true;
  };
  int nt = (int)std::max<int64_t>(1, a->nthreads);
  if (!parallel_tiles(ntiles, nt, work)) return 1;
  a->worst = *std::max_element(worst.begin(), worst.end());
  return 0;
}

}  // extern "C"

// -- MX codecs (dynamiq/codecs/mx.py, formats.py) -------------------------------------------

namespace {

struct MxFormat {
  int32_t nmant, bias, bits, max_code, nan_code, inf_code, emax;
};

enum { SPEC_IEEE = 0, SPEC_FN = 1, SPEC_NONE = 2, SPEC_INT = 3 };

// ElementFormat.decode without a table (vectorizes without gathers): the fp32 value of an
// element code. Normal codes: the code's exponent and mantissa fields moved into fp32's and
// rebiased; subnormal codes (exponent field 0): mantissa * 2^(1 - bias - nmant), exact.
template <int SPEC>
inline float mx_decode_element(uint32_t code, const MxFormat& f) {
  if (SPEC == SPEC_INT) {  // two's complement times 2^-nmant (exact)
    const int32_t q = (int32_t)(int8_t)(uint8_t)code;
    return (float)q * u2f((uint32_t)(127 - f.nmant) << 23);
  }
  const uint32_t magmask = (1u << (f.bits - 1)) - 1;
  const uint32_t mag = code & magmask;
  const uint32_t sign = (code >> (f.bits - 1)) << 31;
  const uint32_t normal = (mag << (23 - f.nmant)) + ((uint32_t)(127 - f.bias) << 23);
  const float sub = (float)(int32_t)mag * u2f((uint32_t)(128 - f.bias - f.nmant) << 23);
  uint32_t bits = mag >= (1u << f.nmant) ? normal : f2u(sub);
  if (SPEC == SPEC_IEEE && (mag >> f.nmant) == (magmask >> f.nmant))  // Inf, NaN
    bits = (mag & ((1u << f.nmant) - 1)) == 0 ? 0x7F800000u : 0x7FC00000u;
  if (SPEC == SPEC_FN && mag == magmask) bits = 0x7FC00000u;  // NaN
  return u2f(bits | sign);
}

// 2^-shared as fp32 (shared in -127 .. 127; 2^-127 is subnormal)
inline float mx_inv_scale(int32_t shared) {
  return shared < 127 ? u2f((uint32_t)(127 - shared) << 23) : u2f(1u << 22);
}

// ElementFormat.encode(x, shared, saturate=True) of a finite x (NaN/Inf blocks never get
// here): the code of x * 2^-shared, rounded to nearest-even with subnormals, saturating.
// y = |x| * 2^-shared (inv) is exact in fp32 wherever the element format can tell values
// apart: it is rounded only below 2^-126, far under half the smallest element subnormal,
// where the code is 0 either way. So rounding y rounds x * 2^-shared:
//   element normals, y >= 2^(1 - bias): round y's fp32 bits at bit 23 - nmant to nearest
//   even and rebias (a carry out of the mantissa moves into the exponent by itself);
//   element subnormals: rintf(y * 2^(bias + nmant - 1)) (an exact scaling);
//   INT elements: rintf(y * 2^nmant).
// y < 2^(emax + 1) (the OCP shared exponent), so saturating at max_code is the only clamp.
template <int SPEC>
inline uint32_t mx_encode_element(float x, float inv, const MxFormat& f) {
  const uint32_t bits = f2u(x);
  const float y = u2f(bits & 0x7FFFFFFFu) * inv;
  int32_t mag;
  if (SPEC == SPEC_INT) {
    mag = std::min((int32_t)rintf(y * u2f((uint32_t)(127 + f.nmant) << 23)), f.max_code);
    const int32_t neg = (int32_t)bits >> 31;  // 0 or -1: two's complement of mag when negative
    return (uint32_t)((mag ^ neg) - neg) & 0xFFu;
  }
  const uint32_t b = f2u(y);
  const int32_t sh = 23 - f.nmant;
  const uint32_t rn = (b + ((1u << (sh - 1)) - 1) + ((b >> sh) & 1u)) >> sh;
  const int32_t mag_normal = (int32_t)rn - ((127 - f.bias) << f.nmant);
  const int32_t mag_sub = (int32_t)rintf(y * u2f((uint32_t)(127 + f.bias + f.nmant - 1) << 23));
  mag = b >= ((uint32_t)(128 - f.bias) << 23) ? mag_normal : mag_sub;
  mag = std::min(mag, f.max_code);  // saturate
  return (uint32_t)mag | ((bits & 0x80000000u) >> (32 - f.bits));
}

inline float e8m0_value(uint32_t c) {
  return c == 0xFF ? u2f(0x7FC00000u) : u2f(c == 0 ? 1u << 22 : c << 23);
}

template <int BS, int SPEC>
inline void mx_encode_codes(const float* __restrict v, int64_t len_, int32_t shared,
                            const MxFormat& f, uint8_t* __restrict c) {
  const int64_t len = BS > 0 ? BS : len_;
  const float inv = mx_inv_scale(shared);
  for (int64_t i = 0; i < len; i++) c[i] = (uint8_t)mx_encode_element<SPEC>(v[i], inv, f);
}

// what every block of one dq_mx_run call shares
struct MxJob {
  int op, specials;
  MxFormat f;
  const uint8_t* in_scales;
  uint8_t* out_scales;
};

// decode: out[i] = element value * 2^scale
template <int BS, int SPEC>
inline void mx_decode_block(const MxJob& j, int64_t b, int64_t len_, const uint8_t* __restrict c,
                            float* __restrict o) {
  const int64_t len = BS > 0 ? BS : len_;
  const float s = e8m0_value(j.in_scales[b]);
  for (int64_t i = 0; i < len; i++) o[i] = mx_decode_element<SPEC>(c[i], j.f) * s;
}

template <int SPEC>
void mx_decode_chunk(const MxJob& j, int64_t n, int64_t b0, int64_t b1, const uint8_t* codes,
                     float* out) {
  for (int64_t b = b0; b < b1; b++) {
    const int64_t s0 = (b - b0) * 32, len = std::min<int64_t>(32, n - b * 32);
    if (len == 32) mx_decode_block<32, SPEC>(j, b, len, codes + s0, out + b * 32);
    else mx_decode_block<0, SPEC>(j, b, len, codes + s0, out + b * 32);
  }
}

// Encoding takes three passes over a chunk of blocks, as for the INT codecs: (1) the values
// (reduce: the decoded incoming codes c plus the local values v) and their absmax, (2) the
// shared exponents (scale bytes), (3) the codes.

// pass 1 for block b: its values in v (reduce: element value * scale, then + local) and the
// integer max of their magnitude bits (in the same loop)
template <int BS, int SPEC>
inline uint32_t mx_values_block(const MxJob& j, int64_t b, int64_t len_,
                                const float* __restrict src, float* __restrict v,
                                const uint8_t* __restrict c) {
  const int64_t len = BS > 0 ? BS : len_;
  prefetch_ahead(src);
  if (j.op != 1) return block_absmax_bits<BS>(src, len, v);
  const float s = e8m0_value(j.in_scales[b]);
  uint32_t m = 0;
  for (int64_t i = 0; i < len; i++) {
    float p = mx_decode_element<SPEC>(c[i], j.f) * s;
    float x = p + src[i];
    v[i] = x;
    m = std::max(m, f2u(x) & 0x7FFFFFFFu);
  }
  return m;
}

// pass 2: the scale byte of a block with absmax bits amax (OCP: floor rule; NaN/Inf: 0xFF)
inline uint8_t mx_scale_code(uint32_t amax, int32_t emax) {
  if (amax >= 0x7F800000u) return 0xFF;
  return (uint8_t)(std::min(std::max(exponent_of(amax) - emax, -127), 127) + 127);
}

// pass 3 for a block with scale byte sc: its codes (0 in a NaN/Inf block)
template <int SPEC>
inline void mx_codes_block(const MxJob& j, int64_t len, const float* __restrict v, uint8_t sc,
                           uint8_t* __restrict c) {
  if (sc == 0xFF) std::memset(c, 0, (size_t)len);
  else if (len == 32) mx_encode_codes<32, SPEC>(v, len, (int32_t)sc - 127, j.f, c);
  else mx_encode_codes<0, SPEC>(v, len, (int32_t)sc - 127, j.f, c);
}

// the three passes over blocks [b0, b1) (at most 128) whose values or local slice are in
// src: values into vals, incoming codes (reduce) from cin, outgoing codes into cout
template <int SPEC>
void mx_encode_chunk(const MxJob& j, int64_t n, int64_t b0, int64_t b1, const float* src,
                     float* vals, const uint8_t* cin, uint8_t* cout) {
  uint32_t amax[128];
  for (int64_t b = b0; b < b1; b++) {  // pass 1: values and block maxima
    const int64_t s0 = (b - b0) * 32, len = std::min<int64_t>(32, n - b * 32);
    amax[b - b0] =
        len == 32 ? mx_values_block<32, SPEC>(j, b, len, src + s0, vals + s0, cin + s0)
                  : mx_values_block<0, SPEC>(j, b, len, src + s0, vals + s0, cin + s0);
  }
  for (int64_t b = b0; b < b1; b++) j.out_scales[b] = mx_scale_code(amax[b - b0], j.f.emax);
  for (int64_t b = b0; b < b1; b++) {  // pass 3: codes
    const int64_t s0 = (b - b0) * 32, len = std::min<int64_t>(32, n - b * 32);
    mx_codes_block<SPEC>(j, len, vals + s0, j.out_scales[b], cout + s0);
  }
}

}  // namespace

extern "C" {

// Arguments of dq_mx_run (mirrored by a ctypes.Structure in cpu_native.py).
struct dq_mx_args {
  DQ_COMMON_ARGS
  int32_t specials;     // 0 ieee, 1 fn, 2 none, 3 int
  int32_t nmant, bias, bits, max_code, nan_code, inf_code, emax;
  int32_t nthreads;
};

int dq_mx_run(dq_mx_args* a) {
  const int64_t n = a->n, bs = 32;
  if (n <= 0) return 0;
  const MxFormat f{a->nmant, a->bias, a->bits, a->max_code, a->nan_code, a->inf_code, a->emax};
  const int bits = a->bits;
  const int64_t nblocks = (n + bs - 1) / bs;
  const int64_t nbytes = (n * bits + 7) / 8;
  const int64_t per_chunk = 128;  // blocks of 32 (whole bytes for every element width)
  const uint8_t* in_stream = a->in ? a->in + nblocks : nullptr;
  uint8_t* out_stream = a->out ? a->out + nblocks : nullptr;
  const MxJob job{a->op, a->specials, f, a->in, a->out};

  // fp32 values read in place, 8-bit codes straight from / into the streams (as dq_int_run)
  const bool direct_x = a->in_kind == 0, direct_codes = bits == 8;
  auto work = [&](int64_t t0, int64_t t1, int) -> bool {
    float vals[per_chunk * 32];
    float loaded[per_chunk * 32];
    uint8_t codes[per_chunk * 32 + 8];
    for (int64_t tc = t0; tc < t1; tc += per_chunk) {
      const int64_t b1 = std::min(t1, tc + per_chunk);
      const int64_t e0 = tc * bs, e1 = std::min(n, b1 * bs);
      const int64_t cnt = e1 - e0, ng = (cnt + 7) / 8;
      if (a->op == 2) {  // decode: element value * scale
        unpack_any(bits, in_stream, nbytes, e0 / 8, ng, codes);
        float* o = a->out_values;
        switch (job.specials) {
          case SPEC_IEEE: mx_decode_chunk<SPEC_IEEE>(job, n, tc, b1, codes, o); break;
          case SPEC_FN: mx_decode_chunk<SPEC_FN>(job, n, tc, b1, codes, o); break;
          case SPEC_NONE: mx_decode_chunk<SPEC_NONE>(job, n, tc, b1, codes, o); break;
          default: mx_decode_chunk<SPEC_INT>(job, n, tc, b1, codes, o); break;
        }
        continue;
      }
      const float* src = (const float*)a->x + e0;
      if (!direct_x) {
        load_values_any(a->in_kind, a->x, e0, cnt, loaded);
        src = loaded;
      }
      const uint8_t* cin = codes;
      if (a->op == 1 && direct_codes) cin = in_stream + e0;
      else if (a->op == 1) unpack_any(bits, in_stream, nbytes, e0 / 8, ng, codes);
      uint8_t* cout = direct_codes ? out_stream + e0 : codes;
      switch (job.specials) {
        case SPEC_IEEE: mx_encode_chunk<SPEC_IEEE>(job, n, tc, b1, src, vals, cin, cout); break;
        case SPEC_FN: mx_encode_chunk<SPEC_FN>(job, n, tc, b1, src, vals, cin, cout); break;
        case SPEC_NONE: mx_encode_chunk<SPEC_NONE>(job, n, tc, b1, src, vals, cin, cout); break;
        default: mx_encode_chunk<SPEC_INT>(job, n, tc, b1, src, vals, cin, cout); break;
      }
      if (direct_codes) continue;
      std::memset(codes + cnt, 0, (size_t)(8 * ng - cnt));
      pack_any(bits, codes, e0 / 8, ng, out_stream, nbytes);
    }
    return true;
  };
  int nt = (int)std::max<int64_t>(1, a->nthreads);
  return parallel_tiles(nblocks, nt, work) ? 0 : 1;
}

}  // extern "C"

// -- declarative block formats (dynamiq/codecs/blockfmt.py, scale_rule "nearest") -----------
//
// Generic over the declared data: element format (4 or 8 bits), block size B (a power of two,
// 8..128: a block's codes fill whole bytes), an 8-bit float scale format and the fp32 tensor
// scale G in front of the payload. Per block: t = b / (Me * G) (IEEE division; Me * G exact),
// s = t rounded to nearest-even in the scale format (t clamped to 2^(emax + 1) first, which
// saturates as the reference does), S = s * G (exact); elements q = x / S rounded likewise
// (mx_encode_element with a unit scale); a block whose scale is 0 gets codes 0, a NaN/Inf
// block the scale format's NaN code and codes 0. Decoding is element * S (exact).

namespace {

struct BlkJob {
  int op, e_spec, s_spec;
  MxFormat e, s;
  int64_t bs;
  float e_max, g_in, g_out, scale_div;  // scale_div = e_max * g_out (exact)
  uint32_t e_limit_bits;
  float s_limit;
  uint32_t s_nan;
};

// SSPEC: the scale format's specials at compile time, or -1: read at run time
template <int SSPEC>
inline float blk_scale_value(const BlkJob& j, uint32_t code) {
  if (SSPEC >= 0) return mx_decode_element<SSPEC < 0 ? 0 : SSPEC>(code, j.s);
  switch (j.s_spec) {
    case SPEC_IEEE: return mx_decode_element<SPEC_IEEE>(code, j.s);
    case SPEC_FN: return mx_decode_element<SPEC_FN>(code, j.s);
    default: return mx_decode_element<SPEC_NONE>(code, j.s);
  }
}

template <int SSPEC>
inline uint32_t blk_scale_code(const BlkJob& j, float t) {
  t = std::min(t, j.s_limit);
  if (SSPEC >= 0) return mx_encode_element<SSPEC < 0 ? 0 : SSPEC>(t, 1.0f, j.s);
  switch (j.s_spec) {
    case SPEC_IEEE: return mx_encode_element<SPEC_IEEE>(t, 1.0f, j.s);
    case SPEC_FN: return mx_encode_element<SPEC_FN>(t, 1.0f, j.s);
    default: return mx_encode_element<SPEC_NONE>(t, 1.0f, j.s);
  }
}

// Encoding a chunk takes three passes over its blocks, as for the INT and MX codecs, so that
// the latency of one block's scale overlaps the work of the others: (1) the values (reduce:
// decoded incoming codes cin plus the values src) and their absmax, (2) the scales, (3) the
// codes. BS: a compile-time block length (vectorized fixed-length loops), or 0 for len_.

// decode of block b into out
template <int ESPEC, int SSPEC, int BS>
inline void blk_decode_block(const BlkJob& j, int64_t b, int64_t len_, const uint8_t* in_scales,
                             const uint8_t* __restrict cin, float* __restrict out) {
  const int64_t len = BS > 0 ? BS : len_;
  const float S = blk_scale_value<SSPEC>(j, in_scales[b]) * j.g_in;
  for (int64_t i = 0; i < len; i++) out[i] = mx_decode_element<ESPEC>(cin[i], j.e) * S;
}

// pass 1 for block b: its values in v and the integer max of their magnitude bits
template <int ESPEC, int SSPEC, int BS>
inline uint32_t blk_values_block(const BlkJob& j, int64_t b, int64_t len_,
                                 const uint8_t* in_scales, const float* __restrict src,
                                 float* __restrict v, const uint8_t* __restrict cin) {
  const int64_t len = BS > 0 ? BS : len_;
  uint32_t m = 0;
  if (j.op == 1) {
    const float S_in = blk_scale_value<SSPEC>(j, in_scales[b]) * j.g_in;
    for (int64_t i = 0; i < len; i++) {
      const float p = mx_decode_element<ESPEC>(cin[i], j.e) * S_in;
      v[i] = p + src[i];
      m = std::max(m, f2u(v[i]) & 0x7FFFFFFFu);
    }
    return m;
  }
  for (int64_t i = 0; i < len; i++) {
    v[i] = src[i];
    m = std::max(m, f2u(v[i]) & 0x7FFFFFFFu);
  }
  return m;
}

// pass 2: the scale byte of a block with absmax bits m, and S (0 where the codes are 0)
template <int SSPEC>
inline float blk_scale_block(const BlkJob& j, uint32_t m, uint8_t* scale_byte) {
  const bool finite = m < 0x7F800000u;
  const float t = u2f(finite ? m : 0u) / j.scale_div;
  const uint32_t sc = finite ? blk_scale_code<SSPEC>(j, t) : j.s_nan;
  *scale_byte = (uint8_t)sc;
  const float S = blk_scale_value<SSPEC>(j, sc) * j.g_out;
  return finite && S > 0.0f ? S : 0.0f;
}

// pass 3 for a block with scale S: its codes
template <int ESPEC, int BS>
inline void blk_codes_block(const BlkJob& j, int64_t len_, const float* __restrict v, float S,
                            uint8_t* __restrict c) {
  const int64_t len = BS > 0 ? BS : len_;
  if (!(S > 0.0f)) {
    std::memset(c, 0, (size_t)len);
    return;
  }
  const uint32_t lim = j.e_limit_bits;
  for (int64_t i = 0; i < len; i++) {
    const uint32_t qb = f2u(v[i] / S);
    const float q = u2f((qb & 0x80000000u) | std::min(qb & 0x7FFFFFFFu, lim));
    c[i] = (uint8_t)mx_encode_element<ESPEC>(q, 1.0f, j.e);
  }
}

// blocks [b0, b1) (at most 512) of a chunk whose first value is e0: decode into out, or the
// three passes (values src, incoming codes cin, outgoing codes cout)
template <int ESPEC, int SSPEC>
void blk_chunk_spec(const BlkJob& j, int64_t n, int64_t b0, int64_t b1, int64_t e0,
                    const uint8_t* in_scales, uint8_t* out_scales, const float* src, float* vals,
                    const uint8_t* cin, uint8_t* cout, float* out) {
  const int64_t bs = j.bs;
  if (j.op == 2) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
      float* o = out + b * bs;
      if (len == 16) blk_decode_block<ESPEC, SSPEC, 16>(j, b, len, in_scales, cin + s0, o);
      else if (len == 32) blk_decode_block<ESPEC, SSPEC, 32>(j, b, len, in_scales, cin + s0, o);
      else blk_decode_block<ESPEC, SSPEC, 0>(j, b, len, in_scales, cin + s0, o);
    }
    return;
  }
  uint32_t amax[512];
  float scale[512];
  for (int64_t b = b0; b < b1; b++) {  // pass 1
    const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
    const float* x = src + s0;
    float* v = vals + s0;
    const uint8_t* c = cin + s0;
    amax[b - b0] = len == 16   ? blk_values_block<ESPEC, SSPEC, 16>(j, b, len, in_scales, x, v, c)
                   : len == 32 ? blk_values_block<ESPEC, SSPEC, 32>(j, b, len, in_scales, x, v, c)
                               : blk_values_block<ESPEC, SSPEC, 0>(j, b, len, in_scales, x, v, c);
  }
  for (int64_t b = b0; b < b1; b++)  // pass 2
    scale[b - b0] = blk_scale_block<SSPEC>(j, amax[b - b0], out_scales + b);
  for (int64_t b = b0; b < b1; b++) {  // pass 3
    const int64_t s0 = b * bs - e0, len = std::min(bs, n - b * bs);
    const float S = scale[b - b0];
    if (len == 16) blk_codes_block<ESPEC, 16>(j, len, vals + s0, S, cout + s0);
    else if (len == 32) blk_codes_block<ESPEC, 32>(j, len, vals + s0, S, cout + s0);
    else blk_codes_block<ESPEC, 0>(j, len, vals + s0, S, cout + s0);
  }
}

// the common scale format (E4M3, "fn") at compile time; others read at run time
template <int ESPEC>
void blk_chunk(const BlkJob& j, int64_t n, int64_t b0, int64_t b1, int64_t e0,
               const uint8_t* in_scales, uint8_t* out_scales, const float* src, float* vals,
               const uint8_t* cin, uint8_t* cout, float* out) {
  if (j.s_spec == SPEC_FN)
    blk_chunk_spec<ESPEC, SPEC_FN>(j, n, b0, b1, e0, in_scales, out_scales, src, vals, cin,
                                   cout, out);
  else
    blk_chunk_spec<ESPEC, -1>(j, n, b0, b1, e0, in_scales, out_scales, src, vals, cin, cout,
                              out);
}

}  // namespace

extern "C" {

// Arguments of dq_blk_run (mirrored by a ctypes.Structure in cpu_native.py).
struct dq_blk_args {
  DQ_COMMON_ARGS
  int64_t block_size;
  int32_t e_specials, e_nmant, e_bias, e_bits, e_max_code, e_nan_code, e_inf_code, e_emax;
  int32_t s_specials, s_nmant, s_bias, s_max_code, s_nan_code, s_emax;
  int32_t header;        // bytes of the tensor scale in front of the payloads (0 or 4)
  uint32_t g_out_bits;   // fp32 bits of the outgoing G (encode, reduce)
  float e_max;           // the element format's largest value
  int32_t nthreads;
};

int dq_blk_run(dq_blk_args* a) {
  const int64_t n = a->n, bs = a->block_size;
  if (n <= 0) return 0;
  const int bits = a->e_bits, hdr = a->header;
  const int64_t nblocks = (n + bs - 1) / bs;
  const int64_t nbytes = (n * bits + 7) / 8;
  BlkJob job;
  job.op = a->op;
  job.e_spec = a->e_specials;
  job.s_spec = a->s_specials;
  job.e = MxFormat{a->e_nmant, a->e_bias, bits, a->e_max_code, a->e_nan_code, a->e_inf_code,
                   a->e_emax};
  job.s = MxFormat{a->s_nmant, a->s_bias, 8, a->s_max_code, a->s_nan_code, 0, a->s_emax};
  job.bs = bs;
  job.e_max = a->e_max;
  job.g_out = u2f(a->g_out_bits);
  job.scale_div = job.e_max * job.g_out;
  job.g_in = 1.0f;
  if (hdr && a->op != 0) {
    uint32_t g;
    std::memcpy(&g, a->in, 4);
    job.g_in = u2f(g);
  }
  job.e_limit_bits = (uint32_t)(a->e_emax + 1 + 127) << 23;
  job.s_limit = u2f((uint32_t)(a->s_emax + 1 + 127) << 23);
  job.s_nan = (uint32_t)a->s_nan_code;
  if (hdr && a->op != 2) std::memcpy(a->out, &a->g_out_bits, 4);
  const uint8_t* in_scales = a->in ? a->in + hdr : nullptr;
  const uint8_t* in_stream = a->in ? a->in + hdr + nblocks : nullptr;
  uint8_t* out_scales = a->out ? a->out + hdr : nullptr;
  uint8_t* out_stream = a->out ? a->out + hdr + nblocks : nullptr;
  const int64_t per_chunk = std::max<int64_t>(1, 4096 / bs);  // blocks (whole bytes)

  auto work = [&](int64_t t0, int64_t t1, int) -> bool {
    float vals[4096];
    float loaded[4096];
    uint8_t codes_in[4096 + 8];
    uint8_t codes_out[4096 + 8];
    for (int64_t tc = t0; tc < t1; tc += per_chunk) {
      const int64_t b1 = std::min(t1, tc + per_chunk);
      const int64_t e0 = tc * bs, e1 = std::min(n, b1 * bs);
      const int64_t cnt = e1 - e0, ng = (cnt + 7) / 8;
      const float* src = nullptr;
      if (a->op != 2) {
        src = (const float*)a->x + e0;
        if (a->in_kind != 0) {
          load_values_any(a->in_kind, a->x, e0, cnt, loaded);
          src = loaded;
        }
      }
      if (a->op != 0) unpack_any(bits, in_stream, nbytes, e0 / 8, ng, codes_in);
      switch (job.e_spec) {
        case SPEC_IEEE:
          blk_chunk<SPEC_IEEE>(job, n, tc, b1, e0, in_scales, out_scales, src, vals, codes_in,
                               codes_out, a->out_values);
          break;
        case SPEC_FN:
          blk_chunk<SPEC_FN>(job, n, tc, b1, e0, in_scales, out_scales, src, vals, codes_in,
                             codes_out, a->out_values);
          break;
        case SPEC_NONE:
          blk_chunk<SPEC_NONE>(job, n, tc, b1, e0, in_scales, out_scales, src, vals, codes_in,
                               codes_out, a->out_values);
          break;
        default:
          blk_chunk<SPEC_INT>(job, n, tc, b1, e0, in_scales, out_scales, src, vals, codes_in,
                              codes_out, a->out_values);
          break;
      }
      if (a->op == 2) continue;
      std::memset(codes_out + cnt, 0, (size_t)(8 * ng - cnt));
      pack_any(bits, codes_out, e0 / 8, ng, out_stream, nbytes);
    }
    return true;
  };
  int nt = (int)std::max<int64_t>(1, a->nthreads);
  return parallel_tiles(nblocks, nt, work) ? 0 : 1;
}

// The layouts of the argument structures (common.h, DQ_LAYOUT).
int64_t dq_int_args_layout(int64_t* out, int64_t cap) {
  using T = dq_int_args;
  return dq_layout(out, cap,
                   {(int64_t)sizeof(T), DQ_COMMON_OFFSETS(T), DQ_OFF(T, block_size),
                    DQ_OFF(T, bits), DQ_OFF(T, fmt), DQ_OFF(T, stochastic), DQ_OFF(T, key0),
                    DQ_OFF(T, key1), DQ_OFF(T, offset), DQ_OFF(T, max_in_bits),
                    DQ_OFF(T, nthreads), DQ_OFF(T, worst)});
}

int64_t dq_mx_args_layout(int64_t* out, int64_t cap) {
  using T = dq_mx_args;
  return dq_layout(out, cap,
                   {(int64_t)sizeof(T), DQ_COMMON_OFFSETS(T), DQ_OFF(T, specials),
                    DQ_OFF(T, nmant), DQ_OFF(T, bias), DQ_OFF(T, bits), DQ_OFF(T, max_code),
                    DQ_OFF(T, nan_code), DQ_OFF(T, inf_code), DQ_OFF(T, emax),
                    DQ_OFF(T, nthreads)});
}

int64_t dq_blk_args_layout(int64_t* out, int64_t cap) {
  using T = dq_blk_args;
  return dq_layout(
      out, cap,
      {(int64_t)sizeof(T), DQ_COMMON_OFFSETS(T), DQ_OFF(T, block_size), DQ_OFF(T, e_specials),
       DQ_OFF(T, e_nmant), DQ_OFF(T, e_bias), DQ_OFF(T, e_bits), DQ_OFF(T, e_max_code),
       DQ_OFF(T, e_nan_code), DQ_OFF(T, e_inf_code), DQ_OFF(T, e_emax), DQ_OFF(T, s_specials),
       DQ_OFF(T, s_nmant), DQ_OFF(T, s_bias), DQ_OFF(T, s_max_code), DQ_OFF(T, s_nan_code),
       DQ_OFF(T, s_emax), DQ_OFF(T, header), DQ_OFF(T, g_out_bits), DQ_OFF(T, e_max),
       DQ_OFF(T, nthreads)});
}

// The layout version of the argument structures (dq_int_args, dq_mx_args, dq_blk_args and
// dynamiq_kernels.cpp's dq_dyn_args) and of the functions' signatures, checked when the
// library loads.
int dq_abi_version(void) { return 8; }

}  // extern "C"
