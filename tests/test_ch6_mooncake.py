"""Chapter 6 on Mooncake Store (optional): skipped, with the reason, when the
`mooncake-transfer-engine-non-cuda` package or the `libibverbs1` library is
missing. Otherwise a local `mooncake_master` (TCP) serves two engines: B
computes only the tail that A did not, with A's tokens and logprobs."""
import pytest

from mini_vllm.global_cache.mooncake_store import mooncake_available

REASON = mooncake_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"Mooncake unavailable: {REASON}")


@pytest.fixture(scope="module")
def master():
    from mini_vllm.global_cache.mooncake_store import MooncakeMasterProcess
    m = MooncakeMasterProcess().start()
    yield m
    m.stop()


def test_store_contract(master):
    from mini_vllm.global_cache.mooncake_store import MooncakeStore
    st = MooncakeStore(master.master_address, master.metadata_server, 32 << 20)
    st.batch_put([("a", b"x" * 100), ("b", b"y" * 7)])
    assert st.batch_get(["a", "b", "c"]) == [b"x" * 100, b"y" * 7, None], (
        "batch_get must return each stored value and None for a missing key, in key order")
    assert st.batch_exists(["a", "c"]) == [True, False], "batch_exists must say which keys are stored, in key order"
    st.close()


def test_two_engines_share_mooncake(master):
    from engine_utils import make_llm
    from global_cache_utils import (BS, assert_same_as_reference, computed_per_request, flush,
                                    greedy_logprobs, prompts_with_prefix, recording_llm)
    tc = {"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"backend": "mooncake", "url": master.master_address,
                                        "metadata_server": master.metadata_server,
                                        "capacity_bytes": 64 << 20}}
    prefix, (pa,) = prompts_with_prefix(31, 1, 150, 20)
    _, tails = prompts_with_prefix(32, 2, 0, 13)
    a = make_llm(kv_transfer_config=tc)
    greedy_logprobs(a, [pa], 2)
    flush(a)
    b, log = recording_llm(kv_transfer_config=tc)
    pb = [prefix + t for t in tails]
    assert_same_as_reference(greedy_logprobs(b, pb, 3), greedy_logprobs(make_llm(), pb, 3), "engine B")
    per_req = computed_per_request(log)
    for rid, p in zip(sorted(per_req, key=int), pb):
        assert per_req[rid] == len(p) - 150 // BS * BS + 2, (
            f"request {rid} computed {per_req[rid] - 2} prompt tokens; only the tail beyond A's {150 // BS * BS} "
            "cached tokens should be")
    assert b.llm_engine.engine_core.engine_core.kv_connector.stats.blocks_loaded == 150 // BS, (
        f"engine B must load A's {150 // BS} shared blocks once from Mooncake, loaded "
        f"{b.llm_engine.engine_core.engine_core.kv_connector.stats.blocks_loaded}")
