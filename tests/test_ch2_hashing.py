"""The sha256 hash chain: determinism across processes, chaining, salt, full blocks only."""
import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)


def test_none_hash_is_fixed_and_documented(chapter):
    kv = chapter("kvcache")
    assert kv.NONE_HASH == hashlib.sha256(b"mini-vllm/kvcache/NONE_HASH/v1").digest(), \
        "NONE_HASH changed: every process and machine must seed the chain with the same documented value"
    assert kv.hash_block_tokens(None, [1, 2]) == kv.hash_block_tokens(kv.NONE_HASH, [1, 2]), \
        "parent_hash=None must mean NONE_HASH: the first block of a chain hashed two ways"


def test_hash_is_stable_across_processes(chapter, impl):
    """Python's hash() is salted per process; a sha256 chain must not be."""
    kv = chapter("kvcache")
    mod = "mini_vllm.kvcache" + (".exercise" if impl == "exercise" else "")
    code = (f"import {mod} as kv; "
            "print(kv.hash_block_tokens(None, [1, 2, 3], ['s']).hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert outs == {kv.hash_block_tokens(None, [1, 2, 3], ["s"]).hex()}, (
        "the same block hashed differently under PYTHONHASHSEED 1, 2 and here: Python's hash() is salted per "
        "process; hash a fixed byte encoding with sha256")


@given(a=tokens, b=tokens)
def test_parent_and_content_both_matter(chapter, a, b):
    kv = chapter("kvcache")
    h = kv.hash_block_tokens
    assert len(h(None, a)) == 32, f"a block hash has {len(h(None, a))} bytes, expected a 32-byte sha256 digest"
    assert (h(None, a) == h(None, b)) == (a == b), "different tokens must not collide"
    pa = h(None, a)
    if a != b:
        # Same block contents under different parents (seed 004's example): different KV.
        assert h(pa, b) != h(h(None, b), b), \
            "parent hash left out: the same block after two different parents hashed the same"


def test_position_matters(chapter):
    """Block [5, 6] after [1, 2] and after [3, 4] are different KV."""
    kv = chapter("kvcache")
    h1 = kv.hash_request_tokens(2, [1, 2, 5, 6])
    h2 = kv.hash_request_tokens(2, [3, 4, 5, 6])
    assert h1[1] != h2[1], "parent hash left out of the chain: block [5, 6] after [1, 2] and after [3, 4] collide"
    assert kv.hash_request_tokens(2, [5, 6])[0] not in (h1[1], h2[1]), \
        "block [5, 6] at position 0 hashed like the same tokens at position 1: the chain lost its parent"


def test_token_encoding_is_unambiguous(chapter):
    kv = chapter("kvcache")
    h = kv.hash_block_tokens
    assert h(None, [1, 2]) != h(None, [1, 2, 0]), "ambiguous encoding: a trailing 0 token vanished (the token count is missing)"
    assert h(None, [256]) != h(None, [1, 0]), "ambiguous encoding: [256] and [1, 0] collide (tokens need a fixed width)"
    assert h(None, [1], ["ab"]) != h(None, [1], ["a", "b"]), \
        "ambiguous encoding: extra keys ['ab'] and ['a', 'b'] collide (each key needs its length)"
    assert h(None, [1], ["x"]) != h(None, [1]), "extra keys ignored: a salted block hashed like an unsalted one"


@given(toks=st.lists(st.integers(0, 9), max_size=30), bs=st.integers(1, 6), salt=st.sampled_from([None, "t"]),
       cut=st.integers(0, 6))
def test_request_chain_equals_manual_chain_and_continues(chapter, toks, bs, salt, cut):
    kv = chapter("kvcache")
    full = kv.hash_request_tokens(bs, toks, salt)
    assert len(full) == len(toks) // bs, "only full blocks are hashed"
    prev, manual = None, []
    for i in range(len(toks) // bs):
        prev = kv.hash_block_tokens(prev, toks[i * bs:(i + 1) * bs], [salt] if i == 0 and salt else None)
        manual.append(prev)
    assert full == manual, "hash_request_tokens must chain hash_block_tokens block by block, the salt in block 0 only"
    k = min(cut, len(full))
    if k:
        rest = kv.hash_request_tokens(bs, toks, salt, parent_hash=full[k - 1], start_block=k)
        assert full[:k] + rest == full, "continuing a chain must equal hashing from scratch"


def test_salt_goes_into_first_block_only_and_isolates(chapter):
    kv = chapter("kvcache")
    toks = list(range(8))
    a, b, none = (kv.hash_request_tokens(4, toks, s) for s in ("a", "b", None))
    assert a[0] != b[0] != none[0] and a[1] != b[1], "different salts must never share a prefix"
    assert a[1] == kv.hash_block_tokens(a[0], toks[4:]), "the salt must not be re-applied after block 0"


def test_bad_arguments(chapter):
    kv = chapter("kvcache")
    with pytest.raises(ValueError, match="block_size"):
        kv.hash_request_tokens(0, [1])
    with pytest.raises(ValueError, match="parent_hash"):
        kv.hash_request_tokens(2, [1, 2, 3, 4], start_block=1)
