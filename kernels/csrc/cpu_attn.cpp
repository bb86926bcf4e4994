// Paged attention for fp32, bf16 and fp8 (e4m3, e5m2) KV caches on x86 CPUs with AVX-512 and
// AVX512_BF16, or AVX2, FMA and F16C: the engine's varlen batch (prefill tiles, chunks and
// decodes), read in place from the paged cache. Written once against simd.h and compiled once per instruction set
// (kernels/cpu_native.py picks the build the CPU can run).
//
// vLLM counterpart: csrc/cpu/cpu_attn.cpp and cpu_attn_impl.hpp (its CPU attention, also
// C++ with AVX-512 / AMX intrinsics). Built and loaded by kernels/cpu_native.py; the work
// items, their order and the threads come from kernels/cpu_paged_attention.py, whose numba
// kernel this replaces where the CPU has the instructions. How each cache format is read (an
// fp8 byte dequantised on load, by bit arithmetic): attn_formats.h.
//
// Why C++ here: the score of a query row and a key is a dot product of two bf16 vectors.
// VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 fp32 sums in one instruction;
// numba cannot emit it, so its loops widen every key element to fp32 first (a shift) and
// ran the decode at about half the read bandwidth and prefills at ~30 GFLOP/s. With the
// instructions chosen by hand, fp32 caches gain too (an FMA where bf16 has a VDPBF16PS).
// Without AVX512_BF16 (AVX2), the same loops widen bf16 in registers (a shift or a mask) and
// multiply-add in fp32, in VDPBF16PS's order: the same bits but for fp32 denormals.
//
// Per work item (one sequence's query tokens t0..t1-1 x KV heads h0..h1-1), FlashAttention's
// loop, one cache block per step, for each KV head and its query rows:
//     S = scale * Q K_blk^T      (bf16 products are exact in fp32; sums in fp32)
//     P = exp(S - running max)   keys in a row's future get P = 0
//     acc = acc * alpha + P V    (V widened to fp32, fp32 FMAs)
// Two paths: attend_item (decodes and small tiles: rows in registers, horizontal sums; a
// decode of several KV heads reads each block in memory order, decode_block_major) and
// attend_tile (tiles of 16+ rows: a row per SIMD lane, everything vertical).
// Invariants (as the numba kernel's):
// - no slot at or past the item's last visible key is read or prefetched: a block's keys
//   stop at kv_end = context_len + t1 <= seq_len;
// - a row's arithmetic depends only on its query, the keys, the block size and the path its
//   item takes, never on which thread or batch holds it: the thread count changes no bit;
// - key 0 is in the first block and visible to every row, so each running max is finite
//   from the first step on and a row that sees none of a later block is left unchanged.
// Arithmetic: fp32 scores, softmax, accumulators; a bf16 output is rounded to nearest even,
// as torch's .to(torch.bfloat16) rounds.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attn_formats.h"
#include "simd.h"

