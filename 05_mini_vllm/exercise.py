"""Chapter 5 exercise: the model runner's headline, the sampler's filters, EAGLE's proposer.

Fill in the stubs, then run the chapter's tests against them with
    .venv/bin/pytest -q tests/test_ch5_*.py --impl=exercise
The run checks your index functions and your runner's state and inputs
against the scheduler (tests/test_ch5_prepare_inputs.py, test_ch5_runner.py),
then plugs your `ModelRunner` into real engines (`plug_runner`): greedy tokens
must equal Hugging Face's, and must not change with batching, chunked
prefill, prefix hits or preemption. Stuck? `05_mini_vllm/HINTS.md` has hints
in three levels, from the idea to the last push before the solution.

Part 1, the runner (vLLM: `vllm/v1/worker/gpu_model_runner.py`):
- `compute_query_start_loc`, `compute_positions`, `compute_slot_mapping`: the
  flat-batch index arithmetic, vectorised;
- `ModelRunner._update_states`: the persistent batch, from SchedulerOutputs alone;
- `ModelRunner._prepare_inputs`: one step's flat inputs and the rows that sample;
- `ModelRunner.execute_model`: the step, from SchedulerOutput to ModelRunnerOutput.
Part 2, the sampler's filters (vLLM: `vllm/v1/sample/ops/topk_topp_sampler.py`):
`apply_top_k_top_p`, `apply_min_p`.
Part 3, EAGLE's proposer (vLLM: `vllm/v1/spec_decode/eagle.py`): `EagleProposer.propose`,
the input shift and the k-step draft loop, run in real engines by `plug_eagle` (its
drafts must equal a plain-PyTorch reference's, greedy tokens must not change, and
sampling must stay lossless). Its own command, while you work on it:
    .venv/bin/pytest -q tests/test_ch5_eagle.py --impl=exercise
Part 4, a mixture of experts' router (vLLM: `fused_topk` in
`vllm/model_executor/layers/fused_moe/router/`): `fused_topk`, each token's k
experts and their weights, renormalised or not (the layer that uses it is
`models/fused_moe/layer.py`; notebook `moe.ipynb`). Its own command:
    .venv/bin/pytest -q tests/test_ch5_moe_layer.py --impl=exercise

Given: the persistent batch's storage (`InputBatch`, `CachedRequestState`:
rows, condensing on removal; `add_request` also writes the request's sampling
parameters into the batch's sampling columns, which `_sample` reads through
`refresh_metadata`), the KV tensors and their swap/copy
(`self.cache_engine`), the model, the sampler call (`_sample`) and
`plug_runner`. Your runner covers plain decoding; speculative decoding, KV
connectors, tensor parallelism, prompt logprobs and structured outputs stay
with the reference runner (`plug_runner` and `_sample` refuse them).
For Part 3 the head, its KV tensor and the helpers `propose` calls are given
(`spec_decode/engine/eagle_base.py`). Nothing here imports the modules that hold the
answers (`model_runner.py`, `prepare_inputs.py`, `ops_topk_topp.py`,
`spec_decode/engine/eagle.py`).
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata  # noqa: F401
from mini_vllm.forward_context import set_forward_context  # noqa: F401
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs  # noqa: F401
from mini_vllm.worker.async_output import HostStaging
from mini_vllm.worker.drafter import Drafter
from mini_vllm.worker.step_outputs import StepOutputs, StepSampler
from mini_vllm.spec_decode.engine.verifier import SpecVerifier
from mini_vllm.structured_output import StructuredOutputs
from mini_vllm.worker.model_forward import ModelForward, eager_config
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import ModelRunnerOutput
from mini_vllm.engine.core_client import InprocClient
from mini_vllm.spec_decode.engine.eagle_base import EagleProposerBase, EagleStep
from mini_vllm.entrypoints.llm import LLM

# ================================================================ Part 1: the runner
# ---- the flat batch's index arithmetic (vectorised numpy, no loop per token) ----


def compute_query_start_loc(num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[num_reqs + 1] int32: where each request's query rows start in the flat batch."""
    raise NotImplementedError(
        "compute_query_start_loc(num_scheduled_tokens Δ [num_reqs], ints >= 1) -> int32 [num_reqs + 1]: "
        "request i owns rows out[i]:out[i+1] of the flat batch, requests one after another from row 0; "
        "out[-1] is the number of scheduled tokens. An empty batch gives [0].")


