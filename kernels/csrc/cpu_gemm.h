// A linear layer, out = x @ W.T (+ bias), in bf16 on AVX512_BF16's VDPBF16PS (and in fp32
// on FMA), over a weight packed once into panels of 32 output columns. Included by
// cpu_layer_ops.cpp, whose parameter block and thread split it shares (op kLinear), after
// simd.h: on AVX2 the same loops read the bf16 weight as it is packed and widen it in
// registers (simd_avx2.h's dpbf16: a mask and a shift per 8 pairs, two FMAs), accumulating
// in fp32 in VDPBF16PS's order.
//
// Why on AVX2: a decode step's product (1 to 16 rows) is bound by reading the weight, and a
// bf16 weight is half the bytes of an fp32 one; oneDNN packs no bf16 weight without AVX-512
// (or AVX-NE-CONVERT), and F.linear's bf16 path there is far slower than this loop
// (kernels/NOTES.md).
//
// vLLM counterpart: csrc/cpu/sgl-kernels/gemm.cpp (`convert_weight_packed`,
// `weight_packed_linear`), the packed bf16 GEMM vLLM's CPU build takes for small weights;
// its larger ones go to oneDNN, as this project's did before this file.
//
// Why not oneDNN: on a decode step (1 to 16 rows) oneDNN's bf16 matmul read the weight at
// 9-14 GB/s on one Zen 4 core, where the core streams 20-23 GB/s; this kernel reads it at
// 18-24 GB/s for 1 row and keeps oneDNN's rate (210-220 GFLOP/s) on a 1,259-token prefill
// (benchmarks/bench_engine_layer_ops.py). And a single kernel for every row count keeps the
// engine batch invariant: choosing a kernel by row count would not.
//
// Layout of the packed bf16 weight (cpu_layer_ops_native.pack_linear_weight makes it with
// torch): panel p (output columns 32p..32p+31), pair kp (inputs 2kp, 2kp+1) holds 64 bf16,
// [column c][t] = W[32p + c][2kp + t], so that one 64-byte load is the pair for 16 columns,
// the operand VDPBF16PS multiplies by a broadcast pair of one row of x.
//
// Invariants (what the tests hold it to):
// * an output element is the same instruction sequence whatever rows share the call or
//   however panels are split between threads: zero, then VDPBF16PS over kp = 0..K/2-1 in
//   order (fp32: FMA over k = 0..K-1), then + bias in fp32, then (bf16) one rounding to
//   nearest even. So a row's bits do not depend on its batch;
// * N is a multiple of 32, and in bf16 K of 2 (the caller falls back to oneDNN otherwise);
//   x's rows may have any stride, out is [rows, N] contiguous.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace mini_vllm_gemm {

using namespace mini_vllm_simd;

constexpr int64_t kPanelColumns = 32;
// A tile is up to kTileRows rows x the 16-column halves of a panel one pass takes (both for
// tiles of up to kGemmBothHalvesRows rows, else one), one accumulator each. AVX-512 (32 zmm):
// 8 rows x both halves, 16 accumulators + 2 weight registers + 1 broadcast. AVX2 (16 ymm, a
// 16-lane value in two): 4 rows x one half, 8 ymm accumulators, the half's weights widened to
// 4 and the row's pair to 2, the panel walked once per half (every other 64-byte line); a
// decode's 1 or 2 rows take both halves in one pass, so its weight streams once, in order.
// Each output's instruction sequence is the same whatever the tile, so the choice changes no
// bit.
constexpr int kTileRows = kGemmTileRows;
template <int R> constexpr int kPassHalves = R <= kGemmBothHalvesRows ? 2 : 1;
// Rows of x taken per pass over the panels: enough to fill about a quarter of L2, so the
// rows stay there while every panel streams past them once.
constexpr int64_t kChunkBytes = 512 * 1024;

inline void store16(float* out, V16 v) { store(out, v); }
inline void store16(uint16_t* out, V16 v) { store_bf16(out, v); }  // one rounding, to nearest even

// After a tile's last step: + bias (fp32) and out, for R rows x H halves from half h0.
template <int R, int H, typename T>
inline void finish(V16 (*acc)[H], const float* bias, int h0, T* out, int64_t out_stride) {
  if (bias) {  // without one, no add: 0 + (-0) would turn a -0 sum into +0
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = add(acc[r][h], load(bias + 16 * (h0 + h)));
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) store16(out + r * out_stride + 16 * (h0 + h), acc[r][h]);
}

// R rows of x (R <= kTileRows) times one panel: 32 output columns of each row, kPassHalves<R>
// halves of 16 at a time. bf16: a step is a pair of inputs, [pair][column][2] in the panel
// (VDPBF16PS, or its AVX2 twin).
template <int R>
inline void tile(const uint16_t* x, int64_t x_stride, int64_t pairs, const uint16_t* panel,
                 const float* bias, uint16_t* out, int64_t out_stride) {
  constexpr int H = kPassHalves<R>;
  for (int h0 = 0; h0 < 2; h0 += H) {
    V16 acc[R][H];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = zero();
    for (int64_t kp = 0; kp < pairs; ++kp) {
      I16 w[H];
      for (int h = 0; h < H; ++h) w[h] = load_i(panel + kp * 64 + 32 * (h0 + h));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // inputs 2kp and 2kp+1 of row r (memcpy: x's rows need no alignment)
        std::memcpy(&pair, x + r * x_stride + 2 * kp, sizeof pair);
        const I16 b = set1_i(pair);
        for (int h = 0; h < H; ++h) acc[r][h] = dpbf16(acc[r][h], b, w[h]);
      }
    }
    finish<R, H>(acc, bias, h0, out, out_stride);
  }
}

