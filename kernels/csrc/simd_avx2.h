// The SIMD layer of the C++ kernels on AVX2 + FMA + F16C (Intel Haswell and later, AMD Zen 1-3:
// the laptops and desktops without AVX-512; F16C widens an fp8 cache's bytes, attn_formats.h): the names of simd_avx512.h, with 16 fp32 lanes held
// as two ymm registers, a lane mask as two all-ones/all-zeros vectors, and bf16 widened to
// fp32 in registers (a shift or a mask: bf16 is the top half of an fp32) where AVX512_BF16
// has one instruction.
//
// Each operation computes what its AVX-512 twin computes, lane for lane and in the same
// order: a bf16 dot step is VDPBF16PS's two multiply-adds, odd element first (products of
// two bf16 are exact in fp32, so an FMA rounds as its add does), and the horizontal sums take
// the same tree. So a kernel compiled against either header gives the same bits, except where
// VDPBF16PS or VCVTNEPS2BF16 flush an fp32 denormal to zero and this code keeps it.
//
// Register budgets (16 ymm registers, and every 16-lane value takes two): fewer rows, keys
// and dims per pass than on AVX-512; a row's arithmetic does not depend on them.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace mini_vllm_simd {

constexpr int kScoreRows = 2, kScoreKeys = 2, kPvVectors = 4, kTileDims = 4, kGemmTileRows = 4,
              kGemmBothHalvesRows = 2;

struct V16 { __m256 lo, hi; };
struct I16 { __m256i lo, hi; };
struct M16 { __m256 lo, hi; };  // a lane is all ones (set) or all zeros

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
// Lanes below n as an integer mask per half (VMASKMOVPS reads the sign bit of each lane).
inline __m256i below(int n, int base) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline M16 first_n(int n) { return {_mm256_castsi256_ps(below(n, 0)), _mm256_castsi256_ps(below(n, 8))}; }
// The first n lanes (0 <= n <= 16); the others are 0 and their memory is not touched.
inline V16 load_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, below(n, 0)), _mm256_maskload_ps(p + 8, below(n, 8))};
}
inline void store_n(float* p, V16 v, int n) {
  _mm256_maskstore_ps(p, below(n, 0), v.lo);
  _mm256_maskstore_ps(p + 8, below(n, 8), v.hi);
}
inline float first(V16 v) { return _mm256_cvtss_f32(v.lo); }

inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 select(M16 m, V16 a, V16 b) {  // m ? a : b
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
// GCC's _mm512_reduce_add_ps / _max_ps tree: the halves, then the quarters, then lanes
// (0 + 2, 1 + 3), then those two.
inline __m128 fold8(__m256 v, bool is_max) {
  __m128 a = is_max ? _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v))
                    : _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  __m128 b = _mm_shuffle_ps(a, a, _MM_SHUFFLE(1, 0, 3, 2));
  return is_max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}
inline float reduce_add(V16 v) {
  __m128 x = fold8(_mm256_add_ps(v.hi, v.lo), false);
  return _mm_cvtss_f32(x) + _mm_cvtss_f32(_mm_shuffle_ps(x, x, 1));
}
inline float reduce_max(V16 v) {
  __m128 x = fold8(_mm256_max_ps(v.hi, v.lo), true);
  float a = _mm_cvtss_f32(x), b = _mm_cvtss_f32(_mm_shuffle_ps(x, x, 1));
  return a > b ? a : b;
}

inline I16 load_i(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline I16 set1_i(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline M16 cmpge_i(I16 a, int32_t b) {  // a >= b, as not (b > a)
  const __m256i bb = _mm256_set1_epi32(b), ones = _mm256_set1_epi32(-1);
  return {_mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(bb, a.lo), ones)),
          _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(bb, a.hi), ones))};
}
inline M16 cmpneq(V16 a, float b) {
  const __m256 bb = _mm256_set1_ps(b);
  return {_mm256_cmp_ps(a.lo, bb, _CMP_NEQ_OQ), _mm256_cmp_ps(a.hi, bb, _CMP_NEQ_OQ)};
}

// The sums of four 16-lane vectors, as [sum a, sum b, sum c, sum d] (simd_avx512.h's tree).
inline __m128 reduce4(V16 a, V16 b, V16 c, V16 d) {
  __m256 a8 = _mm256_add_ps(a.lo, a.hi), b8 = _mm256_add_ps(b.lo, b.hi);
  __m256 c8 = _mm256_add_ps(c.lo, c.hi), d8 = _mm256_add_ps(d.lo, d.hi);
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
inline void store4_n(float* p, __m128 v, int n) {
  _mm_maskstore_ps(p, _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3)), v);
}

// exp(x) on 8 lanes, simd_avx512.h's exp16 operation for operation (see there).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.4426950408889634f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

// bf16 -> fp32 in registers: 8 bf16 zero-extended to 32 bits and shifted into the top half.
inline __m256 widen8(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }
inline V16 widen16(const uint16_t* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {widen8(_mm_loadu_si128(q)), widen8(_mm_loadu_si128(q + 1))};
}
inline V16 widen16_n(const uint16_t* p, int n) {  // no 16-bit masked load in AVX2: a copy of the n
  alignas(32) uint16_t tmp[16] = {};
  std::memcpy(tmp, p, sizeof(uint16_t) * (n < 0 ? 0 : (n > 16 ? 16 : n)));
  return widen16(tmp);
}

// 16 fp16 bit patterns -> 16 fp32, exactly (F16C's VCVTPH2PS; the fp8 cache reads).
inline V16 half16(__m256i h) { return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))}; }

// acc += a . b per lane over a bf16 pair, as VDPBF16PS: lane i holds elements 2i (low half)
// and 2i+1 (high half) of each operand; the odd product is added first.
inline __m256 odd8(__m256i pairs) { return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536))); }
inline __m256 even8(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline V16 dpbf16(V16 acc, I16 a, I16 b) {
  acc.lo = _mm256_fmadd_ps(odd8(a.lo), odd8(b.lo), acc.lo);
  acc.hi = _mm256_fmadd_ps(odd8(a.hi), odd8(b.hi), acc.hi);
  acc.lo = _mm256_fmadd_ps(even8(a.lo), even8(b.lo), acc.lo);
  acc.hi = _mm256_fmadd_ps(even8(a.hi), even8(b.hi), acc.hi);
  return acc;
}

// 8 fp32 -> 8 bf16 bits in the low 16 of each 32-bit lane: nearest even, a NaN a quiet NaN.
inline __m256i bf16_bits8(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  // |u| > inf's bits, compared signed: both sides are below 2^31
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
// 16 lanes of bf16 bits in order: pack the halves (per 128-bit lane) and put the quarters back.
inline __m256i to_bf16(V16 v) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi)), _MM_SHUFFLE(3, 1, 2, 0));
}
inline void store_bf16(uint16_t* p, V16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline void store_bf16_n(uint16_t* p, V16 v, int n) {
  alignas(32) uint16_t tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), to_bf16(v));
  std::memcpy(p, tmp, sizeof(uint16_t) * (n < 0 ? 0 : (n > 16 ? 16 : n)));
}
inline V16 narrow16(V16 v) {  // rounded to bf16, back in fp32: the low 16 bits cleared
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v.hi), 16))};
}
// The attention kernel's output: on AVX2 the same rounding as store_bf16 (AVX-512 has two).
inline void store_bf16_like_torch(uint16_t* p, V16 x) { store_bf16(p, x); }

}  // namespace mini_vllm_simd
