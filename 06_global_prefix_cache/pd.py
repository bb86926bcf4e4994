"""Prefill/decode disaggregation: two engine processes and a small proxy.

vLLM counterparts: `examples/online_serving/disaggregated_prefill.sh` and
`disaggregated_serving/disagg_proxy_demo.py` (a proxy that sends a request to
the prefill instance with max_tokens=1, then to the decode instance), with
the KV moved by a P/D connector (here `PDConnector`, through the shared store).

`EngineProcess` runs one `LLMEngine` in its own process (spawned, one torch
thread) and streams every step's new tokens back with a timestamp taken in
that process (CLOCK_MONOTONIC is system-wide, so gaps compare across
processes). `PDProxy.run` routes each request: prompt -> prefill engine
(max_tokens=1, first token t1) -> decode engine with prompt + [t1] and
max_tokens - 1. A producer flushes its saves before it reports a finished
request, so the decode engine finds the whole prompt when the proxy forwards.
"""
from __future__ import annotations

import multiprocessing as mp
import time


def _serve(model: str, engine_args: dict, conn) -> None:
    import torch
    torch.set_num_threads(1)
    from mini_vllm.config import EngineConfig
    from mini_vllm.engine.llm_engine import LLMEngine
    from mini_vllm.executor import get_executor_class
    from mini_vllm.sampling_params import SamplingParams

    config = EngineConfig.from_kwargs(model, **engine_args)
    computed: dict[str, int] = {}  # request -> tokens the runner computed for it
    first_step: dict[str, int] = {}

    class CountingExecutor(get_executor_class(config)):
        """The engine's own executor, counting what each step computes per request:
        the report shows the decode engine computed none of the handed-off prompt."""

        def execute_model(self, so):
            for rid, n in so.num_scheduled_tokens.items():
                computed[rid] = computed.get(rid, 0) + n
                first_step.setdefault(rid, n)
            return super().execute_model(so)

    # In-process core: this process already is the engine's own process, and the
    # counting executor (a local class) and its connector are read right here.
    eng = LLMEngine(config, executor_class=CountingExecutor, multiprocess_mode=False)
    core = eng.engine_core.engine_core
    conn.send(("ready", None))
    while True:
        while conn.poll(0 if eng.has_unfinished_requests() else None):
            msg = conn.recv()
            if msg[0] == "stop":
                wc = core.kv_connector_worker
                if wc is not None:  # drain saves, then release the store (a p2p group too)
                    wc.flush(5.0)
                    wc.close()
                    wc.store.close()
                conn.send(("stopped", None))
                return
            _, rid, prompt, max_tokens = msg
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            eng.add_request(rid, {"prompt_token_ids": prompt}, sp, output_kind="delta")
        outs = eng.step()
        now = time.monotonic()
        done = [o for o in outs if o.finished]
        if done and core.kv_connector_worker is not None:
            core.kv_connector_worker.flush(5.0)  # the hand-off is in the store before we report
        for o in outs:
            info = None
            if o.finished:
                info = {"computed": computed.pop(o.request_id, 0),
                        "first_step": first_step.pop(o.request_id, 0)}
            conn.send(("out", (o.request_id, list(o.outputs[0].token_ids), o.finished, now, info)))


class EngineProcess:
    """One engine in a spawned process. `wait=False` returns at once (start
    several engines in parallel, then call `wait_ready` on each)."""

    def __init__(self, model: str, wait: bool = True, **engine_args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(str(model), engine_args, child), daemon=True)
        self.proc.start()
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0) -> "EngineProcess":
        if not self._ready:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"engine process {self.proc.pid} did not start in {timeout_s} s")
            kind, _ = self.conn.recv()
            if kind != "ready":
                raise RuntimeError(f"engine process sent {kind!r} before 'ready'")
            self._ready = True
        return self

    def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.conn.send(("add", rid, list(prompt), int(max_tokens)))

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def run_requests(requests, single: EngineProcess | None = None, prefill: EngineProcess | None = None,
                 decode: EngineProcess | None = None) -> dict:
    """Serve `requests` = [(rid, prompt, max_tokens, arrival offset s)], on one
    engine (`single`) or through the proxy (`prefill` then `decode`).

    Returns rid -> {"tokens", "times" (one per token), "decode_info",
    "prefill_info"}; times are CLOCK_MONOTONIC seconds in the engine processes.
    """
    pending = sorted(requests, key=lambda r: r[3])
    res = {rid: {"tokens": [], "times": [], "decode_info": None, "prefill_info": None}
           for rid, *_ in requests}
    prompts = {rid: (p, m) for rid, p, m, _ in requests}
    left = len(requests)
    t0 = time.monotonic()
    engines = [e for e in (single, prefill, decode) if e is not None]
    while left:
        now = time.monotonic() - t0
        while pending and pending[0][3] <= now:
            rid, p, m, _ = pending.pop(0)
            (single or prefill).submit(rid, p, m if single else 1)
        ready = mp.connection.wait([e.conn for e in engines], timeout=0.005)
        for c in ready:
            while c.poll():
                kind, (rid, toks, finished, ts, info) = c.recv()
                r = res[rid]
                r["tokens"] += toks
                r["times"] += [ts] * len(toks)
                if not finished:
                    continue
                if single is not None or c is decode.conn:
                    r["decode_info"] = info
                    left -= 1
                    continue
                r["prefill_info"] = info
                p, m = prompts[rid]
                if m > 1:  # continue on the decode engine from the first token
                    decode.submit(rid, p + r["tokens"][:1], m - 1)
                else:
                    left -= 1
    return res