def compute_positions(num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[T] int64: the absolute token position of every scheduled token."""
    raise NotImplementedError(
        "compute_positions(num_computed_tokens c [num_reqs], num_scheduled_tokens Δ [num_reqs]) -> int64 [T], "
        "T = sum Δ: request i's rows hold its positions c_i .. c_i + Δ_i - 1, requests one after another. "
        "Vectorised (the tests use thousands of tokens).")


def compute_slot_mapping(block_table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """[T] int64: the KV cache slot of every scheduled token."""
    raise NotImplementedError(
        "compute_slot_mapping(block_table [num_reqs, max_blocks] int32 -1 padded, req_indices [T], "
        "positions [T], block_size) -> int64 [T]: the flat cache slot where token t's KV goes, under the "
        "block table of request req_indices[t] (Chapter 1's slot mapping, for a whole batch at once). "
        "int64: slots overflow int32 on big caches.")


# ---- the runner ----

class ModelRunner:
    """The engine's model runner (same constructor and `execute_model` as the reference)."""

    def __init__(self, model, model_config, cache_engine, block_size: int, max_num_seqs: int,
                 max_model_len: int, device) -> None:
        """Given."""
        self.model, self.model_config = model, model_config
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        # Every request the runner knows (running or preempted), by id.
        self.requests: dict[str, CachedRequestState] = {}
        # The persistent batch: one row per request that has a row (see input_batch.py).
        self.input_batch = InputBatch(max_num_seqs, max_model_len, -(-max_model_len // block_size),
                                      self.vocab_size)
        self.sampler = Sampler()
        for layer, kv in zip(model.attention_layers(), cache_engine.gpu_cache):
            layer.kv_cache = kv  # every attention layer reads and writes its own (K, V) pair
        self.kv_connector = None  # not part of the exercise (see plug_runner)
        # Not part of the exercise either: what speculative decoding, structured outputs and
        # asynchronous scheduling add to a step plugs into the reference runner through these
        # three parts; here they are the plain case (no drafts, tokens back within the step),
        # and the reference's methods run on this runner unchanged.
        self.drafter = Drafter(self.requests, self.input_batch, max_model_len)
        self.step_sampler = StepSampler(self.sampler, SpecVerifier(self.device),
                                        StructuredOutputs(None, self.vocab_size), self.requests, self.input_batch)
        self.staging = HostStaging(self.device, max_num_seqs)
        self.outputs = StepOutputs(model, self.step_sampler, self.drafter, append_own_tokens=False)
        self.model_forward = ModelForward(model, eager_config(self.device.type, max_num_seqs), self.device,
                                          -(-max_model_len // block_size))

    def _make_generator(self, params):
        """Given: a seeded request's own generator (None without a seed, and for a
        Chapter 3 scheduler's SchedulerSamplingParams, which declares no seed), on the
        logits' device."""
        seed = params.seed if isinstance(params, SamplingParams) else None
        return None if seed is None else torch.Generator(device=self.device).manual_seed(int(seed))

    def _update_states(self, so) -> None:
        """TODO: bring self.requests and self.input_batch up to date with SchedulerOutput `so`."""
        raise NotImplementedError(
            "_update_states(so) -> None. The runner learns everything from SchedulerOutputs (it never reads "
            "the scheduler's Request objects). Contract, after the call: self.requests holds a "
            "CachedRequestState for every request the scheduler has not finished (finished_req_ids are "
            "forgotten; preempted_req_ids keep their state but lose their batch row); every request "
            "scheduled in this step has a row in self.input_batch (InputBatch.add_request and friends) whose "
            "token ids, num_tokens, num_computed_tokens and block table equal the scheduler's view: "
            "scheduled_new_reqs bring all of it (also a request coming back after a recompute "
            "preemption), scheduled_cached_reqs bring only what changed (new_token_ids, new_block_ids to "
            "append, or the whole table when resumed_from_preemption or replace_block_ids). A seeded "
            "request keeps one generator for its whole life (self._make_generator once): a preemption "
            "must not restart its draws.")

    def _prepare_inputs(self, so):
        """TODO: (input_ids, positions, md, req_ids, logit_rows, sample_req) for this step."""
        raise NotImplementedError(
            "_prepare_inputs(so) -> (input_ids, positions, md, req_ids, logit_rows, sample_req). req_ids = "
            "list(so.num_scheduled_tokens), the batch order; request i has Δ_i scheduled tokens and c_i "
            "computed before this step (self.input_batch, after _update_states). input_ids, positions: long "
            "tensors [T] on self.device, T = sum Δ: the tokens at positions c_i .. c_i + Δ_i - 1 of each "
            "request in turn. md: an AttentionMetadata (forward_context.py) whose slot_mapping (int64 [T]), "
            "block_tables (int32, row i = request i's table, at least the blocks that hold its c_i + Δ_i "
            "keys), cu_seqlens_q (int32 query start locations), seq_lens (int32, c_i + Δ_i), max_query_len, "
            "max_seq_len and the host lists query_lens_cpu / seq_lens_cpu describe the batch; it must pass "
            "md.validate(num_blocks, block_size). sample_req: the indices i (ascending) of the requests "
            "whose known tokens are all computed after this step (a prompt that completes, or a decode); a "
            "request in the middle of its prompt does not sample. logit_rows: for each of them, the flat "
            "row of its last scheduled token (its logits predict the next token).")

    @torch.inference_mode()
    def execute_model(self, so) -> ModelRunnerOutput:
        """TODO: one engine step: SchedulerOutput in, ModelRunnerOutput out."""
        raise NotImplementedError(
            "execute_model(so) -> ModelRunnerOutput. Output: ModelRunnerOutput.from_dict(d), d mapping every "
            "request of so.num_scheduled_tokens to [the token it sampled] if it samples this step (sample_req "
            "of _prepare_inputs), else []; its .logprobs is the dict _sample filled, or None if empty. A step "
            "with no scheduled token returns ModelRunnerOutput([], {}, []). Invariants: the persistent batch "
            "reflects so before anything reads it; so's KV block moves happen on every step, empty or not, "
            "before any layer reads the cache, in the order so.blocks_to_swap_out, so.blocks_to_swap_in, "
            "so.blocks_to_copy (self.cache_engine.swap_out / swap_in / copy); the model runs once per step "
            "over the whole flat batch, its attention layers reading md from set_forward_context(md) "
            "(self.model(input_ids, positions) -> hidden [T, H], which also writes this step's KV); only "
            "the sampling rows reach the LM head (self.model.compute_logits) and self._sample. Drafts "
            "(so.scheduled_spec_decode_tokens) are not part of the exercise.")

    def _sample(self, logits: torch.Tensor, rids: list[str], sampled: dict, logprobs: dict) -> None:
        """Given: sample one token per row of `logits` [len(rids), V] for requests `rids`;
        sampled[rid] = [token], and logprobs[rid] for requests that asked for logprobs."""
        states = [self.requests[r] for r in rids]
        for st in states:
            p = st.sampling_params
            for field in ("prompt_logprobs", "structured_outputs"):  # getattr: a loop over field names
                if getattr(p, field) is not None:
                    raise NotImplementedError(f"request {st.req_id}: {field} is not part of the exercise's "
                                              "runner; use the reference runner")
        # The reference runner's sampler (worker/step_outputs.py): the batch's sampling columns,
        # gathered only when these rows changed, then one token (and logprobs) per row.
        self.step_sampler.sample(logits, rids, sampled, logprobs)


def plug_runner(llm) -> None:
    """Given: replace the model runner of an `LLM` (or an `LLMEngine`) by this
    module's `ModelRunner` (same model, same KV cache), before it runs any request.
    The engine core must run in this process (`multiprocess_mode=False`, or
    MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0), where the runner can be swapped."""
    client = (llm.llm_engine if isinstance(llm, LLM) else llm).engine_core
    if not isinstance(client, InprocClient):
        raise ValueError("plug_runner: the engine core runs in another process; build the engine with "
                         "multiprocess_mode=False (or MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    core = client.engine_core
    cfg = core.config
    for field, off in (("speculative_config", cfg.speculative_config is None),
                       ("kv_transfer_config", core.kv_connector is None),
                       ("tensor_parallel_size", cfg.tensor_parallel_size == 1),
                       ("async_scheduling", not cfg.async_scheduling)):
        if not off:
            raise ValueError(f"plug_runner: {field} is not part of the exercise's runner (build the engine "
                             f"with {field} unset; async_scheduling=False on a GPU, where it is on by default)")
    if core.has_unfinished_requests():
        raise ValueError("plug_runner: the engine already runs requests; plug the runner in first")
    core.executor.collective_rpc("use_model_runner", ModelRunner)


# ================================================================ Part 2: the sampler's filters
# Both take logits [B, V] float32 and per-row parameters [B], and return logits [B, V]
# where every dropped token is -inf and every kept token keeps its value.


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask each row's logits outside its top-k and top-p sets with -inf."""
    raise NotImplementedError(
        "apply_top_k_top_p(logits [B, V], top_k [B] ints or None, top_p [B] floats or None) -> a new "
        "tensor [B, V]. Row b keeps its top-k set, then, among those renormalised, its top-p set; the "
        "rest is -inf, kept logits keep their values. top-k: the tokens whose logit is >= the k-th "
        "largest (ties with the k-th all stay); k == 0, -1 or >= V keeps the row. top-p: the smallest "
        "set of most likely tokens whose probability reaches top_p, where a token is kept iff the "
        "tokens strictly more likely than it total < top_p (equally likely tokens go together, the "
        "most likely always stays); top_p == 1.0 keeps every token, even with rounding. None: no row "
        "uses that filter. Raise ValueError if logits is not 2-D or top_k / top_p is not [B].")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    raise NotImplementedError(
        "apply_min_p(logits [B, V], min_p [B]) -> a new tensor [B, V]: token v of row b stays iff "
        "softmax(logits[b])[v] >= min_p[b] * max softmax(logits[b]), else -inf; min_p 0 keeps the row, "
        "min_p 1 keeps the top token(s) (ties all stay). Raise ValueError if logits is not 2-D or min_p "
        "is not [B].")


__all__ = ["ModelRunner", "apply_min_p", "apply_top_k_top_p", "compute_positions", "compute_query_start_loc",
           "compute_slot_mapping", "fused_topk", "plug_runner"]


# ================================================================ Part 3: EAGLE's proposer
# Given: the head (`self.head`: `self.head(ids, positions, hidden)` inside a forward context,
# `self.head.compute_logits(g)`), `self._metadata`, `self._run`, `self._chain_tables`,
# `self.k`, `self.bs`, `self.device` (spec_decode/engine/eagle_base.py) and `plug_eagle`.


class EagleProposer(EagleProposerBase):
    @torch.inference_mode()
    def propose(self, step: EagleStep) -> list[list[int]]:
        """Write the head's KV for the step's kept positions; return each row's drafts."""
        raise NotImplementedError(
            "EagleProposer.propose(step: EagleStep) -> R lists of ints (R = len(step.kept)). Row i owns flat rows "
            "step.query_start_loc[i]... of the step; its first step.kept[i] positions were kept. Afterwards the "
            "head's KV at each kept position p (its slot: step.slot_mapping of that row) must be what the head "
            "computes from the token at p + 1 and the target's hidden state at p (step.hidden); after the last "
            "kept position the token is step.next_token_ids[i]. Row i returns step.num_drafts[i] greedy drafts "
            "(none when 0): draft 1 predicts the token after next_token_ids[i]; draft j + 1 is what the head "
            "predicts once draft j is fed at the next position with the head's own output as the hidden state, "
            "as vLLM's EAGLE proposer does. Use self._metadata(slots, block_tables, query_lens, seq_lens) for every "
            "head call; positions past a row's step.num_blocks[i] allocated blocks need the scratch blocks of "
            "self._chain_tables(step, rows, positions, k). A row's drafts must not depend on the other rows.")


def plug_eagle(llm) -> None:
    """Given: replace the EAGLE proposer of an `LLM` built with speculative_config method
    "eagle" by this module's (same head, same KV), before it runs any request; the engine
    core must run in this process (`multiprocess_mode=False`)."""
    client = (llm.llm_engine if isinstance(llm, LLM) else llm).engine_core
    if not isinstance(client, InprocClient):
        raise ValueError("plug_eagle: the engine core runs in another process; build the engine with "
                         "multiprocess_mode=False (or MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    core = client.engine_core
    spec = core.config.speculative_config
    if spec is None or spec.method != "eagle":
        raise ValueError("plug_eagle: build the engine with speculative_config={'method': 'eagle', ...}")
    if core.has_unfinished_requests():
        raise ValueError("plug_eagle: the engine already runs requests; plug the proposer in first")
    core.executor.collective_rpc("use_eagle_proposer", EagleProposer)


# ================================================================ Part 4: a mixture of experts' router


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    raise NotImplementedError(
        "fused_topk(gating_output [T, E] router logits, topk k, renormalize) -> (weights float32 [T, k], "
        "ids int32 [T, k]): token t goes to the k experts of largest softmax probability (computed in float32 "
        "over all E experts), most probable first, never one expert twice; its weights are those "
        "probabilities, divided by their sum when renormalize (the config's norm_topk_prob) so that they add "
        "to 1, else left as they are. Raise ValueError if gating_output is not 2-D or k is not in [1, E].")
