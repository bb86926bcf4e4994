"""Chapter 6 under random operations (hypothesis stateful testing): two
model-free engines share one store while requests arrive, steps run, values
are corrupted or dropped, and the store dies and comes back.

Each engine is Chapter 3's real Scheduler with the real connector on both
sides; its runner writes a KV value that depends on the whole prefix (the
cache salt and every token up to the position), as a real model's does. Before
every forward it reads back every computed position of every scheduled
request, loaded ones included: a load of the wrong block, a block of another
prefix or salt, or a corrupted value shows up as a wrong number. After the
run, every local block is free and the connector holds no request state.
"""
import random
import zlib

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from mini_vllm.global_cache import (GlobalCacheConnector, KVConnectorRole, KVLayout, KVTransferConfig,
                                    LocalLRUPool, StoreUnavailable)
from mini_vllm.paged_attention import allocate_kv_cache
from mini_vllm.scheduler import ModelRunnerOutput, Request, RequestStatus, Scheduler, SchedulerConfig
from mini_vllm.scheduler.mini_runner import update_block_tables
from mini_vllm.scheduler.request import SchedulerSamplingParams

BS = 4
LAYOUT = KVLayout("stateful", "float32", block_size=BS, num_layers=2, num_kv_heads=1, head_dim=2)
PREFIXES = [[7, 3, 9, 1, 4, 4, 8, 2, 6, 5], [7, 3, 9, 1, 2, 2, 2, 2, 2], [11, 12, 13, 14, 15, 16, 17, 18]]


def expected_kv(req) -> list[float]:
    """KV number at each position: a hash of the salt and every token up to it."""
    crc = zlib.crc32((req.cache_salt or "").encode())
    out = []
    for t in req.all_token_ids:
        crc = zlib.crc32(t.to_bytes(4, "little"), crc)
        out.append(float(crc % 1_000_003))
    return out


class FlakyPool(LocalLRUPool):
    down = False

    def _check(self):
        if self.down:
            raise StoreUnavailable("killed")

    def batch_put(self, items):
        self._check()
        super().batch_put(items)

    def batch_get(self, keys):
        self._check()
        return super().batch_get(keys)

    def batch_exists(self, keys):
        self._check()
        return super().batch_exists(keys)


