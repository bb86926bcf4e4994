"""`POST /v1/chat/completions`: messages through the chat template, then the engine.

vLLM counterpart: `vllm/entrypoints/openai/chat_completion/serving.py`
(`OpenAIServingChat.create_chat_completion`, `chat_completion_stream_generator`,
`_create_chat_logprobs`) and `vllm/entrypoints/chat_utils.py`.

Invariants:
- The prompt is exactly what `LLM.chat` builds: the tokenizer's (or the
  server's `--chat-template`) template applied with add_generation_prompt.
- Without max_completion_tokens / max_tokens a reply may use the rest of the
  context, max_model_len - prompt length, or the checkpoint's
  generation_config.json max_new_tokens when smaller (vLLM's defaults).
- Tools follow vLLM without a tool-call parser: with tool_choice "none" the
  tools go to the chat template (unless --exclude-tools-when-tool-choice-none)
  and the reply is plain text; tools with "auto" (their default), "required"
  or a named function are a 400, since the reply would need parsing.
- Streaming sends, per choice, a first chunk with role "assistant", then
  content deltas, then a chunk with finish_reason; the content deltas
  concatenate to the non-streamed message.
"""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from mini_vllm.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo, random_id
from mini_vllm.entrypoints.openai.serving_engine import (OpenAIServing, clamp_logprob, error_response, merge_streams,
                                                  sse, value_error_response)


def chat_logprobs(entries, k: int) -> dict:
    content = []
    for d in entries:
        sampled_id, s = next(iter(d.items()))  # the sampled token comes first
        tok = s.decoded_token if s.decoded_token is not None else str(sampled_id)
        top = []
        for tid, lp in sorted(d.items(), key=lambda kv: kv[1].rank or 0):
            if lp.rank is not None and 1 <= lp.rank <= k and len(top) < k:
                t = lp.decoded_token if lp.decoded_token is not None else str(tid)
                top.append({"token": t, "logprob": clamp_logprob(lp.logprob), "bytes": list(t.encode())})
        content.append({"token": tok, "logprob": clamp_logprob(s.logprob), "bytes": list(tok.encode()),
                        "top_logprobs": top})
    return {"content": content}


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, models, chat_template: str | None = None,
                 exclude_tools_when_tool_choice_none: bool = False) -> None:
        super().__init__(engine, models)
        self.chat_template = chat_template
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    async def render(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (ValueError when no template is known, or when the
        rendered prompt has more characters than the context holds).

        Runs in the engine's tokenizer thread: rendering and encoding a big
        conversation take seconds, which the event loop must not wait for."""
        conv = [m.for_template() for m in messages]
        return await self.engine.run_in_tokenizer_thread(self._render, conv, add_generation_prompt, tools)

    def _render(self, conv, add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("messages need a tokenizer with a chat template; this model has no tokenizer")
        if self.chat_template is None and tok.chat_template is None:
            raise ValueError("messages cannot be rendered: the tokenizer has no chat_template; "
                             "start the server with --chat-template")
        from jinja2 import TemplateError

        try:  # the text first, then its tokens: what apply_chat_template(tokenize=True) does
            text = tok.apply_chat_template(conv, chat_template=self.chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, tools=tools)
        except TemplateError as e:  # e.g. a template that raises on a role order it rejects
            raise ValueError(f"messages cannot be rendered by the chat template: {e}") from e
        # Refused before the costly part, as a text prompt is.
        self.engine.engine.processor.check_text_length("messages", text)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    async def create_chat_completion(self, req: ChatCompletionRequest, is_disconnected=None):
        if (err := self.models.check(req.model)) is not None:
            return err
        try:
            req.check_tools()  # before rendering: a 400 must not cost a template run
            ids = await self.render(req.messages, req.add_generation_prompt,
                                    req.tools_for_template(self.exclude_tools_when_tool_choice_none))
            limit = self.engine.max_model_len
            if len(ids) >= limit:
                return error_response(f"messages render to {len(ids)} tokens; the prompt must be "
                                      f"shorter than max_model_len ({limit})", 400, "messages")
            params = req.to_sampling_params(limit, limit - len(ids), self.default_sampling_params)
        except ValueError as e:
            return value_error_response(e)
        return await self.serve(req, [{"prompt_token_ids": ids}], params, random_id("chatcmpl"),
                                is_disconnected)

    async def _full(self, req, streams, rid, model, is_disconnected) -> JSONResponse:
        final = (await self.collect_finals(streams, is_disconnected))[0]
        usage = UsageInfo(prompt_tokens=len(final.prompt_token_ids))
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            usage.completion_tokens += len(c.token_ids)
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(c.logprobs or [], req.top_logprobs or 0)
                            if req.logprobs else None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": model, "choices": choices, "usage": usage.model_dump(),
                             "system_fingerprint": self.system_fingerprint})

    async def _stream(self, req, streams, rid, model):
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = include_usage and bool(so.continuous_usage_stats)
        for i in range(req.n):  # the role comes first, as OpenAI sends it
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        usage = UsageInfo()
        n_out: dict[int, int] = {}
        async for _, out in merge_streams(streams):
            usage.prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                n_out[c.index] = n_out.get(c.index, 0) + len(c.token_ids)
                lp = chat_logprobs(c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                chunk = {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if continuous:  # vLLM: this choice's tokens so far
                    k = n_out[c.index]
                    chunk["usage"] = UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=k,
                                               total_tokens=usage.prompt_tokens + k).model_dump()
                if c.finish_reason is not None and not include_usage:
                    chunk["system_fingerprint"] = self.system_fingerprint
                yield sse(chunk)
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse({**head, "choices": [], "usage": usage.model_dump(),
                       "system_fingerprint": self.system_fingerprint})
        yield sse("[DONE]")