namespace {

using namespace mini_vllm_simd;  // V16 (16 fp32 lanes), its operations and the register budgets
using namespace mini_vllm_attn;  // the formats: Bf16, Fp32, Fp8<query, format>

// The parameter block the Python side fills (cpu_native.PARAMS names each slot).
enum Param {
  kQuery, kKeyCache, kValueCache, kOut, kTables, kTableStride, kCuSeqlens, kSeqLens,
  kItemSeq, kItemT0, kItemH0, kNumItems, kTileTokens, kDecodeHeads, kNumHeads, kNumKvHeads,
  kHeadDim, kBlockSize, kScaleBits, kScratch, kScratchFloats, kCounter, kDtype, kKScaleBits, kVScaleBits,
  kQueryDtype, kNumParams
};

struct Args {
  const void* query;            // [tokens, num_heads, head_dim], the model's dtype (query_dtype)
  const void* key_cache;        // [blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  void* out;                    // like query
  const int32_t* tables;        // [seqs, table_stride]
  int64_t table_stride;
  const int32_t* cu_seqlens;    // [seqs + 1]
  const int32_t* seq_lens;      // [seqs]
  const int64_t* item_seq;
  const int64_t* item_t0;
  const int64_t* item_h0;
  int64_t num_items, tile_tokens, decode_heads, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  float* scratch;
  int64_t scratch_floats;       // per thread
  int64_t* counter;             // the next item to hand out
  int64_t dtype;                // the caches': a Dtype
  float k_scale, v_scale;       // an fp8 cache's per-tensor scales (1 for the others)
  int64_t query_dtype;          // the query's and the output's: kFp32 or kBf16 (the cache's unless fp8)
};

enum Dtype { kFp32 = 0, kBf16 = 1, kFp8E4m3 = 2, kFp8E5m2 = 3 };

float float_bits(int64_t p) {
  uint32_t bits = static_cast<uint32_t>(p);
  float x;
  __builtin_memcpy(&x, &bits, 4);
  return x;
}

Args unpack(const int64_t* p) {
  Args a;
  a.query = reinterpret_cast<const void*>(p[kQuery]);
  a.key_cache = reinterpret_cast<const void*>(p[kKeyCache]);
  a.value_cache = reinterpret_cast<const void*>(p[kValueCache]);
  a.out = reinterpret_cast<void*>(p[kOut]);
  a.tables = reinterpret_cast<const int32_t*>(p[kTables]);
  a.table_stride = p[kTableStride];
  a.cu_seqlens = reinterpret_cast<const int32_t*>(p[kCuSeqlens]);
  a.seq_lens = reinterpret_cast<const int32_t*>(p[kSeqLens]);
  a.item_seq = reinterpret_cast<const int64_t*>(p[kItemSeq]);
  a.item_t0 = reinterpret_cast<const int64_t*>(p[kItemT0]);
  a.item_h0 = reinterpret_cast<const int64_t*>(p[kItemH0]);
  a.num_items = p[kNumItems];
  a.tile_tokens = p[kTileTokens];
  a.decode_heads = p[kDecodeHeads];
  a.num_heads = p[kNumHeads];
  a.num_kv_heads = p[kNumKvHeads];
  a.head_dim = p[kHeadDim];
  a.block_size = p[kBlockSize];
  a.scale = float_bits(p[kScaleBits]);
  a.scratch = reinterpret_cast<float*>(p[kScratch]);
  a.scratch_floats = p[kScratchFloats];
  a.counter = reinterpret_cast<int64_t*>(p[kCounter]);
  a.dtype = p[kDtype];
  a.k_scale = float_bits(p[kKScaleBits]);
  a.v_scale = float_bits(p[kVScaleBits]);
  a.query_dtype = p[kQueryDtype];
  return a;
}

inline void prefetch_rows(const void* first, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(first);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// S[r, j] = scale * q_r . k_j for NR <= kScoreRows query rows (row r's query at q[r], its
// scores at s + r * s_stride) and keys 0..n-1 of one block and KV head (key j at k + j *
// k_stride; kmul: an fp8 cache's multiplier, attn_formats.h). kScoreKeys keys at a time (four
// on AVX-512, two on AVX2, whose 16 registers hold fewer accumulators; the last group repeats
// its last key), each chunk of a key loaded (and dequantised) once for the NR rows, then one
// horizontal sum per row and key (the same tree for any grouping). The rows' loop is inside
// the chunks' so that a key is read once per item, not once per row: a KV head's rows lie
// one cache slot apart (4 KiB for fp32 at head_dim 128, all in one L1 set), and re-reading
// them per row missed L1 (16 fp32 Qwen3 decodes: 7.4 ms, against numba's 6.6).
template <class E, int NR>
void scores_block(const typename E::Q* const* q, const typename E::C* k, int64_t k_stride, int n,
                  int64_t head_dim, float scale, float kmul, float* s, int64_t s_stride) {
  using C = typename E::C;
  constexpr int W = E::kDotWidth;
  const int chunks = static_cast<int>(head_dim / W);
  constexpr int NK = kScoreKeys;
  for (int j = 0; j < n; j += NK) {
    const C* kj[NK];
    for (int c = 0; c < NK; ++c) kj[c] = k + (j + c < n ? j + c : n - 1) * k_stride;
    V16 a[NR][NK];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NK; ++c) a[r][c] = zero();
    for (int c = 0; c < chunks; ++c) {
      typename E::Op kc[NK];
      for (int key = 0; key < NK; ++key) kc[key] = E::key(kj[key] + W * c, kmul);
      for (int r = 0; r < NR; ++r) {
        const typename E::Op qc = E::query(q[r] + W * c);
        for (int key = 0; key < NK; ++key) a[r][key] = E::dot(a[r][key], qc, kc[key]);
      }
    }
    for (int r = 0; r < NR; ++r)  // (with NK < 4 reduce4's other lanes repeat keys, never stored)
      store4_n(s + r * s_stride + j,
               _mm_mul_ps(reduce4(a[r][0], a[r][1 % NK], a[r][2 % NK], a[r][3 % NK]), _mm_set1_ps(scale)),
               n - j < NK ? n - j : NK);
  }
}

template <class E>
void scores(const typename E::Q* const* q, int rows, const typename E::C* k, int64_t k_stride, int n,
            int64_t head_dim, float scale, float kmul, float* s, int64_t s_stride) {
  for (int r = 0; r < rows; r += kScoreRows) {
    const typename E::Q* const* qr = q + r;
    float* sr = s + r * s_stride;
    switch (rows - r < kScoreRows ? rows - r : kScoreRows) {
      case 4: scores_block<E, 4>(qr, k, k_stride, n, head_dim, scale, kmul, sr, s_stride); break;
      case 3: scores_block<E, 3>(qr, k, k_stride, n, head_dim, scale, kmul, sr, s_stride); break;
      case 2: scores_block<E, 2>(qr, k, k_stride, n, head_dim, scale, kmul, sr, s_stride); break;
      default: scores_block<E, 1>(qr, k, k_stride, n, head_dim, scale, kmul, sr, s_stride); break;
    }
  }
}

// One online-softmax step of one row over its first `seen` keys of a block of n: s becomes
// P (0 past `seen`), the running max m and sum l are updated; returns alpha, by which what
// earlier blocks accumulated is rescaled.
float softmax_step(float* s, int seen, int n, float* m, float* l) {
  V16 mx = set1(*m);
  for (int j = 0; j < seen; j += 16) {
    const int left = seen - j < 16 ? seen - j : 16;
    mx = select(first_n(left), max(mx, load_n(s + j, left)), mx);
  }
  float m_new = reduce_max(mx);
  float alpha = first(exp16(set1(*m - m_new)));  // *m = -inf: exp(-87), times l = 0
  V16 sum = zero(), mv = set1(m_new);
  for (int j = 0; j < n; j += 16) {
    int left = n - j < 16 ? n - j : 16;
    int vis = seen - j < 0 ? 0 : (seen - j > 16 ? 16 : seen - j);
    V16 p = select(first_n(vis), exp16(sub(load_n(s + j, vis), mv)), zero());
    sum = add(sum, p);
    store_n(s + j, p, left);
  }
  *l = *l * alpha + reduce_add(sum);
  *m = m_new;
  return alpha;
}

constexpr int kPvRows = 4;
constexpr int kLaneRows = 16;  // items with at least this many query rows take attend_tile

// acc[r] = acc[r] * alpha[r] + sum_j p[r, j] v_j for NR <= 4 rows (row r of acc at acc + r * D,
// of p at p + r * p_stride), keys j < n (key j at v + j * v_stride). Register-blocked: NR rows
// x 16 * ND dims of acc stay in NR * ND <= kPvVectors 16-lane values (16 zmm registers on
// AVX-512; 4 values, 8 ymm, on AVX2) while the keys stream past, each V
// row widened once per pass for all the rows (acc read and written once per block, not once
// per key). Fewer rows take wider passes: a decode's 2 rows cover 128 dims in one pass, so a
// V row is read once (its head's rows lie a cache slot apart, in one L1 set).
template <class E, int NR, int ND = (kPvVectors / NR > 0 ? kPvVectors / NR : 1)>
void pv_block(float* acc, const float* alpha, const float* p, int64_t p_stride, const typename E::C* v,
              int64_t v_stride, float vmul, int n, int64_t head_dim) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * ND) {
    const int nd = head_dim - d0 >= 16 * ND ? ND : static_cast<int>((head_dim - d0) / 16);
    V16 a[NR][ND];
    for (int r = 0; r < NR; ++r) {
      V16 al = set1(alpha[r]);
      for (int c = 0; c < ND; ++c)
        a[r][c] = c < nd ? mul(load(acc + r * head_dim + d0 + 16 * c), al) : al;
    }
    for (int j = 0; j < n; ++j) {
      const typename E::C* vj = v + j * v_stride + d0;
      V16 vv[ND];
      for (int c = 0; c < ND; ++c) vv[c] = c < nd ? E::load16(vj + 16 * c, vmul) : zero();
      for (int r = 0; r < NR; ++r) {
        V16 pr = set1(p[r * p_stride + j]);
        for (int c = 0; c < ND; ++c)
          if (c < nd) a[r][c] = fmadd(pr, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < nd; ++c) store(acc + r * head_dim + d0 + 16 * c, a[r][c]);
  }
}

template <class E>
void pv_rows(int nr, float* acc, const float* alpha, const float* p, int64_t p_stride, const typename E::C* v,
             int64_t v_stride, float vmul, int n, int64_t head_dim) {
  switch (nr) {
    case 4: pv_block<E, 4>(acc, alpha, p, p_stride, v, v_stride, vmul, n, head_dim); break;
    case 3: pv_block<E, 3>(acc, alpha, p, p_stride, v, v_stride, vmul, n, head_dim); break;
    case 2: pv_block<E, 2>(acc, alpha, p, p_stride, v, v_stride, vmul, n, head_dim); break;
    default: pv_block<E, 1>(acc, alpha, p, p_stride, v, v_stride, vmul, n, head_dim); break;
  }
}

// What both paths derive from one sequence of the batch: its typed tensors, its geometry,
// and where its rows, blocks and keys are.
template <class E>
struct Seq {
  using Q = typename E::Q;
  using C = typename E::C;
  const Q* query;
  const C* key_cache;
  const C* value_cache;
  Q* out;
  float kmul, vmul;        // what a K / V element is multiplied by when loaded (fp8 only, attn_formats.h)
  int64_t D, bs, H, KVH, group;
  int64_t q_start, q_len;
  int64_t context_len;     // query t sits at position context_len + t
  const int32_t* table;    // the sequence's block table
  int64_t row_elems;       // one slot of the cache: all KV heads

  Seq(const Args& a, int64_t i)
      : query(static_cast<const Q*>(a.query)), key_cache(static_cast<const C*>(a.key_cache)),
        value_cache(static_cast<const C*>(a.value_cache)), out(static_cast<Q*>(a.out)),
        kmul(multiplier(a.k_scale)), vmul(multiplier(a.v_scale)), D(a.head_dim),
        bs(a.block_size), H(a.num_heads), KVH(a.num_kv_heads), group(a.num_heads / a.num_kv_heads),
        q_start(a.cu_seqlens[i]), q_len(a.cu_seqlens[i + 1] - a.cu_seqlens[i]),
        context_len(a.seq_lens[i] - (a.cu_seqlens[i + 1] - a.cu_seqlens[i])), table(a.tables + i * a.table_stride),
        row_elems(a.num_kv_heads * a.head_dim) {}

  static float multiplier(float scale) {
    if constexpr (E::kFp8) return scale * E::kRebias;
    return 1.0f;
  }

  // Row r of a tile from token t0 whose rows belong to KV head h: token t0 + r / group, query
  // head h * group + r % group; its offset in query and out.
  int64_t row(int64_t t0, int r, int64_t h) const { return ((q_start + t0 + r / group) * H + h * group + r % group) * D; }

  // The keys of the block that starts at key `start` an item reads: never one at or past kv_end.
  int block_keys(int64_t start, int64_t kv_end) const { return static_cast<int>(kv_end - start < bs ? kv_end - start : bs); }

  const C* keys(int64_t phys, int64_t h) const { return key_cache + (phys * bs * KVH + h) * D; }
  const C* values(int64_t phys, int64_t h) const { return value_cache + (phys * bs * KVH + h) * D; }

  // Prefetch KV head h's first n rows of K and V in physical block phys.
  void prefetch_head(int64_t phys, int64_t n, int64_t h) const {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = ((phys * bs + j) * KVH + h) * D;
      prefetch_rows(key_cache + at, D * static_cast<int64_t>(sizeof(C)));
      prefetch_rows(value_cache + at, D * static_cast<int64_t>(sizeof(C)));
    }
  }
};

