"""The runner's persistent batch (counterpart of `vllm/v1/worker/gpu_input_batch.py`).

The runner learns a request once (`NewRequestData`) and afterwards only what
changed (`CachedRequestData`: new blocks, new tokens, the computed count), so
per-step work is proportional to the change, not to the batch (seed 001
§4.6.2). State lives in preallocated numpy rows; a removed request's row is
filled by moving the last row into it (`condense`), so active rows are
always 0..num_reqs-1. The sampling parameters are rows too
(`sample/sampling_columns.py`, written once by `add_request`); a step's
`SamplingMetadata` comes from `refresh_metadata`, rebuilt only when the rows
that sample changed.

Invariants:
* `req_id_to_index` and `req_ids[:num_reqs]` are inverse maps;
* row r holds `num_tokens[r]` known token ids (prompt + sampled), the first
  `num_prompt_tokens[r]` of them the prompt, and its first `num_blocks[r]`
  block-table entries, the rest -1; row r of `sampling` is the same request's;
* `requests` keeps the state of every unfinished request the runner knows,
  including preempted ones that have no row (a swapped-out request comes back
  with a new block table but the same tokens and generator).

`StepInputs` is the flat batch one step builds from these rows
(`ModelRunner._prepare_inputs`): the typed input every later part of the step
reads (the forward pass, the sampler, the drafter, the output mode).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.sampling_columns import SamplingColumns
from mini_vllm.sampling_params import SamplingParams


class StepInputs(NamedTuple):
    """One step's flat inputs. A tuple, so a runner's `_prepare_inputs` may return the six values plainly."""
    input_ids: torch.Tensor  # [T] int64 on the device: the scheduled tokens, request after request
    positions: torch.Tensor  # [T] int64: their absolute positions
    attn_metadata: AttentionMetadata  # slots, block tables, query starts, sequence lengths
    req_ids: list[str]  # the scheduled requests, in batch order
    logit_rows: torch.Tensor  # [R] int64: the flat rows whose logits are computed
    sample_req: list[int]  # indices into req_ids of the requests that sample, ascending

@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]          # prompt + output, as the scheduler sent them
    block_ids: list[int]
    num_computed_tokens: int
    # The engine's SamplingParams (the model-free runner test drives the runner
    # from a Chapter 3 scheduler, whose own SamplingParams holds only stop rules).
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs (prompt_logprobs set): filled chunk by chunk, sent once.
    prompt_logprobs_in_progress: tuple | None = None
    prompt_logprobs_sent: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 vocab_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.token_ids_cpu = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.full((max_num_seqs, max_num_blocks_per_req), -1, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.req_id_to_index: dict[str, int] = {}
        self.sampling = SamplingColumns(max_num_seqs, vocab_size)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        if state.req_id in self.req_id_to_index:
            row = self.req_id_to_index[state.req_id]
        else:
            row = self.num_reqs
            if row >= self.max_num_seqs:
                raise RuntimeError(f"persistent batch is full ({self.max_num_seqs} rows): the "
                                   "scheduler scheduled more requests than max_num_seqs")
            self.req_id_to_index[state.req_id] = row
            self.req_ids[row] = state.req_id
        n = len(state.token_ids)
        self.token_ids_cpu[row, :n] = state.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)
        self.sampling.add_request(row, state.sampling_params, state.generator, state.eos_token_id)
        return row

    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        self.block_table[row, :] = -1
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token_ids(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        self.token_ids_cpu[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_sampled(self, requests: dict[str, CachedRequestState], sampled: dict[str, list[int]]) -> None:
        """Asynchronous scheduling: the next step computes the position of each
        token sampled now (a placeholder to the scheduler, which counts it as
        sent), so the runner appends it to the request's tokens itself. Steps
        run in order, so the next step always finds it here."""
        for rid, toks in sampled.items():
            st = requests.get(rid)
            if toks and st is not None:
                st.token_ids.extend(toks)
                row = self.req_id_to_index.get(rid)
                if row is not None:
                    self.append_token_ids(row, toks)

    def remove_request(self, req_id: str) -> None:
        """Drop a row; the last active row moves into the hole (condense)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self.sampling.remove_request(row)
        self.condense(row)

    def condense(self, hole: int) -> None:
        """Move the last active row into the empty row `hole`. vLLM's `condense`
        fills every hole of a step at once after all removals; here each removal
        fills its own hole at once, so rows are 0..num_reqs-1 after every call."""
        last = self.num_reqs  # after the pop, the old last row index
        if hole != last:
            moved = self.req_ids[last]
            for arr in (self.token_ids_cpu, self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                        self.block_table, self.num_blocks):
                arr[hole] = arr[last]
            self.sampling.move_row(last, hole)
            self.req_ids[hole] = moved
            self.req_id_to_index[moved] = hole
        self.req_ids[last] = None
        self.block_table[last, :] = -1

    def refresh_metadata(self, req_ids: list[str], output_token_ids: list[list[int]], device,
                         token_bitmask: torch.Tensor | None = None) -> SamplingMetadata:
        """The step's sampling metadata, row i for request req_ids[i] (the
        requests that sample, in the step's order). Rebuilt from the sampling
        columns only when these rows changed since the last call; otherwise the
        previous object with this step's output tokens, min_tokens rows and
        grammar bitmask. Equals `SamplingMetadata.from_params` over the same
        requests (the from-scratch reference)."""
        rows = [self.req_id_to_index[r] for r in req_ids]
        return self.sampling.refresh_metadata(rows, self.token_ids_cpu, self.num_prompt_tokens,
                                              output_token_ids, device, token_bitmask)
