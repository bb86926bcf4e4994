"""Chapter 6 mutants: classic mistakes of a shared KV pool, planted in the reference.

Each must make the listed Chapter 6 tests fail within 60 s. The unit tests
(tests/test_ch6_units.py, no model) come first: they catch the matching,
key and serialisation mistakes in about a second; the engine tests catch
what only shows through a real load (wrong bytes in the paged cache).
"""
from mutants.core import Mutant

KEYS = "06_global_prefix_cache/keys.py"
SERDE = "06_global_prefix_cache/serde.py"
CONN = "06_global_prefix_cache/connector.py"
BASE = "06_global_prefix_cache/connector_base.py"
UNITS = ["tests/test_ch6_units.py"]
ENGINE_B = "tests/test_ch6_engine.py::test_engine_b_computes_only_the_uncached_tail"

MUTANTS: list[Mutant] = [
    Mutant(
        name="key_without_fingerprint",
        path=KEYS,
        old='return f"{prefix}:{fingerprint[:32]}:{block_hash.hex()}"',
        new='return f"{prefix}:{block_hash.hex()}"',
        tests=UNITS + ["tests/test_ch6_engine.py::test_other_model_never_loads_this_models_blocks"],
        why="the store key omits the model fingerprint: another model with the same KV layout loads these blocks",
    ),
    Mutant(
        name="gap_continues_the_match",
        path=CONN,
        old="            if v is None:\n                break\n",
        new="            if v is None:\n                continue\n",
        tests=UNITS,
        why="a missing block is skipped: blocks after the gap chain through it and are no prefix of the request",
    ),
    Mutant(
        name="corrupt_block_skipped",
        path=CONN,
        old="break  # later blocks chain through this one: they are not a prefix",
        new="continue",
        tests=UNITS,
        why="a corrupt block is skipped instead of ending the match",
    ),
    Mutant(
        name="checksum_not_verified",
        path=SERDE,
        old="if hashlib.blake2b(mv[:-_SUM], digest_size=_SUM).digest() != bytes(mv[-_SUM:]):",
        new="if False:",
        tests=UNITS,
        why="flipped bytes in the payload load as KV: wrong tokens with no error",
    ),
    Mutant(
        name="foreign_value_accepted",
        path=SERDE,
        old="if digest != _key_digest(key):",
        new="if False:",
        tests=UNITS,
        why="a value stored under another key (a misplaced or foreign write) loads as this block's KV",
    ),
    Mutant(
        name="last_token_external",
        path=CONN,
        old="end = (request.num_tokens - 1) // bs  # never the last token: it must be computed",
        new="end = request.num_tokens // bs",
        tests=UNITS,
        why="the block holding the last prompt token loads from the store: nothing is left to sample from",
    ),
    Mutant(
        name="cache_salt_dropped",
        path=KEYS,
        old="hash_request_tokens(layout.block_size, token_ids, cache_salt=cache_salt)",
        new="hash_request_tokens(layout.block_size, token_ids, cache_salt=None)",
        tests=UNITS,
        why="store keys ignore the cache salt: one tenant's prompt blocks are served to another",
    ),
    Mutant(
        name="producer_loads",
        path=CONN,
        old="        if not self.kv_transfer_config.is_kv_consumer:\n            return 0, False\n",
        new="",
        tests=UNITS,
        why="a kv_producer (prefill-only) engine loads from the store it should only fill",
    ),
    Mutant(
        name="loads_paired_from_block_zero",
        path=BASE,
        old="ids = list(blocks)[t.fetch_start:t.fetch_start + n]",
        new="ids = list(blocks)[:n]",
        tests=UNITS,
        why="fetched blocks are written over the local prefix hit instead of the blocks after it",
    ),
    Mutant(
        name="store_error_not_caught",
        path=CONN,
        old="except StoreUnavailable as e:",
        new="except CorruptBlockError as e:",
        tests=UNITS,
        why="a store that is down makes the request fail instead of costing a recompute",
    ),
    Mutant(
        name="partial_block_saved",
        path=BASE,
        old="full //= self.block_size",
        new="full = -(-full // self.block_size)",
        tests=UNITS,
        why="a partial block is saved under a full block's key: its content still changes",
    ),
    Mutant(
        name="load_writes_key_into_value",
        path=BASE,
        old="as_bytes(v).index_copy_(0, ids, as_bytes(data[:, layer, 1]))",
        new="as_bytes(v).index_copy_(0, ids, as_bytes(data[:, layer, 0]))",
        tests=[ENGINE_B],
        why="a loaded block's keys are written into the value cache: attention reads wrong KV",
    ),
]
