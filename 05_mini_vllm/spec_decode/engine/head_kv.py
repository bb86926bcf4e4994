"""Which cache blocks hold the EAGLE head's KV: what lets dynamic speculation skip the
head entirely at large batches.

vLLM counterpart: none. vLLM 0.32's EAGLE proposer, told to draft 0 tokens by
`num_speculative_tokens_per_batch_size`, still runs the head's first pass over the
step's tokens so that its KV stays complete. On a CPU that pass costs a fifth to a
third of a large batch's step, which is what drafting was turned off to save.

Here a step that drafts nothing runs no head at all, and the positions it computed
have target KV but no head KV. Drafting from such a history would attend to stale
slots: still lossless (verification decides every token) but with lower acceptance.
So a request drafts only while the head's KV of every earlier position is there:
* a request computed in a step without the head (a "gap") drafts no more: its later
  steps skip the head too;
* a prefix-cache hit shares blocks, so the record is per block, not per request:
  `stale[b]` says block b holds target KV written without the head's. A request whose
  earlier positions sit in a stale block (its own gap, or another request's blocks
  found in the prefix cache) is treated as having a gap;
* a block is clean again once the head writes its slot 0 for a new owner, who then
  fills it front to back (a hit is a whole block, so no owner starts mid-block);
* a mark travels with its block's contents: a swap to the CPU and back, or a
  copy-on-write, moves the target's and the head's KV together, and the mark with them.

Invariant: for a request the head runs over, no block holding one of its positions
before this step's first is stale.
"""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("mini_vllm")


class HeadKvTracker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.stale = np.zeros(num_blocks, dtype=bool)  # per pool block: target KV without head KV
        self.bs = block_size
        self.drafting = True  # the last step's schedule drafted (k > 0); a change is logged
        self.swapped: dict[int, bool] = {}  # CPU swap block -> the mark its contents left with

    def complete(self, tables: np.ndarray, first_pos: np.ndarray) -> np.ndarray:
        """Per row: True if no block holding a position before first_pos[i] is stale.
        tables [R, width] are the rows' block tables (entries past the allocation unused)."""
        width = -(-np.asarray(first_pos, dtype=np.int64) // self.bs)   # blocks with positions < first_pos
        used = np.arange(tables.shape[1])[None, :] < width[:, None]
        ids = np.where(used, tables, 0).astype(np.int64)
        return ~(self.stale[ids] & used).any(axis=1)

    def skipped(self, slots: np.ndarray) -> None:
        """The target wrote `slots` (host values; -1: padding, nothing written) without the head."""
        self.stale[slots[slots >= 0] // self.bs] = True

    def written(self, slots: np.ndarray) -> None:
        """The head wrote its KV at `slots`: a block whose slot 0 is among them starts clean
        for its new owner."""
        self.stale[slots[(slots >= 0) & (slots % self.bs == 0)] // self.bs] = False

    def moved(self, swap_out, swap_in, copies) -> None:
        """The cache engine's moves of this step, in its order: (gpu, cpu) swap-outs,
        (cpu, gpu) swap-ins, (src, dst) copies on the device."""
        for gpu, cpu in swap_out:
            self.swapped[cpu] = bool(self.stale[gpu])
        for cpu, gpu in swap_in:
            self.stale[gpu] = self.swapped.pop(cpu, False)
        for src, dst in copies:
            self.stale[dst] = self.stale[src]

    def note_schedule(self, k: int, batch_size: int) -> None:
        """Logs when the batch-size schedule turns drafting off or on."""
        if (k > 0) != self.drafting:
            self.drafting = k > 0
            if self.drafting:
                logger.info("speculative decoding: drafting again at batch size %d; requests that ran "
                            "without drafting do not draft", batch_size)
            else:
                logger.info("speculative decoding: drafting off at batch size %d "
                            "(num_speculative_tokens_per_batch_size); the head does not run", batch_size)
