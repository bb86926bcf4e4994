"""The EAGLE proposer's plumbing: the step record the runner fills, and the helpers
`propose` calls (vLLM: the setup half of `vllm/v1/spec_decode/eagle.py`,
`EagleProposer.__init__`, `load_model` and the metadata it builds per draft step).

`spec_decode/engine/eagle.py` holds `EagleProposer.propose`, the algorithm; the Chapter 5
exercise writes its own `propose` on this same base. Invariants of the helpers:
* the head's attention layer is bound to `kv_cache`, whose first `num_pool_blocks`
  blocks are the pool's (the same block ids as the target's layers) and whose last
  `num_cache_blocks - num_pool_blocks` are scratch blocks only the proposer uses;
* `_metadata` validates what it builds against the whole tensor, scratch included;
* `_chain_tables` gives row w the scratch blocks
  [num_pool_blocks + w * scratch_per_row, ...) for the block indices past its allocation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.spec_decode.engine.head_kv import HeadKvTracker


@dataclass
class EagleStep:
    """What one target step hands the proposer (row i: the i-th scheduled request)."""
    hidden: torch.Tensor          # [T, H] the target's final hidden states of the step
    input_ids: torch.Tensor       # [T] the step's input ids
    positions: np.ndarray         # [T] int64
    slot_mapping: torch.Tensor    # [T] the step's slots
    query_start_loc: np.ndarray   # [R + 1]
    kept: list[int]               # per row: computed positions kept (scheduled minus rejected drafts)
    next_token_ids: list[int]     # per row: the token after the last kept position
    block_table: np.ndarray       # [R, max_blocks] the rows' block tables (-1 or stale past num_blocks)
    num_blocks: list[int]         # per row: blocks allocated to the request
    num_drafts: list[int]         # per row: drafts wanted (0: KV only)
    # Rows are the requests the head runs over this step: those whose earlier positions
    # all have the head's KV (spec_decode/engine/head_kv.py); the flat tensors hold their tokens only.


class EagleProposerBase:
    """Everything of the proposer but `propose`: the head bound to its KV tensor, the
    metadata and forward calls, the chain's block tables with scratch blocks."""

    def __init__(self, head, k: int, block_size: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 num_pool_blocks: int, device) -> None:
        self.head, self.k, self.bs = head, k, block_size
        self.device = torch.device(device)
        self.num_pool_blocks = num_pool_blocks
        self.num_cache_blocks = kv_cache[0].shape[0]  # pool blocks + scratch blocks
        self.scratch_per_row = -(-k // block_size) + 1
        # Which pool blocks lack the head's KV (steps that drafted nothing skip the head);
        # read and written by the runner's side (worker/eagle_drafter.py), never by propose.
        self.head_kv = HeadKvTracker(num_pool_blocks, block_size)
        for layer in head.attention_layers():
            layer.kv_cache = kv_cache

    @staticmethod
    def scratch_blocks_needed(max_num_seqs: int, k: int, block_size: int) -> int:
        return max_num_seqs * (-(-k // block_size) + 1)

    def _metadata(self, slots, tables: np.ndarray, q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        md = AttentionMetadata(slot_mapping=slots if isinstance(slots, torch.Tensor) else torch.from_numpy(slots),
                               block_tables=torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32)),
                               cu_seqlens_q=torch.from_numpy(cu),
                               seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                               max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                               query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens))
        md.validate(self.num_cache_blocks, self.bs)
        return md.to(self.device)

    def _run(self, md, ids, pos, hidden) -> torch.Tensor:
        with set_forward_context(md):
            return self.head(ids, pos, hidden)

    def _chain_tables(self, step: EagleStep, want: np.ndarray, pos: np.ndarray, k: int) -> np.ndarray:
        """Block tables of the drafting rows, wide enough for the chain's last position;
        block indices past a request's allocation point at its scratch blocks."""
        width = int((pos.max() + k) // self.bs) + 1
        out = np.full((len(want), width), -1, dtype=np.int64)
        for w, r in enumerate(want):
            n = min(step.num_blocks[r], width)
            out[w, :n] = step.block_table[r, :n]
            first_scratch = self.num_pool_blocks + w * self.scratch_per_row
            extra = width - n
            if extra > 0:  # only the chain's blocks are ever touched; at most scratch_per_row of them
                need = int((pos[w] + k - 1) // self.bs) + 1 - n
                out[w, n:n + max(0, need)] = first_scratch + np.arange(max(0, need))
        return out
