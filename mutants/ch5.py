"""Chapter 5 mutants: classic engine mistakes planted in the reference.

Each must make the listed Chapter 5 tests fail within 60 s; the fast
exercise tests (runner inputs, sampler filters) come first where they apply.
"""
from mutants.core import Mutant

PREP = "05_mini_vllm/worker/prepare_inputs.py"
OPS = "05_mini_vllm/sample/ops/topk_topp.py"
RUNNER = "05_mini_vllm/worker/model_runner.py"
STEP_OUT = "05_mini_vllm/worker/step_outputs.py"
ASYNC_OUT = "05_mini_vllm/worker/async_output.py"
INPUTS = ["tests/test_ch5_prepare_inputs.py"]
FILTERS = ["tests/test_ch5_sampler_filters.py"]
API = ["tests/test_ch5_engine_api.py"]
ASYNC = "tests/test_ch5_async_scheduling.py"
GRAPHS = "05_mini_vllm/worker/cudagraph_dispatcher.py"
GRAPH_TESTS = ["tests/test_ch5_cudagraph_padding.py"]
EAGLE = "05_mini_vllm/spec_decode/engine/eagle.py"
EAGLE_TESTS = ["tests/test_ch5_eagle.py::test_engine_drafts_are_the_reference_chain"]
HEAD_KV = "05_mini_vllm/spec_decode/engine/head_kv.py"
HEAD_KV_TESTS = ["tests/test_ch5_eagle.py::test_head_kv_tracker_marks_blocks_and_clears_them_for_a_new_owner"]
MOE_KERNEL = "kernels/fused_moe.py"
MOE_KERNEL_TESTS = "tests/test_kernels_fused_moe.py"
MOE_ROUTER = "05_mini_vllm/models/fused_moe/router.py"
MOE_LAYER = "05_mini_vllm/models/fused_moe/layer.py"
MOE_LAYER_TESTS = ["tests/test_ch5_moe_layer.py"]
QUANT_FP8 = "05_mini_vllm/models/quantization/fp8.py"
QUANT_UTILS = "05_mini_vllm/models/quantization/quant_utils.py"
INT8_KERNEL = "kernels/cpu_int8_linear.py"
QUANT_TESTS = "tests/test_ch5_quant_weights.py"

