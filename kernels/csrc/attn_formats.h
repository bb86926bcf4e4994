// How the attention kernel (cpu_attn.cpp) reads each KV-cache format and its query, and writes
// its output: one struct per pairing, the template argument of every loop there.
//
// vLLM counterpart: the dtype dispatch of csrc/cpu/cpu_attn_impl.hpp (its scalar_t / cache_t
// pairs) and the fp8 conversions of csrc/cpu/cpu_types_*.hpp; the fp8 formats are those of
// kernels/kv_cache_dtype.py.
//
// Each struct names the query / output element Q, the cache element C, and:
//   kDotWidth  elements of a row one dot step of the scores takes;
//   query / key  a dot step's operands (a key's loaded once per step for all the rows);
//   dot        acc += q . k over one step, per lane;
//   load16     16 cache elements of a V row (or a K row, in the lane tiles) as fp32;
//   store16    16 fp32 outputs as Q.
// The fp8 ones also take the per-tensor multiplier (`mul`, from k_scale or v_scale) with
// which a cache byte becomes fp32(byte's value) * scale, the value kv_cache_dtype.dequantize
// gives: the same fp32 product, bit for bit (see Fp8E4m3).
#pragma once
#include <immintrin.h>
#include <cstdint>

#include "simd.h"

namespace mini_vllm_attn {

using namespace mini_vllm_simd;

// bf16 cache and query: VDPBF16PS (32 pairs an instruction; bf16 products are exact in fp32),
// V widened by a shift.
struct Bf16 {
  using Q = uint16_t;
  using C = uint16_t;
  using Op = I16;
  static constexpr int kDotWidth = 32;
  static constexpr bool kFp8 = false;
  static Op query(const Q* q) { return load_i(q); }
  static Op key(const C* k, float) { return load_i(k); }
  static V16 dot(V16 acc, Op q, Op k) { return dpbf16(acc, q, k); }
  static V16 load16(const C* p, float) { return widen16(p); }
  static void store16(Q* p, V16 x) { store_bf16_like_torch(p, x); }
};

// fp32 cache and query: FMAs, 16 an instruction.
struct Fp32 {
  using Q = float;
  using C = float;
  using Op = V16;
  static constexpr int kDotWidth = 16;
  static constexpr bool kFp8 = false;
  static Op query(const Q* q) { return load(q); }
  static Op key(const C* k, float) { return load(k); }
  static V16 dot(V16 acc, Op q, Op k) { return fmadd(q, k, acc); }
  static V16 load16(const C* p, float) { return load(p); }
  static void store16(Q* p, V16 x) { store(p, x); }
};

// fp8 -> fp32 by bit arithmetic, 16 bytes at a time: each byte becomes the bits of an fp16
// (F16C's VCVTPH2PS, or AVX-512's, then widens them exactly, subnormals included), times the
// multiplier. Measured against a 256-entry table read with VGATHERDPS (the numba kernel's
// method) on a Zen 3 core: a 2-row dot product over fp8 keys ran 0.13 ns a byte this way,
// 0.50 ns with the gather (kernels/NOTES.md).
//
// E5M2 is the top byte of an fp16 (5 exponent bits, bias 15, with inf and NaN): the byte
// shifted up 8 is the fp16 of the same value; mul = scale.
struct Fp8E5m2 {
  static constexpr float kRebias = 1.0f;
  static __m256i half_bits(__m128i b) { return _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8); }
};

// E4M3 (OCP E4M3FN: 4 exponent bits, bias 7, no inf, S.1111.111 NaN): sign to bit 15 and the
// other 7 bits to bits 7..13 make an fp16 whose exponent field is the byte's (bit 14 clear), so
// its value is the byte's times 2^(7 - 15), exactly, subnormals too (an fp16 subnormal is
// 2^-14 * 0.m, the byte's 2^-6 * 0.m times 2^-8). mul = scale * 2^8, exact while finite
// (cpu_native.scales_ok refuses a scale for which it is not), so (value * 2^-8) * mul rounds
// as value * scale. The NaN code gets the fp16 exponent 31 (its mantissa stays non-zero).
struct Fp8E4m3 {
  static constexpr float kRebias = 256.0f;
  static __m256i half_bits(__m128i b) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                       _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
  }
};

template <class Fmt>
inline V16 fp8_load16(const uint8_t* p, float mul) {
  return ::mini_vllm_simd::mul(half16(Fmt::half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
                               set1(mul));
}

inline V16 load_q16(const float* q) { return load(q); }
inline V16 load_q16(const uint16_t* q) { return widen16(q); }  // a bf16 query
inline void store_q16(float* p, V16 x) { store(p, x); }
inline void store_q16(uint16_t* p, V16 x) { store_bf16_like_torch(p, x); }

// An fp8 cache (format Fmt) read by a query of fp32 or bf16 (Q: float or uint16_t, the
// model's dtype): keys dequantised to fp32 once per dot step for all the rows, fp32 FMAs.
template <class QT, class Fmt>
struct Fp8 {
  using Q = QT;
  using C = uint8_t;
  using Op = V16;
  static constexpr int kDotWidth = 16;
  static constexpr bool kFp8 = true;
  static constexpr float kRebias = Fmt::kRebias;
  static Op query(const Q* q) { return load_q16(q); }
  static Op key(const C* k, float mul) { return fp8_load16<Fmt>(k, mul); }
  static V16 dot(V16 acc, Op q, Op k) { return fmadd(q, k, acc); }
  static V16 load16(const C* p, float mul) { return fp8_load16<Fmt>(p, mul); }
  static void store16(Q* p, V16 x) { store_q16(p, x); }
};

}  // namespace mini_vllm_attn
