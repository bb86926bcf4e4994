"""Helpers shared by the Chapter 6 engine tests (the in-process pool, Valkey, Mooncake,
prefill/decode disaggregation): prompts with a shared prefix, an engine that records
what each step computes, and the oracle comparison against an engine without a pool."""
import random

import torch

from engine_utils import greedy, make_llm
from mini_vllm.executor.uniproc_executor import UniProcExecutor

BS = 16


EXERCISE_CONNECTOR = "mini_vllm.global_cache.exercise"


def with_impl(cfg: dict, impl: str) -> dict:
    """A kv_transfer_config whose connector is the exercise's under --impl=exercise (vLLM's
    `kv_connector_module_path`), so the engines share their pool through the learner's code."""
    return {**cfg, "kv_connector_module_path": EXERCISE_CONNECTOR} if impl == "exercise" else cfg


def prompts_with_prefix(seed, n, prefix_len, tail_len):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 6000) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(10, 6000) for _ in range(tail_len)] for _ in range(n)]


def recording_llm(**kw):
    """(engine, log): per step, the log gets the runner's {request id: tokens scheduled}
    (what it computes), recorded by an executor subclass passed at construction."""
    log = []

    class RecordingExecutor(UniProcExecutor):
        def execute_model(self, so):
            log.append(dict(so.num_scheduled_tokens))
            return super().execute_model(so)
    return make_llm(executor_class=RecordingExecutor, **kw), log


def computed_per_request(log):
    out = {}
    for step in log:
        for rid, n in step.items():
            out[rid] = out.get(rid, 0) + n
    return out


def greedy_logprobs(llm, prompts, max_tokens):
    """(token ids, logprob of each chosen token) per prompt: a finer oracle than
    tokens alone (a slightly wrong KV rarely flips a greedy token of a tiny
    model, but it moves every logprob)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        greedy(max_tokens, logprobs=0), use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return res


def assert_same_as_reference(got, want, what):
    for (tg, lg), (tw, lw) in zip(got, want):
        assert tg == tw, f"{what}: tokens differ from an engine without the pool"
        # Chunking changes float summation order only: ~1e-6 in fp32.
        assert torch.allclose(torch.tensor(lg), torch.tensor(lw), atol=1e-4, rtol=0), (
            f"{what}: logprobs differ from an engine without the pool by "
            f"{(torch.tensor(lg) - torch.tensor(lw)).abs().max():.2e}: loaded KV is not the KV "
            "the engine would have computed")


def flush(llm):
    assert llm.llm_engine.engine_core.engine_core.kv_connector_worker.flush(10), "saves did not drain"
