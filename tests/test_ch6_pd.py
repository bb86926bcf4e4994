"""Chapter 6 prefill/decode disaggregation: a prefill engine (kv_producer) and
a decode engine (kv_consumer) in two processes, a real Valkey server between
them, and the proxy of `mini_vllm.global_cache.pd`. Oracle: one engine
without a connector serving the same greedy requests."""
import random

import pytest

from engine_utils import make_llm, run_greedy, target_path
from mini_vllm.global_cache.pd import EngineProcess, run_requests
from mini_vllm.global_cache.valkey_server import ValkeyServerProcess

BASE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, device="cpu")


def tc(url, role):
    return {"kv_connector": "PDConnector", "kv_role": role,
            "kv_connector_extra_config": {"backend": "valkey", "url": url}}


@pytest.fixture(scope="module")
def pd_pair():
    srv = ValkeyServerProcess().start()
    p = d = None
    try:
        p = EngineProcess(target_path(), wait=False, kv_transfer_config=tc(srv.url, "kv_producer"), **BASE)
        d = EngineProcess(target_path(), wait=False, kv_transfer_config=tc(srv.url, "kv_consumer"), **BASE)
        yield p.wait_ready(), d.wait_ready()  # started in parallel
    finally:
        for e in (p, d):
            if e is not None:
                e.stop()
        srv.stop()


def test_decode_engine_continues_without_recomputing_the_prompt(pd_pair):
    prefill, decode = pd_pair
    rng = random.Random(0)
    # Lengths around block boundaries: a partial last block of 1, 15 and 0 tokens.
    prompts = [[rng.randrange(10, 6000) for _ in range(n)] for n in (33, 47, 64, 5, 200)]
    reqs = [(f"r{i}", p, 7, 0.0) for i, p in enumerate(prompts)]
    res = run_requests(reqs, prefill=prefill, decode=decode)
    want = run_greedy(make_llm(), prompts, 7)
    for (rid, p, _, _), w in zip(reqs, want):
        r = res[rid]
        assert r["tokens"] == w, f"{rid}: P/D tokens differ from a single engine's"
        assert r["prefill_info"]["computed"] == len(p), "the prefill engine computes the whole prompt"
        assert r["decode_info"]["first_step"] == 1, (
            f"{rid} ({len(p)} prompt tokens): the decode engine's first step computed "
            f"{r['decode_info']['first_step']} tokens; only the first generated token may be "
            "computed, every prompt position must come from the hand-off (partial block included)")
        assert r["decode_info"]["computed"] == 6, "then one token per decode step"


def test_max_tokens_one_never_reaches_the_decode_engine(pd_pair):
    prefill, decode = pd_pair
    res = run_requests([("solo", [9, 8, 7, 6, 5], 1, 0.0)], prefill=prefill, decode=decode)
    assert res["solo"]["decode_info"] is None and len(res["solo"]["tokens"]) == 1
