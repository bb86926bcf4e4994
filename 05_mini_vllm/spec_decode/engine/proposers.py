"""The engine's draft-model proposer (vLLM: `vllm/v1/spec_decode/draft_model.py`).

After each step the runner asks its proposer for up to k tokens per request
and the scheduler schedules them as lookahead slots (Chapter 3); the next
forward pass verifies them with Chapter 4's rejection sampler
(`verifier.py`). The runner calls each kind of proposer its own way, as
vLLM's runner does: Chapter 4's `mini_vllm.spec_decode.NgramProposer` as it
is (contexts in, drafts in the same order, nothing kept per request), and
`DraftModelProposer` here with {req_id: confirmed tokens} -> {req_id:
drafts}, plus `free(req_id)` when a request leaves the batch.

`DraftModelProposer` is Chapter 4's `NextTokenModelProposer` whose
next-token model is the draft model run incrementally on its own paged KV
cache: Chapter 4's loop drives the k steps, each call feeds the draft only
the tokens it has no KV for.

Drafts are proposed greedily (argmax), as vLLM v1's proposers do, and passed
to the rejection sampler without draft probabilities: a deterministic
proposal is a valid draft distribution (one-hot q), so verification stays
lossless for sampled requests too; only the acceptance rate is lower than
with sampled drafts. (So the probabilities Chapter 4's loop returns are
dropped: they are not the distribution the drafts were drawn from.)

The draft model has its own paged KV cache and its own block tables, managed
here with Chapter 1's `BlockAllocator` (one list of blocks per request), not
by the scheduler: the draft needs KV for positions the target has not
allocated yet (after `a` accepted drafts it feeds tokens up to position
num_tokens + k - 2). Invariant: `fed[r]` lists exactly the tokens whose draft
KV is in r's blocks, in order; after a rejection only the longest common
prefix with the confirmed tokens stays valid, the rest is recomputed.
"""
from __future__ import annotations

import torch

from mini_vllm import spec_decode
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.paged_attention import BlockAllocator, allocate_kv_cache


class DraftModelProposer(spec_decode.NextTokenModelProposer):
    def __init__(self, model, model_config, k: int, num_blocks: int, block_size: int, dtype, device) -> None:
        # Chapter 4's loop calls self.model(contexts) once per draft position: here the
        # draft model (self.draft) run on its own paged KV cache.
        super().__init__(self._next_token_logits, k)
        self.draft, self.bs = model, block_size
        self.device = torch.device(device)
        self.max_len = model_config.max_position_embeddings
        self.vocab_size = model_config.vocab_size
        self.caches = [allocate_kv_cache(num_blocks, block_size, model_config.num_key_value_heads,
                                         model_config.head_dim, dtype, self.device)
                       for _ in range(model_config.num_hidden_layers)]
        for layer, kv in zip(model.attention_layers(), self.caches):
            layer.kv_cache = kv
        self.allocator = BlockAllocator(num_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.fed: dict[str, list[int]] = {}
        # The call in progress, one entry per row: (req_id, confirmed tokens, drafts wanted).
        self._rows: list[tuple[str, int, int]] = []

    def free(self, req_id: str) -> None:
        for b in self.blocks.pop(req_id, []):
            self.allocator.free(b)
        self.fed.pop(req_id, None)

    def _ensure_blocks(self, rid: str, num_tokens: int) -> bool:
        blocks = self.blocks.setdefault(rid, [])
        need = -(-num_tokens // self.bs) - len(blocks)
        if need > self.allocator.num_free_blocks:
            return False
        blocks.extend(self.allocator.allocate() for _ in range(max(0, need)))
        return True

    def _forward(self, chunks: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """chunks: (req_id, tokens, first position); returns the logits at each chunk's last token."""
        ids, pos, slots, q_lens, s_lens, tables = [], [], [], [], [], []
        for rid, toks, start in chunks:
            tab = self.blocks[rid]
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(tab[p // self.bs] * self.bs + p % self.bs)
            q_lens.append(len(toks))
            s_lens.append(start + len(toks))
            tables.append(tab)
        width = max(len(t) for t in tables)
        bt = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        dev = self.device
        md = AttentionMetadata(torch.tensor(slots, device=dev), bt.to(dev),
                               torch.tensor(cu, dtype=torch.int32, device=dev),
                               torch.tensor(s_lens, dtype=torch.int32, device=dev),
                               max(q_lens), max(s_lens), q_lens, s_lens)
        with set_forward_context(md):
            hidden = self.draft(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev))
        last = torch.tensor(cu[1:], device=dev) - 1
        return self.draft.compute_logits(hidden.index_select(0, last))

    def _next_token_logits(self, contexts: list[list[int]]) -> torch.Tensor:
        """Chapter 4's `NextTokenModel`: logits [B, V] at the end of each context.

        Row i feeds the draft only `contexts[i][len(fed):]`, the tokens it has no
        KV for: the confirmed tokens past the kept prefix on the first call, the
        previous draft on each later one. A row that already holds its k drafts
        (k below the configured one near the context limit) runs nothing and
        gets a zero row, whose token `propose` cuts off."""
        chunks, live = [], []
        for i, (ctx, (rid, num_confirmed, k)) in enumerate(zip(contexts, self._rows)):
            if len(ctx) - num_confirmed >= k:
                continue
            fed = self.fed[rid]
            chunks.append((rid, ctx[len(fed):], len(fed)))
            fed.extend(ctx[len(fed):])
            live.append(i)
        if not chunks:
            return torch.zeros(len(contexts), self.vocab_size, device=self.device)
        logits = self._forward(chunks)
        if len(live) == len(contexts):
            return logits
        out = logits.new_zeros(len(contexts), logits.shape[-1])
        out[torch.tensor(live, device=logits.device)] = logits
        return out

    @torch.inference_mode()
    def propose(self, reqs: dict[str, list[int]]) -> dict[str, list[int]]:
        """reqs: req_id -> confirmed tokens (prompt + output). Returns k drafts each
        (fewer near the context limit, none when the draft's KV pool is full)."""
        rows, contexts = [], []
        for rid, toks in reqs.items():
            k = min(self.k, self.max_len - len(toks))
            if k < 1 or not self._ensure_blocks(rid, len(toks) + k - 1):
                continue
            # Keep the draft KV of the longest common prefix with the confirmed
            # tokens; the last token is always fed again: its logits give draft 1.
            fed = self.fed.setdefault(rid, [])
            valid = 0
            for a, b in zip(fed, toks[:-1]):
                if a != b:
                    break
                valid += 1
            del fed[valid:]
            rows.append((rid, len(toks), k))
            contexts.append(toks)
        if not rows:
            return {}
        self._rows = rows
        try:
            # Chapter 4's loop reads its own sampling metadata: temperature 0 on
            # every row, so it takes argmaxes and draws no random numbers.
            greedy = spec_decode.TemperatureTopKTopP.make([0.0] * len(rows))
            tokens, _ = super().propose(contexts, greedy)  # k calls of _next_token_logits
        finally:
            self._rows = []
        return {rid: drafts[:k] for (rid, _, k), drafts in zip(rows, tokens.tolist())}
