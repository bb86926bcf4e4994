"""vLLM's bounds on what one request may carry, and grammars that accept nothing.

vLLM 0.32 answers 400 beyond 4 stop strings, 128 stop token ids, 128 bad words
(1024 bad-word tokens in all) and a JSON schema nested 64 levels; the server did
accept 1,000 of each and a schema nested 200 levels. A constraint whose language
is empty (the regex `[^\\s\\S]`, a schema that only refers to itself) was served
with empty text and finish_reason "stop", which a client cannot tell from a real
answer: it is a 400 naming structured_outputs now. Each limit is checked at the
bound itself: the maximum is served, one more is refused."""
import httpx
import pytest

from mini_vllm import SamplingParams
from mini_vllm.sampling_params import MAX_JSON_SCHEMA_DEPTH, MAX_NUM_BAD_WORDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from server_utils import API_KEY, SERVED_NAME, api_server  # noqa: F401 - a fixture

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def c(**kw):
    return {"model": SERVED_NAME, "prompt": "def f():", "max_tokens": 4, **kw}


def ch(**kw):
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def nested(levels: int) -> dict:
    """A schema whose document nests `levels` objects: arrays of arrays of ... of integers."""
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


# (id, path, body, param the 400 must name)
REFUSED = [
    ("stop-one-over", CMPL, c(stop=words(MAX_STOP_STRINGS + 1)), "stop"),
    ("stop-1000", CMPL, c(stop=words(1000)), "stop"),
    ("chat-stop-one-over", CHAT, ch(stop=words(MAX_STOP_STRINGS + 1)), "stop"),
    ("stop_token_ids-one-over", CMPL, c(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    ("bad_words-one-over", CMPL, c(bad_words=words(MAX_NUM_BAD_WORDS + 1)), "bad_words"),
    ("bad_words-1000", CMPL, c(bad_words=words(1000)), "bad_words"),
    # 100 words of 20 tokens or more: over MAX_BAD_WORDS_TOTAL_TOKENS (1024) in all
    ("bad_words-too-many-tokens", CMPL, c(bad_words=[f"def function_{i}(x, y, z): return x + y * z - {i}"
                                                     for i in range(100)]), "bad_words"),
    ("schema-one-level-over", CMPL, c(structured_outputs={"json": nested(MAX_JSON_SCHEMA_DEPTH + 1)}),
     "structured_outputs.json"),
    ("schema-200-levels", CMPL, c(structured_outputs={"json": nested(200)}), "structured_outputs.json"),
    ("schema-200-levels-as-text", CMPL, c(structured_outputs={"json": str(nested(200)).replace("'", '"')}),
     "structured_outputs.json"),
    ("chat-response_format-200-levels", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested(200)}}), "structured_outputs.json"),
    ("regex-empty-language", CMPL, c(structured_outputs={"regex": "[^\\s\\S]"}), "structured_outputs.regex"),
    ("schema-only-refers-to-itself", CMPL, c(structured_outputs={"json": {"$ref": "#"}}),
     "structured_outputs.json"),
    ("chat-schema-only-refers-to-itself", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "loop", "schema": {"$ref": "#"}}}), "structured_outputs.json"),
]


@pytest.mark.parametrize("path,body,param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_over_the_limit_or_unsatisfiable_is_a_400_naming_the_field(api_server, path, body, param):
    r = httpx.post(api_server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, f"accepted what vLLM refuses (or what can produce no answer): " \
                                 f"{r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400, f"the 400 must name {param!r}: {err}"


ACCEPTED = [
    ("stop-at-the-limit", c(stop=words(MAX_STOP_STRINGS))),
    ("stop_token_ids-at-the-limit", c(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))),
    ("bad_words-at-the-limit", c(bad_words=words(MAX_NUM_BAD_WORDS))),
    ("schema-at-the-limit", c(structured_outputs={"json": nested(MAX_JSON_SCHEMA_DEPTH)}, max_tokens=8)),
    ("regex-that-can-match", c(structured_outputs={"regex": "x{3}"}, max_tokens=8)),
]


@pytest.mark.parametrize("body", [a[1] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_at_the_limit_is_served(api_server, body):
    r = httpx.post(api_server.url + CMPL, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, f"a request at vLLM's bound must be served: {r.status_code} {r.text[:300]}"


def test_offline_params_share_the_engine_bounds():
    """SamplingParams (offline LLM and server alike) refuse past vLLM's bounds, naming the field;
    stop strings are the API's bound only, as in vLLM."""
    with pytest.raises(ValueError, match=f"^stop_token_ids must have at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(ValueError, match=f"^bad_words must have at most {MAX_NUM_BAD_WORDS}"):
        SamplingParams(bad_words=words(MAX_NUM_BAD_WORDS + 1))
    with pytest.raises(ValueError, match=f"^structured_outputs.json is nested {MAX_JSON_SCHEMA_DEPTH + 1} levels"):
        SamplingParams(structured_outputs={"json": nested(MAX_JSON_SCHEMA_DEPTH + 1)})
    with pytest.raises(ValueError, match="^structured_outputs.json is nested 100000 levels"):  # no recursion limit
        SamplingParams(structured_outputs={"json": "[" * 100_000 + "]" * 100_000})
    assert len(SamplingParams(stop=words(10)).stop) == 10, "offline stop strings are not bounded (vLLM's API is)"
