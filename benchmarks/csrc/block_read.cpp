// What one core can read from a paged KV cache when it does nothing else: the blocks of a
// decode batch, in the order the attention kernel reads them, summed and thrown away.
//
// Used by benchmarks/bench_engine_attention.py as the ceiling for a decode. A decode must
// read every K/V row it attends to, so it can be no faster than this (with the kernel's way
// of prefetching; no other way tried here read faster, see kernels/NOTES.md). The sequential read
// bandwidth (machine.read_bandwidth) is not that ceiling: a batch's blocks lie wherever the
// block pool put them, a block is the longest contiguous run (block_size x KV heads x
// head_dim elements), and each jump costs the hardware prefetcher a new stream. On a Zen 4
// core (AMD EPYC, family 25, 1 thread, 2 MiB pages) this read 15 GB/s from runs of 8 KiB and
// 19-20 GB/s from runs of 16 to 64 KiB, where one sequential stream read 25-30 GB/s.
//
// The reads copy the kernel's: spans in order, K of a span and then V, the next span's K
// (or V) prefetched into L2 a line at a time while the current one is read. The sums are
// integer so the compiler vectorises them without reordering anything.
#include <cstdint>

namespace {

constexpr int64_t kStep = 256;  // bytes per loop step: four cache lines

uint64_t read_span(const char* p, int64_t bytes, const char* next, int64_t next_bytes, uint64_t* acc) {
  for (int64_t b = 0; b < bytes; b += kStep) {
    for (int64_t l = 0; l < kStep; l += 64)
      if (b + l < next_bytes) __builtin_prefetch(next + b + l, 0, 2);
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p + b);
    const int64_t words = (bytes - b < kStep ? bytes - b : kStep) / 8;
    for (int64_t x = 0; x < words; ++x) acc[x] += w[x];
  }
  return acc[0];
}

}  // namespace

extern "C" {

// spans: [num_spans][2] = (byte offset into each cache, bytes), the blocks in reading order;
// every span's bytes are a multiple of 8. Returns a sum of what was read, so none of it is
// optimised away.
uint64_t mini_vllm_block_read(const char* key_cache, const char* value_cache, const int64_t* spans,
                              int64_t num_spans) {
  alignas(64) uint64_t acc[kStep / 8] = {};
  for (int64_t i = 0; i < num_spans; ++i) {
    const int64_t at = spans[2 * i], bytes = spans[2 * i + 1];
    const bool more = i + 1 < num_spans;
    const int64_t next_at = more ? spans[2 * i + 2] : 0, next_bytes = more ? spans[2 * i + 3] : 0;
    read_span(key_cache + at, bytes, key_cache + next_at, next_bytes, acc);
    read_span(value_cache + at, bytes, value_cache + next_at, next_bytes, acc);
  }
  uint64_t total = 0;
  for (uint64_t x : acc) total += x;
  return total;
}

}  // extern "C"
