"""Metrics, the chat entry point and the stat logger."""
import logging

from engine_utils import make_llm
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