// The query rows of a tile, transposed so that 16 rows sit in the 16 lanes of a register:
// fp32 as Qt[d][row]; bf16 as pairs of dims, Qt[d / 2][row][2], the layout VDPBF16PS (dpbf16) reads.
inline void transpose_q(const float* const* q, int rows, int rows_p, int64_t D, float* qt) {
  for (int r = 0; r < rows_p; ++r)  // row by row: each row read once, contiguously
    for (int64_t d = 0; d < D; ++d) qt[d * rows_p + r] = r < rows ? q[r][d] : 0.0f;
}

inline void transpose_q(const uint16_t* const* q, int rows, int rows_p, int64_t D, float* qt) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(qt);  // one (q[d], q[d + 1]) pair per 32 bits
  for (int r = 0; r < rows_p; ++r)  // row by row: each row read once, contiguously
    for (int64_t p = 0; p < D / 2; ++p) {
      uint32_t pair = 0;
      if (r < rows) __builtin_memcpy(&pair, q[r] + 2 * p, 4);
      pairs[p * rows_p + r] = pair;
    }
}

// fp32 lanes from a bf16 query, for an fp8 cache's tiles (whose keys are dequantised to fp32).
inline void transpose_q_fp32(const float* const* q, int rows, int rows_p, int64_t D, float* qt) {
  transpose_q(q, rows, rows_p, D, qt);
}

