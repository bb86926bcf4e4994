"""What the completion and chat handlers share: model-name checks, OpenAI's
error shape, starting a request's stream, and Server-Sent Events framing.

vLLM counterpart: `vllm/entrypoints/openai/serving_engine.py` (`OpenAIServing`,
`create_error_response`) and `serving_models.py` (`OpenAIServingModels`).

Invariants:
- Every error body is `{"error": {"message", "type", "param", "code"}}`;
  `param` names the offending field when the message starts with one
  (the engine's ValueErrors all do: "max_tokens must be ...").
- `start_streams` returns only after every prompt's first output arrived,
  so an invalid request is answered with a 4xx status before any SSE byte
  is sent, and a failing prompt aborts its siblings.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

from fastapi.responses import JSONResponse

from mini_vllm.async_llm import AsyncLLM
from mini_vllm.entrypoints.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_]*) ")


def error_response(message: str, code: int = 400, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(code, "Error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=code)


def value_error_response(e: ValueError) -> JSONResponse:
    msg = str(e)
    m = _LEADING_FIELD.match(msg)
    param = m.group(1) if m else None
    if param == "prompt_token_ids":
        param = "prompt"  # the API field behind the engine's name
    return error_response(msg, 400, param)


def sse(obj) -> str:
    """One Server-Sent Event as OpenAI frames it."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        self.names = list(served_model_names)
        self.model_path, self.max_model_len = model_path, max_model_len
        self.created = int(time.time())

    def check(self, model: str | None) -> JSONResponse | None:
        """None when `model` is served (or omitted); a 404 otherwise."""
        if model is None or model in self.names:
            return None
        return error_response(f"The model `{model}` does not exist; served: {self.names}", 404, "model")

    def list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=n, created=self.created, root=self.model_path,
                                         max_model_len=self.max_model_len) for n in self.names])


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels) -> None:
        self.engine, self.models = engine, models
        self.tokenizer = engine.get_tokenizer()

    async def start_streams(self, prompts, params, request_id: str, output_kind: str):
        """Start one engine request per prompt; returns [(generator, first output)].

        Raises the first ValueError after aborting the prompts that started."""
        gens = [self.engine.generate(p, params, f"{request_id}-{i}", output_kind=output_kind)
                for i, p in enumerate(prompts)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        bad = [f for f in firsts if isinstance(f, BaseException)]
        if bad:
            for g, f in zip(gens, firsts):
                if not isinstance(f, BaseException):
                    await g.aclose()  # aborts it
            raise bad[0]
        return list(zip(gens, firsts))


async def merge_streams(started):
    """Yield (prompt index, output) from several started streams as they come."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen, first):
        try:
            await q.put((i, first))
            if not first.finished:
                async for out in gen:
                    await q.put((i, out))
            await q.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(started)]
    left = len(tasks)
    try:
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # a disconnected client: each pump's generator aborts its request
        for (g, _), t in zip(started, tasks):
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled pumps
                pass
            await g.aclose()
