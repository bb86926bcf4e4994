// The experts of a mixture-of-experts layer in one call: a grouped GEMM over every expert
// that has tokens (gate_up, SiLU-and-mul, down), then each token's weighted sum of its
// experts' rows. Included by cpu_layer_ops.cpp after its row ops (it reuses
// silu_and_mul_row) and cpu_gemm.h (linear_panels, the packed weight layout); exported as
// mini_vllm_fused_moe / mini_vllm_fused_moe_worker, called by kernels/cpu_fused_moe_native.py.
//
// vLLM counterpart: the CPU build's `_C.cpu_fused_moe` op (vllm/_custom_ops.py's
// cpu_fused_moe, called by fused_moe/experts/cpu_moe.py): all of a layer's experts in one
// call, on weights packed at load time.
//
// Why one call: a decode step gives an expert a handful of tokens, so a product per expert
// (two per expert and layer) is a few microseconds of work, and what it cost was the call:
// the Python loop over experts, and with two threads a wake-up of the thread team per product.
// Here the routing is sorted, the rows gathered and the work planned on the calling thread
// (mini_vllm_fused_moe), and the team is woken once per layer: every worker takes items from
// one shared counter until none is left.
//
// The items, in the counter's order:
// 1. (expert, run of gate_up panels): the expert's gathered rows times up to kItemPanels
//    packed panels of its w13. The worker that finishes an expert's last gate_up item
//    computes its SiLU-and-mul rows and then marks the expert ready;
// 2. (expert, run of down panels): waits until the expert is ready, then its act rows times
//    up to kItemPanels panels of its w2;
// 3. (block of tokens): waits until every down item is done, then out[t] = sum over the
//    token's slots k in order of fp32(y) * weight, rounded once to T.
// A worker waits only for items taken before its own (the counter hands them out in order),
// which a running worker holds: no wait can block forever, whatever the number of workers
// the thread pool actually starts, and one worker alone runs the items in order.
//
// Invariants: an output element's arithmetic is linear_panels' and silu_and_mul_row's,
// whatever the routing of other tokens or the split between threads (so a token's bits do
// not depend on its batch); pairs whose id is -1, or whose expert expert_map marks -1, are
// never computed and add nothing; an expert without tokens costs nothing.
#pragma once

#include <immintrin.h>
#include <sched.h>
#include <cstdint>
#include <cstring>

namespace mini_vllm_moe {

// The parameter block (kernels/cpu_fused_moe_native.PARAMS names each slot).
enum MoeParam {
  mDtype, mHidden, mHiddenStride, mTokens, mHiddenSize, mInter, mTopK, mLocalExperts, mIds, mExpertMap,
  mWeights, mW13, mW2, mOut, mIndex, mScratch, mNumParams
};

// Tokens per combine item (3).
constexpr int64_t kCombineTokens = 8;
// Panels per GEMM item: a decode step's busy experts (32 in the MoE benchmark) still give
// two threads about two hundred items to balance, and a worker takes the counter's cache
// line from the other core a quarter as often as with one panel per item.
constexpr int64_t kItemPanels = 4;
// Output values a combine step sums in registers and L1 (a stack buffer of fp32).
constexpr int64_t kCombineWidth = 256;

// The int64 index workspace (n = tokens * top_k pairs, E local experts), as
// cpu_fused_moe_native.index_slots sizes it, from its first 64-byte boundary: the shared
// item counter alone in a cache line (every item's fetch-and-add moves that line between
// cores; nothing else should move with it), a line of kHead counters, then pending [E]
// (gate_up items left), ready [E], order [n] (pair ids t * top_k + k sorted by expert,
// stable), slot [n] (each pair's place in that order, or -1), offsets [E + 1] and active
// [E] (the experts with tokens).
constexpr int64_t kLine = 8;  // int64 slots per cache line
enum Head { hDownLeft, hActive, hPairs, hItems1, hItems2, hItems, kHead };
static_assert(kHead <= kLine, "the counters fill one cache line");

struct Moe {
  const int64_t* p;
  int64_t n, E, H, I;
  int64_t *next, *head, *pending, *ready, *order, *slot, *offsets, *active;
  explicit Moe(const int64_t* params) : p(params) {
    n = p[mTokens] * p[mTopK];
    E = p[mLocalExperts];
    H = p[mHiddenSize];
    I = p[mInter];
    next = reinterpret_cast<int64_t*>((p[mIndex] + 63) & ~int64_t(63));
    head = next + kLine;
    pending = head + kLine;
    ready = pending + E;
    order = ready + E;
    slot = order + n;
    offsets = slot + n;
    active = offsets + E + 1;
  }
  // The T scratch, rows of the sorted pairs: xs [n, H], gate_up [n, 2I], act [n, I], y [n, H].
  template <typename T> T* xs() const { return reinterpret_cast<T*>(p[mScratch]); }
  template <typename T> T* gate_up() const { return xs<T>() + n * H; }
  template <typename T> T* act() const { return gate_up<T>() + n * 2 * I; }
  template <typename T> T* y() const { return act<T>() + n * I; }
};

// Spins until *flag == want; a wait is one item at most, but on a machine with more busy
// threads than cores the worker holding that item may be descheduled: after kSpins pauses
// the waiter gives its core away (sched_yield) instead of spinning through its time slice.
constexpr int kSpins = 4096;
inline void wait_for(const int64_t* flag, int64_t want) {
  for (int spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) != want; ++spins) {
    if (spins < kSpins)
      _mm_pause();
    else
      sched_yield();
  }
}

