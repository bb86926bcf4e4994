"""Chapter 1 mutants: classic paged-attention mistakes planted in the reference.

Each must make `tests/test_ch1_*.py` fail; the hand-built examples run first
so the first failure names the mistake.
"""
from mutants.core import Mutant

TESTS = [
    "tests/test_ch1_examples.py",
    "tests/test_ch1_slot_mapping.py",
    "tests/test_ch1_attention.py",
    "tests/test_ch1_allocator.py",
    "tests/test_ch1_validation.py",
]
SLOT = "01_paged_attention/slot_mapping.py"
ATTN = "01_paged_attention/attention.py"
CACHE = "01_paged_attention/cache_ops.py"
ALLOC = "01_paged_attention/kv_cache.py"
# The compiled CPU kernel (the engine's default CPU attention) gets its own
# mistakes, caught by its own tests against the dense oracle and the reference.
CPU_KERNEL = "kernels/cpu_paged_attention.py"
CPU_TESTS = ["tests/test_kernels_cpu_attention.py"]
# The fused CPU layer ops and the oneDNN linear dispatch beside them.
# The C++ kernel that runs fp32 and bf16 caches on x86 CPUs with AVX-512 + BF16 or AVX2 + FMA
# (kernels/cpu_native.py builds one source per instruction set); its mutants are caught by its
# own tests, which run every build the CPU has and skip on other CPUs (the run says so).
NATIVE = "kernels/csrc/cpu_attn.cpp"
NATIVE_TESTS = ["tests/test_kernels_cpu_native.py"]
LAYER_OPS = "kernels/cpu_layer_ops.py"
LAYER_TESTS = ["tests/test_kernels_cpu_layer_ops.py"]


def layer_test(name: str) -> list[str]:
    """The one test of LAYER_TESTS that catches a numba layer-op mistake: the file runs every
    op's C++ builds before its numba runs, and numba compiles each loop on first use, so on a
    loaded 2-core machine the whole file reaches a late numba test after the 60 s limit."""
    return [f"{LAYER_TESTS[0]}::{name}"]
LAYER_OPS_CPP = "kernels/csrc/cpu_layer_ops.cpp"  # caught where the C++ layer ops run (either build)
GEMM_CPP = "kernels/csrc/cpu_gemm.h"  # the same
# The AVX2 SIMD layer: every x86-64 CPU the C++ kernels run on runs this build (an AVX-512
# machine runs both), so its mutants are caught on every such CPU.
SIMD_AVX2 = "kernels/csrc/simd_avx2.h"
GEMM_TESTS = ["tests/test_kernels_cpu_gemm.py"]
SPLIT = "kernels/paged_attention_split.py"
SPLIT_TESTS = ["tests/test_kernels_paged_attention_split.py"]
# The fp8 KV cache's quantize/dequantize pair (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2"), checked
# against an fp8 oracle that decodes bytes from their bits (tests/fp8_oracle.py).
FP8 = "kernels/kv_cache_dtype.py"
FP8_TESTS = "tests/test_kernels_fp8_kv.py"


def fp8_test(node: str) -> list[str]:
    """The one fp8 test that catches a mistake: each numba or Triton path compiles on first use
    in the mutant's fresh copy, and the whole file passes 60 s on a loaded 2-core machine."""
    return [f"{FP8_TESTS}::{node}"]

