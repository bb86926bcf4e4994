// The fused layer ops of kernels/cpu_layer_ops.py in C++, for fp32 and bf16 rows: RMSNorm
// (alone and after the residual add), SiLU-and-mul, the neox rotary embedding, and Qwen3's
// per-head q/k norm followed by the rotation; and, through the same parameter block and
// thread split, the linear layer of cpu_gemm.h (op kLinear); and, with its own parameter
// block and entry points, the experts of a mixture-of-experts layer (cpu_moe.h).
//
// vLLM counterpart: csrc/cpu/layernorm.cpp, activation.cpp and pos_encoding.cpp, templates
// over the element type that widen to fp32, compute and narrow, as these do.
//
// Why C++ when numba already compiles these loops: not the loops but the call. A decode step
// of a Qwen3-0.6B-shaped model makes 112 of these calls (4 per layer), each on 16 rows of
// 1,024 to 3,072 values, a few microseconds of arithmetic. The numba dispatcher types every
// argument and the parallel loop wakes the thread team on every call; with the caches cold
// from the layer's weights (the linears stream tens of MiB between two calls) a call took
// 75 us in the engine. Here a call is one ctypes call on a parameter block, and small calls
// run on the calling thread; only larger ones are split across the team. And the bf16 loops
// narrow with AVX512_BF16's VCVTNEPS2BF16, one instruction where numba needs six integer ones
// (on AVX2, simd_avx2.h's integer rounding, on 8 lanes an instruction as numba's).
// Compiled once per instruction set (csrc/simd.h, kernels/cpu_native.py).
//
// Contract: the rounding points of the numba ops (cpu_layer_ops.py for fp32,
// cpu_layer_ops_bf16.py for bf16), which torch's code in mini_vllm.models is the reference
// for. `Narrow` is the identity for fp32 and round-to-nearest-even to bf16 for bf16, so one
// template states both: in bf16 every point where torch rounds a tensor is a Narrow here.
// The bf16 specialisations below write the same points with intrinsics.
// Compiled with -ffp-contract=off: the rotation's products are rounded before their sum, as
// torch rounds them. Sums of squares are vectorised (another order than numba's or torch's:
// they agree to a few fp32 ulps, as the tests bound).
//
// Invariants: rows [begin, end) of a call depend only on those rows (a linear's panels only
// on theirs), so any split between threads gives the same bits; positions are checked
// against the table before any row is written (mini_vllm_layer_op returns an error instead
// of reading outside it).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "cpu_gemm.h"

namespace {

namespace simd = mini_vllm_simd;
using simd::V16;

// The parameter block the Python side fills (cpu_layer_ops_native.PARAMS names each slot).
enum Param {
  kOp, kDtype, kRows, kWidth, kX, kXStride, kResidual, kResidualStride, kWeight, kEpsBits, kOut,
  kResidualOut, kPositions, kCos, kSin, kCosStride, kSinStride, kTableRows, kHeadSize, kQHeads, kKHeads,
  kKWeight, kKOut, kInFeatures, kBias, kNumParams
};
// kLinear: x [rows, in_features] @ weight.T (+ bias) -> out [rows, width]; weight is packed
// (cpu_gemm.h), bias fp32 or 0, and threads split the output's panels.
enum Op { kRmsNorm, kAddRmsNorm, kSiluAndMul, kRope, kQkNormRope, kLinear };
// The largest head the rotations take (their per-row scratch lives on the stack).
constexpr int64_t kMaxHeadSize = 512;

inline float bf16_to_fp32(uint16_t bits) {
  return __builtin_bit_cast(float, uint32_t(bits) << 16);
}

inline uint16_t fp32_to_bf16(float f) {  // nearest even; a NaN becomes a quiet NaN, as torch's
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  uint16_t rounded = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : rounded;
}

// Element access: Load widens, Store narrows, Narrow is a round trip (identity for fp32).
template <typename T> struct Elem;
template <> struct Elem<float> {
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
  static float Narrow(float v) { return v; }
};
template <> struct Elem<uint16_t> {
  static float Load(uint16_t v) { return bf16_to_fp32(v); }
  static uint16_t Store(float v) { return fp32_to_bf16(v); }
  static float Narrow(float v) { return bf16_to_fp32(fp32_to_bf16(v)); }
};

// exp(x) for x clamped to [-87, 88]: the kernels' Cephes polynomial (cpu_paged_attention._exp),
// 2**n * p(r) with n = round(x / ln 2), so that the loop vectorises (libm's expf would not).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float n = std::floor(x * 1.4426950408889634f + 0.5f);
  float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p * r, r, r) + 1.0f;
  // 2**n as a float's exponent bits (unsigned: GCC 12 vectorises no bit cast of a signed int)
  return p * __builtin_bit_cast(float, uint32_t(int32_t(n) + 127) << 23);
}

