"""Metrics, the chat entry point and the stat logger."""
import logging

import pytest

from engine_utils import ALWAYS_DRAFT, make_llm
from mini_vllm import SamplingParams

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_request_metrics_are_ordered_and_complete():
    llm = make_llm(block_size=8, max_num_seqs=2)
    outs = llm.generate(["def f(x):", "import os", "class A:"],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time, (
            f"request timestamps out of order (arrival <= first scheduled <= first token <= last token): {m}")
        assert m.last_token_time <= m.finished_time, (
            f"finished_time predates the last token: {m.finished_time} < {m.last_token_time}")
        assert len(m.inter_token_latencies) == 5, "6 tokens one per step give 5 inter-token latencies"
        assert 0 <= m.time_in_queue <= m.ttft <= m.e2e_latency, (
            f"derived latencies inconsistent (0 <= time_in_queue <= ttft <= e2e_latency): {m.time_in_queue} {m.ttft} "
            f"{m.e2e_latency}")
    # max_num_seqs=2: the third request got a slot only once one of the first two
    # finished. Timestamps in program order, not durations: nothing here depends on speed.
    first_free = min(o.metrics.finished_time for o in outs[:2])
    assert outs[2].metrics.first_scheduled_time >= first_free, \
        "the third request's first_scheduled_time predates the first free slot: queue time is wrong"
    s = llm.llm_engine.get_stats()
    assert s["requests_finished"] == 3, f"get_stats counted {s['requests_finished']} finished requests, want 3"
    assert llm.llm_engine.metrics.num_generation_tokens == 18, (
        f"{llm.llm_engine.metrics.num_generation_tokens} generation tokens counted, want 3 x 6 = 18")
    assert s["ttft_p50_s"] is not None and s["ttft_p50_s"] <= s["ttft_p99_s"], (
        f"TTFT percentiles missing or out of order: p50 {s['ttft_p50_s']} p99 {s['ttft_p99_s']}")
    assert 0 < s["kv_cache_usage_max"] <= 1, (
        f"kv_cache_usage_max must be a used fraction in (0, 1], got {s['kv_cache_usage_max']}")


def test_prefix_cache_hit_rate_counts_shared_prompt():
    llm = make_llm(block_size=8)
    p = list(range(50, 90))
    llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.generate([{"prompt_token_ids": p + [7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    sched = llm.llm_engine.engine_core.call_utility("make_stats")
    assert sched["prefix_cache_hits"] == 40, "the second request should hit all 5 blocks of the first prompt"
    assert sched["prefix_cache_queries"] == 40 + 41, (
        f"prefix-cache queries must be each prompt's tokens once (40 + 41), got {sched['prefix_cache_queries']}")
    assert 0.4 < llm.llm_engine.metrics.prefix_cache_hit_rate < 0.6, (
        "prefix-cache hit rate must be hits over queries, about 40 / 81, got "
        f"{llm.llm_engine.metrics.prefix_cache_hit_rate}")
    assert llm.llm_engine.metrics.num_prompt_tokens == 40 + 1, \
        "prompt throughput must count computed prompt tokens only (the hit 40 are not recomputed)"


def test_chat_uses_the_chat_template():
    llm = make_llm()
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "write a loop"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                   use_tqdm=False, chat_template=TEMPLATE)[0]
    assert out.prompt_token_ids == tok("<user>write a loop\n<assistant>")["input_ids"], (
        "LLM.chat did not render the given chat_template into the prompt tokens")
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids},
                          SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids, (
        "LLM.chat generated differently from generate on its own rendered prompt")


def test_stat_logger_logs_throughput(caplog):
    llm = make_llm(log_stats=True, stats_log_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="mini_vllm"):
        llm.generate("x = 1", SamplingParams(max_tokens=3), use_tqdm=False)
    assert any("generation throughput" in r.message for r in caplog.records), "no periodic stats line"


def test_spec_decoding_stats_mean_acceptance_length():
    from mini_vllm.metrics.stats import SpecDecodingStats

    s = SpecDecodingStats()
    assert s.mean_acceptance_length is None, "mean acceptance length must stay undefined before any draft (vLLM)"
    for drafts, accepted in ((3, 2), (1, 0), (3, 3)):  # three draft sequences: 7 draft tokens, 5 accepted
        s.observe_draft(drafts, accepted)
    assert (s.num_draft_sequences, s.num_drafts, s.num_accepted) == (3, 7, 5), (
        f"counted {s.num_draft_sequences} sequences, {s.num_drafts} draft tokens, {s.num_accepted} accepted; "
        "want 3, 7, 5 (a sequence is one request-step, however many drafts it carries)")
    assert s.mean_acceptance_length == 1 + 5 / 3, (
        f"mean acceptance length {s.mean_acceptance_length}, want 1 + accepted / draft sequences = 1 + 5 / 3")
    assert s.drafts_per_position == [3, 2, 2] and s.accepted_per_position == [2, 2, 1], (
        f"per position: drafts {s.drafts_per_position}, accepted {s.accepted_per_position}; want [3, 2, 2] and "
        "[2, 2, 1] (position j counts sequences with more than j drafts, accepted if all up to j were)")


@pytest.mark.parametrize("method,async_scheduling", [("ngram", False), ("draft_model", True)],
                         ids=["ngram", "draft-model-async"])
def test_prometheus_spec_decode_counters_match_the_verifier(method, async_scheduling):
    """The step-by-step counters on /metrics (counted by the core from each step's
    drafts and sampled tokens) against the worker's verifier, which counts alone;
    with asynchronous scheduling the core schedules placeholder drafts that the
    runner fills, and those count too."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from engine_utils import SMALL_KV, target_path
    from mini_vllm.course.tiny_models import model_path
    from mini_vllm.engine.async_llm import AsyncLLM
    from mini_vllm.metrics.prometheus import PrometheusStatLogger

    k = 3
    spec = {"method": method, "num_speculative_tokens": k, **ALWAYS_DRAFT}
    if method == "draft_model":
        spec["model"] = str(model_path("tiny-py-draft"))
    prompts = ["def __init__(self, name, value=None):\n        self.name = name\n        self.value = ",
               "import os\nimport sys\nimport re\nimport ", "for i in range(10):\n    print(i)\nfor j in range("]
    prom = PrometheusStatLogger("tiny", num_spec_tokens=k)

    async def main():
        llm = AsyncLLM.from_engine_args(target_path(), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV,
                                        block_size=8, stat_loggers=[prom], multiprocess_mode=True,
                                        async_scheduling=async_scheduling, speculative_config=spec)
        try:
            async def run(i, p):
                async for _ in llm.generate(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                            f"r{i}"):
                    pass
            await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
            return await llm.call_utility("spec_decoding_stats")
        finally:
            llm.shutdown()

    want = asyncio.run(main())
    got = {(s.name, s.labels.get("position")): s.value
           for fam in text_string_to_metric_families(prom.render().decode()) for s in fam.samples
           if s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total")}
    assert 0 < want["num_draft_sequences"] < want["num_drafts"] and 0 < want["num_accepted"] < want["num_drafts"], (
        f"the workload must verify several drafts per sequence, with acceptances and rejections: {want}")
    assert got.get(("vllm:spec_decode_num_drafts_total", None)) == want["num_draft_sequences"], (
        f"vllm:spec_decode_num_drafts_total {got.get(('vllm:spec_decode_num_drafts_total', None))} != the "
        f"verifier's {want['num_draft_sequences']} draft sequences (counted draft tokens, or missed steps)")
    assert got.get(("vllm:spec_decode_num_draft_tokens_total", None)) == want["num_drafts"], (
        f"vllm:spec_decode_num_draft_tokens_total {got.get(('vllm:spec_decode_num_draft_tokens_total', None))} "
        f"!= the verifier's {want['num_drafts']} draft tokens")
    assert got.get(("vllm:spec_decode_num_accepted_tokens_total", None)) == want["num_accepted"], (
        f"vllm:spec_decode_num_accepted_tokens_total {got.get(('vllm:spec_decode_num_accepted_tokens_total', None))}"
        f" != the verifier's {want['num_accepted']} accepted tokens (the bonus token counted as accepted?)")
    per_pos = [got.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))) for j in range(k)]
    want_pos = want["accepted_per_position"] + [0] * (k - len(want["accepted_per_position"]))
    assert per_pos == want_pos and sum(per_pos) == want["num_accepted"], (
        f"vllm:spec_decode_num_accepted_tokens_per_pos_total by position {per_pos} != the verifier's {want_pos}")
    assert want["mean_acceptance_length"] == 1 + want["num_accepted"] / want["num_draft_sequences"], (
        f"the engine's mean acceptance length {want['mean_acceptance_length']} is not 1 + accepted / drafts")
