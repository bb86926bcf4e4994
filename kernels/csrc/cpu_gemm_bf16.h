// A bf16 linear layer, out = x @ W.T (+ bias), on AVX512_BF16's VDPBF16PS, over a weight
// packed once into panels of 32 output columns. Included by cpu_layer_ops.cpp, whose
// parameter block and thread split it shares (op kLinear).
//
// vLLM counterpart: csrc/cpu/sgl-kernels/gemm.cpp (`convert_weight_packed`,
// `weight_packed_linear`), the packed bf16 GEMM vLLM's CPU build takes for small weights;
// its larger ones go to oneDNN, as this project's did before this file.
//
// Why not oneDNN: on a decode step (1 to 16 rows) oneDNN's bf16 matmul read the weight at
// 7-12 GB/s on one Zen 4 core, where the core streams 20-22 GB/s; this kernel reads it at
// 20-30 GB/s for 1 row and keeps oneDNN's rate (210-220 GFLOP/s) on a 1,259-token prefill
// (benchmarks/bench_engine_layer_ops.py). And a single kernel for every row count keeps the
// engine batch invariant: choosing a kernel by row count would not.
//
// Layout of the packed weight (cpu_layer_ops_native.pack_linear_weight makes it with torch):
// panel p (output columns 32p..32p+31), pair kp (inputs 2kp, 2kp+1) holds 64 bf16,
// [column c][t] = W[32p + c][2kp + t], so that one 64-byte load is the pair for 16 columns,
// the operand VDPBF16PS multiplies by a broadcast pair of one row of x.
//
// Invariants (what the tests hold it to):
// * an output element is the same instruction sequence whatever rows share the call or
//   however panels are split between threads: zero, then VDPBF16PS over kp = 0..K/2-1 in
//   order, then + bias in fp32, then one rounding to bf16 (nearest even). So a row's bits do
//   not depend on its batch;
// * N is a multiple of 32 and K of 2 (the caller falls back to oneDNN otherwise); x's rows
//   may have any stride, out is [rows, N] contiguous.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace mini_vllm_gemm {

constexpr int64_t kPanelColumns = 32;
constexpr int kTileRows = 8;  // 16 accumulators + 2 weight registers + 1 broadcast of 32
// Rows of x taken per pass over the panels: enough to fill about a quarter of L2, so the
// rows stay there while every panel streams past them once.
constexpr int64_t kChunkBytes = 512 * 1024;

// R rows of x (R <= kTileRows) times one panel: 32 output columns of each row.
template <int R>
inline void tile(const uint16_t* x, int64_t x_stride, int64_t pairs, const uint16_t* panel,
                 const float* bias, uint16_t* out, int64_t out_stride) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_setzero_ps();
    hi[r] = _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + kp * 64);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + kp * 64 + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // inputs 2kp and 2kp+1 of row r (memcpy: x's rows need no alignment)
      std::memcpy(&pair, x + r * x_stride + 2 * kp, sizeof pair);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      lo[r] = _mm512_dpbf16_ps(lo[r], b, w_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], b, w_hi);
    }
  }
  if (bias) {  // without one, no add: 0 + (-0) would turn a -0 sum into +0
    const __m512 b_lo = _mm512_loadu_ps(bias), b_hi = _mm512_loadu_ps(bias + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_add_ps(lo[r], b_lo);
      hi[r] = _mm512_add_ps(hi[r], b_hi);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride), (__m256i)_mm512_cvtneps_pbh(lo[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + 16), (__m256i)_mm512_cvtneps_pbh(hi[r]));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, uint16_t*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                          tile<5>, tile<6>, tile<7>, tile<8>};

// Panels [panel_begin, panel_end) of out = x @ W.T + bias for all `rows` rows. bias is
// fp32 (the caller widens it once) or null.
inline void linear_panels(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t in_features,
                          const uint16_t* packed, const float* bias, uint16_t* out, int64_t out_features,
                          int64_t panel_begin, int64_t panel_end) {
  const int64_t pairs = in_features / 2;
  int64_t chunk = kChunkBytes / (2 * in_features) / kTileRows * kTileRows;
  if (chunk < kTileRows) chunk = kTileRows;
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t c1 = c0 + chunk < rows ? c0 + chunk : rows;
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      const uint16_t* panel = packed + p * pairs * 2 * kPanelColumns;
      const float* panel_bias = bias ? bias + p * kPanelColumns : nullptr;
      for (int64_t r = c0; r < c1; r += kTileRows) {
        const int64_t n = c1 - r < kTileRows ? c1 - r : kTileRows;
        kTiles[n](x + r * x_stride, x_stride, pairs, panel, panel_bias, out + r * out_features + p * kPanelColumns,
                  out_features);
      }
    }
  }
}

}  // namespace mini_vllm_gemm
