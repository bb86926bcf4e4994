"""The server's OpenAPI document (`/openapi.json`, `/docs`): what it really accepts and answers.

vLLM counterpart: none of its own; vLLM serves FastAPI's generated document,
which documents FastAPI's 422 although vLLM (like this server) answers a
validation error with 400.

FastAPI's generated document is corrected in three ways:
- Statuses: every route lists what it can answer, with OpenAI's error body:
  400 for any invalid request (never 422), 401 on /v1 routes when the server
  has an API key, 404 for a model it does not serve, 503 once the engine died.
- Bodies: completions answer JSON or, with `stream`, Server-Sent Events;
  their JSON is described by `response_models`; /health has no body (200 or
  503); /metrics is Prometheus' text format.
- Ranges: the request schemas carry every range the server enforces that a
  JSON schema can say: vLLM's static ones (from `sampling_params`) and this
  server's own (max_model_len, the vocabulary, --max-logprobs, whether
  priority is honoured). A client, or a fuzzer, generating from the document
  learns what is valid; what a schema cannot say (min_tokens <= max_tokens, a
  prompt's length in tokens, a grammar that compiles) is a documented 400.
Invariant: the document is never stricter than the server (a value it calls
invalid is rejected), which the fuzz test checks with schema-violating requests.
"""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from mini_vllm.entrypoints.openai import response_models as rm
from mini_vllm.entrypoints.openai.protocol import ErrorResponse
from mini_vllm.entrypoints.openai.response_models import ModelList
from mini_vllm.sampling_params import (INT64_MAX, INT64_MIN, MAX_N_SEQUENCES, MAX_NUM_BAD_WORDS, MAX_STOP_STRINGS,
                                       MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE)

_REF = "#/components/schemas/{model}"
_ERROR_TEXT = {400: "Invalid request (OpenAI's error body names the field)", 401: "Missing or wrong API key",
               404: "The model is not served here", 503: "The engine died; the server is exiting"}


def _bound(schema: dict, **bounds) -> None:
    """Put bounds on a number schema, or on the number members of an anyOf."""
    members = schema.get("anyOf", [schema])
    for m in members:
        if m.get("type") in ("integer", "number"):
            m.update(bounds)


def _bound_items(schema: dict, **bounds) -> None:
    for m in schema.get("anyOf", [schema]):
        if m.get("type") == "array":
            m["items"].update(bounds)


def _size(schema: dict, **bounds) -> None:
    """Put bounds on an array schema, or on the array members of an anyOf."""
    for m in schema.get("anyOf", [schema]):
        if m.get("type") == "array":
            m.update(bounds)


def _json(ref: str) -> dict:
    return {"application/json": {"schema": {"$ref": _REF.format(model=ref)}}}


def _responses(ok: dict | None, *codes: int) -> dict:
    out = {"200": ok} if ok is not None else {}
    for c in codes:
        out[str(c)] = {"description": _ERROR_TEXT[c], "content": _json("ErrorResponse")}
    return out


def _sampling_ranges(props: dict, *, max_model_len: int, vocab_size: int, max_logprobs: int,
                     priority_honoured: bool, chat: bool) -> None:
    """The ranges of `SamplingParams` and of this server, on one request schema's properties."""
    _bound(props["n"], minimum=1, maximum=MAX_N_SEQUENCES)
    _bound(props["temperature"], minimum=0, maximum=MAX_TEMPERATURE)
    _bound(props["top_p"], exclusiveMinimum=0, maximum=1)
    _bound(props["top_k"], minimum=-1)
    _bound(props["min_p"], minimum=0, maximum=1)
    for name in ("presence_penalty", "frequency_penalty"):
        _bound(props[name], minimum=-2, maximum=2)
    _bound(props["repetition_penalty"], exclusiveMinimum=0)
    _bound(props["seed"], minimum=INT64_MIN, maximum=INT64_MAX)
    _bound(props["min_tokens"], minimum=0, maximum=max_model_len)
    _bound(props["priority"], **({"minimum": INT64_MIN, "maximum": INT64_MAX} if priority_honoured
                                 else {"minimum": 0, "maximum": 0}))
    for name in ("stop_token_ids", "allowed_token_ids"):
        _bound_items(props[name], minimum=0, maximum=vocab_size - 1)
    _size(props["allowed_token_ids"], minItems=1)  # an empty allow-list would allow nothing
    # Strings the sampler could never match: an empty stop string, a blank bad word.
    _bound_items(props["stop"], minLength=1)
    for m in props["stop"]["anyOf"]:
        if m.get("type") == "string":
            m["minLength"] = 1
    _bound_items(props["bad_words"], pattern=r"\S")
    # vLLM's bounds on how many of each one request may carry.
    _size(props["stop"], maxItems=MAX_STOP_STRINGS)
    _size(props["stop_token_ids"], maxItems=MAX_STOP_TOKEN_IDS)
    _size(props["bad_words"], maxItems=MAX_NUM_BAD_WORDS)
    cap = vocab_size if max_logprobs == -1 else min(vocab_size, max_logprobs)
    if chat:
        for name in ("max_tokens", "max_completion_tokens"):
            _bound(props[name], minimum=1, maximum=max_model_len)
        _bound(props["top_logprobs"], minimum=0, maximum=min(20, cap))
    else:
        _bound(props["max_tokens"], minimum=0, maximum=max_model_len)  # 0 only with echo
        for name in ("logprobs", "prompt_logprobs"):
            _bound(props[name], minimum=0, maximum=cap)


