// The CPU fast path of the pass-through codecs fp32, bf16 and fp16: encode, decode and the
// fused reduce (widen the incoming payload, add the local slice in fp32, narrow), one pass over
// memory.
//
// Bit-exact with the PyTorch reference in dynamiq/codecs/passthrough.py
// (tests/kernels/test_cpu_native_passthrough.py):
//   * values already in the payload's type are copied bit for bit (the reference's clone);
//   * otherwise finite values beyond the payload type's largest are saturated to it (the
//     reference clamps before it casts; Inf stays Inf), rounding is to nearest, ties to even,
//     subnormals kept (torch's casts), and every NaN becomes the canonical quiet NaN
//     (0x7FC00000, 0x7FC0, 0x7E00);
//   * widening bf16 / fp16 to fp32 is exact, and the reduce's sum is one fp32 addition, incoming
//     value first (as decode(payload) + local).
// All conversions are integer operations on the bit patterns except the fp16 subnormal case,
// an exact scaling by 2^24 and rintf (round to nearest even under the default rounding mode).

#include <type_traits>

#include "common.h"

namespace {

// fp32 -> bf16 bits: nearest even; finite values rounding beyond the largest bf16 saturate
inline uint32_t narrow_bf16(float v) {
  const uint32_t u = f2u(v), a = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // no carry into the sign
  const uint32_t out = ((r & 0x7FFFu) == 0x7F80u && a < 0x7F800000u) ? (sign | 0x7F7Fu) : r;
  return a > 0x7F800000u ? 0x7FC0u : out;
}

// fp32 -> fp16 bits: nearest even, subnormals kept; finite values beyond 65504 saturate
inline uint32_t narrow_f16(float v) {
  const uint32_t u = f2u(v), a = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
  // normal results (a >= 2^-14): rebias the exponent (127 -> 15), round off 13 bits
  const uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13;
  // below 2^-14: |v| * 2^24 is exact, and its nearest-even integer is the code (1024 is the
  // smallest normal, whose code is 0x400)
  const uint32_t sub = (uint32_t)(int32_t)std::rint(u2f(a) * 16777216.0f);
  uint32_t mag = a < 0x38800000u ? sub : normal;
  mag = a > 0x477FE000u ? 0x7BFFu : mag;  // beyond 65504: the largest fp16
  mag = a == 0x7F800000u ? 0x7C00u : mag;
  return a > 0x7F800000u ? 0x7E00u : (sign | mag);
}

// payload element i (KIND: 0 fp32, 1 bf16, 2 fp16) of an fp32 value that is not already of
// the payload's type
template <int OUT>
inline void store_narrowed(uint8_t* __restrict out, int64_t i, float v) {
  if constexpr (OUT == 0) {
    const uint32_t b = v != v ? 0x7FC00000u : f2u(v);
    std::memcpy(out + 4 * i, &b, 4);
  } else {
    const uint16_t h = (uint16_t)(OUT == 1 ? narrow_bf16(v) : narrow_f16(v));
    std::memcpy(out + 2 * i, &h, 2);
  }
}

template <int OUT, int IN>
void encode_range(const void* __restrict x, uint8_t* __restrict out, int64_t a, int64_t b) {
  if constexpr (OUT == IN) {  // the reference's clone: the bits as they are
    constexpr int64_t size = OUT == 0 ? 4 : 2;
    std::memcpy(out + size * a, (const uint8_t*)x + size * a, (size_t)((b - a) * size));
  } else {
    for (int64_t i = a; i < b; i++) store_narrowed<OUT>(out, i, load_value<IN>(x, i));
  }
}

template <int OUT>
void decode_range(const uint8_t* __restrict in, float* __restrict out, int64_t a, int64_t b) {
  for (int64_t i = a; i < b; i++) out[i] = load_value<OUT>(in, i);
}

// the sum is an fp32 tensor encoded: fp32 payloads take its bits as they are (NaN included)
template <int OUT, int IN>
void reduce_range(const uint8_t* __restrict in, const void* __restrict x, uint8_t* __restrict out,
                  int64_t a, int64_t b) {
  for (int64_t i = a; i < b; i++) {
    const float v = load_value<OUT>(in, i) + load_value<IN>(x, i);
    if constexpr (OUT == 0) {
      std::memcpy(out + 4 * i, &v, 4);
    } else {
      store_narrowed<OUT>(out, i, v);
    }
  }
}

constexpr int64_t TILE = 1 << 14;  // values per tile (threads take contiguous runs of tiles)

template <int OUT, int IN>
bool run_kinds(int op, const void* x, const uint8_t* in, uint8_t* out, float* out_values,
               int64_t n, int nthreads) {
  const int64_t ntiles = (n + TILE - 1) / TILE;
  return parallel_tiles(ntiles, nthreads, [&](int64_t t0, int64_t t1, int) {
    const int64_t a = t0 * TILE, b = std::min<int64_t>(n, t1 * TILE);
    if (op == 0) encode_range<OUT, IN>(x, out, a, b);
    else if (op == 1) reduce_range<OUT, IN>(in, x, out, a, b);
    else decode_range<OUT>(in, out_values, a, b);
    return true;
  });
}

template <int OUT>
bool run_out(int op, int in_kind, const void* x, const uint8_t* in, uint8_t* out,
             float* out_values, int64_t n, int nthreads) {
  if (in_kind == 0) return run_kinds<OUT, 0>(op, x, in, out, out_values, n, nthreads);
  if (in_kind == 1) return run_kinds<OUT, 1>(op, x, in, out, out_values, n, nthreads);
  return run_kinds<OUT, 2>(op, x, in, out, out_values, n, nthreads);
}

}  // namespace

extern "C" {

// Arguments of dq_pt_run (mirrored by a ctypes.Structure in cpu_native.py).
struct dq_pt_args {
  DQ_COMMON_ARGS
  int32_t out_kind;  // the payload's type: 0 fp32, 1 bf16, 2 fp16
  int32_t nthreads;
};

int dq_pt_run(dq_pt_args* a) {
  if (a->n <= 0) return 0;
  const int nt = (int)std::max<int64_t>(1, a->nthreads);
  auto run = [&](auto out_kind) {
    return run_out<decltype(out_kind)::value>(a->op, a->in_kind, a->x, a->in, a->out,
                                              a->out_values, a->n, nt);
  };
  bool ok;
  if (a->out_kind == 0) ok = run(std::integral_constant<int, 0>{});
  else if (a->out_kind == 1) ok = run(std::integral_constant<int, 1>{});
  else ok = run(std::integral_constant<int, 2>{});
  return ok ? 0 : 1;
}

// The layout of dq_pt_args (common.h, DQ_LAYOUT).
int64_t dq_pt_args_layout(int64_t* out, int64_t cap) {
  using T = dq_pt_args;
  return dq_layout(out, cap,
                   {(int64_t)sizeof(T), DQ_COMMON_OFFSETS(T), DQ_OFF(T, out_kind),
                    DQ_OFF(T, nthreads)});
}

}  // extern "C"
