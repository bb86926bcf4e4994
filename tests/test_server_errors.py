"""Bad input: every case gets a 4xx in OpenAI's error shape naming the field,
and the server keeps serving. The server runs with --api-key."""
import httpx
import openai
import pytest

from server_utils import API_KEY, SERVED_NAME, api_server  # noqa: F401 - a fixture

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def c(**kw):
    return {"model": SERVED_NAME, "prompt": "def f():", "max_tokens": 4, **kw}


def ch(**kw):
    return {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, **kw}


# (id, path, body (dict, or raw bytes), headers, status, param the error must name)
CASES = [
    ("malformed-json", CMPL, b'{"prompt": "x", ', AUTH, 400, None),
    ("malformed-json-chat", CHAT, b"not json at all", AUTH, 400, None),
    ("body-is-a-list", CMPL, [1, 2], AUTH, 400, None),
    ("prompt-wrong-type", CMPL, c(prompt=5), AUTH, 400, "prompt"),
    ("prompt-missing", CMPL, {"model": SERVED_NAME, "max_tokens": 4}, AUTH, 400, "prompt"),
    ("max_tokens-string", CMPL, c(max_tokens="abc"), AUTH, 400, "max_tokens"),
    ("max_tokens-negative", CMPL, c(max_tokens=-1), AUTH, 400, "max_tokens"),
    ("max_tokens-zero-without-echo", CMPL, c(max_tokens=0), AUTH, 400, "max_tokens"),
    ("temperature-negative", CMPL, c(temperature=-0.5), AUTH, 400, "temperature"),
    ("top_p-above-1", CMPL, c(top_p=1.5), AUTH, 400, "top_p"),
    ("top_p-zero", CMPL, c(top_p=0), AUTH, 400, "top_p"),
    ("n-zero", CMPL, c(n=0), AUTH, 400, "n"),
    ("top_k-below-minus-1", CMPL, c(top_k=-5), AUTH, 400, "top_k"),
    ("min_p-above-1", CMPL, c(min_p=2.0), AUTH, 400, "min_p"),
    ("repetition_penalty-zero", CMPL, c(repetition_penalty=0), AUTH, 400, "repetition_penalty"),
    ("presence_penalty-too-big", CMPL, c(presence_penalty=3), AUTH, 400, "presence_penalty"),
    ("logprobs-negative", CMPL, c(logprobs=-1), AUTH, 400, "logprobs"),
    ("min_tokens-over-max", CMPL, c(min_tokens=9), AUTH, 400, "min_tokens"),
    ("stop-empty-string", CMPL, c(stop=[""]), AUTH, 400, "stop"),
    ("seed-not-int", CMPL, c(seed="x"), AUTH, 400, "seed"),
    # Integers checked against the types they end in, before the engine sees them.
    ("seed-over-int64", CMPL, c(seed=2 ** 70), AUTH, 400, "seed"),
    ("seed-int64-max-plus-1", CMPL, c(seed=2 ** 63), AUTH, 400, "seed"),
    ("seed-under-int64", CMPL, c(seed=-(2 ** 63) - 1), AUTH, 400, "seed"),
    ("n-over-max", CMPL, c(n=10 ** 6, temperature=1.0), AUTH, 400, "n"),
    ("temperature-over-2", CMPL, c(temperature=2.5), AUTH, 400, "temperature"),
    ("max_tokens-over-max_model_len", CMPL, c(max_tokens=10 ** 12), AUTH, 400, "max_tokens"),
    ("chat-max_tokens-over-max_model_len", CHAT, ch(max_tokens=1025), AUTH, 400, "max_tokens"),
    ("chat-max_completion_tokens-over-max_model_len", CHAT, ch(max_tokens=None, max_completion_tokens=10 ** 9),
     AUTH, 400, "max_completion_tokens"),
    ("stop_token_ids-out-of-vocab", CMPL, c(stop_token_ids=[10 ** 9], min_tokens=2), AUTH, 400, "stop_token_ids"),
    ("stop_token_ids-over-int64", CMPL, c(stop_token_ids=[2 ** 70], min_tokens=2), AUTH, 400, "stop_token_ids"),
    ("allowed_token_ids-over-int64", CMPL, c(allowed_token_ids=[2 ** 70]), AUTH, 400, "allowed_token_ids"),
    ("logprobs-over-int64", CMPL, c(logprobs=2 ** 70), AUTH, 400, "logprobs"),
    # Lone surrogates (JSON's \ud800 escape): no tokenizer can encode them.
    ("prompt-lone-surrogate", CMPL, b'{"prompt": "abc\\ud800def", "max_tokens": 3}', AUTH, 400, "prompt"),
    ("prompt-list-lone-surrogate", CMPL, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 3}', AUTH, 400, "prompt"),
    ("chat-lone-surrogate", CHAT,
     b'{"messages": [{"role": "user", "content": "abc\\ud800def"}], "max_tokens": 3}', AUTH, 400,
     "messages.0.content"),
    ("chat-part-lone-surrogate", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}', AUTH, 400,
     "messages.0.content.0.text"),
    ("stop-lone-surrogate", CMPL, b'{"prompt": "x", "stop": ["\\udc00"]}', AUTH, 400, "stop"),
    ("bad_words-lone-surrogate", CMPL, b'{"prompt": "x", "bad_words": ["\\udc00"]}', AUTH, 400, "bad_words"),
    ("structured-lone-surrogate", CMPL, b'{"prompt": "x", "structured_outputs": {"regex": "a\\udc00"}}', AUTH, 400,
     "structured_outputs"),
    ("model-lone-surrogate", CMPL, b'{"model": "ti\\ud800ny", "prompt": "x"}', AUTH, 400, "model"),
    ("tokenize-lone-surrogate", "/tokenize", b'{"prompt": "abc\\ud800def"}', {}, 400, "prompt"),
    ("token-id-out-of-vocab", CMPL, c(prompt=[1, 2, 10 ** 7]), AUTH, 400, "prompt"),
    ("prompt-over-max_model_len", CMPL, c(prompt="x = 1\n" * 1200), AUTH, 400, "prompt"),
    ("logprobs-over-max_logprobs", CMPL, c(logprobs=21), AUTH, 400, "logprobs"),
    ("prompt_logprobs-streamed", CMPL, c(prompt_logprobs=1, stream=True), AUTH, 400, "prompt_logprobs"),
    ("unknown-field", CMPL, c(foo=1), AUTH, 400, "foo"),
    ("unsupported-openai-field", CMPL, c(best_of=2), AUTH, 400, "best_of"),
    ("stream_options-without-stream", CMPL, c(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options"),
    ("greedy-n-above-1", CMPL, c(n=2, temperature=0), AUTH, 400, "n"),
    ("logit_bias-out-of-vocab", CMPL, c(logit_bias={"99999": 1.0}), AUTH, 400, "logit_bias"),
    ("logit_bias-not-an-id", CMPL, c(logit_bias={"abc": 1.0}), AUTH, 400, "logit_bias"),
    ("allowed_token_ids-empty", CMPL, c(allowed_token_ids=[]), AUTH, 400, "allowed_token_ids"),
    ("bad_words-empty-word", CMPL, c(bad_words=[""]), AUTH, 400, "bad_words"),
    ("structured-two-constraints", CMPL, c(structured_outputs={"regex": "a", "choice": ["b"]}), AUTH, 400,
     "structured_outputs"),
    ("structured-unknown-option", CMPL, c(structured_outputs={"regex": "a", "whitespace_pattern": " "}), AUTH,
     400, "structured_outputs"),
    ("structured-bad-regex", CMPL, c(structured_outputs={"regex": "(a"}), AUTH, 400, "structured_outputs.regex"),
    ("structured-bad-schema", CMPL, c(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), AUTH, 400, "structured_outputs.json"),
    ("response_format-and-structured", CMPL, c(response_format={"type": "json_object"},
                                               structured_outputs={"regex": "a"}), AUTH, 400, "response_format"),
    ("response_format-unknown-type", CMPL, c(response_format={"type": "structural_tag"}), AUTH, 400,
     "response_format.type"),
    ("priority-without-priority-policy", CMPL, c(priority=1), AUTH, 400, "priority"),
    ("chat-tools-without-parser", CHAT, ch(tools=[{"type": "function", "function": {"name": "f"}}]), AUTH, 400,
     "tools"),
    ("chat-tools-required-without-parser", CHAT, ch(tools=[{"type": "function", "function": {"name": "f"}}],
                                                    tool_choice="required"), AUTH, 400, "tool_choice"),
    ("chat-tool-without-name", CHAT, ch(tools=[{"type": "function", "function": {}}], tool_choice="none"), AUTH,
     400, "tools.0.function.name"),
    ("chat-tool-choice-unknown", CHAT, ch(tool_choice="sometimes"), AUTH, 400, "tool_choice"),
    ("chat-tool_choice-without-parser", CHAT, ch(tool_choice="auto"), AUTH, 400, "tool_choice"),
    ("chat-unknown-field", CHAT, ch(parallel_tool_calls=True), AUTH, 400, "parallel_tool_calls"),
    ("chat-message-unknown-field", CHAT, ch(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
     AUTH, 400, "messages.0.tool_call_id"),
    ("chat-stream_options-without-stream", CHAT, ch(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options"),
    ("unknown-model", CMPL, c(model="gpt-4"), AUTH, 404, "model"),
    ("missing-api-key", CMPL, c(), {}, 401, None),
    ("wrong-api-key", CMPL, c(), {"Authorization": "Bearer nope"}, 401, None),
    ("chat-empty-messages", CHAT, ch(messages=[]), AUTH, 400, "messages"),
    ("chat-unknown-role", CHAT, ch(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400,
     "messages.0.role"),
    ("chat-messages-not-list", CHAT, ch(messages="hi"), AUTH, 400, "messages"),
    ("chat-image-part", CHAT, ch(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     AUTH, 400, "messages.0.content"),
    ("chat-oversize", CHAT, ch(messages=[{"role": "user", "content": "x = 1\n" * 1200}]), AUTH, 400,
     "messages"),
    ("chat-top_logprobs-too-many", CHAT, ch(logprobs=True, top_logprobs=30), AUTH, 400, "top_logprobs"),
    ("chat-top_logprobs-without-logprobs", CHAT, ch(top_logprobs=2), AUTH, 400, "top_logprobs"),
    ("chat-temperature-negative", CHAT, ch(temperature=-1), AUTH, 400, "temperature"),
    ("chat-unknown-model", CHAT, ch(model="nope"), AUTH, 404, "model"),
    ("chat-wrong-api-key", CHAT, ch(), {"Authorization": "Bearer nope"}, 401, None),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10 ** 7]}, {}, 400, "tokens"),
    ("tokenize-unknown-field", "/tokenize", {"prompt": "x", "foo": 1}, {}, 400, "foo"),
    ("tokenize-prompt-with-add_generation_prompt", "/tokenize", {"prompt": "x", "add_generation_prompt": False},
     {}, 400, "add_generation_prompt"),
    ("tokenize-messages-with-add_special_tokens", "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                                                "add_special_tokens": False}, {}, 400,
     "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,headers,status,param", [c_[1:] for c_ in CASES], ids=[c_[0] for c_ in CASES])
def test_bad_input_gets_openai_error_shape(api_server, path, body, headers, status, param):
    kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": headers}
    r = httpx.post(api_server.url + path, timeout=30, **kw)
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    err = r.json().get("error")
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, \
        f"not OpenAI's error shape: {r.text[:300]}"
    assert err["code"] == status and err["message"]
    assert err["param"] == param, f"param should name {param!r}: {err}"
    if param and status == 400 and "." not in param:
        assert param in err["message"], "the message must name the field"


def test_openai_client_raises_typed_errors_and_server_still_serves(api_server):
    good = openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    bad_key = openai.OpenAI(base_url=api_server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        good.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4, top_p=2.0)
    assert e.value.body["param"] == "top_p" and "(0, 1]" in e.value.body["message"], \
        "the message must state the allowed range"
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="missing", messages=USER, max_tokens=2)
    r = good.completions.create(model=SERVED_NAME, prompt="def f():", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3, "the server must keep serving after bad requests"
    assert httpx.get(api_server.url + "/health").status_code == 200, "/health needs no key"
    m = httpx.get(api_server.url + "/metrics").text
    assert "vllm:kv_cache_usage_perc" in m, "/metrics needs no key"


def test_requests_that_once_killed_the_engine_get_400_and_it_keeps_serving(api_server):
    """Each of these used to pass validation and then raise inside a step (seed overflow in
    torch's generator; a stop id indexing past the vocabulary under min_tokens), or hang the
    engine (n = 10**6 samples), answering 503 "engine died" to everyone afterwards."""
    bodies = [c(seed=1180591620717411303424), c(stop_token_ids=[10 ** 9], min_tokens=2),
              c(n=10 ** 6, temperature=1.0), c(n=2, temperature=1.0, seed=2 ** 63 - 1, max_tokens=2)]
    codes = [httpx.post(api_server.url + CMPL, json=b, headers=AUTH, timeout=60).status_code for b in bodies]
    # The last one is valid: its children's seeds wrap around within int64 instead of overflowing.
    assert codes == [400, 400, 400, 200], f"a request that reached the engine unchecked: {codes}"
    assert httpx.get(api_server.url + "/health").status_code == 200, "a bad request killed the engine"
    r = httpx.post(api_server.url + CMPL, json=c(max_tokens=3, temperature=0), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, \
        f"the engine stopped serving after the bad requests: {r.text[:300]}"


def test_tools_with_tool_choice_none_reach_the_template(api_server):
    """vLLM without a tool parser serves tool_choice "none": the tools go to the chat
    template (the test server's template prints them) and the reply is plain text."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    plain = httpx.post(api_server.url + CHAT, json=ch(temperature=0), headers=AUTH, timeout=60)
    with_tools = httpx.post(api_server.url + CHAT, json=ch(temperature=0, tools=tools, tool_choice="none"),
                            headers=AUTH, timeout=60)
    assert plain.status_code == 200 and with_tools.status_code == 200, with_tools.text[:300]
    grown = with_tools.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert grown > 10, f"the template did not see the tools (prompt grew by {grown} tokens): they were dropped"
    assert with_tools.json()["choices"][0]["message"]["content"] is not None
