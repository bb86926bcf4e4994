"""vLLM's defaults and limits in the server: generation_config.json, requests
past the context, /v1/models, system_fingerprint, /tokenize token_strs,
continuous usage stats.

Oracles: the checkpoint's own files (generation_config.json, the tokenizer),
offline `LLM.generate`, and counting (context length, streamed chunks)."""
import json
from pathlib import Path

import httpx
import pytest

from engine_utils import ALWAYS_DRAFT, make_llm, target_path
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import load_tiny_tokenizer
from server_utils import API_KEY, SERVED_NAME, Server, api_server  # noqa: F401 - a fixture

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 1024  # the tiny target's max_position_embeddings


def _post(server, path, body, **kw):
    r = httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, headers=AUTH, timeout=120, **kw)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _chunks(server, path, body) -> list[dict]:
    out = []
    with httpx.stream("POST", server.url + path, json={"model": SERVED_NAME, "stream": True, **body},
                      headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_chat_without_max_tokens_stops_at_generation_config(api_server):
    want = json.loads(Path(target_path(), "generation_config.json").read_text())
    assert want["max_new_tokens"] == 64, "the checkpoint's generation_config.json sets max_new_tokens"
    r = _post(api_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a loop"}],
                                                   "temperature": 0, "ignore_eos": True})
    assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (64, "length"), \
        "without max_tokens a reply must stop at generation_config.json's max_new_tokens (vLLM's default)"
    r = _post(api_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a loop"}],
                                                   "temperature": 0, "ignore_eos": True, "max_tokens": 70})
    assert r["usage"]["completion_tokens"] == 70, "a request's own max_tokens wins over the default"


