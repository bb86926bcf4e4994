"""The OpenAI-compatible HTTP server: `python -m mini_vllm serve MODEL_PATH`.

vLLM counterpart: `vllm/entrypoints/openai/api_server.py` (`build_app`,
`run_server`, the API-key middleware, the validation-error handler) and
`vllm/entrypoints/serve/` (`/tokenize`, `/detokenize`).

Routes: GET /health, /version, /metrics, /v1/models; POST /v1/completions,
/v1/chat/completions, /tokenize, /detokenize.

Invariants:
- Every 4xx body is OpenAI's error shape; a request that fails validation
  never reaches the engine, and one that the engine rejects leaves it
  untouched, so in-flight requests never notice a bad one.
- With `--api-key`, every /v1 route needs `Authorization: Bearer KEY` (401
  otherwise); /health, /version and /metrics stay open, as in vLLM.
- SIGINT/SIGTERM: the server stops accepting, waits up to
  `--timeout-graceful-shutdown` seconds for in-flight responses, answers
  what is left with 503 (an error event and [DONE] in a stream), and the
  process exits with code 0 (`launcher.ApiServer`).
- A dead engine ends the process: every in-flight request gets an error
  (a 503 body, or an error event in a stream), /health answers 503, and the
  server shuts down and exits with code 1 (vLLM's API server does the same
  when its engine core dies), so that a supervisor restarts it. The log names
  the exception.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import mini_vllm
from mini_vllm.engine.async_llm import AsyncLLM, EngineDeadError
from mini_vllm.entrypoints.launcher import ApiServer
from mini_vllm.metrics.prometheus import PrometheusStatLogger
from mini_vllm.entrypoints.openai.openapi import build_openapi
from mini_vllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                            TokenizeRequest)
from mini_vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.openai.tokenize_worker import TokenizeWorker
from mini_vllm.entrypoints.openai.serving_engine import (ClientDisconnected, OpenAIServingModels, error_response,
                                                  value_error_response)

logger = logging.getLogger("mini_vllm")
# pydantic adds these union-member names to an error's location; they are not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_param(err: dict) -> str | None:
    """The field path of a pydantic error, without the union-member tags it adds
    ("prompt.list[int]" -> "prompt")."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not (
        isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "-" in x))]
    return ".".join(loc) or None


def _validation_msg(err: dict) -> str:
    """pydantic's message, without the "Value error, " it puts before our own checks' text."""
    msg = str(err.get("msg", ""))
    return msg.removeprefix("Value error, ") if err.get("type") == "value_error" else msg


