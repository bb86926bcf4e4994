"""EAGLE's drafter: what the step computed and kept, for the proposer.

vLLM counterpart: the EAGLE branch of `GPUModelRunner.propose_draft_token_ids`
(`vllm/v1/worker/gpu_model_runner.py`), which hands `EagleProposer` the
step's token ids, positions, hidden states and the next token of each
request, minus the rejected drafts.

Per scheduled request (row i): `kept` = scheduled tokens minus the drafts the
verifier rejected; the next token is the last one the step produced, or, for a
prompt still being prefilled, its next prompt token; drafts are wanted only
from a request that sampled and may use them (`spec_eligible`), at most as
many as fit under `max_model_len`.

The head runs only over the requests whose earlier positions all have its KV, and
not at all in a step the batch-size schedule gives k = 0 (`spec_decode/engine/head_kv.py`:
the skipped positions' blocks are marked, and their requests draft no more).
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.kernels.paged_checks import host_values
from mini_vllm.spec_decode.engine.eagle_base import EagleStep
from mini_vllm.spec_decode.engine.verifier import spec_eligible
from mini_vllm.worker.drafter import Drafter
from mini_vllm.worker.input_batch import StepInputs


class EagleDrafter(Drafter):
    """The drafter of an `EagleProposerBase`: its head reads this step's hidden states."""

    def blocks_moved(self, so) -> None:
        # which blocks lack the head's KV moves with them
        self.proposer.head_kv.moved(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)

    def propose(self, step: StepInputs, hidden: torch.Tensor,
                sampled: dict[str, list[int]]) -> dict[str, list[int]] | None:
        # Reads this step's hidden states (k = 0: the KV marks only).
        return self._publish(sampled, propose_eagle(self, step, hidden, sampled))


def propose_eagle(drafter: EagleDrafter, step: StepInputs, hidden: torch.Tensor,
                  sampled: dict[str, list[int]]) -> dict[str, list[int]]:
    req_ids, input_ids, positions, md = step.req_ids, step.input_ids, step.positions, step.attn_metadata
    batch, k = drafter.input_batch, drafter.num_drafts_after(len(req_ids))
    tracker = drafter.proposer.head_kv
    tracker.note_schedule(k, len(req_ids))
    slots_h = host_values(md.slot_mapping)  # the marks of spec_decode/engine/head_kv.py are kept per slot
    if k == 0:  # the head does not run: mark what the step wrote, nothing more
        tracker.skipped(slots_h)
        return {}
    rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    q_lens = np.asarray(md.query_lens_cpu, dtype=np.int64)
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    pos = positions.cpu().numpy()
    tables = batch.block_table[rows]
    row_of = np.repeat(np.arange(len(req_ids)), q_lens)  # flat token -> its row
    run = tracker.complete(tables, pos[qsl[:-1]])  # the rows with a complete history
    if not run.all():
        tracker.skipped(slots_h[~run[row_of]])
    if not run.any():
        return {}
    kept, nxt, n_blocks, n_drafts = [], [], [], []
    for i in np.flatnonzero(run):
        rid = req_ids[i]
        q, toks = int(q_lens[i]), sampled.get(rid) or []
        drafts = drafter.step_drafts.get(rid, ())
        kept.append(q - (len(drafts) - (len(toks) - 1)) if drafts and toks else q)
        st = drafter.requests[rid]
        if toks:
            nxt.append(toks[-1])
            room = drafter.max_model_len - (len(st.token_ids) + len(toks))
            n_drafts.append(max(0, min(k, room)) if spec_eligible(st.sampling_params) else 0)
        else:  # a partial prefill: the prompt token after the chunk
            nxt.append(int(batch.token_ids_cpu[rows[i], md.seq_lens_cpu[i]]))
            n_drafts.append(0)
        n_blocks.append(len(st.block_ids))
    ran, n_kept = np.flatnonzero(run), np.asarray(kept, dtype=np.int64)
    offsets = np.arange(n_kept.sum()) - np.repeat(np.cumsum(n_kept) - n_kept, n_kept)  # 0.. within a row
    tracker.written(slots_h[np.repeat(qsl[ran], n_kept) + offsets])  # pass 1 writes the kept positions
    slots = md.slot_mapping
    if not run.all():  # the flat tensors of the running rows only
        tok = np.flatnonzero(run[row_of])
        tok_t = torch.from_numpy(tok).to(hidden.device)
        hidden, input_ids, slots, pos = (hidden.index_select(0, tok_t), input_ids.index_select(0, tok_t),
                                         slots.index_select(0, tok_t.to(slots.device)), pos[tok])
        qsl = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum(q_lens[run], out=qsl[1:])
    eagle_step = EagleStep(hidden=hidden, input_ids=input_ids, positions=pos, slot_mapping=slots,
                     query_start_loc=qsl, kept=kept, next_token_ids=nxt,
                     block_table=tables[run], num_blocks=n_blocks, num_drafts=n_drafts)
    out = drafter.proposer.propose(eagle_step)
    return {req_ids[i]: d for i, d in zip(ran, out) if d}
