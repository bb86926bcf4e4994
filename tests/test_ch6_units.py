"""Chapter 6 building blocks without a model: config validation, block
values with checksums, keys and fingerprints, the LRU byte budget, and the
connector's matching logic (`get_num_new_matched_tokens`) against a pool
filled by hand. The serde and matching tests also run with --impl=exercise."""
import dataclasses
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.global_cache import (KVConnectorRole, KVLayout, KVTransferConfig, LocalLRUPool,
                                    StoreUnavailable)

LAYOUT = KVLayout("m", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=3)
PROGRAMS = Path(__file__).resolve().parent / "programs"


def block_for(i: int, layout=LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(layout.block_shape, generator=g).to(layout.torch_dtype)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("bad, field", [
    ({"kv_role": "kv_sender"}, "kv_role"),
    ({"kv_connector": "Nixl"}, "kv_connector"),
    ({"kv_connector_extra_config": {"bakend": "local"}}, "unknown key"),
    ({"kv_connector_extra_config": {"backend": "disk"}}, "backend"),
    ({"kv_connector_extra_config": {"timeout_s": 0}}, "timeout_s"),
    ({"kv_connector_extra_config": {"backend": "valkey", "url": "http://x"}}, "url"),
    ({"kv_rank": 0}, "unknown key"),
    ({"kv_connector_extra_config": {"backend": "p2p", "url": "tcp://127.0.0.1:1"}}, "p2p_rank"),
    ({"kv_connector_extra_config": {"backend": "mooncake", "url": "127.0.0.1:1"}}, "metadata_server"),
])
def test_bad_kv_transfer_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_dict(bad)


def test_roles():
    for role, prod, cons in (("kv_producer", True, False), ("kv_consumer", False, True),
                             ("kv_both", True, True)):
        tc = KVTransferConfig.from_dict({"kv_role": role})
        assert (tc.is_kv_producer, tc.is_kv_consumer) == (prod, cons), role


# ------------------------------------------------------------------- serde
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_round_trip_is_bit_exact(chapter, dtype):
    gc = chapter("global_cache")
    lay = dataclasses.replace(LAYOUT, dtype=dtype)
    x = block_for(1, lay)
    out = gc.unpack_block("k1", gc.pack_block("k1", x), lay)
    assert out.dtype == x.dtype and out.shape == x.shape, (
        f"round trip changed the dtype or shape: {out.dtype} {tuple(out.shape)}, want {x.dtype} {tuple(x.shape)}")
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), "round trip changed bytes"


def _rejects(gc, key, data, layout, why):
    """unpack_block must raise CorruptBlockError (not return KV, not another error)."""
    try:
        gc.unpack_block(key, data, layout)
    except gc.CorruptBlockError as e:
        return e
    pytest.fail(f"unpack_block returned KV for {why}")


@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_flipped_bit_is_rejected(chapter, pos, bit):
    gc = chapter("global_cache")
    data = bytearray(gc.pack_block("k", block_for(2)))
    data[pos % len(data)] ^= 1 << bit
    _rejects(gc, "k", bytes(data), LAYOUT, f"a value with bit {bit} of byte {pos % len(data)} flipped: "
             "the checksum must cover header and payload")


def test_truncated_foreign_and_other_layout_values_are_rejected(chapter):
    gc = chapter("global_cache")
    data = gc.pack_block("k", block_for(3))
    for bad, why in ((data[:-1], "truncated"), (data[:10], "truncated header"),
                     (data + b"x", "trailing bytes"), (b"", "empty")):
        with pytest.raises(gc.CorruptBlockError):
            gc.unpack_block("k", bad, LAYOUT)
            pytest.fail(why)
    e = _rejects(gc, "other", data, LAYOUT, "a value stored under another key (foreign value): check the key digest")
    assert "another key" in str(e), f"the error for a foreign value must say so ('another key'), got {e}"
    with pytest.raises(gc.CorruptBlockError):  # same byte count, other dtype
        gc.unpack_block("k", data, dataclasses.replace(LAYOUT, dtype="float16", head_dim=6))


# -------------------------------------------------------------------- keys
KEY_TOKENS = list(range(100, 117))  # 17 tokens: 4 full blocks of 4, one partial


def test_block_keys_change_with_every_layout_field(chapter):
    gc = chapter("global_cache")
    base = gc.block_keys("p", LAYOUT, KEY_TOKENS)
    assert len(base) == 4 and all(isinstance(k, str) for k in base), \
        f"one str key per full block (4 here; the partial fifth has none), got {base!r}"
    assert len(set(base)) == 4, "blocks with other tokens must have other keys"
    assert gc.block_keys("p", KVLayout(*dataclasses.astuple(LAYOUT)), KEY_TOKENS) == base, \
        "an equal layout must give equal keys"
    for f, v in (("model_id", "m2"), ("dtype", "bfloat16"), ("num_layers", 3), ("num_kv_heads", 2),
                 ("head_dim", 4), ("tp_rank", 1)):
        other = gc.block_keys("p", dataclasses.replace(LAYOUT, **{f: v}), KEY_TOKENS)
        assert not set(other) & set(base), f"{f} changes the KV bytes, so it must change every block's key"
    other = gc.block_keys("p", dataclasses.replace(LAYOUT, block_size=8), KEY_TOKENS)
    assert len(other) == 2 and not set(other) & set(base), "block_size changes the blocks and their keys"
    assert not set(gc.block_keys("q", LAYOUT, KEY_TOKENS)) & set(base), "the prefix is a namespace: it must change keys"