// out = Store(weight * Narrow(x / sqrt(mean(x^2) + eps))), one row of n values.
template <typename T>
void norm_row(const T* x, const T* weight, float eps, T* out, int64_t n) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) {
    float v = Elem<T>::Load(x[j]);
    ss += v * v;
  }
  float inv = 1.0f / std::sqrt(ss / float(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    out[j] = Elem<T>::Store(Elem<T>::Load(weight[j]) * Elem<T>::Narrow(Elem<T>::Load(x[j]) * inv));
}

// out = Store(Narrow(silu(gate)) * up), one row of n values.
template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float g = E::Load(gate[j]);
    out[j] = E::Store(E::Narrow(g / (1.0f + fast_exp(-g))) * E::Load(up[j]));
  }
}

// One head's neox rotation from halves x1, x2 into o1, o2; cos and sin already narrowed.
template <typename T>
void rotate_head(const T* x1, const T* x2, const float* cos, const float* sin, T* o1, T* o2, int64_t half) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    float a = E::Load(x1[j]), b = E::Load(x2[j]);
    o1[j] = E::Store(E::Narrow(a * cos[j]) - E::Narrow(b * sin[j]));
    o2[j] = E::Store(E::Narrow(b * cos[j]) + E::Narrow(a * sin[j]));
  }
}

// out = Store(x + r), one row of n values: the residual stream's add.
template <typename T>
void add_row(const T* x, const T* r, T* out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = Elem<T>::Store(Elem<T>::Load(x[j]) + Elem<T>::Load(r[j]));
}

// The bf16 rows written out with the SIMD layer, 16 values a step, the last step masked. On
// AVX-512 VCVTNEPS2BF16 narrows 16 floats to nearest even in one instruction, where the
// generic code's integer rounding takes six (and Zen 4 runs each 512-bit one as two halves).
// It treats a denormal fp32 as zero, so a result under 1.2e-38 in magnitude becomes 0 (the
// generic code would round it): no layer's output lives there. On AVX2 the narrowing is the
// generic code's integer rounding (simd_avx2.h), 8 lanes an instruction.
inline int left16(int64_t left) { return left >= 16 ? 16 : static_cast<int>(left); }
inline V16 load16(const uint16_t* p, int n) { return n == 16 ? simd::widen16(p) : simd::widen16_n(p, n); }
inline void store16(uint16_t* p, V16 v, int n) {
  if (n == 16)
    simd::store_bf16(p, v);
  else
    simd::store_bf16_n(p, v, n);
}
using simd::narrow16;

template <>
void add_row<uint16_t>(const uint16_t* x, const uint16_t* r, uint16_t* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const int m = left16(n - j);
    store16(out + j, simd::add(load16(x + j, m), load16(r + j, m)), m);
  }
}

template <>
void norm_row<uint16_t>(const uint16_t* x, const uint16_t* weight, float eps, uint16_t* out, int64_t n) {
  V16 ss = simd::zero();
  for (int64_t j = 0; j < n; j += 16) {
    V16 v = load16(x + j, left16(n - j));
    ss = simd::fmadd(v, v, ss);
  }
  V16 inv = simd::set1(1.0f / std::sqrt(simd::reduce_add(ss) / float(n) + eps));
  for (int64_t j = 0; j < n; j += 16) {
    const int m = left16(n - j);
    V16 normed = narrow16(simd::mul(load16(x + j, m), inv));
    store16(out + j, simd::mul(load16(weight + j, m), normed), m);
  }
}