MUTANTS: list[Mutant] = [
    Mutant(
        name="positions_from_zero",
        path=PREP,
        old="return np.asarray(num_computed_tokens, dtype=np.int64)[req_indices] + offsets",
        new="return offsets",
        tests=INPUTS,
        why="positions restart at 0 for every step instead of at num_computed_tokens",
    ),
    Mutant(
        name="query_start_off_by_one",
        path=PREP,
        old="np.cumsum(num_scheduled_tokens, out=out[1:])",
        new="np.cumsum(num_scheduled_tokens, out=out[1:]); out[1:] -= 1",
        tests=INPUTS,
        why="query start locations one row early: each request loses its last token",
    ),
    Mutant(
        name="slot_block_from_offset",
        path=PREP,
        old="block_table[req_indices, positions // block_size]",
        new="block_table[req_indices, positions % block_size]",
        tests=INPUTS,
        why="the batch slot mapping looks up the block with pos % B",
    ),
    Mutant(
        name="min_p_absolute",
        path=OPS,
        old="return logits.masked_fill(logits < row_max + log_min_p.unsqueeze(1), float(\"-inf\"))",
        new="return logits.masked_fill(logits - logits.logsumexp(-1, keepdim=True) < log_min_p.unsqueeze(1), "
            "float(\"-inf\"))",
        tests=FILTERS,
        why="min_p compared with the absolute probability, not relative to the top token's",
    ),
    Mutant(
        name="top_k_drops_kth",
        path=OPS,
        old="masked = logits.masked_fill(logits < kth, float(\"-inf\"))",
        new="masked = logits.masked_fill(logits <= kth, float(\"-inf\"))",
        tests=FILTERS,
        why="top-k keeps k - 1 tokens: the k-th largest (and its ties) dropped",
    ),
    Mutant(
        name="seeded_row_uses_global_rng",
        path=OPS,
        old="        noise[i] = _seeded_row_noise(g, vocab, device)",
        new="        noise[i] = _seeded_row_noise(None, vocab, device)",
        tests=["tests/test_ch5_sampler.py", "tests/test_ch5_engine_api.py"],
        why="a seeded request draws from the global generator, so its tokens depend on the batch",
    ),
    Mutant(
        name="logits_from_first_token",
        path=RUNNER,
        old="end = int(query_start_loc[i + 1])",
        new="end = int(query_start_loc[i]) + 1",
        tests=API,
        why="a prefill samples from its first token's logits instead of its last token's",
    ),
    Mutant(
        name="cow_table_not_sent",
        path="03_scheduler/scheduler_base.py",
        old="replace = resumed or rid in cow",
        new="replace = resumed",
        tests=["tests/test_scheduler_copy_on_write.py"],
        why="after copy-on-write the runner keeps writing into the shared block (forked samples corrupt each other)",
    ),
    Mutant(
        name="stop_string_streamed_early",
        path="05_mini_vllm/engine/detokenizer.py",
        old="self.hold = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1",
        new="self.hold = 0",
        tests=API,
        why="streaming sends characters that later turn out to start a stop string",
    ),
    Mutant(
        name="utf8_split_character_emitted",
        path="05_mini_vllm/engine/detokenizer.py",
        old="if len(after) > len(before) and not after.endswith(_INCOMPLETE):",
        new="if len(after) > len(before):",
        tests=["tests/test_ch5_engine_unicode.py"],
        why="text is emitted for an incomplete multi-byte UTF-8 character: é中😀 streams as U+FFFD",
    ),
    Mutant(
        name="seeded_generator_reset_on_recompute",
        path=RUNNER,
        old="gen = old.generator if old is not None else self._make_generator(nr.sampling_params)",
        new="gen = self._make_generator(nr.sampling_params)",
        tests=["tests/test_ch5_engine_invariance.py::test_seeded_sampling_invariant_under_preemption"],
        why="a seeded request preempted by recompute restarts its draws: its tokens depend on memory pressure",
    ),
    Mutant(
        name="repetition_penalty_ignores_prompt",
        path="05_mini_vllm/sample/sampler.py",
        old="seen = seen[:, :vocab] | (counts > 0)",
        new="seen = counts > 0",
        tests=["tests/test_ch5_sampler.py"],
        why="the repetition penalty looks at output tokens only (vLLM counts prompt + output)",
    ),
    Mutant(
        name="spec_rows_shifted",
        path=STEP_OUT,
        old="(spec_rows.extend(range(row, row + k + 1)) if k else plain_rows.append(row))",
        new="(spec_rows.extend(range(row + 1, row + k + 2)) if k else plain_rows.append(row))",
        tests=["tests/test_ch5_spec_decode.py::test_greedy_identical_to_no_speculation"],
        why="drafts verified against the logits of the next position: accepted tokens the target would not emit",
    ),
    # Asynchronous scheduling: the races an overlap scheduler must not have.
    Mutant(
        name="placeholder_never_subtracted",
        path="03_scheduler/scheduler.py",
        old="        req.num_output_placeholders -= len(sampled)",
        new="        req.num_output_placeholders -= 0",
        tests=[ASYNC + "::test_async_scheduling_gives_the_synchronous_tokens[plain]"],
        why="a token that came back never replaces its placeholder: the scheduler computes positions "
            "whose tokens do not exist",
    ),
    Mutant(
        name="block_completed_in_flight_never_cached",
        path="03_scheduler/scheduler_base.py",
        old="                self.kv_cache_manager.allocate_slots(req, 0)",
        new="                pass",
        tests=[ASYNC + "::test_prefix_hits_under_async_scheduling_read_only_known_tokens"],
        why="blocks are hashed only at the next allocation, which a request finishing with tokens in "
            "flight never gets: its last full blocks are never cached and later turns miss them",
    ),
    Mutant(
        name="token_of_preempted_request_dropped",
        path="03_scheduler/scheduler_base.py",
        old="if req is None or req.is_finished():",
        new="if req is None or req.status != RequestStatus.RUNNING:",
        tests=[ASYNC + "::test_async_scheduling_gives_the_synchronous_tokens[recompute]"],
        why="a request preempted while its step was in flight loses the token that step sampled",
    ),
    Mutant(
        name="runner_forgets_its_own_tokens",
        path=ASYNC_OUT,
        old="            self.sampler.input_batch.append_sampled(self.sampler.requests, pending.lists()[0])",
        new="            pending.lists()",
        tests=[ASYNC + "::test_async_scheduling_gives_the_synchronous_tokens[plain]"],
        why="a deferred step's tokens never reach the runner's host state: the runner waits for the scheduler "
            "to send tokens it sampled itself, and later steps read stale inputs",
    ),
    Mutant(
        name="runner_forgets_its_own_tokens_with_drafts",
        path=STEP_OUT,
        old="""        if self.append_own_tokens:
            self.sampler.input_batch.append_sampled(self.sampler.requests, sampled)""",
        new="""        if self.append_own_tokens:
            pass""",
        tests=[ASYNC + "::test_async_scheduling_with_a_draft_model[plain]"],
        why="under async speculation the runner waits for the scheduler to send tokens it sampled itself: "
            "the next step reads a stale input",
    ),
    Mutant(
        name="pending_tokens_not_fed_back",
        path=ASYNC_OUT,
        old="        input_ids[dst] = self.pending.tokens[src]",
        new="        pass",
        tests=[ASYNC + "::test_the_next_step_reads_the_last_tokens_on_the_device"],
        why="the step prepared while the previous step's tokens are pending reads the stale host entry at "
            "their positions instead of the tokens on the device",
    ),
    Mutant(
        name="history_read_before_settling",
        path="05_mini_vllm/sample/param_effects.py",
        old="    return isinstance(params, SamplingParams) and uses_any(params, _HISTORY_FIELDS)",
        new="    return False",
        tests=[ASYNC + "::test_the_next_step_reads_the_last_tokens_on_the_device"],
        why="a penalised request's step is prepared before the pending tokens are settled: penalties and "
            "grammars miss the latest token",
    ),
    Mutant(
        name="drafts_for_a_parameter_the_verifier_does_not_rebuild",
        path="05_mini_vllm/sample/param_effects.py",
        old='    "min_p": _NO_DRAFTS, "logit_bias": _NO_DRAFTS,',
        new='    "min_p": _PLAIN, "logit_bias": _NO_DRAFTS,',
        tests=["tests/test_ch5_sampling_params.py::test_param_effects_drive_drafts_and_history"],
        why="min_p requests get drafts, but verification rebuilds only temperature, top-k and top-p: drafts are "
            "judged under a distribution min_p would have cut, so speculation is no longer lossless for them",
    ),
    Mutant(
        name="every_step_waits_for_the_last_tokens",
        path=ASYNC_OUT,
        old="        if self.pending is not None and any(",
        new="        if self.pending is not None and 1 or self.pending is not None and any(",
        tests=[ASYNC + "::test_the_next_step_reads_the_last_tokens_on_the_device"],
        why="the runner settles every step before preparing the next: correct tokens, but the device idles "
            "for the runner's host work every step (the overlap asynchronous scheduling is for)",
    ),
    Mutant(
        name="runner_reads_the_optimistic_positions",
        path=RUNNER,
        old="            if not self.drafter.keeps_computed_counts or cr.resumed_from_preemption:",
        new="            if True:",
        tests=[ASYNC + "::test_async_scheduling_with_a_draft_model[plain]"],
        why="under async speculation the runner takes the scheduler's count, which assumes every draft in "
            "flight was accepted: rejected positions are skipped and the KV has holes",
    ),
    Mutant(
        name="capture_size_not_padded_to",
        path=GRAPHS,
        old="padded = self.config.padded_size(num_tokens)",
        new="padded = num_tokens if self.config.padded_size(num_tokens) else None",
        tests=GRAPH_TESTS,
        why="a graph step runs at its own token count instead of the capture size it pads to: no graph exists for it",
    ),
    Mutant(
        name="static_buffer_reallocated_after_capture",
        path=GRAPHS,
        old="self.input_ids[:n].copy_(input_ids, non_blocking=True)",
        new="self.input_ids = torch.zeros_like(self.input_ids); self.input_ids[:n].copy_(input_ids)",
        tests=GRAPH_TESTS,
        why="the step's ids go into a new buffer: a replay would read the captured (stale) address",
    ),
    Mutant(
        name="padded_row_writes_a_real_slot",
        path=GRAPHS,
        old="self.slot_mapping[n:padded].fill_(-1)",
        new="self.slot_mapping[n:padded].fill_(0)",
        tests=GRAPH_TESTS,
        why="padded rows write their garbage K/V into slot 0, a real token's slot",
    ),
    # ---- EAGLE's proposer (spec_decode/engine/eagle.py): the exercise's Part 3 ----
    Mutant(
        name="eagle_ids_not_shifted",
        path=EAGLE,
        old="torch.from_numpy(np.minimum(idx + 1, len(step.input_ids) - 1))",
        new="torch.from_numpy(idx)",
        tests=EAGLE_TESTS,
        why="the head reads the token the target read at p, not the one at p + 1",
    ),
    Mutant(
        name="eagle_hidden_of_the_wrong_position",
        path=EAGLE,
        old="step.hidden.index_select(0, idx_t))",
        new="step.hidden.index_select(0, torch.clamp(idx_t - 1, min=0)))",
        tests=EAGLE_TESTS,
        why="the hidden states are shifted with the ids: position p reads the target's state at p - 1",
    ),
    Mutant(
        name="eagle_kv_not_written",
        path=EAGLE,
        old="md = self._metadata(step.slot_mapping.index_select(0, idx_t), tables",
        new="md = self._metadata(torch.full_like(idx_t, -1), tables",
        tests=EAGLE_TESTS,
        why="pass 1 attends but writes no KV: later drafts read stale or empty keys",
    ),
    Mutant(
        name="eagle_positions_not_advanced",
        path=EAGLE,
        old="p = pos_w[live] + (j - 1)",
        new="p = pos_w[live] + 1",
        tests=EAGLE_TESTS,
        why="every chain step after the second sits at the same position (rotary and slot)",
    ),
    Mutant(
        name="eagle_target_hidden_fed_back",
        path=EAGLE,
        old="g = self._run(md, tok, torch.from_numpy(p).to(dev), g)",
        new="g = self._run(md, tok, torch.from_numpy(p).to(dev), "
            "step.hidden.index_select(0, torch.from_numpy(idx[last[want[live]]]).to(dev)))",
        tests=EAGLE_TESTS,
        why="the chain feeds the target's last hidden state again instead of the head's own output",
    ),
    # ---- which blocks hold the head's KV (spec_decode/engine/head_kv.py) ----
    Mutant(
        name="eagle_gap_not_marked",
        path=HEAD_KV,
        old="self.stale[slots[slots >= 0] // self.bs] = True",
        new="pass",
        tests=HEAD_KV_TESTS
        + ["tests/test_ch5_eagle.py::test_no_head_at_large_batches_and_requests_with_gaps_stop_drafting"],
        why="a step without the head leaves no mark: its requests draft from holes in the head's KV later",
    ),
    Mutant(
        name="eagle_stale_block_never_cleared",
        path=HEAD_KV,
        old="self.stale[slots[(slots >= 0) & (slots % self.bs == 0)] // self.bs] = False",
        new="pass",
        tests=HEAD_KV_TESTS,
        why="a block once written without the head stays marked: every later owner of it stops drafting",
    ),
    Mutant(
        name="compiled_graph_unpacks_linears",
        path="05_mini_vllm/models/cpu_ops.py",
        old="return torch.ops.mini_vllm.packed_linear(x, weight, bias, owner._packed_name)",
        new="return F.linear(x, weight, bias)",
        tests=["tests/test_ch5_compilation.py::test_compiled_pieces_keep_the_packed_linears"],
        why="the compiled CPU model traces its linears to torch's matmul on the unpacked weight (slower in bf16)",
    ),
    Mutant(
        name="linear_kernel_chosen_by_row_count",
        path="05_mini_vllm/models/cpu_ops.py",
        old="if native_ops.handles_linear(x, weight):",
        new="if native_ops.handles_linear(x, weight) and x.numel() < 64 * x.shape[-1]:",
        tests=["tests/test_kernels_cpu_gemm.py::test_linear_gives_every_row_the_same_bits_in_any_batch"],
        why="small batches take the C++ kernel and large ones oneDNN: a request's tokens depend on its batch",
    ),
    Mutant(
        name="greedy_verify_emits_the_bonus_row",
        path="05_mini_vllm/spec_decode/engine/verifier.py",
        old="out.append(list(d[:n]) + [best[row + n]])",
        new="out.append(list(d[:n]) + [best[row + len(d)]])",
        tests=["tests/test_ch5_spec_decode.py::test_greedy_verification_gives_the_rejection_samplers_tokens"],
        why="after a rejected draft the greedy path emits the bonus row's argmax, not the rejected row's",
    ),
    Mutant(
        name="auto_schedule_drafts_on_a_tie",
        path="05_mini_vllm/spec_decode/engine/auto_schedule.py",
        old="drafting = length > cost",
        new="drafting = length >= cost",
        tests=["tests/test_ch5_auto_schedule.py::test_break_even_equal_to_the_acceptance_length_does_not_draft"],
        why="at the break-even drafting costs exactly what it saves: the measured schedule must not draft",
    ),
    Mutant(
        name="auto_schedule_without_a_prior",
        path="05_mini_vllm/spec_decode/engine/auto_schedule.py",
        old="return float(self.k + 1)",
        new="return 1.0",
        tests=["tests/test_ch5_auto_schedule.py::test_prior_and_rounding_up_between_measured_sizes"],
        why="with no optimistic prior the engine never drafts, so it never measures an acceptance length",
    ),
    Mutant(
        name="spec_profile_leaves_out_the_proposer",
        path="05_mini_vllm/worker/spec_profile.py",
        old="out.append((b, sum(times[1:]) / times[0]))",
        new="out.append((b, times[1] / times[0]))",
        tests=["tests/test_ch5_auto_schedule.py::test_the_ladder_doubles_and_stops_where_no_acceptance_pays"],
        why="the break-even must count the proposer's passes, not only the target's verification",
    ),
    Mutant(
        name="eagle_tree_mask_shows_siblings",
        path="training/eagle_tree.py",
        old="mask[1 + i, [context + 1 + j for j in tree.path(i)]] = True",
        new="mask[1 + i, context + 1:context + 2 + i] = True",
        tests=["tests/test_eagle_tree.py::test_tree_mask_sees_the_context_the_root_and_the_path_only",
               "tests/test_eagle_tree.py::test_one_forward_with_tree_attention_gives_each_paths_causal_logits"],
        why="a causal mask over the flattened tree lets a node attend to other branches' tokens",
    ),
    Mutant(
        name="moe_topk_not_renormalised",
        path=MOE_ROUTER,
        old="weights = torch.softmax(top_logits, dim=-1)  # = p_i / sum of the k picked p's",
        new="weights = torch.exp(top_logits - torch.logsumexp(logits, dim=-1, keepdim=True))",
        tests=MOE_LAYER_TESTS,
        why="with norm_topk_prob set the k experts' weights must be divided by their sum",
    ),
    Mutant(
        name="moe_token_to_one_expert_twice",
        path=MOE_ROUTER,
        old="top_logits, ids = torch.topk(logits, topk, dim=-1)",
        new="top_logits, ids = torch.topk(logits, topk, dim=-1); ids[:, -1:] = ids[:, :1]; "
            "top_logits = logits.gather(1, ids)",
        tests=MOE_LAYER_TESTS,
        why="a token's k slots must name k distinct experts; one expert twice doubles its term",
    ),
    Mutant(
        name="moe_ep_expert_offset_off_by_one",
        path=MOE_LAYER,
        old="self.expert_offset, self.intermediate_size_per_partition = rank * self.local_num_experts, "
            "intermediate_size",
        new="self.expert_offset, self.intermediate_size_per_partition = rank * self.local_num_experts + 1, "
            "intermediate_size",
        tests=["tests/test_ch5_moe_layer.py::test_ranks_partial_outputs_add_up_to_one_rank"],
        why="under expert parallelism rank r holds experts [r*E/ep, (r+1)*E/ep): a shifted offset drops one expert",
    ),
    Mutant(
        name="moe_fused_gate_up_swapped",
        path=MOE_LAYER,
        old="param[:, :i].copy_(mine[:, col0:col0 + i])",
        new="param[:, :i].copy_(mine[:, i_full + col0:i_full + col0 + i])",
        tests=["tests/test_ch5_moe_layer.py::test_layer_loads_fused_tensors_like_per_expert"],
        why="a fused experts.gate_up_proj holds every expert's gate rows first, then its up rows",
    ),
    Mutant(
        name="moe_sparse_layer_step_from_zero",
        path="05_mini_vllm/models/moe_config.py",
        old="and (layer_idx + 1) % config.decoder_sparse_step == 0)",
        new="and layer_idx % config.decoder_sparse_step == 0)",
        tests=["tests/test_ch5_moe_model.py::test_ragged_prefill_matches_hf[e8-k2-step2]"],
        why="with decoder_sparse_step s the sparse layers are s-1, 2s-1, ...: layer i is sparse iff (i + 1) % s == 0",
    ),
    Mutant(
        name="moe_kernel_padding_reaches_output",
        path=MOE_KERNEL,
        old="sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)",
        new="sorted_ids = torch.full((max_padded,), numel - 1, dtype=torch.int32, device=device)",
        tests=[f"{MOE_KERNEL_TESTS}::test_align_worked_example", f"{MOE_KERNEL_TESTS}::test_kernel_equals_reference"],
        why="the align step's padding must be the sentinel T*k, one past the last (token, slot) pair: padding "
            "that names a real pair makes every padded block overwrite that pair's row with its expert's output",
    ),
    Mutant(
        name="moe_align_token_to_one_expert_twice",
        path=MOE_KERNEL,
        old="offs = c * CHUNK + tl.arange(0, CHUNK)",
        new="offs = c * (CHUNK - 1) + tl.arange(0, CHUNK)",
        tests=[f"{MOE_KERNEL_TESTS}::test_align_spans_several_chunks", f"{MOE_KERNEL_TESTS}::test_align_invariants"],
        why="the align programs must read disjoint chunks of pairs: overlapping chunks place the pair at each "
            "chunk edge in its expert's segment twice",
    ),
    Mutant(
        name="fp8_weight_scale_applied_twice",
        path=QUANT_FP8,
        old="    out = acc * x_scale * w_scale.reshape(1, -1)\n",
        new="    out = acc * x_scale * w_scale.reshape(1, -1) * w_scale.reshape(1, -1)\n",
        tests=[f"{QUANT_TESTS}::test_fp8_scaled_mm_matches_dequantized_reference[per-token]"],
        why="the W8A8 product is scaled by s_x * s_w once: a weight scale applied again (once by _scaled_mm's "
            "scale_b, once after it) shrinks every output by max|w| / 448",
    ),
    Mutant(
        name="fp8_activation_scale_not_applied",
        path=QUANT_FP8,
        old="    out = acc * x_scale * w_scale.reshape(1, -1)\n",
        new="    out = acc * w_scale.reshape(1, -1)\n",
        tests=[f"{QUANT_TESTS}::test_fp8_scaled_mm_matches_dequantized_reference[per-tensor]"],
        why="the dequantizing side must undo both quantizations: without s_x the output is in units of the "
            "activations' fp8 codes, max|x| / 448 times too large or small",
    ),
    Mutant(
        name="int8_scale_not_applied_on_dequantize",
        path=INT8_KERNEL,
        old="_int8_linear_kernel(xf.numpy(), q.numpy(), scale.numpy(), out.numpy())",
        new="_int8_linear_kernel(xf.numpy(), q.numpy(), torch.ones_like(scale).numpy(), out.numpy())",
        tests=[f"{QUANT_TESTS}::test_int8_kernel_matches_reference_and_is_batch_invariant[3-dtype0]"],
        why="the int8 kernel sums x * q, the weight's integer codes: the row's scale turns the sum back into "
            "x @ w; dropped, every output is 127 / max|w_row| times too large",
    ),
    Mutant(
        name="int8_quantize_divides_by_scale_twice",
        path=QUANT_UTILS,
        old="return (w.float() / _as_rows(scale, w)).round()",
        new="return (w.float() / _as_rows(scale, w) / _as_rows(scale, w)).round()",
        tests=[f"{QUANT_TESTS}::test_int8_round_trip_within_half_a_step"],
        why="quantizing divides by the scale once; twice, nearly every code clips to +-127 and the weight's "
            "shape is lost",
    ),
]
