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
4. runs the model once, computes logits only at the rows that sample
   (the last scheduled token of a request whose prompt is complete), plus
   every prompt row of a request that asked for prompt logprobs;
5. samples (the sampling metadata come from the persistent batch's columns,
   rebuilt only when the rows that sample change) and returns the tokens (and
   logprobs) per request; prompt
   logprobs go back once, on the step that completes the prompt (vLLM's
   `_get_prompt_logprobs_dict`), so chunked prefill fills them piece by piece.
   With asynchronous scheduling and no speculation the step returns a
   `DeferredStepOutput` as soon as its work is queued; the next step reads
   its tokens on the device and appends them to the host state only after
   queuing its own work (`async_output.py`: the device never waits for the
   runner's host work). Every upload goes through pinned staging, one
   transfer per step (`HostStaging`).
Nothing here reads the scheduler's Request objects, so a tensor-parallel
executor can broadcast the same SchedulerOutput to every worker.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.worker.async_drafts import AsyncDrafts
from mini_vllm.sample.param_effects import reads_history
from mini_vllm.worker.async_output import DeferredStepOutput, HostStaging, defer_step, feedback_indices
from mini_vllm.compilation.config import CompilationConfig
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch
from mini_vllm.worker.model_forward import ModelForward, eager_config
from mini_vllm.worker.prompt_logprobs import prompt_logprobs_dict
from mini_vllm.worker.prepare_inputs import compute_positions, compute_query_start_loc, compute_slot_mapping
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import ModelRunnerOutput
from mini_vllm.speculative.eagle_base import EagleProposerBase
from mini_vllm.speculative.proposers import DraftModelProposer
from mini_vllm.worker.draft_inputs import propose_drafts
from mini_vllm.worker.eagle_inputs import propose_eagle
from mini_vllm.speculative.verifier import SpecVerifier


class ModelRunner:
    def __init__(self, model, model_config, cache_engine, block_size: int, max_num_reqs: int,
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
        self.input_batch = InputBatch(max_num_reqs, max_model_len, max_blocks, model_config.vocab_size)
        self.sampler = Sampler(logprobs_mode)
        self.vocab_size = model_config.vocab_size
        for layer, kv in zip(model.attention_layers(), cache_engine.gpu_cache):
            layer.kv_cache = kv  # every layer reads and writes its own pair
        # The forward pass: eager, compiled, or CUDA graphs (`model_forward.py`); None: eager.
        self.compilation_config = compilation_config or eager_config(self.device.type, max_num_reqs)
        self.model_forward = ModelForward(model, self.compilation_config, self.device, max_blocks)
        # Chapter 6: the worker-side KV connector when kv_transfer_config is given
        # (duck-typed, never imported here), else None.
        self.kv_connector = kv_connector
        self.spec_verifier = SpecVerifier(self.device)
        # The speculative proposer (Chapter 4's `NgramProposer`,
        # `speculative.proposers.DraftModelProposer` or `speculative.eagle.EagleProposer`), or None without
        # speculative decoding: after each step it drafts the next step's tokens.
        self.proposer = proposer
        # Dynamic speculative decoding (`SpeculativeConfig.num_tokens_for_batch`, or the
        # measured `speculative.auto_schedule.AutoSchedule` the worker sets after capture): how
        # many drafts to propose after a step of n requests; None: always the proposer's k.
        self.spec_tokens_for_batch = spec_tokens_for_batch
        # Asynchronous scheduling with speculation: the drafts kept between steps and the
        # runner's own computed counts (`async_drafts.py`); None otherwise.
        self.async_drafts = AsyncDrafts() if async_scheduling and proposer is not None else None
        # Asynchronous scheduling without speculation: each step returns a deferred output and
        # the next one reads its tokens on the device (`async_output.py`); `pending` is the
        # previous step's output until this runner has appended its tokens (settled it).
        self.defer_outputs = async_scheduling and proposer is None
        self.pending: DeferredStepOutput | None = None
        # Pinned staging of each step's uploads (one transfer, no wait on the device) and of
        # the deferred outputs' tokens; plain tensors on a CPU.
        self.staging = HostStaging(self.device, max_num_reqs)
        # This step's drafts to verify, by request id (set by _prepare_inputs): the
        # scheduled ones, with placeholders filled by the runner's own.
        self.step_drafts: dict[str, list[int]] = {}
        # Structured outputs: the tokenizer folder and one grammar per
        # constrained request, built on its first sampling step.
        self.tokenizer_path = tokenizer_path
        self.grammars: dict = {}

    # ---------------------------------------------------------- 1. states
    def _update_states(self, so) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.grammars.pop(rid, None)
            batch.remove_request(rid)
            if isinstance(self.proposer, DraftModelProposer):  # its KV; the n-gram lookup keeps nothing
                self.proposer.free(rid)
            if self.async_drafts is not None:
                self.async_drafts.drop(rid)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)  # keep the state: a swapped request comes back
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.free(rid)
            if self.async_drafts is not None:
                self.async_drafts.drop(rid)
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
            if self.async_drafts is None or cr.resumed_from_preemption:
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
    def _prepare_inputs(self, so):
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64,
                           count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed_tokens[rows]
        self.step_drafts = {}  # every scheduled draft is verified
        for i, rid in enumerate(req_ids):  # drafts sit after the known tokens
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                n = int(batch.num_tokens[rows[i]])
                if self.async_drafts is not None and AsyncDrafts.are_placeholders(drafts):
                    drafts = self.async_drafts.fill(rid, drafts, int(batch.token_ids_cpu[rows[i], n - 1]))
                batch.token_ids_cpu[rows[i], n:n + len(drafts)] = drafts
                self.step_drafts[rid] = list(drafts)
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
        dst, src = ([], []) if self.pending is None else feedback_indices(
            self.pending, req_ids, batch.num_tokens[rows], computed, num_sched, query_start_loc)
        ids_d, pos_d, sm_d, bt_d, cu_d, sl_d, rows_d, dst_d, src_d = self.staging.upload(
            input_ids, positions, slot_mapping, md.block_tables.numpy(), query_start_loc, md.seq_lens.numpy(),
            np.asarray(logit_rows, dtype=np.int64), np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64))
        if dst:
            ids_d[dst_d] = self.pending.tokens[src_d]
        return ids_d, pos_d, md.with_tensors(sm_d, bt_d, cu_d, sl_d), req_ids, rows_d, sample_req

    # ---------------------------------------------------------- 4-5. run
    @torch.inference_mode()
    def execute_model(self, so) -> ModelRunnerOutput | DeferredStepOutput:
        """The step's output; with deferred outputs (asynchronous scheduling without
        speculation) a `DeferredStepOutput`, returned once the step's work is queued."""
        if self.pending is not None and any(
                r in so.num_scheduled_tokens and reads_history(self.requests[r].sampling_params)
                for r in self.pending.index if r in self.requests):
            self._settle()  # this step's sampling reads the pending tokens on the host
        self._update_states(so)
        ce = self.cache_engine
        ce.swap_out(so.blocks_to_swap_out)
        ce.swap_in(so.blocks_to_swap_in)
        ce.copy(so.blocks_to_copy)
        if isinstance(self.proposer, EagleProposerBase):  # which blocks lack the head's KV moves with them
            self.proposer.head_kv.moved(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
        if not so.num_scheduled_tokens:
            self._settle()
            return ModelRunnerOutput([], {}, [])
        input_ids, positions, md, req_ids, logit_rows, sample_req = self._prepare_inputs(so)
        # Returns at once for this class's _prepare_inputs (it checked the host copies); it checks
        # the metadata of an exercise runner's _prepare_inputs, which this execute_model also serves.
        md.validate(self.cache_engine.num_gpu_blocks, self.block_size)
        kvc = self.kv_connector
        if kvc is not None:  # external KV lands in its blocks before any layer reads them
            kvc.bind_connector_metadata(so.kv_connector_metadata)
            kvc.start_load_kv(md)
        hidden = self.model_forward(input_ids, positions, md)
        if kvc is not None:  # queue this step's full blocks; bounded, never waits on the store
            kvc.wait_for_save()
            kvc.clear_connector_metadata()
        if self.defer_outputs:
            return defer_step(self, hidden, md, req_ids, logit_rows, sample_req)
        sampled: dict[str, list[int]] = {r: [] for r in req_ids}
        logprobs: dict[str, list] = {}
        if sample_req:
            logits = self.model.compute_logits(hidden.index_select(0, logit_rows))
            plain, plain_rows, spec, spec_rows, row = [], [], [], [], 0
            for i in sample_req:  # each verifying request owns k + 1 consecutive logits rows
                k = len(self.step_drafts.get(req_ids[i], ()))
                (spec if k else plain).append(i)
                (spec_rows.extend(range(row, row + k + 1)) if k else plain_rows.append(row))
                row += k + 1
            if plain:
                self._sample(logits[plain_rows] if spec else logits, [req_ids[i] for i in plain],
                             sampled, logprobs)
            if spec:
                rids = [req_ids[i] for i in spec]
                emitted = self.spec_verifier.verify(
                    logits[spec_rows], [self.step_drafts[r] for r in rids],
                    self._sampling_metadata([self.requests[r] for r in rids], logits.device))
                sampled.update(zip(rids, emitted))
        if self.async_scheduling:
            self._append_sampled(sampled)
            if self.async_drafts is not None:
                self._advance_computed(so, req_ids, md.query_lens_cpu, sampled)
        mro = ModelRunnerOutput.from_dict(sampled)
        mro.logprobs = logprobs or None
        mro.prompt_logprobs_dict = prompt_logprobs_dict(self.model, self.requests, hidden, req_ids, md) or None
        if isinstance(self.proposer, EagleProposerBase):  # reads this step's hidden states (k = 0: KV only)
            mro.spec_token_ids = propose_eagle(self, req_ids, input_ids, positions, md, hidden, sampled)
        elif self.proposer is not None:
            drafts = propose_drafts(self, sampled, self.num_drafts_after(len(req_ids)))
            if self.async_drafts is None:
                mro.spec_token_ids = drafts  # for the scheduler's next schedule()
            else:  # the next step is scheduled already, with placeholders this runner fills
                self.async_drafts.store([r for r, t in sampled.items() if t], drafts)
        return mro

    def _settle(self) -> None:
        """Append the pending step's tokens to the requests and their rows (waits for
        its copy to the host); a request that finished meanwhile is skipped."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._append_sampled(pending.lists()[0])

    def _advance_computed(self, so, req_ids: list[str], num_sched: list[int], sampled: dict) -> None:
        """Asynchronous speculation: this runner's count of computed tokens moves by what
        the step computed and kept (scheduled tokens minus rejected drafts), see
        async_drafts.py; the scheduler learns of the rejections a step later."""
        batch = self.input_batch
        for rid, n in zip(req_ids, num_sched):
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())
            toks = sampled.get(rid)
            rejected = len(drafts) - (len(toks) - 1) if drafts and toks else 0
            st = self.requests[rid]
            st.num_computed_tokens += n - rejected
            row = batch.req_id_to_index.get(rid)
            if row is not None:
                batch.num_computed_tokens[row] = st.num_computed_tokens

    def capture_model(self) -> None:
        """Capture the CUDA graphs (nothing without a graph mode); after the KV
        cache is bound, before the first step (vLLM: `GPUModelRunner.capture_model`)."""
        self.model_forward.capture(self.cache_engine.num_gpu_blocks, self.block_size)

    def _append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Asynchronous scheduling: the next step computes the position of each
        token sampled now (a placeholder to the scheduler, which counts it as
        sent), so the runner appends it to the request's tokens itself. Steps
        run in order, so the next step always finds it here."""
        batch = self.input_batch
        for rid, toks in sampled.items():
            st = self.requests.get(rid)
            if toks and st is not None:
                st.token_ids.extend(toks)
                row = batch.req_id_to_index.get(rid)
                if row is not None:
                    batch.append_token_ids(row, toks)

    def _sampling_metadata(self, states, device, token_bitmask=None) -> SamplingMetadata:
        """One row per request state: the same metadata for plain sampling and for
        verifying drafts, so both apply one temperature / top-k / top-p. Gathered
        from the persistent batch's sampling columns, and only when these rows
        changed (vLLM's `refresh_metadata`); `SamplingMetadata.from_params` over
        the same states is the from-scratch equivalent."""
        return self.input_batch.refresh_metadata([s.req_id for s in states], [s.output_token_ids for s in states],
                                                 device, token_bitmask)

    def _sample_on_device(self, logits, rids: list[str]):
        """(the requests' states, the SamplerOutput): one token per row, still on the device."""
        states = [self.requests[r] for r in rids]
        return states, self.sampler(logits, self._sampling_metadata(states, logits.device,
                                                                    self._grammar_bitmask(states)))

    def _sample(self, logits, rids: list[str], sampled: dict, logprobs: dict) -> None:
        states, out = self._sample_on_device(logits, rids)
        toks = out.sampled_token_ids.tolist()
        lp = out.logprobs_tensors
        if lp is not None:
            ids_l, lps_l, ranks_l = (lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                                     lp.selected_token_ranks.tolist())
        for j, (rid, st) in enumerate(zip(rids, states)):
            sampled[rid] = [int(toks[j])]
            n_lp = st.sampling_params.logprobs
            if lp is not None and n_lp is not None:
                logprobs[rid] = [(ids_l[j][:n_lp + 1], lps_l[j][:n_lp + 1], ranks_l[j])]

    def _grammar_bitmask(self, states):
        """One bitmask row per sampling request; None when none is constrained."""
        rows = [(j, st) for j, st in enumerate(states)
                if st.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        from mini_vllm.structured_output import get_backend

        backend = get_backend(self.tokenizer_path, self.vocab_size)
        bitmask = backend.allocate_bitmask(len(states))
        for j, st in rows:
            g = self.grammars.get(st.req_id)
            if g is None:
                g = self.grammars[st.req_id] = backend.new_grammar(st.sampling_params.structured_outputs)
            g.advance(st.output_token_ids)
            g.fill_bitmask(bitmask, j)
        return bitmask

    def num_drafts_after(self, batch_size: int) -> int:
        """Drafts per request to propose after a step that scheduled `batch_size`
        requests (vLLM's scheduler computes the same count as num_spec_tokens_to_schedule)."""
        k = self.proposer.k
        return k if self.spec_tokens_for_batch is None else min(k, self.spec_tokens_for_batch(batch_size))
