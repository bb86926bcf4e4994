"""The runner's side of EAGLE: what the step computed and kept, for the proposer.

vLLM counterpart: the EAGLE branch of `GPUModelRunner.propose_draft_token_ids`
(`vllm/v1/worker/gpu_model_runner.py`), which hands `EagleProposer` the
step's token ids, positions, hidden states and the next token of each
request, minus the rejected drafts.

Per scheduled request (row i): `kept` = scheduled tokens minus the drafts the
verifier rejected; the next token is the last one the step produced, or, for a
prompt still being prefilled, its next prompt token; drafts are wanted only
from a request that sampled and may use them (`spec_eligible`), at most as
many as fit under `max_model_len`.
"""
from __future__ import annotations

import numpy as np

from mini_vllm.speculative.eagle_base import EagleStep
from mini_vllm.speculative.verifier import spec_eligible


def propose_eagle(runner, req_ids: list[str], input_ids, positions, md, hidden,
                  sampled: dict[str, list[int]]) -> dict[str, list[int]]:
    batch, k = runner.input_batch, runner.num_drafts_after(len(req_ids))  # k = 0: pass 1 still writes the KV
    rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    kept, nxt, n_blocks, n_drafts = [], [], [], []
    for i, rid in enumerate(req_ids):
        q, toks = md.query_lens_cpu[i], sampled.get(rid) or []
        drafts = runner.step_drafts.get(rid, ())
        kept.append(q - (len(drafts) - (len(toks) - 1)) if drafts and toks else q)
        st = runner.requests[rid]
        if toks:
            nxt.append(toks[-1])
            room = runner.max_model_len - (len(st.token_ids) + len(toks))
            n_drafts.append(max(0, min(k, room)) if spec_eligible(st.sampling_params) else 0)
        else:  # a partial prefill: the prompt token after the chunk
            nxt.append(int(batch.token_ids_cpu[rows[i], md.seq_lens_cpu[i]]))
            n_drafts.append(0)
        n_blocks.append(len(st.block_ids))
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(md.query_lens_cpu, out=qsl[1:])
    step = EagleStep(hidden=hidden, input_ids=input_ids, positions=positions.cpu().numpy(),
                     slot_mapping=md.slot_mapping, query_start_loc=qsl, kept=kept, next_token_ids=nxt,
                     block_table=batch.block_table[rows], num_blocks=n_blocks, num_drafts=n_drafts)
    out = runner.proposer.propose(step)
    return {rid: d for rid, d in zip(req_ids, out) if d}