template <>
void silu_and_mul_row<uint16_t>(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  const V16 one = simd::set1(1.0f), zero = simd::zero();
  for (int64_t j = 0; j < n; j += 16) {
    const int m = left16(n - j);
    V16 g = load16(gate + j, m);
    V16 silu = narrow16(simd::div(g, simd::add(one, simd::exp16(simd::sub(zero, g)))));
    store16(out + j, simd::mul(silu, load16(up + j, m)), m);
  }
}

template <>
void rotate_head<uint16_t>(const uint16_t* x1, const uint16_t* x2, const float* cos, const float* sin,
                           uint16_t* o1, uint16_t* o2, int64_t half) {
  for (int64_t j = 0; j < half; j += 16) {
    const int m = left16(half - j);
    V16 a = load16(x1 + j, m), b = load16(x2 + j, m);
    V16 c = simd::load_n(cos + j, m), s = simd::load_n(sin + j, m);
    store16(o1 + j, simd::sub(narrow16(simd::mul(a, c)), narrow16(simd::mul(b, s))), m);
    store16(o2 + j, simd::add(narrow16(simd::mul(b, c)), narrow16(simd::mul(a, s))), m);
  }
}

struct Call {
  const int64_t* p;
  template <typename U> U* ptr(Param k) const { return reinterpret_cast<U*>(p[k]); }
  float eps() const {
    double d;
    std::memcpy(&d, &p[kEpsBits], 8);
    return float(d);
  }
};

// The token's cos and sin rows, narrowed to T's precision (torch's .to() of the tables).
template <typename T>
void table_rows(const Call& c, int64_t t, float* cos, float* sin) {
  const int64_t pos = c.ptr<const int64_t>(kPositions)[t], half = c.p[kHeadSize] / 2;
  const float* cr = c.ptr<const float>(kCos) + pos * c.p[kCosStride];
  const float* sr = c.ptr<const float>(kSin) + pos * c.p[kSinStride];
  for (int64_t j = 0; j < half; ++j) {
    cos[j] = Elem<T>::Narrow(cr[j]);
    sin[j] = Elem<T>::Narrow(sr[j]);
  }
}

template <typename T>
void run_rows(const Call& c, int64_t begin, int64_t end) {
  const int64_t width = c.p[kWidth], xs = c.p[kXStride];
  const T* x = c.ptr<const T>(kX);
  T* out = c.ptr<T>(kOut);
  switch (c.p[kOp]) {
    case kRmsNorm:
      for (int64_t r = begin; r < end; ++r)
        norm_row(x + r * xs, c.ptr<const T>(kWeight), c.eps(), out + r * width, width);
      break;
    case kAddRmsNorm:
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = x + r * xs;
        const T* rr = c.ptr<const T>(kResidual) + r * c.p[kResidualStride];
        T* sr = c.ptr<T>(kResidualOut) + r * width;
        add_row(xr, rr, sr, width);
        norm_row(sr, c.ptr<const T>(kWeight), c.eps(), out + r * width, width);  // sr is still in L1
      }
      break;
    case kSiluAndMul:  // width = the output's (inter); x's rows are [gate | up]
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = x + r * xs;
        silu_and_mul_row(gate, gate + width, out + r * width, width);
      }
      break;
    case kRope: {  // width = heads * head_size, the same for out
      const int64_t head = c.p[kHeadSize], half = head / 2;
      float cos[kMaxHeadSize / 2], sin[kMaxHeadSize / 2];
      for (int64_t r = begin; r < end; ++r) {
        table_rows<T>(c, r, cos, sin);
        const T* xr = x + r * xs;
        T* o = out + r * width;
        for (int64_t a = 0; a < width; a += head)
          rotate_head(xr + a, xr + a + half, cos, sin, o + a, o + a + half, half);
      }
      break;
    }
    case kQkNormRope: {  // x = qkv rows; out = q [rows, q_heads * head]; k_out [rows, k_heads * head]
      const int64_t head = c.p[kHeadSize], half = head / 2, q_width = c.p[kQHeads] * head;
      const int64_t k_width = c.p[kKHeads] * head;
      float cos[kMaxHeadSize / 2], sin[kMaxHeadSize / 2];
      T normed[kMaxHeadSize];
      for (int64_t r = begin; r < end; ++r) {
        table_rows<T>(c, r, cos, sin);
        const T* src[2] = {x + r * xs, x + r * xs + q_width};
        T* dst[2] = {out + r * q_width, c.ptr<T>(kKOut) + r * k_width};
        const T* weight[2] = {c.ptr<const T>(kWeight), c.ptr<const T>(kKWeight)};
        const int64_t widths[2] = {q_width, k_width};
        for (int part = 0; part < 2; ++part)
          for (int64_t a = 0; a < widths[part]; a += head) {
            norm_row(src[part] + a, weight[part], c.eps(), normed, head);
            rotate_head<T>(normed, normed + half, cos, sin, dst[part] + a, dst[part] + a + half, half);
          }
      }
      break;
    }
  }
}

