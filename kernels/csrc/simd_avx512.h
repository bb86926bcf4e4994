// AVX-512 pieces the two C++ libraries share (cpu_attn.cpp, cpu_layer_ops.cpp): exp on 16
// lanes and the widening of 16 bf16 values. Each library includes it in its own
// translation unit; kernels/cpu_native.py hashes this header into both builds' names, so an
// edit here rebuilds both.
#pragma once
#include <immintrin.h>

namespace mini_vllm_simd {

// exp(x) on 16 lanes, x clamped to [-87, 88]: the polynomial of the numba kernels' _exp
// (Cephes, relative error < 1e-7), 2**n * p(r) with n = round(x / ln 2), 2**n written into
// the exponent bits. The attention kernel takes scores minus the running max (x <= 0).
inline __m512 exp16(__m512 x) {
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
inline __m512 widen16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

}  // namespace mini_vllm_simd
