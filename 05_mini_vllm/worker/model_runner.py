"""The model runner: persistent batch -> flat inputs -> forward -> sample.

vLLM counterpart: `vllm/v1/worker/gpu_model_runner.py` (`GPUModelRunner`:
`_update_states`, `_prepare_inputs`, `execute_model`, `initialize_kv_cache`).

One `execute_model(scheduler_output)` call:
1. updates the persistent batch from the SchedulerOutput alone (finished and
   preempted requests leave; new ones arrive with their tokens and block
   table; cached ones bring new blocks and new tokens);
2. executes swap-out, swap-in and copy on the real KV tensors, in that order;
3. builds input ids, positions, slot mapping, block tables, query start
   locations and sequence lengths for the whole mixed batch (vectorised);
4. runs the model once (a KV connector loads external KV before it and
   queues the step's full blocks after it);
5. hands the hidden states to the output mode, which computes logits only at
   the rows that sample (the last scheduled token of a request whose prompt is
   complete, plus its draft rows), samples, and returns the tokens per request.

What the options add plugs in through three declared parts, so `execute_model`
is the same eight calls whatever is switched on:
* `self.drafter` (`drafter.py`, `eagle_drafter.py`): speculative decoding; the
  base `Drafter` is "none", every hook a no-op;
* `self.step_sampler` (`step_outputs.StepSampler`): the sampling state pooled in
  the persistent batch's columns, structured outputs' grammars, the verifier
  of draft rows;
* `self.outputs`: `step_outputs.StepOutputs` (the tokens reach the host within
  the step; prompt logprobs go back once, on the step that completes the
  prompt), or `async_output.DeferredOutputs` under asynchronous scheduling
  without speculation (the step returns as soon as its work is queued; the
  next step reads its tokens on the device).
Every upload goes through pinned staging, one transfer per step (`HostStaging`).
Nothing here reads the scheduler's Request objects, so a tensor-parallel
executor can broadcast the same SchedulerOutput to every worker.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.compilation.config import CompilationConfig
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import ModelRunnerOutput
from mini_vllm.spec_decode.engine.eagle_base import EagleProposerBase
from mini_vllm.spec_decode.engine.verifier import SpecVerifier
from mini_vllm.structured_output import StructuredOutputs
from mini_vllm.worker.async_output import DeferredOutputs, DeferredStepOutput, HostStaging
from mini_vllm.worker.drafter import Drafter, TokenDrafter
from mini_vllm.worker.eagle_drafter import EagleDrafter
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from mini_vllm.worker.model_forward import ModelForward, eager_config
from mini_vllm.worker.prepare_inputs import compute_positions, compute_query_start_loc, compute_slot_mapping
from mini_vllm.worker.step_outputs import OutputMode, StepOutputs, StepSampler


class ModelRunner:
    def __init__(self, model, model_config, cache_engine, block_size: int, max_num_seqs: int,
                 max_model_len: int, device, logprobs_mode: str = "raw_logprobs",
                 tokenizer_path: str | None = None, kv_connector=None, proposer=None,
                 async_scheduling: bool = False, compilation_config: CompilationConfig | None = None,
                 spec_tokens_for_batch: Callable[[int], int] | None = None) -> None:
        self.model, self.model_config = model, model_config
        # Asynchronous scheduling: the next SchedulerOutput is built before the
        # scheduler knows this step's tokens, so the runner appends them itself.
        self.async_scheduling = async_scheduling
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.requests: dict[str, CachedRequestState] = {}
        max_blocks = -(-max_model_len // block_size)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_blocks, model_config.vocab_size)
        self.sampler = Sampler(logprobs_mode)
        self.vocab_size = model_config.vocab_size
        for layer, kv in zip(model.attention_layers(), cache_engine.gpu_cache):
            layer.kv_cache = kv  # every layer reads and writes its own pair
        # The forward pass: eager, compiled, or CUDA graphs (`model_forward.py`); None: eager.
        self.compilation_config = compilation_config or eager_config(self.device.type, max_num_seqs)
        self.model_forward = ModelForward(model, self.compilation_config, self.device, max_blocks)
        # Chapter 6: the worker-side KV connector when kv_transfer_config is given
        # (duck-typed, never imported here), else None.
        self.kv_connector = kv_connector
        # The parts that plug into every step, each behind a declared interface:
        # speculative decoding (`drafter.py`: no-op without it), sampling with its pooled
        # state and structured outputs (`step_outputs.StepSampler`), and the output mode
        # (`step_outputs.StepOutputs`, or `async_output.DeferredOutputs` under asynchronous
        # scheduling without speculation: the step returns before its tokens reach the host).
        drafter_cls = (Drafter if proposer is None else
                       EagleDrafter if isinstance(proposer, EagleProposerBase) else TokenDrafter)
        self.drafter: Drafter = drafter_cls(self.requests, self.input_batch, max_model_len, proposer,
                                            async_scheduling, spec_tokens_for_batch)
        self.step_sampler = StepSampler(self.sampler, SpecVerifier(self.device),
                                        StructuredOutputs(tokenizer_path, self.vocab_size),
                                        self.requests, self.input_batch)
        # Pinned staging of each step's uploads (one transfer, no wait on the device) and of
        # the deferred outputs' tokens; plain tensors on a CPU.
        self.staging = HostStaging(self.device, max_num_seqs)
        self.outputs: OutputMode = (DeferredOutputs(model, self.step_sampler, self.staging)
                                    if async_scheduling and proposer is None else
                                    StepOutputs(model, self.step_sampler, self.drafter, async_scheduling))

    # ---------------------------------------------------------- 1. states
    def _update_states(self, so) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
            self.step_sampler.forget(rid)
            self.drafter.forget(rid)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)  # keep the state: a swapped request comes back
            self.drafter.forget(rid)
        for nr in so.scheduled_new_reqs:
            old = self.requests.get(nr.req_id)
            gen = old.generator if old is not None else self._make_generator(nr.sampling_params)
            st = CachedRequestState(nr.req_id, list(nr.prompt_token_ids), list(nr.token_ids),
                                    list(nr.block_ids), nr.num_computed_tokens,
                                    nr.sampling_params, nr.eos_token_id, gen)
            self.requests[nr.req_id] = st
            batch.add_request(st)
        for cr in so.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            st.token_ids.extend(cr.new_token_ids)
            if not self.drafter.keeps_computed_counts or cr.resumed_from_preemption:
                st.num_computed_tokens = cr.num_computed_tokens
            elif cr.num_computed_tokens < st.num_computed_tokens:  # async_drafts.py's invariant
                raise RuntimeError(f"request {cr.req_id!r}: the scheduler counts {cr.num_computed_tokens} computed "
                                   f"tokens, fewer than the {st.num_computed_tokens} this runner computed")
            if cr.resumed_from_preemption or cr.replace_block_ids:
                st.block_ids = list(cr.new_block_ids)
                batch.add_request(st)
                continue
            st.block_ids.extend(cr.new_block_ids)
            row = batch.req_id_to_index.get(cr.req_id)
            if row is None:
                batch.add_request(st)
                continue
            if cr.new_token_ids:
                batch.append_token_ids(row, cr.new_token_ids)
            if cr.new_block_ids:
                batch.append_block_ids(row, cr.new_block_ids)
            batch.num_computed_tokens[row] = st.num_computed_tokens

    def _make_generator(self, params):
        # A Chapter 3 scheduler's own SamplingParams (max_tokens and stop rules
        # only, as in tests/test_ch5_runner.py) declares no seed: no generator.
        seed = params.seed if isinstance(params, SamplingParams) else None
        if seed is None:
            return None
        # On the logits' device: a CUDA tensor cannot draw from a CPU generator.
        return torch.Generator(device=self.device).manual_seed(int(seed))

    # ---------------------------------------------------------- 3. inputs
    def _prepare_inputs(self, so) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64,
                           count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed_tokens[rows]
        self.drafter.begin_step()  # every scheduled draft is verified
        for i, rid in enumerate(req_ids):  # drafts sit after the known tokens
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                n = int(batch.num_tokens[rows[i]])
                drafts = self.drafter.fill(rid, drafts, int(batch.token_ids_cpu[rows[i], n - 1]))
                batch.token_ids_cpu[rows[i], n:n + len(drafts)] = drafts
        query_start_loc = compute_query_start_loc(num_sched)
        positions = compute_positions(computed, num_sched)
        req_indices = np.repeat(np.arange(len(req_ids)), num_sched)
        input_ids = batch.token_ids_cpu[rows[req_indices], positions]
        block_table = batch.block_table[rows]
        slot_mapping = compute_slot_mapping(block_table, req_indices, positions, self.block_size)
        seq_lens = computed + num_sched
        num_drafts = np.array([len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids],
                              dtype=np.int64)
        samples = seq_lens - num_drafts >= batch.num_tokens[rows]  # prompt complete
        max_blocks = max(1, int(-(-seq_lens.max() // self.block_size)))
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_table[:, :max_blocks])),
            cu_seqlens_q=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            max_query_len=int(num_sched.max()), max_seq_len=int(seq_lens.max()),
            query_lens_cpu=num_sched.tolist(), seq_lens_cpu=seq_lens.tolist())
        # Checked once per step on the host copies, before the upload: on a GPU the same
        # checks on device tensors would wait for the GPU five times per step.
        md.validate(self.cache_engine.num_gpu_blocks, self.block_size)
        # Logit rows: the last token of each sampling request, plus its draft rows.
        logit_rows, sample_req = [], []
        for i in np.flatnonzero(samples):
            end = int(query_start_loc[i + 1])
            k = int(num_drafts[i])
            logit_rows.extend(range(end - 1 - k, end))
            sample_req.append(int(i))
        # The previous step's tokens the host does not know yet (deferred outputs only).
        dst, src = self.outputs.pending_rows(req_ids, batch.num_tokens[rows], computed, num_sched, query_start_loc)
        ids_d, pos_d, sm_d, bt_d, cu_d, sl_d, rows_d, dst_d, src_d = self.staging.upload(
            input_ids, positions, slot_mapping, md.block_tables.numpy(), query_start_loc, md.seq_lens.numpy(),
            np.asarray(logit_rows, dtype=np.int64), np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64))
        if dst:
            self.outputs.feed_back(ids_d, dst_d, src_d)
        return StepInputs(ids_d, pos_d, md.with_tensors(sm_d, bt_d, cu_d, sl_d), req_ids, rows_d, sample_req)

    # ---------------------------------------------------------- 4-5. run
    @torch.inference_mode()
    def execute_model(self, so) -> ModelRunnerOutput | DeferredStepOutput:
        """The step's output; with deferred outputs (asynchronous scheduling without
        speculation) a `DeferredStepOutput`, returned once the step's work is queued.
        The same calls run whatever is switched on: what speculative decoding, structured
        outputs and the output mode add happens inside `self.drafter`, `self.step_sampler`
        and `self.outputs`."""
        self.outputs.before_step(so)
        self._update_states(so)
        ce = self.cache_engine
        ce.swap_out(so.blocks_to_swap_out)
        ce.swap_in(so.blocks_to_swap_in)
        ce.copy(so.blocks_to_copy)
        self.drafter.blocks_moved(so)
        if not so.num_scheduled_tokens:
            return self.outputs.empty()
        step = StepInputs(*self._prepare_inputs(so))
        # Returns at once for this class's _prepare_inputs (it checked the host copies); it checks
        # the metadata of an exercise runner's _prepare_inputs, which this execute_model also serves.
        step.attn_metadata.validate(self.cache_engine.num_gpu_blocks, self.block_size)
        kvc = self.kv_connector
        if kvc is not None:  # external KV lands in its blocks before any layer reads them
            kvc.bind_connector_metadata(so.kv_connector_metadata)
            kvc.start_load_kv(step.attn_metadata)
        hidden = self.model_forward(step.input_ids, step.positions, step.attn_metadata)
        if kvc is not None:  # queue this step's full blocks; bounded, never waits on the store
            kvc.wait_for_save()
            kvc.clear_connector_metadata()
        return self.outputs.finish(step, hidden)

    def capture_model(self) -> None:
        """Capture the CUDA graphs (nothing without a graph mode); after the KV
        cache is bound, before the first step (vLLM: `GPUModelRunner.capture_model`)."""
        self.model_forward.capture(self.cache_engine.num_gpu_blocks, self.block_size)
