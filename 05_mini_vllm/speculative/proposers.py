"""Draft proposers inside the engine (vLLM: `vllm/v1/spec_decode/ngram_proposer.py`,
`draft_model.py` / `eagle.py`).

After each step the runner asks a drafter for up to k tokens per request; the
scheduler schedules them as lookahead slots (Chapter 3) and the next forward
pass verifies them with Chapter 4's rejection sampler.

Drafts are proposed greedily (argmax), as vLLM v1's proposers do, and passed
to the rejection sampler without draft probabilities: a deterministic
proposal is a valid draft distribution (one-hot q), so verification stays
lossless for sampled requests too; only the acceptance rate is lower than
with sampled drafts.

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

from mini_vllm.forward_context import AttentionMetadata, set_forward_context
from mini_vllm.paged_attention import BlockAllocator, allocate_kv_cache
from mini_vllm.spec_decode import propose_ngram


class NgramDrafter:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, reqs: dict[str, list[int]]) -> dict[str, list[int]]:
        return {rid: propose_ngram(toks, self.min_n, self.max_n, self.k) for rid, toks in reqs.items()}

    def free(self, req_id: str) -> None:
        pass


class DraftModelDrafter:
    def __init__(self, model, model_config, k: int, num_blocks: int, block_size: int, dtype, device) -> None:
        self.model, self.k, self.bs = model, k, block_size
        self.device = torch.device(device)
        self.max_len = model_config.max_position_embeddings
        self.caches = [allocate_kv_cache(num_blocks, block_size, model_config.num_key_value_heads,
                                         model_config.head_dim, dtype, self.device)
                       for _ in range(model_config.num_hidden_layers)]
        for layer, kv in zip(model.attention_layers(), self.caches):
            layer.kv_cache = kv
        self.allocator = BlockAllocator(num_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.fed: dict[str, list[int]] = {}

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
        """chunks: (req_id, tokens, first position); returns the argmax at each chunk's last token."""
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
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev))
        last = torch.tensor(cu[1:], device=dev) - 1
        return self.model.compute_logits(hidden.index_select(0, last)).argmax(-1)

    @torch.inference_mode()
    def propose(self, reqs: dict[str, list[int]]) -> dict[str, list[int]]:
        """reqs: req_id -> confirmed tokens (prompt + output). Returns k drafts each
        (fewer or none when the context or the draft's KV pool is full)."""
        chunks, ks = [], {}
        for rid, toks in reqs.items():
            k = min(self.k, self.max_len - len(toks))
            fed = self.fed.get(rid, [])
            valid = 0
            for a, b in zip(fed, toks[:-1]):  # the last token is always fed: we need its logits
                if a != b:
                    break
                valid += 1
            if k < 1 or not self._ensure_blocks(rid, len(toks) + k - 1):
                continue
            self.fed[rid] = list(toks)
            chunks.append((rid, toks[valid:], valid))
            ks[rid] = k
        if not chunks:
            return {}
        drafts = {rid: [] for rid, _, _ in chunks}
        nxt = self._forward(chunks).tolist()
        live = [rid for rid, _, _ in chunks]
        for step in range(max(ks.values())):
            for rid, t in zip(live, nxt):
                drafts[rid].append(int(t))
            live = [rid for rid in live if len(drafts[rid]) < ks[rid]]
            if not live:
                break
            dec = [(rid, [drafts[rid][-1]], len(self.fed[rid])) for rid in live]
            for rid in live:
                self.fed[rid].append(drafts[rid][-1])
            nxt = self._forward(dec).tolist()
        return drafts