def test_block_keys_chain_and_salt(chapter):
    gc = chapter("global_cache")
    keys = gc.block_keys("p", LAYOUT, KEY_TOKENS)
    assert gc.block_keys("p", LAYOUT, KEY_TOKENS[:12]) == keys[:3], "a prefix of the tokens keeps its keys"
    assert gc.block_keys("p", LAYOUT, KEY_TOKENS[:15]) == keys[:3], "a partial block must not get a key"
    moved = gc.block_keys("p", LAYOUT, [1, 2, 3, 4] + KEY_TOKENS[4:8])
    assert moved[1] != keys[1], ("block 1 holds the same tokens after another block 0: other KV, so its key "
                                 "must chain through the blocks before it")
    salted = gc.block_keys("p", LAYOUT, KEY_TOKENS, "tenant-a")
    assert not set(salted) & set(keys), "the cache salt must change every block's key (it salts the chain)"
    assert gc.block_keys("p", LAYOUT, KEY_TOKENS, "tenant-a") == salted, (
        "the same tokens and salt must give the same keys (the salt hashed non-deterministically?)")
    assert not set(gc.block_keys("p", LAYOUT, KEY_TOKENS, "tenant-b")) & set(salted), (
        "two cache salts share a block key: one tenant could read the other's KV")


# -------------------------------------------------------------- LRU pool
@given(ops=st.lists(st.tuples(st.sampled_from("pg"), st.integers(0, 7), st.integers(1, 40)),
                    max_size=60), cap=st.integers(1, 100))
def test_lru_pool_matches_a_model(ops, cap):
    pool, model = LocalLRUPool(cap), OrderedDict()
    for op, k, n in ops:
        key = f"k{k}"
        if op == "p":
            pool.batch_put([(key, bytes([k]) * n)])
            if n <= cap:
                model.pop(key, None)
                while sum(map(len, model.values())) + n > cap:
                    model.popitem(last=False)
                model[key] = bytes([k]) * n
        else:
            got = pool.batch_get([key])[0]
            assert got == model.get(key), "the pool must evict least recently used first"
            if key in model:
                model.move_to_end(key)
        assert pool.used_bytes == sum(map(len, model.values())) <= cap, "byte budget broken"
    assert pool.batch_exists([f"k{i}" for i in range(8)]) == [f"k{i}" in model for i in range(8)], (
        "batch_exists must say, key by key, whether the LRU model still holds it")


# ------------------------------------------------------- connector matching
class Req:
    def __init__(self, rid, tokens, salt=None):
        self.request_id, self.all_token_ids, self.cache_salt = rid, list(tokens), salt

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def make_conn(gc, role="kv_both", store=None):
    tc = KVTransferConfig.from_dict({"kv_role": role})
    return gc.GlobalCacheConnector(tc, KVConnectorRole.SCHEDULER, LAYOUT,
                                   store if store is not None else LocalLRUPool(1 << 20))


def fill(conn, tokens, n_blocks, salt=None, corrupt=(), missing=()):
    keys = conn.keys_for(tokens, salt)
    for i in range(n_blocks):
        if i in missing:
            continue
        key = keys[i]
        data = bytearray(conn.pack_block(key, block_for(i)))
        if i in corrupt:
            data[-1] ^= 0xFF
        conn.store.batch_put([(key, bytes(data))])


TOKENS = list(range(100, 121))  # 21 tokens: 5 full blocks of 4, one partial


@pytest.mark.parametrize("stored, computed, expect", [
    (5, 0, 20),   # every full block, the partial one never
    (5, 8, 12),   # beyond a local hit of two blocks
    (2, 0, 8),    # the longest stored run
    (0, 0, 0),
    (5, 20, 0),   # nothing left beyond the local hit
])
def test_matched_tokens_is_the_stored_run_after_the_local_hit(chapter, stored, computed, expect):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, stored)
    n, async_load = conn.get_num_new_matched_tokens(Req("a", TOKENS), computed)
    assert (n, async_load) == (expect, False), (
        f"{stored} stored blocks beyond {computed} local tokens: matched {n} tokens (async {async_load}), want "
        f"{expect} (the partial block or the local hit counted?)")


def test_last_token_is_never_external(chapter):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    toks = TOKENS[:20]  # exactly 5 blocks: the 5th holds the last token
    fill(conn, toks, 5)
    assert conn.get_num_new_matched_tokens(Req("a", toks), 0)[0] == 16, \
        "the last token must be computed to sample from it"


def test_a_corrupt_block_ends_the_match(chapter):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, 5, corrupt={2})
    assert conn.get_num_new_matched_tokens(Req("a", TOKENS), 0)[0] == 8, \
        "a corrupt block is a miss, and blocks after it chain through it"
    assert conn.stats.corrupt_blocks == 1, f"the corrupt block must be counted once, got {conn.stats.corrupt_blocks}"


