// The SIMD layer of the C++ kernels on AVX-512 F/BW/VL/DQ + AVX512_BF16: 16 fp32 lanes are one
// zmm register, a lane mask is a k register, a bf16 dot product is VDPBF16PS and a narrowing
// to bf16 is VCVTNEPS2BF16. simd_avx2.h has the same names for AVX2 + FMA; simd.h includes
// the one the compiler's -m flags select, so each kernel source is written once and compiled
// twice (kernels/cpu_native.py hashes every header into both builds' names).
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace mini_vllm_simd {

// Register budgets of the kernels' loops (32 zmm registers): query rows and keys per pass of
// the score loop, 16-lane accumulators per pass of P V, dims per pass of a lane tile, rows per
// tile of the linear and 16-column halves of a panel per pass. A row's arithmetic does not
// depend on any of them.
constexpr int kScoreRows = 4, kScoreKeys = 4, kPvVectors = 16, kTileDims = 16, kGemmTileRows = 8,
              kGemmBothHalvesRows = 8;

using V16 = __m512;    // 16 fp32 lanes
using I16 = __m512i;   // 16 int32 lanes (or 16 bf16 pairs)
using M16 = __mmask16; // a lane mask

inline V16 zero() { return _mm512_setzero_ps(); }
inline V16 set1(float x) { return _mm512_set1_ps(x); }
inline V16 load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline M16 first_n(int n) { return n >= 16 ? M16(0xffff) : M16((1u << (n < 0 ? 0 : n)) - 1); }
// The first n lanes (0 <= n <= 16); the others are 0 and their memory is not touched.
inline V16 load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(first_n(n), p); }
inline void store_n(float* p, V16 v, int n) { _mm512_mask_storeu_ps(p, first_n(n), v); }
inline float first(V16 v) { return _mm512_cvtss_f32(v); }

inline V16 add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V16 select(M16 m, V16 a, V16 b) { return _mm512_mask_mov_ps(b, m, a); }  // m ? a : b
inline float reduce_add(V16 v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(V16 v) { return _mm512_reduce_max_ps(v); }

inline I16 load_i(const void* p) { return _mm512_loadu_si512(p); }
inline I16 set1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline M16 cmpge_i(I16 a, int32_t b) { return _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(b)); }
inline M16 cmpneq(V16 a, float b) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_NEQ_OQ); }

// The sums of four 16-lane vectors, as [sum a, sum b, sum c, sum d].
inline __m128 reduce4(V16 a, V16 b, V16 c, V16 d) {
  __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
inline void store4_n(float* p, __m128 v, int n) { _mm_mask_storeu_ps(p, static_cast<__mmask8>((1u << n) - 1), v); }

// exp(x) on 16 lanes, x clamped to [-87, 88]: the polynomial of the numba kernels' _exp
// (Cephes, relative error < 1e-7), 2**n * p(r) with n = round(x / ln 2), 2**n written into
// the exponent bits. The attention kernel takes scores minus the running max (x <= 0).
inline V16 exp16(V16 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);    // ln 2 in two parts,
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);          // so r keeps its low bits
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 bf16 values (their bits) -> 16 fp32: bf16 is the top half of an fp32.
inline V16 widen16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline V16 widen16(const uint16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V16 widen16_n(const uint16_t* p, int n) {
  return widen16(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(first_n(n)), p));
}

// 16 fp16 bit patterns -> 16 fp32, exactly (VCVTPH2PS; the fp8 cache reads).
inline V16 half16(__m256i h) { return _mm512_cvtph_ps(h); }

// acc += a . b per lane over a bf16 pair (lane i: a[2i] b[2i] + a[2i+1] b[2i+1]): VDPBF16PS.
inline V16 dpbf16(V16 acc, I16 a, I16 b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// 16 fp32 -> 16 bf16 at p, rounded to nearest even (VCVTNEPS2BF16: an fp32 denormal becomes
// 0, so a result under 1.2e-38 in magnitude is 0); the layer ops' and the linear's narrowing.
inline __m256i to_bf16(V16 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline void store_bf16(uint16_t* p, V16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline void store_bf16_n(uint16_t* p, V16 v, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>(first_n(n)), to_bf16(v));
}
inline V16 narrow16(V16 v) { return widen16(to_bf16(v)); }  // rounded to bf16, back in fp32

// 16 fp32 -> 16 bf16 bits at p, as torch's .to(torch.bfloat16) rounds: nearest even, a
// denormal kept, a NaN a quiet NaN (rounding would carry its mantissa into the exponent).
// The attention kernel's output.
inline void store_bf16_like_torch(uint16_t* p, V16 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}

}  // namespace mini_vllm_simd