// Items per expert: runs of kItemPanels of a weight's panels.
inline int64_t runs(int64_t panels) { return (panels + kItemPanels - 1) / kItemPanels; }
inline int64_t run_end(int64_t run, int64_t panels) {
  return (run + 1) * kItemPanels < panels ? (run + 1) * kItemPanels : panels;
}

// The plan, on the calling thread: local ids, a stable counting sort of the pairs by expert,
// the rows gathered, the counters set.
template <typename T>
void plan(const Moe& m) {
  const int32_t* ids = reinterpret_cast<const int32_t*>(m.p[mIds]);
  const int32_t* emap = reinterpret_cast<const int32_t*>(m.p[mExpertMap]);  // or null
  int64_t* cursor = m.pending;  // scratch for the sort; set to its real value below
  std::memset(m.offsets, 0, sizeof(int64_t) * (m.E + 1));
  for (int64_t q = 0; q < m.n; ++q) {
    const int64_t e = ids[q] >= 0 && emap ? emap[ids[q]] : ids[q];
    m.slot[q] = e;  // the local expert for now
    if (e >= 0) ++m.offsets[e + 1];
  }
  int64_t na = 0;
  for (int64_t e = 0; e < m.E; ++e) {
    if (m.offsets[e + 1]) m.active[na++] = e;
    cursor[e] = m.offsets[e];
    m.offsets[e + 1] += m.offsets[e];
  }
  for (int64_t q = 0; q < m.n; ++q) {
    const int64_t e = m.slot[q];
    m.slot[q] = e >= 0 ? cursor[e]++ : -1;
    if (e >= 0) m.order[m.slot[q]] = q;
  }
  const int64_t pairs = m.offsets[m.E], top_k = m.p[mTopK], stride = m.p[mHiddenStride];
  const T* hidden = reinterpret_cast<const T*>(m.p[mHidden]);
  T* xs = m.xs<T>();
  for (int64_t s = 0; s < pairs; ++s)
    std::memcpy(xs + s * m.H, hidden + (m.order[s] / top_k) * stride, sizeof(T) * m.H);
  const int64_t per13 = runs(2 * m.I / mini_vllm_gemm::kPanelColumns);
  const int64_t per2 = runs(m.H / mini_vllm_gemm::kPanelColumns);
  for (int64_t e = 0; e < m.E; ++e) {
    m.pending[e] = per13;
    m.ready[e] = 0;
  }
  *m.next = 0;
  m.head[hDownLeft] = na * per2;
  m.head[hActive] = na;
  m.head[hPairs] = pairs;
  m.head[hItems1] = na * per13;
  m.head[hItems2] = na * (per13 + per2);
  m.head[hItems] = m.head[hItems2] + (m.p[mTokens] + kCombineTokens - 1) / kCombineTokens;
}

template <typename T>
void gate_up_item(const Moe& m, int64_t e, int64_t run) {
  const int64_t r0 = m.offsets[e], rows = m.offsets[e + 1] - r0, two_i = 2 * m.I;
  T* gate_up = m.gate_up<T>() + r0 * two_i;
  const T* w13 = reinterpret_cast<const T*>(m.p[mW13]) + e * two_i * m.H;
  const int64_t panels = two_i / mini_vllm_gemm::kPanelColumns;
  mini_vllm_gemm::linear_panels(m.xs<T>() + r0 * m.H, m.H, rows, m.H, w13, nullptr, gate_up, two_i,
                                run * kItemPanels, run_end(run, panels));
  if (__atomic_sub_fetch(&m.pending[e], 1, __ATOMIC_ACQ_REL) == 0) {  // the expert's last panel
    T* act = m.act<T>() + r0 * m.I;
    for (int64_t r = 0; r < rows; ++r)
      silu_and_mul_row(gate_up + r * two_i, gate_up + r * two_i + m.I, act + r * m.I, m.I);
    __atomic_store_n(&m.ready[e], 1, __ATOMIC_RELEASE);
  }
}

