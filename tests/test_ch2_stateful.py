"""A hypothesis state machine over the KV cache manager.

The runner is simulated: after every successful `allocate_slots` the machine
executes the copy-on-write list and "computes" the scheduled tokens by writing,
into each physical slot, the identity of the KV it would hold: the request's
salt and the token prefix ending at that position (the KV of a token depends on
every token before it). A prefix hit is then correct only if every returned
block holds exactly the identities the hitting request expects, which catches
stale hashes, wrong chaining, salt leaks and writes into shared blocks.

Invariants checked after every step are listed in `check_kv_invariants`.
Run long:  HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -s tests/test_ch2_stateful.py
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule, run_state_machine_as_test)

STEPS = {"steps": 0, "runs": 0, "rules": 0}
VOCAB = st.integers(0, 3)  # a tiny vocabulary so independent prompts share prefixes


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self, mod):
        super().__init__()
        self.mod = mod
        self.live = {}       # request_id -> SimpleRequest holding blocks
        self.contents = {}   # block_id -> [identity or None] * block_size
        self.next_id = 0

    # ---- set-up ------------------------------------------------------------
    @initialize(num_blocks=st.integers(3, 32), block_size=st.sampled_from([1, 2, 4]),
                caching=st.sampled_from([True, True, True, False]),
                prefixes=st.lists(st.lists(VOCAB, min_size=1, max_size=12), min_size=1, max_size=3))
    def setup(self, num_blocks, block_size, caching, prefixes):
        self.m = self.mod.KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.bs, self.n = block_size, num_blocks
        self.prefixes = prefixes
        self.contents = {b: [None] * block_size for b in range(num_blocks)}
        STEPS["runs"] += 1

    # ---- the simulated runner ---------------------------------------------------
    def _ident(self, req, pos):
        return (req.cache_salt, tuple(req.all_token_ids[:pos + 1]))

    def _snapshot(self):
        pool = self.m.block_pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
                {r: self.m.get_block_ids(r) for r in self.live})

    def _run_step(self, req, num_new, n_hit=0, hit_blocks=None, lookahead=0):
        """allocate_slots + execute copies + write the computed tokens; False if no room."""
        before = self._snapshot()
        got = self.m.allocate_slots(req, num_new, n_hit, hit_blocks, num_lookahead_tokens=lookahead)
        if got is None:
            assert self._snapshot() == before, "allocate_slots returned None but changed state (not atomic)"
            return False
        for src, dst in self.m.take_blocks_to_copy():
            assert self.m.block_pool.blocks[dst].ref_cnt == 1, "copy-on-write target is shared"
            self.contents[dst] = list(self.contents[src])
        table = self.m.get_block_ids(req.request_id)
        start = req.num_computed_tokens + n_hit
        need = start + num_new + lookahead
        assert len(table) >= -(-need // self.bs), \
            f"block table has {len(table)} blocks for {need} slots (under-allocation)"
        for pos in range(start, start + num_new):
            bid = table[pos // self.bs]
            assert self.m.block_pool.blocks[bid].ref_cnt == 1, \
                f"write at position {pos} into shared block {bid}: copy-on-write missing"
            self.contents[bid][pos % self.bs] = self._ident(req, pos)
        req.num_computed_tokens = start + num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(req.num_tokens % 4)  # "sample" the next token
        STEPS["steps"] += 1
        return True

    # ---- rules ------------------------------------------------------------------
    @rule(data=st.data())
    def add_request(self, data):
        prefix = data.draw(st.sampled_from(self.prefixes))
        tail = data.draw(st.lists(VOCAB, max_size=8))
        salt = data.draw(st.sampled_from([None, None, "tenant-a", "tenant-b"]))
        req = self.mod.SimpleRequest(f"r{self.next_id}", prefix + tail, cache_salt=salt)
        self.next_id += 1
        hit, n_hit = self.m.get_computed_blocks(req)
        assert n_hit == len(hit) * self.bs and n_hit < req.num_tokens, \
            "a hit must be whole blocks and leave the last prompt token to recompute"
        for i, block in enumerate(hit):
            for off in range(self.bs):
                assert self.contents[block.block_id][off] == self._ident(req, i * self.bs + off), \
                    f"prefix hit on block {block.block_id} returns KV of other tokens (stale hash?)"
        chunk = data.draw(st.integers(1, 8))
        num_new = min(chunk, req.num_tokens - n_hit)
        if self._run_step(req, num_new, n_hit, hit):
            self.live[req.request_id] = req
        else:
            self.m.free(req)  # drop the waiting request; must not leak its hash list

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        """One prefill chunk or one decode step (with optional lookahead slots)."""
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        chunk = data.draw(st.integers(1, 6))
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 3]))
        self._run_step(req, min(chunk, req.num_tokens - req.num_computed_tokens), lookahead=lookahead)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        """Parallel sampling: the child shares every block, then samples a different token."""
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self.mod.SimpleRequest(f"r{self.next_id}", list(parent.all_token_ids),
                                       num_prompt_tokens=parent.num_prompt_tokens,
                                       num_computed_tokens=parent.num_computed_tokens,
                                       cache_salt=parent.cache_salt)
        self.next_id += 1
        child.all_token_ids[-1] = (child.all_token_ids[-1] + 1) % 4  # uncomputed: free to differ
        self.m.fork(parent, child)
        assert self.m.get_block_ids(child.request_id) == self.m.get_block_ids(parent.request_id), \
            "a forked child must share every block of its parent"
        self.live[child.request_id] = child

    @precondition(lambda self: any(r.num_computed_tokens < r.num_prompt_tokens for r in self.live.values()))
    @rule(data=st.data())
    def abort_mid_prefill(self, data):
        """Abort a request whose prompt is only partly computed (chunked prefill)."""
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.live.items()
                                               if q.num_computed_tokens < q.num_prompt_tokens)))
        self.m.free(self.live.pop(rid))
        assert self.m.get_block_ids(rid) == [], "an aborted request must hold no blocks after free"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        """Finish (or abort) any live request."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(self.live.pop(rid))
        assert self.m.get_block_ids(rid) == [], "a freed request must hold no blocks"

    @rule()
    def reset(self):
        in_use = any(self.m.get_block_ids(r) for r in self.live)
        assert self.m.reset_prefix_cache() == (not in_use), \
            "reset_prefix_cache must be refused exactly while a block is in use"
        if not in_use:
            assert not self.m.block_pool.cached_block_hash_to_block, "a successful reset must empty the hash map"

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def check_kv_invariants(self):
        if not hasattr(self, "m"):
            return
        STEPS["rules"] += 1  # runs once after initialisation and after every rule
        pool = self.m.block_pool
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
        holders = {b: 0 for b in range(self.n)}
        for r in self.live:
            for bid in self.m.get_block_ids(r):
                holders[bid] += 1
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], \
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != {holders[b.block_id]} live holders (leak?)"
            assert (b.block_id in free_ids) == (b.ref_cnt == 0), \
                f"block {b.block_id} must be free-queued iff ref_cnt == 0"
        assert self.m.num_free_blocks == len(free_ids) == sum(h == 0 for h in holders.values()), (
            f"num_free_blocks {self.m.num_free_blocks}, {len(free_ids)} queued, "
            f"{sum(h == 0 for h in holders.values())} without a holder: the free count drifted from the queue")
        assert abs(self.m.usage - (1 - len(free_ids) / self.n)) < 1e-12, \
            f"usage {self.m.usage} is not the fraction of blocks out of the free queue"
        # Hash map <-> block hashes, and every hash is the true hash of the block's KV.
        mapped = set()
        for h, entry in pool.cached_block_hash_to_block.items():
            assert entry, "empty multimap entry left behind"
            for bid, block in entry.items():
                assert block is pool.blocks[bid] and block.block_hash == h, "hash map disagrees with block"
                mapped.add(bid)
        for b in pool.blocks:
            assert (b.block_hash is not None) == (b.block_id in mapped), "hashed block missing from map"
            if b.block_hash is not None:
                assert all(c is not None for c in self.contents[b.block_id]), \
                    f"block {b.block_id} is hashed but not full of computed tokens (stale hash?)"
                salt, prefix = self.contents[b.block_id][-1]
                want = self.mod.hash_request_tokens(self.bs, list(prefix), salt)[-1]
                assert b.block_hash == want, f"block {b.block_id} hash does not match its contents"
        s = self.m.prefix_cache_stats
        assert 0 <= s.hits <= s.queries, f"prefix cache stats hits {s.hits} > queries {s.queries}"

    def teardown(self):
        if hasattr(self, "m"):
            for req in list(self.live.values()):
                self.m.free(req)
            self.live.clear()
            self.check_kv_invariants()
            assert self.m.num_free_blocks == self.n, "blocks leaked after freeing every request"
            assert not self.m._req_blocks and not self.m._req_block_hashes, \
                "per-request state leaked after free"


def test_kvcache_state_machine(chapter):
    mod = chapter("kvcache")
    STEPS.update(steps=0, runs=0, rules=0)
    run_state_machine_as_test(lambda: KVCacheMachine(mod),
                              settings=settings(settings(), stateful_step_count=100))
    print(f"\nKV cache state machine: {STEPS['runs']} runs, {STEPS['rules']} invariant-checked "
          f"states, {STEPS['steps']} successful allocation steps")