// One row of x times two panels at once (bf16, both halves of each): the decode GEMV at
// batch 1. Why: one core reading one sequential stream from memory got 15-17 GB/s on the
// 2-core Zen 3 test machine, two streams 20-21 GB/s (the hardware prefetcher runs ahead
// on each stream, so twice the lines are in flight); the weight read is the whole cost of
// a batch-1 decode step. Each output keeps tile<1>'s instruction sequence (zero, dpbf16 over
// kp in order, + bias, one rounding), so a row's bits do not depend on which path ran it.
inline void tile_two_panels(const uint16_t* x, int64_t pairs, const uint16_t* panel_a, const uint16_t* panel_b,
                            const float* bias_a, const float* bias_b, uint16_t* out_a, uint16_t* out_b) {
  V16 acc_a[1][2] = {{zero(), zero()}}, acc_b[1][2] = {{zero(), zero()}};
  for (int64_t kp = 0; kp < pairs; ++kp) {
    int32_t pair;  // inputs 2kp and 2kp+1 (memcpy: x needs no alignment)
    std::memcpy(&pair, x + 2 * kp, sizeof pair);
    const I16 b = set1_i(pair);
    const I16 wa0 = load_i(panel_a + kp * 64), wa1 = load_i(panel_a + kp * 64 + 32);
    const I16 wb0 = load_i(panel_b + kp * 64), wb1 = load_i(panel_b + kp * 64 + 32);
    acc_a[0][0] = dpbf16(acc_a[0][0], b, wa0);
    acc_a[0][1] = dpbf16(acc_a[0][1], b, wa1);
    acc_b[0][0] = dpbf16(acc_b[0][0], b, wb0);
    acc_b[0][1] = dpbf16(acc_b[0][1], b, wb1);
  }
  finish<1, 2>(acc_a, bias_a, 0, out_a, 0);
  finish<1, 2>(acc_b, bias_b, 0, out_b, 0);
}

// fp32: a step is one input, [k][column] in the panel (FMA). oneDNN's products were the
// same bits for K = 256; this one is cheaper to call (16 rows of 256 x 512: 43 against
// 88 us on one Zen 4 core).
template <int R>
inline void tile(const float* x, int64_t x_stride, int64_t steps, const float* panel, const float* bias,
                 float* out, int64_t out_stride) {
  constexpr int H = kPassHalves<R>;
  for (int h0 = 0; h0 < 2; h0 += H) {
    V16 acc[R][H];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = zero();
    for (int64_t k = 0; k < steps; ++k) {
      V16 w[H];
      for (int h = 0; h < H; ++h) w[h] = load(panel + k * 32 + 16 * (h0 + h));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V16 b = set1(x[r * x_stride + k]);
        for (int h = 0; h < H; ++h) acc[r][h] = fmadd(b, w[h], acc[r][h]);
      }
    }
    finish<R, H>(acc, bias, h0, out, out_stride);
  }
}

// Inputs per step of the k loop: a bf16 pair, or one fp32.
template <typename T> constexpr int64_t kStep = sizeof(T) == 2 ? 2 : 1;

template <typename T>
inline void run_tile(int64_t n, const T* x, int64_t x_stride, int64_t steps, const T* panel, const float* bias,
                     T* out, int64_t out_stride) {
  switch (n) {  // n = 1..kTileRows rows
    case 1: tile<1>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 2: tile<2>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 3: tile<3>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 4: tile<4>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 5: tile<5>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 6: tile<6>(x, x_stride, steps, panel, bias, out, out_stride); break;
    case 7: tile<7>(x, x_stride, steps, panel, bias, out, out_stride); break;
    default: tile<kTileRows>(x, x_stride, steps, panel, bias, out, out_stride); break;
  }
}

// Panels [panel_begin, panel_end) of out = x @ W.T + bias for all `rows` rows, T = float or
// bf16 bits (uint16_t). bias is fp32 (the caller widens a bf16 one) or null.
template <typename T>
inline void linear_panels(const T* x, int64_t x_stride, int64_t rows, int64_t in_features, const T* packed,
                          const float* bias, T* out, int64_t out_features, int64_t panel_begin, int64_t panel_end) {
  const int64_t steps = in_features / kStep<T>;
  int64_t chunk = kChunkBytes / (int64_t(sizeof(T)) * in_features) / kTileRows * kTileRows;
  if (chunk < kTileRows) chunk = kTileRows;
  if constexpr (sizeof(T) == 2) {
    if (rows == 1) {  // a bf16 decode of one row: its panels as two streams
      const int64_t half = (panel_end - panel_begin) / 2;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t p = panel_begin + i, q = p + half;
        tile_two_panels(x, steps, packed + p * in_features * kPanelColumns, packed + q * in_features * kPanelColumns,
                        bias ? bias + p * kPanelColumns : nullptr, bias ? bias + q * kPanelColumns : nullptr,
                        out + p * kPanelColumns, out + q * kPanelColumns);
      }
      panel_begin += 2 * half;  // an odd panel left over takes the loop below
    }
  }
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t c1 = c0 + chunk < rows ? c0 + chunk : rows;
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      const T* panel = packed + p * in_features * kPanelColumns;
      const float* panel_bias = bias ? bias + p * kPanelColumns : nullptr;
      for (int64_t r = c0; r < c1; r += kTileRows) {
        const int64_t n = c1 - r < kTileRows ? c1 - r : kTileRows;
        run_tile<T>(n, x + r * x_stride, x_stride, steps, panel, panel_bias, out + r * out_features + p * kPanelColumns,
                    out_features);
      }
    }
  }
}

}  // namespace mini_vllm_gemm