@pytest.mark.parametrize("missing", [{0}, {2}, {4}, {1, 3}])
def test_a_missing_block_ends_the_match(chapter, missing):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, 5, missing=missing)
    want = min(missing) * LAYOUT.block_size
    got = conn.get_num_new_matched_tokens(Req("a", TOKENS), 0)[0]
    assert got == want, (f"blocks {sorted(missing)} missing from the store: matched {got} tokens, want {want}; "
                         "a gap must end the match (the blocks after it chain through a block that is not "
                         "there, so they are no prefix of this request)")
    assert conn.stats.corrupt_blocks == 0, "a missing block is a miss, not a corrupt block"


def test_another_model_never_matches(chapter):
    """Same KV layout, other model: only the fingerprint tells the blocks apart,
    and serialised values carry no model id to catch it later."""
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, 5)
    tc = KVTransferConfig.from_dict({"kv_role": "kv_both"})
    other = gc.GlobalCacheConnector(tc, KVConnectorRole.SCHEDULER, dataclasses.replace(LAYOUT, model_id="m2"),
                                    conn.store)
    assert other.get_num_new_matched_tokens(Req("a", TOKENS), 0)[0] == 0, (
        "a connector for another model matched this model's blocks: the store key must include the "
        "model fingerprint")
    assert conn.get_num_new_matched_tokens(Req("b", TOKENS), 0)[0] == 20, "set-up: the same model must match"


def test_salt_and_role_gate_matching(chapter):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, 5, salt="tenant-a")
    assert conn.get_num_new_matched_tokens(Req("a", TOKENS, "tenant-b"), 0)[0] == 0, \
        "tenant-b matched blocks stored under tenant-a's cache salt"
    assert conn.get_num_new_matched_tokens(Req("b", TOKENS, None), 0)[0] == 0, \
        "a request without a cache salt matched blocks stored under a salt"
    assert conn.get_num_new_matched_tokens(Req("c", TOKENS, "tenant-a"), 0)[0] == 20, \
        "the same cache salt must match: the keys must hash the request's salt as Chapter 2 does"
    prod = make_conn(gc, "kv_producer", conn.store)
    assert prod.get_num_new_matched_tokens(Req("d", TOKENS, "tenant-a"), 0)[0] == 0, \
        "a kv_producer never loads"


def test_store_down_is_a_counted_miss(chapter):
    gc = chapter("global_cache")

    class Down(LocalLRUPool):
        def batch_get(self, keys):
            raise StoreUnavailable("down")

    conn = make_conn(gc, store=Down(1 << 20))
    try:
        n = conn.get_num_new_matched_tokens(Req("a", TOKENS), 0)[0]
    except StoreUnavailable:
        pytest.fail("a store that is down made the lookup raise: it must be a counted miss (a recompute)")
    assert n == 0, f"a store that is down must match nothing, matched {n} tokens"
    assert conn.stats.store_errors == 1, f"the failed lookup must count one store error, got {conn.stats.store_errors}"


def test_loads_pair_fetched_blocks_with_allocated_ids(chapter):
    gc = chapter("global_cache")
    conn = make_conn(gc)
    fill(conn, TOKENS, 5)
    req = Req("a", TOKENS)
    req.num_computed_tokens = 0
    assert conn.get_num_new_matched_tokens(req, 4)[0] == 16, (
        "set-up: beyond a local hit of one block, the 4 stored blocks after it must match (16 tokens)")
    conn.update_state_after_alloc(req, [7, 8, 9, 10, 11, 12], 16)
    from mini_vllm.scheduler.output import NewRequestData, SchedulerOutput
    so = SchedulerOutput(num_scheduled_tokens={"a": 1})
    so.scheduled_new_reqs.append(NewRequestData("a", TOKENS, TOKENS, [7, 8, 9, 10, 11, 12], 20))
    req.num_computed_tokens = 21
    meta = conn.build_connector_meta(so)
    assert [b for b, _ in meta.loads] == [8, 9, 10, 11], "block i of the request goes to its id"
    for (b, x), i in zip(meta.loads, range(1, 5)):
        assert torch.equal(x, block_for(i)), f"block {b} got another block's KV"
    assert meta.saves == [], "loaded or locally cached blocks are not saved again"


def test_block_keys_are_the_same_in_every_process(chapter, impl):
    """Last in the file: it starts a Python process (a few seconds)."""
    gc = chapter("global_cache")
    mod = "mini_vllm.global_cache" + (".exercise" if impl == "exercise" else "")
    args = [mod, "p", json.dumps(dataclasses.astuple(LAYOUT)), json.dumps(KEY_TOKENS), "s"]
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # another str hash than this process's
    out = subprocess.run([sys.executable, str(PROGRAMS / "block_keys.py"), *args],
                         env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == gc.block_keys("p", LAYOUT, KEY_TOKENS, "s"), \
        "keys differ between processes: Python's hash() is salted per process (PYTHONHASHSEED)"