inline void transpose_q_fp32(const uint16_t* const* q, int rows, int rows_p, int64_t D, float* qt) {
  for (int r = 0; r < rows_p; ++r)
    for (int64_t d = 0; d < D; ++d) {
      uint32_t bits = r < rows ? static_cast<uint32_t>(q[r][d]) << 16 : 0u;  // bf16: an fp32's top half
      __builtin_memcpy(qt + d * rows_p + r, &bits, 4);
    }
}

// Scores of 16 rows (lanes) and four keys: S[j][lanes] = q_lanes . k_j.
inline void scores16x4(const float* qt, int rows_p, const float* const* k, int64_t D, V16* out) {
  V16 a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; ++d) {
    V16 qd = load(qt + d * rows_p);
    a0 = fmadd(qd, set1(k[0][d]), a0);
    a1 = fmadd(qd, set1(k[1][d]), a1);
    a2 = fmadd(qd, set1(k[2][d]), a2);
    a3 = fmadd(qd, set1(k[3][d]), a3);
  }
  out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

inline void scores16x4(const float* qt, int rows_p, const uint16_t* const* k, int64_t D, V16* out) {
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(qt);
  V16 a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 2) {
    I16 qd = load_i(pairs + d / 2 * rows_p * 2);
    int32_t k0, k1, k2, k3;  // the pair (k[d], k[d + 1]) of each key, as one 32-bit lane to broadcast
    __builtin_memcpy(&k0, k[0] + d, 4);
    __builtin_memcpy(&k1, k[1] + d, 4);
    __builtin_memcpy(&k2, k[2] + d, 4);
    __builtin_memcpy(&k3, k[3] + d, 4);
    a0 = dpbf16(a0, qd, set1_i(k0));
    a1 = dpbf16(a1, qd, set1_i(k1));
    a2 = dpbf16(a2, qd, set1_i(k2));
    a3 = dpbf16(a3, qd, set1_i(k3));
  }
  out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

