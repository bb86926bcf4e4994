"""What the scheduler tells the model runner, and what the runner answers.

Counterparts: `vllm/v1/core/sched/output.py` (SchedulerOutput, NewRequestData,
CachedRequestData) and `vllm/v1/outputs.py` (ModelRunnerOutput).

A runner keeps a persistent batch (seed 001 §4.6.2): it learns a request's
prompt and block ids once (NewRequestData) and afterwards only the *new*
block ids (CachedRequestData). Before the forward pass it executes, in this
order, `blocks_to_swap_out`, `blocks_to_swap_in`, `blocks_to_copy`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NewRequestData:
    """First schedule of a request, or its return after a recompute preemption.

    `token_ids` is prompt + any output already generated (a resumed request
    recomputes both); `num_computed_tokens` counts tokens already in the KV
    cache before this step (prefix-cache hits), and `block_ids` is the whole
    block table.
    """

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # What a model runner needs to sample for the request (the model-free
    # MiniRunner ignores them): its SchedulerSamplingParams and EOS id.
    sampling_params: object = None
    eos_token_id: int | None = None


@dataclass
class CachedRequestData:
    """A request the runner already knows.

    `new_block_ids` are appended to its block table, except when
    `replace_block_ids` (a swap-in, or a copy-on-write that gave the request a
    private copy of a shared block): then they *replace* the table.
    `new_token_ids` are the tokens sampled since the runner last saw it (empty
    when the runner produced them itself).
    """

    req_id: str
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    # True when `new_block_ids` is the whole table: a swap-in, or a
    # copy-on-write replaced one of the request's existing blocks.
    replace_block_ids: bool = False


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> Δ, the tokens computed this step (drafts included).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # req_id -> draft tokens verified this step (a suffix of its Δ tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished (stopped or aborted) since the previous step: the
    # runner drops them from its persistent batch.
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on GPU
    # Requests that sample a token this step (the others are mid-prefill chunks).
    # Decided when the step is scheduled: under asynchronous scheduling a later
    # schedule() has moved the requests on before this step's output comes back.
    sampling_req_ids: set[str] = field(default_factory=set)
    # Chapter 6: what the KV connector's worker side must load and save this step
    # (None without a connector); built by the scheduler's connector.
    kv_connector_metadata: object | None = None
    # What this step means for the metrics, counted by the scheduler that decided it:
    # prompt tokens computed (drafts and output tokens excluded), and the requests
    # scheduled for the first time in their life (vLLM: their SCHEDULED event).
    num_prompt_tokens: int = 0
    first_scheduled_req_ids: list[str] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler after a step, made by `Scheduler.make_stats`
    (vLLM: `SchedulerStats` in `vllm/v1/metrics/stats.py`, made by the scheduler)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0     # tokens found, cumulative
    num_preemptions: int = 0       # cumulative


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per scheduled request.

    `sampled_token_ids[req_id_to_index[r]]` is a list: empty for a request
    still in the middle of its prefill, one token for a normal step, and
    1..k+1 tokens after verifying k drafts (accepted drafts + one bonus or
    correction token), as in vLLM v1.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    # req_id -> one (token_ids, logprobs, sampled_rank) triple per sampled
    # token, for requests that asked for logprobs (the engine's runner fills it).
    logprobs: dict | None = None
    # req_id -> draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: dict | None = None
    # req_id -> (token_ids, logprobs, ranks) of every prompt position after the
    # first, sent once, on the step that completes the prompt (prompt_logprobs).
    prompt_logprobs_dict: dict | None = None

    @classmethod
    def from_dict(cls, sampled: dict[str, list[int]]) -> "ModelRunnerOutput":
        ids = list(sampled)
        return cls(ids, {r: i for i, r in enumerate(ids)}, [list(sampled[r]) for r in ids])