class ApiKeyMiddleware:
    """401 for /v1 routes without `Authorization: Bearer KEY`. A plain ASGI
    middleware: it passes `receive` through untouched, so handlers still see
    the client's disconnect."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization")
            if auth != self.expected:
                resp = error_response("Unauthorized: a missing or wrong API key", 401)
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_names: list[str], model_path: str,
              stat_logger: PrometheusStatLogger, api_key: str | None = None,
              chat_template: str | None = None, exclude_tools_when_tool_choice_none: bool = False) -> FastAPI:
    models = OpenAIServingModels(served_model_names, model_path, engine.max_model_len)
    completions = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models, chat_template, exclude_tools_when_tool_choice_none)
    cfg = engine.engine.config
    tokenize_worker = TokenizeWorker(cfg.tokenizer or cfg.model, chat_template)

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()  # a core that dies while the server is idle still stops it
        yield
        tokenize_worker.shutdown()
        engine.shutdown()  # after uvicorn drained the connections: abort what is left

    app = FastAPI(title="mini-vLLM OpenAI-compatible server", version=mini_vllm.__version__,
                  lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # Our own checks (value errors) first: in a union, the other members' type
        # mismatches ("should be a valid string") say less than "holds a lone surrogate".
        errs = sorted(exc.errors(), key=lambda e: e.get("type") != "value_error")
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":  # loc is a character position, not a field
            return error_response(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                  400, None)
        param = _validation_param(first)
        if first.get("type") == "extra_forbidden":  # honoured or rejected, never ignored
            return error_response(f"{param} is not a field this server supports (unknown or unsupported "
                                  "field; it would otherwise be ignored)", 400, param)
        msgs = dict.fromkeys(f"{_validation_param(e) or 'body'}: {_validation_msg(e)}" for e in errs)
        msg = "; ".join(list(msgs)[:5])
        return error_response(msg or "invalid request", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # Starlette's own errors (a body that is not UTF-8, an unknown path, a wrong
        # method) in OpenAI's error shape too, with their headers (405's Allow).
        resp = error_response(str(exc.detail), exc.status_code, None)
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(str(exc), 503)

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version():
        return {"version": mini_vllm.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    @app.get("/v1/models")
    async def list_models():
        return models.list().model_dump()

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await completions.create_completion(req, raw.is_disconnected)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await chat.create_chat_completion(req, raw.is_disconnected)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if (err := models.check(req.model)) is not None:
            return err
        tok = engine.get_tokenizer()
        if tok is None:
            return error_response("this model has no tokenizer", 400, None)
        if (req.prompt is None) == (req.messages is None):
            return error_response("give exactly one of prompt and messages", 400, "prompt")
        # Each flag applies to one form only; sent with the other it would be ignored.
        misplaced = "add_special_tokens" if req.messages is not None else "add_generation_prompt"
        if misplaced in req.model_fields_set:
            return error_response(f"{misplaced} applies to {'prompt' if req.messages is not None else 'messages'} "
                                  "only", 400, misplaced)
        if req.messages is not None and chat.chat_template is None and tok.chat_template is None:
            return error_response("messages cannot be rendered: the tokenizer has no chat_template; start the "
                                  "server with --chat-template", 400, "messages")
        conv = None if req.messages is None else [m.for_template() for m in req.messages]
        try:  # in a process of its own: a 2 MB text takes seconds (vLLM does not bound /tokenize either)
            body = await asyncio.wrap_future(tokenize_worker.submit(
                req.prompt, conv, req.add_special_tokens, req.add_generation_prompt, req.return_token_strs,
                engine.max_model_len))
        except ValueError as e:
            return value_error_response(e)
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if (err := models.check(req.model)) is not None:
            return err
        tok = engine.get_tokenizer()
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if tok is None or bad:
            return error_response(f"tokens must lie in [0, {vocab}), got {bad[:5]}" if bad
                                  else "this model has no tokenizer", 400, "tokens")
        return {"prompt": tok.decode(req.tokens)}

    core = engine.engine
    document: dict = {}

    def openapi() -> dict:  # FastAPI's hook: built on first request, then served as it is
        if not document:
            document.update(build_openapi(app, max_model_len=engine.max_model_len,
                                          vocab_size=core.model_config.vocab_size,
                                          max_logprobs=core.config.max_logprobs,
                                          priority_honoured=core.config.policy == "priority",
                                          api_key=api_key is not None))
        return document

    app.openapi = openapi
    return app


def _json_arg(flag: str, value: str | None):
    import json

    try:
        return None if value is None else json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be JSON: {e}") from None


def _read_chat_template(value: str | None) -> str | None:
    """A file path or the template itself (vLLM's --chat-template)."""
    if value is None:
        return None
    p = Path(value)
    return p.read_text() if len(value) < 4096 and p.is_file() else value


def run_server(args, engine_kwargs: dict) -> int:
    """Load the engine, serve until SIGINT/SIGTERM (then exit the process with 0) or
    until the engine dies (then exit with 1)."""
    import uvicorn

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model]
    # vLLM registers the speculative-decoding counters only with a speculative config;
    # one per draft position, so the logger needs k before the engine exists.
    spec = engine_kwargs.get("speculative_config") or {}
    stat_logger = PrometheusStatLogger(names[0], num_spec_tokens=spec.get("num_speculative_tokens"))
    api_key = args.api_key or os.environ.get("MINI_VLLM_API_KEY")
    engine_kwargs = {**engine_kwargs, "generation_config": args.generation_config,
                     "max_logprobs": args.max_logprobs, "policy": args.policy,
                     "structured_outputs_config": _json_arg("--structured-outputs-config",
                                                            args.structured_outputs_config)}
    server: ApiServer | None = None  # set below; the engine only steps once it serves

    def on_engine_dead(exc: BaseException) -> None:
        if server is not None:
            server.engine_dead(exc)

    engine = AsyncLLM.from_engine_args(args.model, stat_loggers=[stat_logger], on_dead=on_engine_dead,
                                       **engine_kwargs)
    core, cfg = engine.engine, engine.engine.config
    stat_logger.set_cache_config_info(block_size=cfg.block_size, num_gpu_blocks=core.num_gpu_blocks,
                                      num_cpu_blocks=core.num_cpu_blocks, cache_dtype=cfg.kv_cache_dtype,
                                      enable_prefix_caching=cfg.enable_prefix_caching)
    app = build_app(engine, names, args.model, stat_logger, api_key,
                    _read_chat_template(args.chat_template), args.exclude_tools_when_tool_choice_none)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log)
    logger.info("serving %s as %s on http://%s:%d", args.model, names, args.host, args.port)
    server = ApiServer(config, engine, args.timeout_graceful_shutdown)
    server.run()
    engine.shutdown()
    # Everything is drained and stopped; skip the interpreter's teardown of torch
    # and the model, which takes seconds and can only delay the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)