def _prompt_schema(max_model_len: int, vocab_size: int) -> dict:
    ids = {"type": "array", "minItems": 1, "maxItems": max_model_len - 1,
           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    return {"title": "Prompt", "description": "Text, texts, token ids, or lists of token ids; a prompt must be "
            f"shorter than max_model_len ({max_model_len}) tokens",
            "anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                      ids, {"type": "array", "minItems": 1, "items": ids}]}


def build_openapi(app, *, max_model_len: int, vocab_size: int, max_logprobs: int, priority_honoured: bool,
                  api_key: bool) -> dict:
    """The corrected document of `app` (call after its routes are declared)."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="An OpenAI-compatible server of the mini-vLLM course engine.")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, defs = models_json_schema([(m, "serialization") for m in (
        ErrorResponse, ModelList, rm.CompletionResponse, rm.ChatCompletionResponse, rm.CompletionStreamResponse,
        rm.ChatCompletionStreamResponse, rm.TokenizeResponse,
        rm.DetokenizeResponse, rm.VersionResponse)], ref_template=_REF)
    schemas.update(defs["$defs"])

    ranges = dict(max_model_len=max_model_len, vocab_size=vocab_size, max_logprobs=max_logprobs,
                  priority_honoured=priority_honoured)
    _sampling_ranges(schemas["CompletionRequest"]["properties"], chat=False, **ranges)
    schemas["CompletionRequest"]["properties"]["prompt"] = _prompt_schema(max_model_len, vocab_size)
    _sampling_ranges(schemas["ChatCompletionRequest"]["properties"], chat=True, **ranges)
    _bound_items(schemas["DetokenizeRequest"]["properties"]["tokens"], minimum=0, maximum=vocab_size - 1)

    auth = (401,) if api_key else ()
    def sse(chunk: str) -> dict:
        """Each event of a stream (OpenAPI before 3.2: `schema` describes one event): a JSON
        chunk, an error body if the stream fails after it began, or the final [DONE]."""
        data = {"anyOf": [{"const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [{"$ref": _REF.format(model=chunk)}, {"$ref": _REF.format(model="ErrorResponse")}]}}]}
        return {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                 "properties": {"data": data}}}}

    routes = {
        ("/v1/completions", "post"): _responses({"description": "The completion (JSON), or its stream",
                                                 "content": {**_json("CompletionResponse"),
                                                             **sse("CompletionStreamResponse")}},
                                                400, *auth, 404, 503),
        ("/v1/chat/completions", "post"): _responses({"description": "The chat completion (JSON), or its stream",
                                                      "content": {**_json("ChatCompletionResponse"),
                                                                  **sse("ChatCompletionStreamResponse")}},
                                                     400, *auth, 404, 503),
        ("/v1/models", "get"): _responses({"description": "The served models", "content": _json("ModelList")},
                                          *auth),
        ("/tokenize", "post"): _responses({"description": "Token ids", "content": _json("TokenizeResponse")},
                                          400, 404, 503),
        ("/detokenize", "post"): _responses({"description": "Text", "content": _json("DetokenizeResponse")},
                                            400, 404),
        ("/version", "get"): _responses({"description": "The course's version", "content": _json("VersionResponse")}),
        ("/health", "get"): {"200": {"description": "The engine is running (no body)"},
                             "503": {"description": "The engine died; the server is exiting (no body)"}},
        ("/metrics", "get"): {"200": {"description": "Prometheus' text exposition format",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}},
    }
    for (path, method), responses in routes.items():
        op = doc["paths"][path][method]
        op["responses"] = responses
        if api_key and path.startswith("/v1"):
            op["security"] = [{"bearer": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    missing = {(p, m) for p, ops in doc["paths"].items() for m in ops} - set(routes)
    assert not missing, f"routes without documented responses: {sorted(missing)}"
    return doc