MUTANTS: list[Mutant] = [
    Mutant(
        name="slot_off_by_one",
        path=SLOT,
        old="return block_ids * block_size + pos % block_size",
        new="return block_ids * block_size + pos % block_size + 1",
        tests=TESTS,
        why="slot = block * B + offset + 1: every token lands one slot late",
    ),
    Mutant(
        name="slot_block_from_offset",
        path=SLOT,
        old="block_ids = block_tables[req, pos // block_size].long()",
        new="block_ids = block_tables[req, pos % block_size].long()",
        tests=TESTS,
        why="logical block looked up with pos % B instead of pos // B",
    ),
    Mutant(
        name="gqa_head_mapping_mod",
        path=ATTN,
        old="k = k.float().repeat_interleave(group, dim=1)\n    v = v.float().repeat_interleave(group, dim=1)",
        new="k = k.float().repeat(1, group, 1)\n    v = v.float().repeat(1, group, 1)",
        tests=TESTS,
        why="query head h reads KV head h % num_kv_heads instead of h // group",
    ),
    Mutant(
        name="no_causal_offset",
        path=ATTN,
        old="q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]",
        new="q_pos = torch.arange(0, q_len, device=q.device)[:, None]",
        tests=TESTS,
        why="chunked-prefill queries treated as positions 0..q_len-1, not the last q_len of seq_len",
    ),
    Mutant(
        name="no_causal_mask",
        path=ATTN,
        old='scores = scores.masked_fill(k_pos > q_pos, float("-inf"))',
        new="scores = scores",
        tests=TESTS,
        why="prefill queries attend to later positions",
    ),
    Mutant(
        name="no_softmax_scale",
        path=ATTN,
        old='scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale',
        new='scores = torch.einsum("qhd,khd->hqk", q.float(), k)',
        tests=TESTS,
        why="softmax scale 1/sqrt(d) forgotten",
    ),
    Mutant(
        name="read_past_seq_len",
        path=ATTN,
        old="k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [num_used*block_size, ...] -> seq_len\n"
            "    v = value_cache[blocks].flatten(0, 1)[:seq_len]",
        new="k = key_cache[blocks].flatten(0, 1)\n    v = value_cache[blocks].flatten(0, 1)",
        tests=TESTS,
        why="keys of the whole last block are used, slots past seq_len included",
    ),
    Mutant(
        name="assumes_contiguous_blocks",
        path=ATTN,
        old="blocks = block_table_row[:num_used].long()",
        new="blocks = block_table_row[0].long() + torch.arange(num_used)",
        tests=TESTS,
        why="a sequence's blocks taken as consecutive ids from its first block, not from the block table",
    ),
    Mutant(
        name="decode_misses_own_token",
        path=ATTN,
        old="k, v = gather_kv(key_cache, value_cache, block_tables[i], int(seq_lens[i]), k_scale, v_scale)\n"
            "        out[i] =",
        new="k, v = gather_kv(key_cache, value_cache, block_tables[i], int(seq_lens[i]) - 1, k_scale, v_scale)\n"
            "        out[i] =",
        tests=TESTS,
        why="decode attends to seq_len - 1 positions, not to the token it just wrote",
    ),
    Mutant(
        name="padding_slot_written",
        path=CACHE,
        old="real = slot_mapping >= 0",
        new="real = slot_mapping >= -1",
        tests=TESTS,
        why="slot -1 (padding) is written and wraps to the cache's last slot",
    ),
    Mutant(
        name="free_ignores_refcount",
        path=ALLOC,
        old="if self._ref[block_id] == 0:\n            self._free.append(block_id)",
        new="self._free.append(block_id)",
        tests=TESTS,
        why="a shared block returns to the free list while another sequence still uses it",
    ),
    Mutant(
        name="allocate_n_partial",
        path=ALLOC,
        old="if n > len(self._free):\n            raise NoFreeBlocksError",
        new="if n > len(self._free) + n:\n            raise NoFreeBlocksError",
        tests=TESTS,
        why="allocate_n hands out blocks before finding there are not enough: a failed call leaks",
    ),
    Mutant(
        name="cpu_no_causal_offset",
        path=CPU_KERNEL,
        old="context_len = seq_len - q_len  # query t sits",
        new="context_len = 0  # query t sits",
        tests=CPU_TESTS,
        why="cpu kernel: chunk and decode queries placed at positions 0..q_len-1, not the last q_len of seq_len",
    ),
    Mutant(
        name="cpu_gqa_head_mapping_mod",
        path=CPU_KERNEL,
        old="_widen_block(key_cache, phys, kvh, keys, fmt, k_tile[c:], k_table)\n"
            "            _widen_block(value_cache, phys, kvh, keys,",
        new="_widen_block(key_cache, phys, (kvh * group) % key_cache.shape[2], keys, fmt, k_tile[c:], k_table)\n"
            "            _widen_block(value_cache, phys, (kvh * group) % key_cache.shape[2], keys,",
        tests=CPU_TESTS,
        why="cpu kernel: query head h reads KV head h % num_kv_heads instead of h // group",
    ),
    Mutant(
        name="cpu_read_past_seq_len",
        path=CPU_KERNEL,
        old="n = min(step_keys, kv_end - start)  # never a slot",
        new="n = min(step_keys, -(-kv_end // block_size) * block_size - start)  # never a slot",
        tests=CPU_TESTS,
        why="cpu kernel: the whole last block is read, slots past seq_len (masked, but 0 * NaN = NaN) included",
    ),
    Mutant(
        name="cpu_no_causal_mask",
        path=CPU_KERNEL,
        old="seen = min(n, context_len + t0 + r // group - start + 1)",
        new="seen = n",
        tests=CPU_TESTS,
        why="cpu kernel: prefill queries attend to later positions",
    ),
    Mutant(
        name="cpu_softmax_without_running_max",
        path=CPU_KERNEL,
        old="m_new = max(m_new, s[r, j])",
        new="m_new = max(m_new, np.float32(0.0))",
        tests=CPU_TESTS,
        why="cpu kernel: exp(score) without subtracting the running max overflows fp32 on large logits",
    ),
    Mutant(
        name="cpu_no_rescale",
        path=CPU_KERNEL,
        old="acc[r, d] = acc[r, d] * alpha[r] + pv[r, d]",
        new="acc[r, d] = acc[r, d] + pv[r, d]",
        tests=CPU_TESTS,
        why="cpu kernel: the accumulator keeps earlier steps' weights when the running max grows",
    ),
    Mutant(
        name="cpu_sum_not_rescaled",
        path=CPU_KERNEL,
        old="l_r = l[r] * a",
        new="l_r = l[r]",
        tests=CPU_TESTS,
        why="cpu kernel: the running sum keeps earlier steps' terms at their old max while the accumulator is rescaled",
    ),
    Mutant(
        name="cpu_causal_misses_own_token",
        path=CPU_KERNEL,
        old="seen = min(n, context_len + t0 + r // group - start + 1)",
        new="seen = min(n, context_len + t0 + r // group - start)",
        tests=CPU_TESTS,
        why="cpu kernel: a query does not see the key at its own position",
    ),
    Mutant(
        name="cpu_assumes_contiguous_blocks",
        path=CPU_KERNEL,
        old="phys = table_row[(start + c) // block_size]",
        new="phys = table_row[0] + (start + c) // block_size",
        tests=CPU_TESTS,
        why="cpu kernel: a sequence's blocks taken as consecutive ids from its first block, not from the table",
    ),
    Mutant(
        name="cpu_bf16_low_half",
        path=CPU_KERNEL,
        old="return np.uint32(np.uint32(bits) << 16).view(np.float32)",
        new="return np.uint32(bits).view(np.float32)",
        tests=CPU_TESTS,
        why="cpu kernel (both paths): bf16 bits widened into the low half of an fp32 (tiny denormals), not the high half",
    ),
    # The decode path (`_decode_item`: one query token, all KV heads of a
    # sequence, plain loops) is what the engine runs for its decodes, so the
    # classic mistakes are planted there too. Its online softmax is the shared
    # `_softmax_step`, which cpu_softmax_without_running_max and
    # cpu_sum_not_rescaled above already plant in both paths.
    Mutant(
        name="cpu_decode_no_causal_offset",
        path=CPU_KERNEL,
        old="kv_end = seq_len - q_len + 1  # the token sits",
        new="kv_end = 0 + 1  # the token sits",
        tests=CPU_TESTS,
        why="cpu decode path: the decode query placed at position 0 (q_len - 1), not seq_len - 1: it sees key 0 only",
    ),
    Mutant(
        name="cpu_decode_misses_own_token",
        path=CPU_KERNEL,
        old="kv_end = seq_len - q_len + 1  # the token sits",
        new="kv_end = seq_len - q_len  # the token sits",
        tests=CPU_TESTS,
        why="cpu decode path: the decode attends to seq_len - 1 positions, not to the token it just wrote",
    ),
    Mutant(
        name="cpu_decode_gqa_head_mapping_mod",
        path=CPU_KERNEL,
        old="q_rows[r, d] = query[tok, h0 * group + r, d] * scale",
        new="q_rows[r, d] = query[tok, h0 + r // group + r % group * num_kv_heads, d] * scale",
        tests=CPU_TESTS,
        why="cpu decode path: KV head kvh serves query heads kvh, kvh + num_kv_heads, ... (h % num_kv_heads), "
            "not its group kvh * group .. kvh * group + group - 1",
    ),
    Mutant(
        name="cpu_decode_row_pair_reuses_first_query",
        path=CPU_KERNEL,
        old="y0 += q_rows[r + 1, d] * k0\n"
            "                                    y1 += q_rows[r + 1, d] * k1\n"
            "                                s[r + 1, j], s[r + 1, c + pair] = y0, y1\n"
            "                            else:\n"
            "                                for d in range(head_dim):\n"
            "                                    x0 += q_rows[r, d] * key_cache",
        new="y0 += q_rows[r, d] * k0\n"
            "                                    y1 += q_rows[r + 1, d] * k1\n"
            "                                s[r + 1, j], s[r + 1, c + pair] = y0, y1\n"
            "                            else:\n"
            "                                for d in range(head_dim):\n"
            "                                    x0 += q_rows[r, d] * key_cache",
        tests=CPU_TESTS,
        why="cpu decode path (fp32): the second query row of a pass scores its first key with the first row's query",
    ),
    Mutant(
        name="cpu_decode_read_past_seq_len",
        path=CPU_KERNEL,
        old="keys = min(step_keys, kv_end - start)  # stops at kv_end",
        new="keys = min(step_keys, -(-kv_end // block_size) * block_size - start)  # stops at kv_end",
        tests=CPU_TESTS,
        why="cpu decode path: the whole last block is read, slots past seq_len included",
    ),
    Mutant(
        name="cpu_decode_no_rescale",
        path=CPU_KERNEL,
        old="acc[r, d] *= a",
        new="acc[r, d] *= np.float32(1.0)",
        tests=CPU_TESTS,
        why="cpu decode path: the accumulator keeps earlier steps' weights when the running max grows",
    ),
    Mutant(
        name="cpu_decode_assumes_contiguous_blocks",
        path=CPU_KERNEL,
        old="phys = table_row[blk]  # the block's physical id",
        new="phys = table_row[0] + blk  # the block's physical id",
        tests=CPU_TESTS,
        why="cpu decode path: a sequence's blocks taken as consecutive ids from its first block, not from the table",
    ),
    Mutant(
        name="native_causal_misses_own_token",
        path=NATIVE,
        old="int64_t seen = context_len + t0 + r / group - start + 1;",
        new="int64_t seen = context_len + t0 + r / group - start;",
        tests=NATIVE_TESTS,
        why="C++ kernel: a query row sees the keys before its position but not its own",
    ),
    Mutant(
        name="native_reads_whole_blocks",
        path=NATIVE,
        old="return static_cast<int>(kv_end - start < bs ? kv_end - start : bs);",
        new="return static_cast<int>(bs);",
        tests=NATIVE_TESTS,
        why="C++ kernel (both paths): the last block read in full, past seq_len (slots that were never written)",
    ),
    Mutant(
        name="native_acc_not_rescaled",
        path=NATIVE,
        old="a[r][c] = c < nd ? mul(load(acc + r * head_dim + d0 + 16 * c), al) : al;",
        new="a[r][c] = c < nd ? load(acc + r * head_dim + d0 + 16 * c) : al;",
        tests=NATIVE_TESTS,
        why="C++ kernel: what earlier blocks accumulated is not rescaled when the running max rises",
    ),
    Mutant(
        name="native_sum_not_rescaled",
        path=NATIVE,
        old="*l = *l * alpha + reduce_add(sum);",
        new="*l = *l + reduce_add(sum);",
        tests=NATIVE_TESTS,
        why="C++ kernel: the running sum is not rescaled when the running max rises",
    ),
    Mutant(
        name="native_gqa_head_mapping_mod",
        path=NATIVE,
        old="return ((q_start + t0 + r / group) * H + h * group + r % group) * D;",
        new="return ((q_start + t0 + r / group) * H + (h + r % group * KVH) % H) * D;",
        tests=NATIVE_TESTS,
        why="C++ kernel (both paths): query head h * group + g taken as head (h + g * KVH) % H (interleaved GQA map)",
    ),
    Mutant(
        name="native_decode_item_first_kv_head_only",
        path=NATIVE,
        old="attend_item<E>(a, i, 0, 1, h0, h0 + a.decode_heads, scratch,",
        new="attend_item<E>(a, i, 0, 1, h0, h0 + 1, scratch,",
        tests=NATIVE_TESTS,
        why="C++ kernel: a decode item of all KV heads computes only its first",
    ),
    # decode_block_major: a decode of every KV head, block by block in memory order
    Mutant(
        name="native_block_major_acc_not_rescaled",
        path=NATIVE,
        old="store(acc + x * D + d, mul(load(acc + x * D + d), al));",
        new="store(acc + x * D + d, load(acc + x * D + d));",
        tests=NATIVE_TESTS,
        why="C++ kernel, whole decodes: what earlier blocks accumulated is not rescaled when the max rises",
    ),
    Mutant(
        name="native_block_major_scores_head_zero",
        path=NATIVE,
        old="scores<E>(qrow + h * group, group, kb + j * row + h * D, row,",
        new="scores<E>(qrow + h * group, group, kb + j * row, row,",
        tests=NATIVE_TESTS,
        why="C++ kernel, whole decodes: every KV head's rows scored against KV head 0's keys (slot offset without the head's)",
    ),
    Mutant(
        name="native_block_major_pv_first_slot_weight",
        path=NATIVE,
        old="x = fmadd(set1(j < nj ? p[r * p_stride + j] : 0.0f), vv[j], x);",
        new="x = fmadd(set1(j < nj ? p[r * p_stride] : 0.0f), vv[j], x);",
        tests=NATIVE_TESTS,
        why="C++ kernel, whole decodes: each group of four slots' values weighted by the first slot's probability",
    ),
    # attend_tile: prefill and chunk tiles of 16+ rows, a row per SIMD lane
    Mutant(
        name="native_tile_causal_misses_own_token",
        path=NATIVE,
        old="M16 seen = cmpge_i(pos, j + c);",
        new="M16 seen = cmpge_i(pos, j + c + 1);",
        tests=NATIVE_TESTS,
        why="C++ kernel, lane tiles: a query row sees the keys before its position but not its own",
    ),
    Mutant(
        name="native_tile_sum_not_rescaled",
        path=NATIVE,
        old="store(l + g, fmadd(load(l + g), alpha, sum));",
        new="store(l + g, add(load(l + g), sum));",
        tests=NATIVE_TESTS,
        why="C++ kernel, lane tiles: the running sums are not rescaled when the running max rises",
    ),
    Mutant(
        name="native_tile_acc_not_rescaled",
        path=NATIVE,
        old="ac[c] = mul(load(acc + (d0 + c) * rows_p + g), alpha);",
        new="ac[c] = load(acc + (d0 + c) * rows_p + g);",
        tests=NATIVE_TESTS,
        why="C++ kernel, lane tiles: what earlier blocks accumulated is not rescaled when the max rises",
    ),
    Mutant(
        name="native_output_truncated",
        path=SIMD_AVX2,
        old="__m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);",
        new="__m256i rounded = _mm256_srli_epi32(u, 16);",
        tests=NATIVE_TESTS,
        why="C++ kernel (AVX2 build): the fp32 output cut to bf16 (toward zero), not rounded to nearest even as torch rounds",
    ),
    Mutant(
        name="avx2_dpbf16_drops_even_elements",
        path=SIMD_AVX2,
        old="  acc.lo = _mm256_fmadd_ps(even8(a.lo), even8(b.lo), acc.lo);\n",
        new="",
        tests=GEMM_TESTS,
        why="AVX2 bf16 dot step: the even element of each pair (its low half) never multiplied in lanes 0-7",
    ),
    Mutant(
        name="avx2_masked_load_one_lane_too_many",
        path=SIMD_AVX2,
        old="return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));",
        new="return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - base + 1), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));",
        tests=NATIVE_TESTS,
        why="AVX2 masked loads and stores take one lane past n: a softmax step reads a score past the row's last visible key",
    ),
    Mutant(
        name="cpu_add_norm_of_x",
        path=LAYER_OPS,
        old="_norm_row(sr, weight, eps, out[r])",
        new="_norm_row(xr, weight, eps, out[r])",
        tests=layer_test("test_rms_norm_matches_torch"),
        why="fused add + RMSNorm scales x instead of x + residual (the sum of squares is of the sum)",
    ),
    Mutant(
        name="cpu_silu_of_up",
        path=LAYER_OPS,
        old="o[j] = g / (one + _exp(-g)) * up[j]",
        new="o[j] = up[j] / (one + _exp(-up[j])) * g",
        tests=layer_test("test_silu_and_mul_matches_torch"),
        why="SiLU-and-mul with the halves swapped: silu(up) * gate",
    ),
    Mutant(
        name="cpu_rope_fused_multiply_add",
        path=LAYER_OPS,
        old='@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: products rounded before the sum',
        new='@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")  # products rounded before the sum',
        tests=layer_test("test_rotary_embedding_equals_torch_bit_for_bit"),
        why="rotary with contracted multiply-adds: rounds differently from the torch reference",
    ),
    Mutant(
        name="cpu_bf16_rope_second_half_of_head_0",
        path="kernels/cpu_layer_ops_bf16.py",
        old="x[t, base + half:base + head_size], cos, sin,",
        new="x[t, half:head_size], cos, sin,",
        tests=layer_test("test_bf16_rotary_embedding_equals_torch_bit_for_bit"),
        why="bf16 rotary: every head's second half read from head 0 (a head view offset forgotten)",
    ),
    Mutant(
        name="cpu_qk_norm_rope_k_takes_q_weight",
        path=LAYER_OPS,
        old="_norm_rotate_heads(qkv[t, q_end:q_end + k_heads * head_size], k_weight,",
        new="_norm_rotate_heads(qkv[t, q_end:q_end + k_heads * head_size], q_weight,",
        tests=layer_test("test_qk_norm_rope_equals_the_ops_apart_and_torch"),
        why="Qwen3's fused q/k norm + rotation normalises k's heads with q_norm's weight",
    ),
    Mutant(
        name="cpp_add_norm_of_x",
        path=LAYER_OPS_CPP,
        old="norm_row(sr, c.ptr<const T>(kWeight)",
        new="norm_row(xr, c.ptr<const T>(kWeight)",
        tests=LAYER_TESTS,
        why="C++ fused add + RMSNorm normalises x instead of x + residual",
    ),
    Mutant(
        name="cpp_worker_skips_its_first_row",
        path=LAYER_OPS_CPP,
        old="run_range(params, total * w / n, total * (w + 1) / n);",
        new="run_range(params, total * w / n + 1, total * (w + 1) / n);",
        tests=LAYER_TESTS,
        why="C++ ops split between threads: each worker's first row is never written",
    ),
    Mutant(
        name="cpp_bf16_silu_not_rounded",
        path=LAYER_OPS_CPP,
        old="V16 silu = narrow16(simd::div(",
        new="V16 silu = (simd::div(",
        tests=LAYER_TESTS,
        why="C++ bf16 SiLU-and-mul keeps silu(gate) in fp32 where torch rounds it to bf16 before the product",
    ),
    Mutant(
        name="cpp_bf16_rope_table_not_rounded",
        path=LAYER_OPS_CPP,
        old="cos[j] = Elem<T>::Narrow(cr[j]);",
        new="cos[j] = cr[j];",
        tests=LAYER_TESTS,
        why="C++ bf16 rotary uses the fp32 cos table where torch rounds it to bf16 first",
    ),
    Mutant(
        name="cpp_qk_norm_rope_k_takes_q_weight",
        path=LAYER_OPS_CPP,
        old="const T* weight[2] = {c.ptr<const T>(kWeight), c.ptr<const T>(kKWeight)};",
        new="const T* weight[2] = {c.ptr<const T>(kWeight), c.ptr<const T>(kWeight)};",
        tests=LAYER_TESTS,
        why="C++ Qwen3 q/k norm + rotation normalises k's heads with q_norm's weight",
    ),
    Mutant(
        name="cpu_packed_weight_stale",
        path="05_mini_vllm/models/cpu_ops.py",
        old="key = (weight.data_ptr(), weight._version, ",
        new="key = (weight.data_ptr(), ",
        tests=layer_test("test_packed_weight_follows_in_place_writes"),
        why="the oneDNN-packed weight keyed without the version counter: a weight written in place is never repacked",
    ),
    Mutant(
        name="gemm_hi_half_takes_lo_weights",
        path=GEMM_CPP,
        old="w[h] = load_i(panel + kp * 64 + 32 * (h0 + h));",
        new="w[h] = load_i(panel + kp * 64);",
        tests=GEMM_TESTS,
        why="bf16 linear: a panel's columns 16-31 are multiplied by the weights of columns 0-15",
    ),
    Mutant(
        name="gemm_last_input_pair_skipped",
        path=GEMM_CPP,
        old="for (int64_t kp = 0; kp < pairs; ++kp) {\n      I16 w[H];",
        new="for (int64_t kp = 0; kp < pairs - 1; ++kp) {\n      I16 w[H];",
        tests=GEMM_TESTS,
        why="bf16 linear: the sum over the inputs stops one pair short",
    ),
    Mutant(
        name="gemm_one_row_last_input_pair_skipped",
        path=GEMM_CPP,
        old="for (int64_t kp = 0; kp < pairs; ++kp) {\n    int32_t pair;",
        new="for (int64_t kp = 0; kp < pairs - 1; ++kp) {\n    int32_t pair;",
        tests=GEMM_TESTS,
        why="bf16 linear, one row (a batch-1 decode reads two panels at once): its sum stops one pair short",
    ),
    Mutant(
        name="gemm_one_row_second_stream_reads_the_first_panel",
        path=GEMM_CPP,
        old="const int64_t p = panel_begin + i, q = p + half;",
        new="const int64_t p = panel_begin + i, q = p;",
        tests=GEMM_TESTS,
        why="bf16 linear, one row: the second stream reads the first stream's panel, so half the outputs "
            "are another panel's",
    ),
    Mutant(
        name="gemm_bias_dropped",
        path=GEMM_CPP,
        old="if (bias) {  // without one",
        new="if (false) {  // without one",
        tests=GEMM_TESTS,
        why="bf16 linear: the bias is never added",
    ),
    Mutant(
        name="gemm_tail_rows_dropped",
        path=GEMM_CPP,
        old="for (int64_t r = c0; r < c1; r += kTileRows) {",
        new="for (int64_t r = c0; r + kTileRows <= c1; r += kTileRows) {",
        tests=GEMM_TESTS,
        why="bf16 linear: rows past the last full tile of 8 are never written",
    ),
    Mutant(
        name="gemm_pack_pairs_transposed",
        path="kernels/cpu_layer_ops_native.py",
        old=".permute(0, 2, 1, 3)",
        new=".permute(0, 2, 3, 1)",
        tests=GEMM_TESTS,
        why="bf16 linear: the weight packed [pair][2][32] where the kernel reads [pair][32][2]",
    ),
    Mutant(
        name="gemm_fp32_last_input_skipped",
        path=GEMM_CPP,
        old="for (int64_t k = 0; k < steps; ++k) {",
        new="for (int64_t k = 0; k < steps - 1; ++k) {",
        tests=GEMM_TESTS,
        why="fp32 linear: the sum over the inputs stops one short",
    ),
    Mutant(
        name="gemm_fp32_pack_untransposed",
        path="kernels/cpu_layer_ops_native.py",
        old="return w.reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k).permute(0, 2, 1).contiguous()",
        new="return w.reshape(n // PANEL_COLUMNS, k, PANEL_COLUMNS).contiguous()",
        tests=GEMM_TESTS,
        why="fp32 linear: the weight's rows cut into panels without the transpose the kernel reads",
    ),
    # The split-KV decode kernel (FlashDecoding) of the GPU path, caught in Triton's interpreter.
    Mutant(
        name="split_kv_reduce_without_rescale",
        path=SPLIT,
        old="w = tl.where(s_ok, tl.exp2(m - m_all), 0.0)",
        new="w = tl.where(s_ok, 1.0, 0.0)",
        tests=SPLIT_TESTS,
        why="split-KV reduce: each segment's sums added at its own maximum, not rescaled to the global one",
    ),
    Mutant(
        name="split_kv_empty_segment_contributes",
        path=SPLIT,
        old="s_ok = s < used",
        new="s_ok = s < NUM_SEGMENTS",
        tests=SPLIT_TESTS,
        why="split-KV reduce: segments past a short sequence's end (never written: stale workspace) are summed",
    ),
    Mutant(
        name="split_kv_segments_overlap",
        path=SPLIT,
        old="kv_end = tl.minimum(seq_len, kv_start + per_segment * BLOCK_N)",
        new="kv_end = seq_len",
        tests=SPLIT_TESTS,
        why="split-KV: every segment runs to the end of the sequence, so later keys are counted several times",
    ),
    Mutant(
        name="fp8_scale_applied_twice",
        path=FP8,
        old="return (x.float() / scale).clamp(-big, big).to(dtype)",
        new="return (x.float() / scale / scale).clamp(-big, big).to(dtype)",
        tests=fp8_test("test_quantize_matches_the_oracle"),
        why="fp8 KV cache: the scale divided twice on the way in, so every cached value is off by 1 / scale",
    ),
    Mutant(
        name="fp8_scale_not_applied_on_reading",
        path=ATTN,
        old="k, v = dequantize(k, float(k_scale)), dequantize(v, float(v_scale))",
        new="k, v = dequantize(k, 1.0), dequantize(v, 1.0)",
        tests=fp8_test("test_decode_reads_dequantised_cache[reference-e4m3]"),
        why="fp8 KV cache: the reference reads stored bytes without multiplying by k_scale / v_scale",
    ),
    Mutant(
        name="fp8_wrong_format_when_writing",
        path=FP8,
        old="return (x.float() / scale).clamp(-big, big).to(dtype)",
        new="return (x.float() / scale).clamp(-big, big).to(torch.float8_e5m2).view(dtype)",
        tests=fp8_test("test_quantize_matches_the_oracle"),
        why="fp8 KV cache: values written as e5m2 bytes into an e4m3 cache that is read as e4m3",
    ),
    Mutant(
        name="fp8_wrong_format_when_reading",
        path=ATTN,
        old="k, v = dequantize(k, float(k_scale)), dequantize(v, float(v_scale))",
        new="k, v = dequantize(k.view(torch.float8_e5m2), float(k_scale)), dequantize(v, float(v_scale))",
        tests=fp8_test("test_decode_reads_dequantised_cache[reference-e4m3]"),
        why="fp8 KV cache: key bytes written as e4m3 are read back as e5m2",
    ),
    Mutant(
        name="fp8_scale_not_applied_on_reading_triton",
        path="kernels/paged_attention.py",
        old="k = k.to(tl.float32) * k_scale",
        new="k = k.to(tl.float32)",
        tests=fp8_test("test_decode_reads_dequantised_cache[triton-e4m3]"),
        why="fp8 KV cache: the Triton kernels read key bytes without multiplying by k_scale",
    ),
    Mutant(
        name="fp8_scale_applied_twice_triton",
        path="kernels/reshape_and_cache.py",
        old="k = tl.clamp(k.to(tl.float32) / k_scale, -fp8_max, fp8_max)",
        new="k = tl.clamp(k.to(tl.float32) / k_scale / k_scale, -fp8_max, fp8_max)",
        tests=fp8_test("test_writers_store_the_oracle_bytes[in_dtype0-triton-e4m3]"),
        why="fp8 KV cache: the Triton writer divides keys by k_scale twice",
    ),
    # The C++ kernel's fp8 reads: the AVX2 build, which every CPU that runs the C++ kernels runs.
    Mutant(
        name="fp8_scale_not_applied_on_reading_cpp",
        path=NATIVE,
        old="kmul(multiplier(a.k_scale))",
        new="kmul(multiplier(1.0f))",
        tests=fp8_test("test_decode_reads_dequantised_cache[cpp_avx2-e4m3]"),
        why="fp8 KV cache: the C++ kernel reads key bytes without multiplying by k_scale",
    ),
    Mutant(
        name="fp8_e4m3_nan_read_as_a_number_cpp",
        path="kernels/csrc/attn_formats.h",
        old="return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));",
        new="return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_setzero_si256()));",
        tests=fp8_test("test_cpp_kernel_reads_every_byte_as_value_times_scale[e4m3-avx2]"),
        why="fp8 KV cache: the C++ kernel reads e4m3's NaN code (S.1111.111) as 480 times the scale",
    ),
]