// Output panels [begin, end) of a kLinear call, every row.
template <typename T>
void run_panels(const Call& c, int64_t begin, int64_t end) {
  mini_vllm_gemm::linear_panels(c.ptr<const T>(kX), c.p[kXStride], c.p[kRows], c.p[kInFeatures],
                                c.ptr<const T>(kWeight), c.ptr<const float>(kBias), c.ptr<T>(kOut), c.p[kWidth],
                                begin, end);
}

// Rows [begin, end) of an op, or, for kLinear, output panels [begin, end) of every row.
void run_range(const int64_t* params, int64_t begin, int64_t end) {
  Call c{params};
  const bool fp32 = params[kDtype] == 0;
  if (params[kOp] == kLinear)
    fp32 ? run_panels<float>(c, begin, end) : run_panels<uint16_t>(c, begin, end);
  else
    fp32 ? run_rows<float>(c, begin, end) : run_rows<uint16_t>(c, begin, end);
}

// What threads split: rows, or a linear's output panels (each needs every row of x).
int64_t units(const int64_t* params) {
  return params[kOp] == kLinear ? params[kWidth] / mini_vllm_gemm::kPanelColumns : params[kRows];
}

}  // namespace

// The experts of an MoE layer in one call (after the row ops: it reuses silu_and_mul_row).
#include "cpu_moe.h"

extern "C" {

// The number of parameter slots the caller must fill (checked once at load).
int64_t MINI_VLLM_EXPORT(mini_vllm_layer_op_num_params)() { return kNumParams; }

// Checks the call, then, when `run` is nonzero, computes every row on the calling thread.
// Returns 0; 1 for a position outside the cos/sin table, 2 for a head over kMaxHeadSize (no
// row written). The Python side passes run = 0 before splitting the rows between threads.
int64_t MINI_VLLM_EXPORT(mini_vllm_layer_op)(const int64_t* params, int64_t run) {
  if (params[kOp] == kRope || params[kOp] == kQkNormRope) {
    if (params[kHeadSize] > kMaxHeadSize) return 2;
    const int64_t* pos = reinterpret_cast<const int64_t*>(params[kPositions]);
    for (int64_t t = 0; t < params[kRows]; ++t)
      if (pos[t] < 0 || pos[t] >= params[kTableRows]) return 1;
  }
  if (run) run_range(params, 0, units(params));
  return 0;
}

// Worker w of n: units [total * w / n, total * (w + 1) / n) (rows, or a linear's panels),
// called once per thread by numba's prange (cpu_layer_ops_native._fan_out) after
// mini_vllm_layer_op(params, 0) returned 0.
void MINI_VLLM_EXPORT(mini_vllm_layer_op_worker)(const int64_t* params, int64_t w, int64_t n) {
  const int64_t total = units(params);
  run_range(params, total * w / n, total * (w + 1) / n);
}

}  // extern "C"
