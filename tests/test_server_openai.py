"""The server through the official `openai` client (sync and async): completions
and chat, streamed and not, against offline `LLM.generate`/`LLM.chat` as the oracle."""
import asyncio

import httpx
import openai
import pytest

from engine_utils import make_llm
from mini_vllm import SamplingParams
from server_utils import API_KEY, SERVED_NAME, TEMPLATE, api_server  # noqa: F401 - a fixture

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def _stream_text(chunks, n=1):
    texts, finish, usage = [""] * n, [None] * n, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish, usage


def test_completions_match_offline_and_stream(client, llm):
    tok = llm.get_tokenizer()
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, off in zip(PROMPTS, offline):
        r = client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=16, **GREEDY)
        assert r.choices[0].text == off.outputs[0].text, f"{p!r}: server text differs from LLM.generate"
        assert r.choices[0].finish_reason == "length"
        n_prompt = len(tok(p)["input_ids"])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (n_prompt, 16, n_prompt + 16), "usage must count the prompt once and every sampled token"
        chunks = list(client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        texts, finish, usage = _stream_text(chunks)
        assert len(chunks) >= 4, "a 16-token stream should arrive in several chunks"
        assert texts[0] == r.choices[0].text, f"{p!r}: concatenated stream != non-streamed text"
        assert finish == ["length"] and usage.completion_tokens == 16
        assert chunks[-1].choices == [] and chunks[-1].usage is not None, "usage must come last, alone"


def test_prompt_forms_list_token_ids_and_echo(client, llm):
    tok = llm.get_tokenizer()
    ids = tok(PROMPTS[0])["input_ids"]
    # n > 1 needs sampling (greedy is rejected, as in vLLM); top_k=1 samples the argmax
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=1.0,
                                  extra_body={"ignore_eos": True, "top_k": 1})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3], "choices are prompt_index * n + sample"
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3], "greedy samples of one prompt agree"
    r_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert r_ids.choices[0].text == by_index[0], "a token-id prompt must give the same text as its string"
    r_lists = client.completions.create(model=SERVED_NAME, prompt=[ids, ids[:-1]], max_tokens=6, **GREEDY)
    assert [c.index for c in r_lists.choices] == [0, 1] and r_lists.choices[0].text == by_index[0], \
        "a list of token-id prompts is one prompt per list"
    r_echo = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=6, echo=True, **GREEDY)
    assert r_echo.choices[0].text == PROMPTS[0] + by_index[0], "echo prepends the prompt"
    texts, _, _ = _stream_text(client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=6,
                                                         echo=True, stream=True, **GREEDY))
    assert texts[0] == r_echo.choices[0].text, "streamed echo differs"


def test_chat_matches_llm_chat_streamed_and_not(client, llm):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a loop"}]
    off = llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False,
                   chat_template=TEMPLATE)[0]
    r = client.chat.completions.create(model=SERVED_NAME, messages=msgs, max_completion_tokens=12, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == off.outputs[0].text, "chat reply differs from LLM.chat"
    assert r.usage.prompt_tokens == len(off.prompt_token_ids), "chat prompt is not the rendered template"
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=msgs, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant", "the first chunk carries the role"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == off.outputs[0].text, "concatenated chat deltas differ from the full reply"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_seeded_n_samples_are_reproducible_and_match_offline(client, llm):
    kw = dict(model=SERVED_NAME, prompt="def parse(s):", max_tokens=8, n=3, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert ta == [c.text for c in sorted(b.choices, key=lambda c: c.index)], "same seed, different samples"
    assert len(set(ta)) > 1, "n=3 seeded samples should differ from each other"
    off = llm.generate("def parse(s):", SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=1234,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert ta == [o.text for o in sorted(off.outputs, key=lambda o: o.index)], "server seeds != offline seeds"
    texts, _, _ = _stream_text(client.completions.create(stream=True, **kw), n=3)
    assert texts == ta, "streamed n=3 seeded samples differ from non-streamed"


def test_stop_string_cuts_text(client, llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[8:11]
    assert stop.strip(), "pick a visible stop string"
    want = full[:full.index(stop)]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=24, stop=[stop], **GREEDY)
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (want, "stop"), "text must end right before the stop string"
    assert c.model_extra.get("stop_reason") == stop
    texts, finish, _ = _stream_text(client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0],
                                                              max_tokens=24, stop=stop, stream=True, **GREEDY))
    assert texts == [want] and finish == ["stop"], "a streamed stop string leaked or cut early"


def test_logprobs_completions_and_chat(client, llm):
    off = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    want = [d[t].logprob for d, t in zip(off.logprobs, off.token_ids)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4), "server logprobs != offline logprobs"
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert tok_lp == pytest.approx(max(top.values())), "greedy token must be the most likely one"
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    streamed = [c.logprobs for ch in client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=5,
                                                               logprobs=3, stream=True, **GREEDY)
                for c in ch.choices if c.logprobs is not None]
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset, "streamed text offsets must continue"
    ch = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = ch.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)


def test_async_client_concurrent_streams(server, llm):
    off = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)

    async def one(client, p):
        text = ""
        async for ch in await client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=10,
                                                        stream=True, **GREEDY):
            text += "".join(c.text for c in ch.choices)
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        streamed = await asyncio.gather(*(one(client, p) for p in PROMPTS))
        chat = await client.chat.completions.create(model=SERVED_NAME, max_tokens=3,
                                                    messages=[{"role": "user", "content": "x"}], **GREEDY)
        await client.close()
        return streamed, chat

    streamed, chat = asyncio.run(main())
    assert streamed == [o.outputs[0].text for o in off], "async concurrent streams differ from LLM.generate"
    assert chat.usage.completion_tokens == 3


def test_models_health_version_tokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    tok = llm.get_tokenizer()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[2]}, headers=auth).json()
    assert r["tokens"] == tok(PROMPTS[2])["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPTS[2]
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["tokens"] == tok("<user>a\n<assistant>")["input_ids"], "chat tokenize must apply the template"
