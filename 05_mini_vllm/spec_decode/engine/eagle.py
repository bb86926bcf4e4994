"""The EAGLE proposer: drafts from the target's own hidden states.

vLLM counterpart: `vllm/v1/spec_decode/eagle.py` (`EagleProposer.propose`,
`prepare_inputs`). The head is `mini_vllm.models.llama_eagle`.

After each target step, for every scheduled request:
1. **The shift.** The target computed positions s .. s+q-1 and kept the first
   `kept` of them (the rest were rejected drafts). Position p gets the token
   at p+1 and the target's hidden state at p; the last kept position gets
   the token this step produced (the sampled one, or the next prompt token of
   a partial prefill). Positions and hidden states are not shifted.
2. **Pass 1** runs the head over all kept positions of all requests at once.
   It writes the head's KV there, through the target's own slot mapping and
   block tables, so the draft KV of every computed token sits in the block
   that holds its target KV: a prefix-cache hit finds both, a swap or
   copy-on-write moves both. Requests that want drafts read the head's output
   at their last kept position: logits -> draft 1 (argmax).
3. **Steps 2..k** feed each draft back with the head's own output as its
   hidden state, one position further each time, with slots from the
   request's block table. The scheduler has allocated blocks only up to this
   step's tokens, so a position past them is written to a scratch block the
   proposer owns (ids >= the pool's block count, in the head's KV tensor
   only): the next step's pass 1 overwrites those positions anyway.

Drafts are greedy (argmax) and go to the rejection sampler without
probabilities (one-hot proposals), as vLLM's EAGLE proposer does; verification
stays lossless for sampled requests.
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.spec_decode.engine.eagle_base import EagleProposerBase, EagleStep


class EagleProposer(EagleProposerBase):
    @torch.inference_mode()
    def propose(self, step: EagleStep) -> list[list[int]]:
        """Writes the head's KV for every kept position; returns each row's drafts."""
        qsl, kept = step.query_start_loc, np.asarray(step.kept, dtype=np.int64)
        starts = qsl[:-1].astype(np.int64)
        idx = np.arange(int(kept.sum()), dtype=np.int64) - np.repeat(np.cumsum(kept) - kept, kept) \
            + np.repeat(starts, kept)                               # flat rows of the kept positions
        last = np.cumsum(kept) - 1                                  # their last row, in pass-1 order
        dev = self.device
        idx_t = torch.from_numpy(idx).to(dev)
        # 1. the shift: the token at p + 1, the hidden state at p
        ids = step.input_ids.index_select(0, torch.from_numpy(np.minimum(idx + 1, len(step.input_ids) - 1)).to(dev))
        ids[torch.from_numpy(last).to(dev)] = torch.tensor(step.next_token_ids, dtype=ids.dtype, device=dev)
        pos = step.positions[idx]
        seq_lens = (step.positions[starts] + kept).tolist()
        tables = step.block_table[:, : max(1, -(-max(seq_lens) // self.bs))]
        md = self._metadata(step.slot_mapping.index_select(0, idx_t), tables, kept.tolist(), seq_lens)
        g = self._run(md, ids, torch.from_numpy(pos).to(dev), step.hidden.index_select(0, idx_t))
        out: list[list[int]] = [[] for _ in kept]
        want = np.flatnonzero(np.asarray(step.num_drafts) > 0)
        if not len(want):
            return out
        # 2. draft 1 from the last kept position of each drafting row
        g = g.index_select(0, torch.from_numpy(last[want]).to(dev))
        tok = self.head.compute_logits(g).argmax(dim=-1)
        drafts = [tok]
        pos_w = np.asarray(seq_lens, dtype=np.int64)[want] - 1     # the position draft 1 came from
        n_w = np.asarray(step.num_drafts, dtype=np.int64)[want]
        table_w = self._chain_tables(step, want, pos_w, int(n_w.max()))
        live = np.arange(len(want))
        # 3. steps 2..k: the previous draft at the next position, the head's own output as hidden
        for j in range(2, int(n_w.max()) + 1):
            keep = n_w[live] >= j
            if not keep.all():
                sel = torch.from_numpy(np.flatnonzero(keep)).to(dev)
                live, tok, g = live[keep], tok.index_select(0, sel), g.index_select(0, sel)
            p = pos_w[live] + (j - 1)
            blocks = table_w[live, p // self.bs].astype(np.int64)
            md = self._metadata(blocks * self.bs + p % self.bs, table_w[live], [1] * len(live), (p + 1).tolist())
            g = self._run(md, tok, torch.from_numpy(p).to(dev), g)
            tok = self.head.compute_logits(g).argmax(dim=-1)
            full = torch.full((len(want),), -1, dtype=tok.dtype, device=dev)
            full[torch.from_numpy(live).to(dev)] = tok
            drafts.append(full)
        rows = torch.stack(drafts, dim=1).tolist()
        for w, r in enumerate(want):
            out[r] = rows[w][: int(n_w[w])]
        return out