// A prefill or chunk tile (query tokens t0..t1-1 of sequence i x the group of KV head h) with
// 16 query rows per register: scores, softmax and the accumulator are all vertical (one row a
// lane), so there is no horizontal sum, and each K or V element loaded serves 16 rows at once
// through a broadcast. Same arithmetic per row as attend_item (fp32 sums of exact products;
// only their order differs), same block steps, same invariants. An fp8 block's K is
// dequantised to fp32 once, as its V is, and scored as an fp32 cache's (the query in fp32).
template <class E>
void attend_tile(const Args& a, int64_t i, int64_t t0, int64_t t1, int64_t h, float* scratch) {
  using Q = typename E::Q;
  using C = typename E::C;
  using K = std::conditional_t<E::kFp8, float, C>;  // the keys the scores read
  const Seq<E> sq(a, i);
  const int64_t D = sq.D, bs = sq.bs, group = sq.group, context_len = sq.context_len;
  const int64_t kv_end = context_len + t1;
  const int rows = static_cast<int>((t1 - t0) * group);
  const int rows_p = (rows + 15) / 16 * 16;  // padded to whole registers; padding lanes hold q = 0
  // Scratch (cpu_native.scratch_floats): row pointers, Qt [D][rows_p], acc^T [D][rows_p],
  // m and l [rows_p], P^T [bs][16], one block of V widened to fp32 [bs][D], and of K [bs][D].
  const Q** qrow = reinterpret_cast<const Q**>(scratch);
  float* qt = scratch + 2 * rows_p;
  float* acc = qt + D * rows_p;
  float* m = acc + D * rows_p;
  float* l = m + rows_p;
  float* pt = l + rows_p;
  float* vf = pt + bs * 16;
  float* kf = vf + bs * D;
  for (int r = 0; r < rows; ++r) qrow[r] = sq.query + sq.row(t0, r, h);
  if constexpr (E::kFp8)
    transpose_q_fp32(qrow, rows, rows_p, D, qt);
  else
    transpose_q(qrow, rows, rows_p, D, qt);
  for (int64_t x = 0; x < D * rows_p; ++x) acc[x] = 0.0f;
  for (int r = 0; r < rows_p; ++r) { m[r] = -INFINITY; l[r] = 0.0f; }
  const int64_t num_blocks = (kv_end + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs;
    const int n = sq.block_keys(start, kv_end);
    const int64_t phys = sq.table[b];
    if (b + 1 < num_blocks) sq.prefetch_head(sq.table[b + 1], sq.block_keys(start + bs, kv_end), h);
    const C* k = sq.keys(phys, h);
    const C* v = sq.values(phys, h);
    for (int j = 0; j < n; ++j)  // V widened once per block for all rows (fp32: a copy), and an fp8 K
      for (int64_t d = 0; d < D; d += 16) {
        store(vf + j * D + d, E::load16(v + j * sq.row_elems + d, sq.vmul));
        if constexpr (E::kFp8) store(kf + j * D + d, E::load16(k + j * sq.row_elems + d, sq.kmul));
      }
    const K* kr;
    int64_t k_stride;
    if constexpr (E::kFp8) {
      kr = kf;
      k_stride = D;
    } else {
      kr = k;
      k_stride = sq.row_elems;
    }
    for (int g = 0; g < rows_p; g += 16) {
      // Lane r of this group is row g + r, at position context_len + t0 + (g + r) / group (the
      // padding lanes take the last row's); it sees key start + j iff start + j <= position.
      const int last = g + 15 < rows ? g + 15 : rows - 1;
      const int64_t last_pos = context_len + t0 + last / group;
      if (last_pos < start) continue;  // no row of the group sees this block
      alignas(64) int32_t lane_pos[16];  // relative to the block's first key
      for (int c = 0; c < 16; ++c)
        lane_pos[c] = static_cast<int32_t>(context_len + t0 + (g + c < rows ? g + c : rows - 1) / group - start);
      const I16 pos = load_i(lane_pos);
      V16 m_old = load(m + g), m_new = m_old;
      for (int j = 0; j < n; j += 4) {
        const K* kj[4];
        for (int c = 0; c < 4; ++c) kj[c] = kr + (j + c < n ? j + c : n - 1) * k_stride;
        V16 sc[4];
        scores16x4(qt + g, rows_p, kj, D, sc);
        for (int c = 0; c < 4 && j + c < n; ++c) {
          M16 seen = cmpge_i(pos, j + c);
          V16 sj = select(seen, mul(sc[c], set1(a.scale)), set1(-INFINITY));
          store(pt + (j + c) * 16, sj);
          m_new = max(m_new, sj);
        }
      }
      // Every row saw key 0 in block 0, so m_new is finite from there on; a row that sees no
      // key of this block keeps its max (alpha = 1) and adds P = 0.
      const V16 alpha = exp16(sub(m_old, m_new));
      V16 sum = zero();
      for (int j = 0; j < n; ++j) {
        V16 sj = load(pt + j * 16);
        V16 p = select(cmpneq(sj, -INFINITY), exp16(sub(sj, m_new)), zero());
        sum = add(sum, p);
        store(pt + j * 16, p);
      }
      store(l + g, fmadd(load(l + g), alpha, sum));
      store(m + g, m_new);
      // acc^T[d][lanes] = acc^T * alpha + sum_j P^T[j] v_j[d], kTileDims dims x 16 rows in
      // registers (16 dims on AVX-512, 4 on AVX2).
      for (int64_t d0 = 0; d0 < D; d0 += kTileDims) {
        V16 ac[kTileDims];
        for (int c = 0; c < kTileDims; ++c) ac[c] = mul(load(acc + (d0 + c) * rows_p + g), alpha);
        for (int j = 0; j < n; ++j) {
          V16 pj = load(pt + j * 16);
          const float* vj = vf + j * D + d0;
          for (int c = 0; c < kTileDims; ++c) ac[c] = fmadd(pj, set1(vj[c]), ac[c]);
        }
        for (int c = 0; c < kTileDims; ++c) store(acc + (d0 + c) * rows_p + g, ac[c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];  // l >= 1: the row saw its own max
    float row[16];
    Q* o = sq.out + sq.row(t0, r, h);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int c = 0; c < 16; ++c) row[c] = acc[(d0 + c) * rows_p + r] * inv;
      E::store16(o + d0, load(row));
    }
  }
}

// A decode's P V over up to four slots of one block, for the query rows of one KV head:
// acc[r] += sum_j p[r, j] v_j, j < nj. The slots' V rows are loaded (and widened) once for
// all the rows, and acc is read and written once per four slots. The FMAs run in slot
// order, as pv_block's do, so a row gets the same bits from either path.
template <class E>
void pv_slots(float* acc, const float* p, int64_t p_stride, const typename E::C* v, int64_t v_stride, float vmul,
              int nj, int64_t D, int rows) {
  for (int64_t d = 0; d < D; d += 16) {
    V16 vv[4];
    for (int j = 0; j < 4; ++j) vv[j] = j < nj ? E::load16(v + j * v_stride + d, vmul) : zero();
    for (int r = 0; r < rows; ++r) {
      V16 x = load(acc + r * D + d);
      for (int j = 0; j < 4; ++j) x = fmadd(set1(j < nj ? p[r * p_stride + j] : 0.0f), vv[j], x);
      store(acc + r * D + d, x);
    }
  }
}

// Where a decode item starts reading: the run of its heads in each slot of its first block,
// and how many of that block's slots it may read (nullptr: nothing to prefetch).
template <class E>
struct FirstBlock {
  const typename E::C* keys = nullptr;
  const typename E::C* values = nullptr;
  int n = 0;
};

// One decode (a single query token) x KV heads h0..h1-1 (two or more), in the cache's memory
// order. A block holds its slots one after another, each slot all the KV heads:
// [slot][head][D], so a slot's heads h0..h1-1 are one contiguous run. The head-by-head loop
// of attend_item reads a head's rows of a block a whole slot apart; here both passes over a
// block (the scores, then P V) take four slots at a time across the item's heads, so each
// pass reads the block front to back, and the same slots of the next block are prefetched
// head by head between the heads' work (as the numba kernel does). On a Zen 4 core (AMD
// EPYC, family 25, 1 thread; 28 layers' caches, so each call starts cold), 16 Qwen3 decodes
// of 80-190 tokens in bf16 with block 32 took 1.47 ms head by head and 0.80 ms this way: a
// software prefetch holds one of the core's few L1 miss buffers until its line arrives, and
// reads a slot apart give the L2's stream prefetcher no run to follow (kernels/NOTES.md).
// The last block prefetches `after`: the first block of the decode this thread will most
// likely take next, so that no item starts on a block nobody asked for (short sequences are
// a few blocks each: 16 decodes of 80-190 tokens ran 10-13% faster with it, 128 of 16-768 5-9%).
// Each row's arithmetic is attend_item's, operation for operation: the same bits.
template <class E>
void decode_block_major(const Args& a, const Seq<E>& sq, int64_t kv_end, int64_t num_blocks, int64_t h0, int64_t h1,
                        const typename E::Q** qrow, float* acc, float* s, float* m, float* l, float* alpha,
                        const FirstBlock<E>& after) {
  using C = typename E::C;
  const int64_t D = sq.D, bs = sq.bs, heads = h1 - h0, row = sq.row_elems;
  const int group = static_cast<int>(sq.group);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs;
    const int n = sq.block_keys(start, kv_end);
    const C* kb = sq.keys(sq.table[b], h0);  // slot 0, head h0: a slot's heads h0..h1-1 are contiguous
    const C* vb = sq.values(sq.table[b], h0);
    // The next block's readable slots (none at or past its item's kv_end), four at a time.
    const bool last = b + 1 == num_blocks;
    const C* kn = last ? after.keys : sq.keys(sq.table[b + 1], h0);
    const C* vn = last ? after.values : sq.values(sq.table[b + 1], h0);
    const int nn = last ? after.n : sq.block_keys(start + bs, kv_end);
    for (int j = 0; j < n; j += 4) {
      const int nj = n - j < 4 ? n - j : 4;
      const int pj = j < nn ? (nn - j < 4 ? nn - j : 4) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        for (int c = 0; c < pj; ++c) prefetch_rows(kn + (j + c) * row + h * D, D * static_cast<int64_t>(sizeof(C)));
        scores<E>(qrow + h * group, group, kb + j * row + h * D, row, nj, D, a.scale, sq.kmul, s + h * group * bs + j,
                  bs);
      }
    }
    for (int x = 0; x < heads * group; ++x) {  // a decode sees every key up to kv_end: seen = n
      alpha[x] = softmax_step(s + x * bs, n, n, m + x, l + x);
      const V16 al = set1(alpha[x]);
      for (int64_t d = 0; d < D; d += 16) store(acc + x * D + d, mul(load(acc + x * D + d), al));
    }
    for (int j = 0; j < n; j += 4) {
      const int nj = n - j < 4 ? n - j : 4;
      const int pj = j < nn ? (nn - j < 4 ? nn - j : 4) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        for (int c = 0; c < pj; ++c) prefetch_rows(vn + (j + c) * row + h * D, D * static_cast<int64_t>(sizeof(C)));
        pv_slots<E>(acc + h * group * D, s + h * group * bs + j, bs, vb + j * row + h * D, row, sq.vmul, nj, D, group);
      }
    }
  }
}

