"""Chapter 6 prefill/decode disaggregation: a prefill engine (kv_producer) and
a decode engine (kv_consumer) in two processes behind the proxy of
`mini_vllm.global_cache.pd`, the KV sent directly with torch.distributed
(gloo); and the same hand-off through a real Valkey server. Oracle: one engine
without a connector serving the same greedy requests."""
import random

import pytest

from engine_utils import make_llm, run_greedy, target_path
from mini_vllm.global_cache.pd import EngineProcess, run_requests
from mini_vllm.global_cache.valkey_server import ValkeyServerProcess, free_port

BASE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, device="cpu")


def tc(backend, url, role):
    extra = {"backend": backend, "url": url}
    if backend == "p2p":
        extra["p2p_rank"] = 0 if role == "kv_producer" else 1
    else:  # a healthy local server: a 0.5 s default timeout would turn a busy machine into misses
        extra["timeout_s"] = 30.0
    return {"kv_connector": "PDConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def pd_pair():
    """Two engine processes; the hand-off is sent directly (torch.distributed, gloo)."""
    p = d = None
    try:
        url = f"tcp://127.0.0.1:{free_port()}"
        p = EngineProcess(target_path(), wait=False, kv_transfer_config=tc("p2p", url, "kv_producer"),
                          **BASE)
        d = EngineProcess(target_path(), wait=False, kv_transfer_config=tc("p2p", url, "kv_consumer"),
                          **BASE)
        yield p.wait_ready(), d.wait_ready()  # started in parallel: both must join the group
    finally:
        for e in (p, d):
            if e is not None:
                e.stop()


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
    assert res["solo"]["decode_info"] is None and len(res["solo"]["tokens"]) == 1, (
        "a request with max_tokens=1 is done after the prefill: it must not be handed to the decode engine, got "
        f"{res['solo']}")


def test_hand_off_through_a_valkey_server():
    """The same hand-off through a shared server (two engines in this process;
    test_ch6_valkey.py covers two processes on one server)."""
    from global_cache_utils import recording_llm
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 6000) for _ in range(n)] for n in (50, 16, 3)]
    with ValkeyServerProcess() as srv:
        prefill = make_llm(kv_transfer_config=tc("valkey", srv.url, "kv_producer"))
        decode, log = recording_llm(kv_transfer_config=tc("valkey", srv.url, "kv_consumer"))
        want = run_greedy(make_llm(), prompts, 5)
        for i, p in enumerate(prompts):
            (t1,) = run_greedy(prefill, [p], 1)
            assert prefill.llm_engine.engine_core.engine_core.kv_connector_worker.flush(10), (
                "the prefill engine's saves did not reach the Valkey server within 10 s (a save lost or stuck in the "
                "queue)")
            log.clear()
            rest = run_greedy(decode, [p + t1], 4)[0]
            assert t1 + rest == want[i], f"prompt {i}: P/D tokens differ from a single engine's"
            assert list(log[0].values()) == [1], \
                f"prompt {i} ({len(p)} tokens): the decode engine recomputed prompt tokens"