class Engine:
    def __init__(self, store, num_blocks, budget):
        tc = KVTransferConfig.from_dict({"kv_role": "kv_both",
                                         "kv_connector_extra_config": {"backend": "local"}})
        self.sc = GlobalCacheConnector(tc, KVConnectorRole.SCHEDULER, LAYOUT, store)
        self.wc = GlobalCacheConnector(tc, KVConnectorRole.WORKER, LAYOUT, store, self.sc.stats)
        cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=num_blocks * BS)
        self.sched = Scheduler(cfg, num_blocks, BS, connector=self.sc)
        self.caches = [allocate_kv_cache(num_blocks, BS, 1, 2) for _ in range(LAYOUT.num_layers)]
        self.wc.register_kv_caches(self.caches)
        self.tables: dict[str, list[int]] = {}
        self.live: dict[str, Request] = {}

    def read(self, table, p):
        k, v = self.caches[p % LAYOUT.num_layers]
        return float(k[table[p // BS], p % BS, 0, 0]), float(v[table[p // BS], p % BS, 0, 1])

    def step(self):
        so = self.sched.schedule()
        update_block_tables(self.tables, so)
        self.wc.bind_connector_metadata(so.kv_connector_metadata)
        self.wc.start_load_kv()
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req, table = self.live[rid], self.tables[rid]
            want = expected_kv(req)
            end = req.num_computed_tokens  # schedule() advanced it already
            for p in range(end - n):  # local hits, loads and earlier steps
                assert self.read(table, p) == (want[p], -want[p]), (
                    f"{rid} position {p}: KV read back is not this prefix's (a wrong, foreign "
                    "or corrupted block was loaded, or a block table is wrong)")
            for p in range(end - n, end):
                for k, v in self.caches:
                    k[table[p // BS], p % BS] = want[p]
                    v[table[p // BS], p % BS] = -want[p]
            sampled[rid] = [int(want[end - 1]) % 50 + 1] if end >= req.num_tokens else []
        self.wc.wait_for_save()
        self.wc.clear_connector_metadata()
        assert self.wc.flush(10), (
            "the step's saves were not all attempted within 10 s: a save stuck in the queue (a store error stopped "
            "the saver?)")
        for o in self.sched.update_from_output(so, ModelRunnerOutput.from_dict(sampled)):
            if o.finished:
                self.live.pop(o.request_id, None)

    def drain(self):
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish in 500 steps")


class GlobalCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 16), budget=st.integers(4, 24),
                capacity=st.sampled_from([3, 8, 1000]))
    def setup(self, num_blocks, budget, capacity):
        nbytes = len(GlobalCacheConnector.pack_block("k", torch.zeros(LAYOUT.block_shape)))
        self.store = FlakyPool(capacity * nbytes)
        self.engines = [Engine(self.store, num_blocks, budget) for _ in range(2)]
        self.n = 0
        self.rng = random.Random(0)

    @rule(e=st.integers(0, 1), prefix=st.integers(0, 2), tail=st.lists(st.integers(1, 50), max_size=9),
          salt=st.sampled_from([None, None, "tenant"]), max_tokens=st.integers(1, 4))
    def add_request(self, e, prefix, tail, salt, max_tokens):
        eng = self.engines[e]
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, PREFIXES[prefix] + tail, SchedulerSamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      cache_salt=salt)
        eng.live[rid] = req
        eng.sched.add_request(req)

    @rule(e=st.integers(0, 1), times=st.integers(1, 4))
    def step(self, e, times):
        for _ in range(times):
            self.engines[e].step()

    @rule(e=st.integers(0, 1), pick=st.integers(0, 100))
    def abort(self, e, pick):
        eng = self.engines[e]
        if eng.live:
            rid = sorted(eng.live)[pick % len(eng.live)]
            eng.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            del eng.live[rid]

    @rule(pick=st.integers(0, 1000), pos=st.integers(0, 10_000))
    def corrupt_value(self, pick, pos):
        keys = list(self.store._data)
        if keys:
            k = keys[pick % len(keys)]
            data = bytearray(self.store._data[k])
            data[pos % len(data)] ^= 0x20
            self.store.raw_set(k, bytes(data))

    @rule(pick=st.integers(0, 1000))
    def drop_value(self, pick):
        keys = list(self.store._data)
        if keys:
            with self.store._lock:
                v = self.store._data.pop(keys[pick % len(keys)])
                self.store.used_bytes -= len(v)

    @rule(down=st.booleans())
    def kill_or_revive(self, down):
        self.store.down = down

    @invariant()
    def pool_within_budget(self):
        assert self.store.used_bytes <= self.store.capacity_bytes, (
            f"the pool holds {self.store.used_bytes} bytes over its capacity {self.store.capacity_bytes}: a put that "
            "did not fit was kept, or eviction freed too little")

    def teardown(self):
        if not hasattr(self, "engines"):
            return
        for eng in self.engines:
            eng.drain()
            kv = eng.sched.kv_cache_manager
            assert kv.num_free_blocks == eng.sched.num_gpu_blocks, "local KV blocks leaked"
            assert not eng.sc._reqs and not eng.sc._pending_loads, \
                "the connector kept state of finished requests"
            eng.wc.close()


def test_global_cache_state_machine():
    run_state_machine_as_test(GlobalCacheMachine, settings=settings(stateful_step_count=40))


def test_machine_loads_across_engines():
    """The machine's oracle is live: engine 1 really loads what engine 0 saved."""
    m = GlobalCacheMachine()
    m.setup(num_blocks=16, budget=24, capacity=1000)
    m.add_request(0, 0, [5, 6, 7], None, 2)
    m.engines[0].drain()
    m.add_request(1, 0, [9], None, 2)
    m.engines[1].drain()
    assert m.engines[1].sc.stats.blocks_loaded == 2, "10-token shared prefix: 2 full blocks to load"
    m.teardown()