def test_prompt_plus_max_tokens_over_the_context_stops_at_the_limit(api_server):
    """`vllm bench serve` with input 950 / output 128 on a 1,024 context."""
    prompt = list(range(100, 1050))  # 950 token ids
    r = _post(api_server, "/v1/completions", {"prompt": prompt, "max_tokens": 128, "temperature": 0,
                                              "ignore_eos": True})
    c = r["choices"][0]
    assert (r["usage"]["completion_tokens"], c["finish_reason"]) == (CONTEXT - 950, "length"), \
        "the request must be served up to max_model_len and end with 'length', as vLLM does"
    chunks = _chunks(api_server, "/v1/completions", {"prompt": prompt, "max_tokens": 128, "temperature": 0,
                                                     "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == CONTEXT - 950
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_models_fingerprint_token_strs(api_server):
    card = httpx.get(api_server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["parent"] is None and card["root"] == str(Path(target_path()).resolve())
    assert [p["object"] for p in card["permission"]] == ["model_permission"], "vLLM's permission list"
    cmpl = _post(api_server, "/v1/completions", {"prompt": "def f():", "max_tokens": 2})
    chat = _post(api_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    fp = cmpl["system_fingerprint"]
    assert fp and fp.startswith("mini-vllm-") and chat["system_fingerprint"] == fp, \
        "one fingerprint per server, on completions and chat"
    last = _chunks(api_server, "/v1/completions", {"prompt": "def f():", "max_tokens": 2})[-1]
    assert last["system_fingerprint"] == fp, "the last chunk of a stream carries the fingerprint"
    tok = load_tiny_tokenizer()
    r = _post(api_server, "/tokenize", {"prompt": "def fib(n):", "return_token_strs": True})
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and len(r["token_strs"]) == r["count"]
    assert _post(api_server, "/tokenize", {"prompt": "def fib(n):"})["token_strs"] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "import os\n", "n": 2, "temperature": 1.0, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 1.0,
                              "seed": 3}),
])
def test_continuous_usage_stats(api_server, path, body):
    chunks = _chunks(api_server, path, {**body, "max_tokens": 6, "ignore_eos": True,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    per_choice: dict[int, list[int]] = {}
    for ch in chunks[:-1]:
        if ch["choices"] and ch["choices"][0].get("delta", {}).get("role"):
            continue  # chat's role chunk comes before any token
        assert "usage" in ch, "every chunk needs usage with continuous_usage_stats"
        per_choice.setdefault(ch["choices"][0]["index"], []).append(ch["usage"]["completion_tokens"])
    assert set(per_choice) == {0, 1}
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 6, f"running completion_tokens must reach 6: {counts}"
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    plain = _chunks(api_server, path, {**body, "max_tokens": 6, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1]), "usage per chunk only with continuous_usage_stats"


def test_generation_config_path_and_vllm(tmp_path):
    """--generation-config PATH: the file's temperature 0 makes a request that gives
    none greedy (equal to offline greedy); 'vllm' ignores the file."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 9}))
    llm = make_llm(generation_config=str(tmp_path))
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.max_tokens) == (0.0, 9), "defaults must come from the given folder"
    assert make_llm(generation_config="vllm").get_default_sampling_params().max_tokens == 16
    assert make_llm().get_default_sampling_params().max_tokens == 64, "auto: the model folder's file"
    with pytest.raises(ValueError, match="generation_config"):
        make_llm(generation_config=str(tmp_path / "missing"))
    greedy = llm.generate("def fib(n):", SamplingParams(max_tokens=9, temperature=0), use_tqdm=False)[0]
    s = Server("--generation-config", str(tmp_path))
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 9}, timeout=60)
        assert r.json()["choices"][0]["text"] == greedy.outputs[0].text, \
            "a request without temperature must take the generation config's temperature 0"
    finally:
        s.stop()


def _samples(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_request_metric_series(api_server):
    """vLLM's per-request and per-step series, checked by counting what was sent."""
    before = _samples(api_server)
    r1 = _post(api_server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 6, "n": 2, "temperature": 1.0,
                                               "seed": 2, "ignore_eos": True})
    r2 = _post(api_server, "/v1/completions", {"prompt": "def f():", "max_tokens": 5, "temperature": 0,
                                               "allowed_token_ids": [5], "stop_token_ids": [5]})  # stops at once
    assert r2["choices"][0]["finish_reason"] == "stop"
    api_server.wait_idle()
    after = _samples(api_server)

    def d(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    n_prompt = r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]
    n_gen = r1["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"]
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:request_success_total", finished_reason="stop") == 1
    assert d("vllm:request_prompt_tokens_sum") == n_prompt and d("vllm:request_prompt_tokens_count") == 2
    assert d("vllm:request_generation_tokens_sum") == n_gen == 12 + 1
    assert d("vllm:request_max_num_generation_tokens_sum") == 6 + 1
    assert d("vllm:request_params_n_sum") == 3 and d("vllm:request_params_max_tokens_sum") == 11
    for name in ("queue", "prefill", "decode", "inference"):
        assert d(f"vllm:request_{name}_time_seconds_count") == 2
    assert d("vllm:request_inference_time_seconds_sum") >= d("vllm:request_decode_time_seconds_sum") > 0
    assert d("vllm:request_time_per_output_token_seconds_count") == 2
    # Steps count computed tokens: a forked sample recomputes its last prompt token, hence the counters.
    assert d("vllm:iteration_tokens_total_sum") == d("vllm:prompt_tokens_total") + d("vllm:generation_tokens_total")
    assert d("vllm:generation_tokens_total") == n_gen and d("vllm:iteration_tokens_total_count") >= 7
    info = [k for k in after if k[0] == "vllm:cache_config_info"]
    assert info and dict(info[0][1])["block_size"] == "16"


def test_spec_decode_series_on_metrics(api_server):
    """--speculative-config puts vLLM's four speculative-decoding counters on /metrics;
    oracle: the verifier's own counts in an offline engine given the same greedy requests,
    one at a time. A server without speculation shows none (vLLM registers them only
    with a speculative config)."""
    plain = sorted({key[0] for key in _samples(api_server) if key[0].startswith("vllm:spec_decode_")})
    assert not plain, f"a server without speculation must not show speculative-decoding series: {plain}"
    k = 3
    spec = {"method": "ngram", "num_speculative_tokens": k, **ALWAYS_DRAFT}
    prompts = ["import os\nimport sys\nimport re\nimport ", "for i in range(10):\n    print(i)\nfor j in range("]
    s = Server("--speculative-config", json.dumps(spec))
    try:
        for p in prompts:
            r = httpx.post(s.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": p, "max_tokens": 24,
                                                            "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text[:300]
        s.wait_idle()
        got = _samples(s)
    finally:
        s.stop()
    llm = make_llm(speculative_config=spec)
    for p in prompts:
        llm.generate(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    want = llm.llm_engine.engine_core.call_utility("spec_decoding_stats")
    assert 0 < want["num_draft_sequences"] < want["num_drafts"], f"the workload must verify drafts: {want}"
    for name, key in (("drafts", "num_draft_sequences"), ("draft_tokens", "num_drafts"),
                      ("accepted_tokens", "num_accepted")):
        value = got.get((f"vllm:spec_decode_num_{name}_total", ()))
        assert value == want[key], (f"vllm:spec_decode_num_{name}_total is {value}, the verifier counted "
                                    f"{want[key]} {key} (counter missing, or fed the wrong count)")
    per_pos = [got.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),)))
               for j in range(k)]
    want_pos = want["accepted_per_position"] + [0] * (k - len(want["accepted_per_position"]))
    assert per_pos == want_pos, (f"vllm:spec_decode_num_accepted_tokens_per_pos_total by position {per_pos}, "
                                 f"the verifier counted {want_pos} (one series per position 0 .. k - 1)")
