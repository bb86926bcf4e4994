"""Structured outputs through the server: `response_format` (json_schema,
json_object) and vLLM's `structured_outputs`, streamed and not, on
completions and chat. Oracles: `jsonschema`, `re.fullmatch`, and offline
`LLM.generate` with the same constraint."""
import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine_utils import make_llm
from mini_vllm import SamplingParams
from mini_vllm.sampling_params import StructuredOutputsParams
from server_utils import API_KEY, SERVED_NAME, api_server  # noqa: F401 - a fixture

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # vLLM's option: no whitespace loops
# The schema is bounded: its longest output, {"name":"<12 chars of <= 4 bytes>","age":150}, is
# 69 bytes, and the tokenizer is byte-level BPE, so it must end within this many tokens whatever
# the tiny model prefers (which greedy path it takes is a near-tie the CPU's kernels can flip).
MAX_TOKENS = 72


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_json_schema_completion_validates_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(model=SERVED_NAME, prompt="kwargs = ", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"response_format": rf, **COMPACT})
    r = client.completions.create(**kw)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == text, "the streamed JSON differs from the whole one"
    off = make_llm().generate("kwargs = ", SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=
                              StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)), use_tqdm=False)
    assert off[0].outputs[0].text == text, "server and offline LLM disagree under the same schema"


def test_json_schema_chat_validates_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "a person as JSON"}], max_tokens=MAX_TOKENS,
              temperature=1.0, seed=5, response_format=rf, extra_body=COMPACT)
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text


@pytest.mark.parametrize("so, check", [
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"regex": r"[a-z]{3}_[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}_[0-9]{2}", t)),
    ({"grammar": 'root ::= "x = " [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x = [0-9]{1,2}", t)),
    # unbounded: any object may run to max_tokens, so a cut one is allowed (see below)
    ({"json_object": True, "disable_any_whitespace": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_structured_outputs_field(api_server, so, check):
    sampling = {"n": 1, "temperature": 0} if "json_object" in so else {"n": 2, "temperature": 1.0, "seed": 1}
    r = httpx.post(api_server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": SERVED_NAME, "prompt": "kwargs = ", "max_tokens": 32, **sampling,
                         "structured_outputs": so})
    assert r.status_code == 200, r.text[:300]
    for c in r.json()["choices"]:
        if "json_object" in so and c["finish_reason"] == "length":
            assert c["text"].startswith("{"), f"a cut json_object does not begin an object: {c['text']!r}"
            continue
        assert c["finish_reason"] == "stop" and check(c["text"]), f"{so}: {c['text']!r}"


def test_server_disable_any_whitespace_per_request_and_as_the_servers_default(api_server):
    """A json_schema response_format after a prompt where the tiny model pads with
    whitespace (given enough tokens it is cut by max_tokens, unparsable, as vLLM
    answers) unless the request sets structured_outputs.disable_any_whitespace;
    offline, the server's --structured-outputs-config default gives the same
    compact output."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    body = {"model": SERVED_NAME, "prompt": "x = ", "max_tokens": MAX_TOKENS, "temperature": 0, "response_format": rf}
    post = lambda b: httpx.post(api_server.url + "/v1/completions", json=b, timeout=60,  # noqa: E731
                                headers={"Authorization": f"Bearer {API_KEY}"}).json()["choices"][0]
    loose, compact = post(body), post({**body, **COMPACT})
    assert re.search(r"\s", re.sub(r'"[^"]*"', '""', loose["text"])), (
        f"no whitespace outside strings without disable_any_whitespace: the server compacts by default? {loose}")
    if loose["finish_reason"] == "stop":
        jsonschema.validate(json.loads(loose["text"]), SCHEMA)
    assert compact["finish_reason"] == "stop", compact
    jsonschema.validate(json.loads(compact["text"]), SCHEMA)
    llm = make_llm(structured_outputs_config={"disable_any_whitespace": True})
    off = llm.generate("x = ", SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)[0].outputs[0]
    assert off.text == compact["text"], "the engine-wide default must give what the per-request option gives"