template <typename T>
void down_item(const Moe& m, int64_t e, int64_t run) {
  wait_for(&m.ready[e], 1);
  const int64_t r0 = m.offsets[e], rows = m.offsets[e + 1] - r0;
  const T* w2 = reinterpret_cast<const T*>(m.p[mW2]) + e * m.H * m.I;
  const int64_t panels = m.H / mini_vllm_gemm::kPanelColumns;
  mini_vllm_gemm::linear_panels(m.act<T>() + r0 * m.I, m.I, rows, m.I, w2, nullptr, m.y<T>() + r0 * m.H, m.H,
                                run * kItemPanels, run_end(run, panels));
  __atomic_sub_fetch(&m.head[hDownLeft], 1, __ATOMIC_ACQ_REL);
}

// out[t] = T(sum over k of fp32(y[slot]) * weight), the products rounded before the sum
// (torch's order: the layer's rows weighted, then summed over k).
template <typename T>
void combine_item(const Moe& m, int64_t block) {
  wait_for(&m.head[hDownLeft], 0);
  const int64_t top_k = m.p[mTopK], t1 = (block + 1) * kCombineTokens < m.p[mTokens]
                                              ? (block + 1) * kCombineTokens : m.p[mTokens];
  const float* weights = reinterpret_cast<const float*>(m.p[mWeights]);
  const T* y = m.y<T>();
  T* out = reinterpret_cast<T*>(m.p[mOut]);
  for (int64_t t = block * kCombineTokens; t < t1; ++t) {
    for (int64_t h0 = 0; h0 < m.H; h0 += kCombineWidth) {  // k outside h: the h loop vectorises
      const int64_t width = m.H - h0 < kCombineWidth ? m.H - h0 : kCombineWidth;
      float acc[kCombineWidth] = {};
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t s = m.slot[t * top_k + k];
        if (s < 0) continue;  // a pair not computed here adds nothing
        const float w = weights[t * top_k + k];
        const T* row = y + s * m.H + h0;
#pragma omp simd
        for (int64_t h = 0; h < width; ++h) acc[h] += Elem<T>::Load(row[h]) * w;
      }
      T* o = out + t * m.H + h0;
#pragma omp simd
      for (int64_t h = 0; h < width; ++h) o[h] = Elem<T>::Store(acc[h]);
    }
  }
}

// A worker: items from the shared counter until none is left.
template <typename T>
void work(const int64_t* params) {
  const Moe m(params);
  const int64_t per13 = runs(2 * m.I / mini_vllm_gemm::kPanelColumns);
  const int64_t per2 = runs(m.H / mini_vllm_gemm::kPanelColumns);
  const int64_t items1 = m.head[hItems1], items2 = m.head[hItems2], items = m.head[hItems];
  for (;;) {
    const int64_t i = __atomic_fetch_add(m.next, 1, __ATOMIC_RELAXED);
    if (i >= items) break;
    if (i < items1)
      gate_up_item<T>(m, m.active[i / per13], i % per13);
    else if (i < items2)
      down_item<T>(m, m.active[(i - items1) / per2], (i - items1) % per2);
    else
      combine_item<T>(m, i - items2);
  }
}

}  // namespace mini_vllm_moe

extern "C" {

// The number of parameter slots the caller fills (checked by the Python side at load).
int64_t MINI_VLLM_EXPORT(mini_vllm_fused_moe_num_params)() { return mini_vllm_moe::mNumParams; }

// Plans the call (sort, gather, counters); when `run` is nonzero, also runs every item on
// the calling thread. The Python side passes run = 0 before waking the team.
void MINI_VLLM_EXPORT(mini_vllm_fused_moe)(const int64_t* params, int64_t run) {
  const mini_vllm_moe::Moe m(params);
  const bool fp32 = params[mini_vllm_moe::mDtype] == 0;
  fp32 ? mini_vllm_moe::plan<float>(m) : mini_vllm_moe::plan<uint16_t>(m);
  if (run) fp32 ? mini_vllm_moe::work<float>(params) : mini_vllm_moe::work<uint16_t>(params);
}

// One thread's worker (numba's prange calls it once per thread, cpu_fused_moe_native._fan_out).
void MINI_VLLM_EXPORT(mini_vllm_fused_moe_worker)(const int64_t* params, int64_t) {
  params[mini_vllm_moe::mDtype] == 0 ? mini_vllm_moe::work<float>(params) : mini_vllm_moe::work<uint16_t>(params);
}

}  // extern "C"