// Whether sequence i's item is a decode of decode_heads KV heads (the plan gives a single
// query token one item of several heads when decode_heads > 0).
inline bool decode_item(const Args& a, int64_t i) {
  return a.cu_seqlens[i + 1] - a.cu_seqlens[i] == 1 && a.decode_heads > 0;
}

// Where item `it` starts reading, if it is a decode: what decode_block_major prefetches
// last. A decode sees every key below its sequence's length.
template <class E>
FirstBlock<E> first_block(const Args& a, int64_t it) {
  FirstBlock<E> f;
  if (it < 0 || it >= a.num_items) return f;
  const int64_t j = a.item_seq[it];
  if (!decode_item(a, j)) return f;
  const Seq<E> sq(a, j);
  f.keys = sq.keys(sq.table[0], a.item_h0[it]);
  f.values = sq.values(sq.table[0], a.item_h0[it]);
  f.n = sq.block_keys(0, a.seq_lens[j]);
  return f;
}

// One work item: query tokens t0..t1-1 of sequence i x the query heads of KV heads h0..h1-1;
// `next` is the item the worker expects to take after it (-1: none known).
template <class E>
void attend_item(const Args& a, int64_t i, int64_t t0, int64_t t1, int64_t h0, int64_t h1, float* scratch,
                 int64_t next) {
  using Q = typename E::Q;
  using C = typename E::C;
  const Seq<E> sq(a, i);
  const int64_t D = sq.D, bs = sq.bs, group = sq.group, context_len = sq.context_len;
  const int64_t kv_end = context_len + t1;  // the item's last query sees keys < kv_end
  const int rows_per_head = static_cast<int>((t1 - t0) * group);
  const int rows = rows_per_head * static_cast<int>(h1 - h0);
  // Scratch (cpu_native.scratch_floats): the rows' query pointers first (8-byte aligned),
  // then acc [rows, D], S [rows, bs], running max, running sum and alpha [rows].
  const Q** qrow = reinterpret_cast<const Q**>(scratch);
  float* acc = scratch + 2 * rows;
  float* s = acc + rows * D;
  float* m = s + rows * bs;
  float* l = m + rows;
  float* alpha = l + rows;
  // row (kv head h, r): token t0 + r / group, query head h * group + r % group
  for (int64_t h = h0; h < h1; ++h)
    for (int r = 0; r < rows_per_head; ++r) {
      int x = static_cast<int>((h - h0) * rows_per_head + r);
      qrow[x] = sq.query + sq.row(t0, r, h);
      m[x] = -INFINITY;
      l[x] = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc[x * D + d] = 0.0f;
    }
  const int64_t num_blocks = (kv_end + bs - 1) / bs;
  const bool decode = t1 - t0 == 1 && h1 - h0 > 1;  // one token, several KV heads
  if (decode) decode_block_major<E>(a, sq, kv_end, num_blocks, h0, h1, qrow, acc, s, m, l, alpha, first_block<E>(a, next));
  for (int64_t b = 0; !decode && b < num_blocks; ++b) {
    const int64_t start = b * bs;
    const int n = sq.block_keys(start, kv_end);
    const int64_t phys = sq.table[b];
    for (int64_t h = h0; h < h1; ++h) {
      // The next block's rows of this KV head, while this head's rows compute: spread over
      // the heads, so that a few KiB are in flight at a time, not the whole next block.
      if (b + 1 < num_blocks) sq.prefetch_head(sq.table[b + 1], sq.block_keys(start + bs, kv_end), h);
      const int x0 = static_cast<int>((h - h0) * rows_per_head);
      const C* k = sq.keys(phys, h);
      const C* v = sq.values(phys, h);
      // The first row that sees any key of this block (rows are ordered by token).
      int first = 0;
      while (first < rows_per_head && context_len + t0 + first / group - start + 1 <= 0) ++first;
      if (first == rows_per_head) continue;
      scores<E>(qrow + x0 + first, rows_per_head - first, k, sq.row_elems, n, D, a.scale, sq.kmul,
                s + (x0 + first) * bs, bs);
      for (int r = first; r < rows_per_head; ++r) {
        int64_t seen = context_len + t0 + r / group - start + 1;
        int x = x0 + r;
        alpha[x] = softmax_step(s + x * bs, static_cast<int>(seen < n ? seen : n), n, m + x, l + x);
      }
      // acc = acc * alpha + P V, four rows at a time. Masked keys add 0 * v, and v is a
      // real key's value (j < n <= kv_end), never a NaN slot.
      for (int r = first; r < rows_per_head; r += kPvRows) {
        const int x = x0 + r, nr = rows_per_head - r < kPvRows ? rows_per_head - r : kPvRows;
        pv_rows<E>(nr, acc + x * D, alpha + x, s + x * bs, bs, v, sq.row_elems, sq.vmul, n, D);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int r = 0; r < rows_per_head; ++r) {
      int x = static_cast<int>((h - h0) * rows_per_head + r);
      float inv = 1.0f / l[x];  // l >= 1: the row saw its own max
      Q* o = sq.out + sq.row(t0, r, h);
      for (int64_t d = 0; d < D; d += 16) E::store16(o + d, mul(load(acc + x * D + d), set1(inv)));
    }
}

// The items of one call, for one format: each item from the shared counter until none is left.
template <class E>
void work(const Args& a, float* scratch) {
  for (int64_t it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED); it < a.num_items;
       it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED)) {
    const int64_t i = a.item_seq[it], t0 = a.item_t0[it], h0 = a.item_h0[it];
    const int64_t q_len = a.cu_seqlens[i + 1] - a.cu_seqlens[i];
    const int64_t t1 = t0 + a.tile_tokens < q_len ? t0 + a.tile_tokens : q_len;
    if (decode_item(a, i))
      // The counter now holds the item handed out next: this thread's, unless another takes
      // it first (then the prefetch was wasted, never wrong: it reads only readable slots).
      attend_item<E>(a, i, 0, 1, h0, h0 + a.decode_heads, scratch, __atomic_load_n(a.counter, __ATOMIC_RELAXED));
    else if ((t1 - t0) * (a.num_heads / a.num_kv_heads) >= kLaneRows)  // rows enough to fill the lanes
      attend_tile<E>(a, i, t0, t1, h0, scratch);
    else
      attend_item<E>(a, i, t0, t1, h0, h0 + 1, scratch, -1);
  }
}

// An fp8 cache's format, read by a query of the model's dtype.
template <class Fmt>
void work_fp8(const Args& a, float* scratch) {
  if (a.query_dtype == kBf16)
    work<Fp8<uint16_t, Fmt>>(a, scratch);
  else
    work<Fp8<float, Fmt>>(a, scratch);
}

}  // namespace

extern "C" {

// The number of parameter slots the caller must fill (checked once at load).
int64_t MINI_VLLM_EXPORT(mini_vllm_attn_num_params)() { return kNumParams; }

// Worker w: takes the next unstarted item from the shared counter until none is left. The
// Python side calls it once per thread (numba's prange), or directly with one thread.
void MINI_VLLM_EXPORT(mini_vllm_attn_worker)(const int64_t* params, int64_t w) {
  const Args a = unpack(params);
  float* scratch = a.scratch + w * a.scratch_floats;
  switch (a.dtype) {
    case kBf16: work<Bf16>(a, scratch); break;
    case kFp8E4m3: work_fp8<Fp8E4m3>(a, scratch); break;
    case kFp8E5m2: work_fp8<Fp8E5m2>(a, scratch); break;
    default: work<Fp32>(a, scratch); break;
  }
}

}  // extern "C"
