"""`PDConnector`: prefill/decode disaggregation through the shared store.

vLLM counterparts: the P/D connectors `nixl_connector.py`,
`mooncake_connector.py` and `p2p/p2p_nccl_connector.py` under
`vllm/distributed/kv_transfer/kv_connector/v1/`, and the proxies in
`examples/online_serving/disaggregated_*`.

A prefill engine (`kv_role="kv_producer"`) computes a prompt, samples its
first token and publishes the prompt's KV; a decode engine
(`kv_role="kv_consumer"`) receives prompt + first token and continues from
there. A prefix cache publishes full blocks only (a partial block's content
still changes); a hand-off must also carry the prompt's partial last block,
or the decode engine would recompute up to `block_size - 1` prompt tokens.
The partial block's key is the chain hash of its tokens so far (Chapter 2's
`hash_block_tokens` accepts any count, and encodes it), so it names exactly
the KV of those positions and never collides with the full block.

Through a shared store this is the *pull* variant (seed 002 §7.3: the decode
side fetches at admission); with the `p2p` backend (`p2p_store.py`) the
prefill engine pushes the blocks to the decode engine with torch.distributed
send/recv, as vLLM's p2p_nccl connector does, and the decode engine reads
them from its receive buffer. Invariant: a decode request whose whole prompt was
published computes exactly one token in its first step (the first generated
token, the last token of its own prompt), and no token of the prompt.
"""
from __future__ import annotations

from mini_vllm.kvcache import hash_block_tokens, hash_request_tokens

from .connector import GlobalCacheConnector, _Tracked
from .keys import block_key, layout_fingerprint
from .store import CorruptBlockError, StoreUnavailable


class PDConnector(GlobalCacheConnector):
    def _partial_key(self, t: _Tracked, num_tokens: int) -> str | None:
        """Key of the partial block holding tokens [k * bs, num_tokens), k = num_tokens // bs."""
        bs, req = self.block_size, t.request
        k = num_tokens // bs
        if num_tokens % bs == 0:
            return None
        salt = getattr(req, "cache_salt", None)
        parent = hash_request_tokens(bs, req.all_token_ids[:k * bs], cache_salt=salt)[-1] if k else None
        extra = (salt,) if (k == 0 and salt is not None) else None  # as Chapter 2 salts block 0
        # The full blocks' key scheme (keys.block_keys), applied to the partial block's chain hash.
        h = hash_block_tokens(parent, req.all_token_ids[k * bs:num_tokens], extra)
        return block_key(self.key_prefix, layout_fingerprint(self.layout), h)

    def _fetch(self, t: _Tracked, start: int, end: int):
        out = super()._fetch(t, start, end)
        last = t.request.num_tokens - 1  # the decode side's own last token is computed
        if start + len(out) < end or self.kv_transfer_config.is_kv_producer:
            return out
        key = self._partial_key(t, last)
        if key is None:
            return out
        try:
            (value,) = self.store.batch_get([key])
        except StoreUnavailable:
            self.stats.store_errors += 1
            return out
        if value is not None:
            try:
                out.append(self.unpack_block(key, value, self.layout))
                self.stats.hit_blocks += 1
            except CorruptBlockError:
                self.stats.corrupt_blocks += 1
        return out

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        if self.kv_transfer_config.is_kv_consumer:
            return meta  # only a pure producer hands prompts over
        for rid in scheduler_output.num_scheduled_tokens:
            t = self._reqs.get(rid)
            if t is None or getattr(t, "handed_off", False):
                continue
            req = t.request
            n = req.num_prompt_tokens
            if req.num_computed_tokens >= n:  # the prompt is complete after this step
                t.handed_off = True
                key = self._partial_key(t, n)
                if key is not None:
                    meta.saves.append((key, t.block_ids[n // self.block_size]))
        return meta
