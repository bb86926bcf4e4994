"""`POST /v1/completions`: prompts in, text out, whole or as Server-Sent Events.

vLLM counterpart: `vllm/entrypoints/openai/serving_completion.py`
(`OpenAIServingCompletion.create_completion`, `completion_stream_generator`,
`request_output_to_completion_response`, `_create_completion_logprobs`).

Invariants:
- `prompt` may be a string, a list of strings, a list of token ids or a list
  of token-id lists; each prompt is one engine request with `n` samples and
  its choices have indices prompt_index * n + sample_index.
- Streaming uses the engine's "delta" outputs: the chunks' texts concatenate
  to the non-streamed text. `usage` counts each prompt once and every
  sampled token of every choice.
- Logprobs use the legacy completions shape: tokens, token_logprobs,
  top_logprobs (the `logprobs` most likely tokens, plus the sampled one) and
  text_offset (character offsets into the choice's text).
"""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from mini_vllm.entrypoints.protocol import CompletionRequest, UsageInfo, random_id
from mini_vllm.entrypoints.serving_engine import (OpenAIServing, error_response, merge_streams, sse,
                                                  value_error_response)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def completion_logprobs(entries, k: int, offset: int, tokenizer) -> dict:
    """Legacy logprobs for a run of tokens; `offset` is the text length before them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for d in entries:
        sampled_id, sampled = next(iter(d.items()))  # the sampled token comes first
        text = sampled.decoded_token if sampled.decoded_token is not None else str(sampled_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(sampled.logprob)
        top = {}
        for tid, lp in sorted(d.items(), key=lambda kv: kv[1].rank or 0):
            if lp.rank is not None and lp.rank <= k or tid == sampled_id:
                top.setdefault(lp.decoded_token if lp.decoded_token is not None else str(tid), lp.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, is_disconnected=None):
        if (err := self.models.check(req.model)) is not None:
            return err
        if req.suffix:
            return error_response("suffix is not supported", 400, "suffix")
        if req.echo and req.logprobs is not None:
            return error_response("echo with logprobs needs prompt logprobs, which this server does not "
                                  "compute; use one or the other", 400, "echo")
        try:
            prompts = _prompts(req.prompt)
            params = req.to_sampling_params(default_max_tokens=16)
        except ValueError as e:
            return value_error_response(e)
        return await self.serve(req, prompts, params, random_id("cmpl"), is_disconnected)

    def _prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    async def _full(self, req, streams, rid, model, is_disconnected) -> JSONResponse:
        n = req.n
        finals = await self.collect_finals(streams, is_disconnected)
        choices, usage = [], UsageInfo()
        for i in range(len(streams)):
            out = finals[i]
            usage.prompt_tokens += len(out.prompt_token_ids)
            prefix = self._prompt_text(out) if req.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                usage.completion_tokens += len(c.token_ids)
                lp = None if req.logprobs is None else completion_logprobs(
                    c.logprobs or [], req.logprobs, len(prefix), self.tokenizer)
                choices.append({"index": i * n + c.index, "text": prefix + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": model, "choices": choices, "usage": usage.model_dump()})

    async def _stream(self, req, streams, rid, model):
        n, created = req.n, int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        usage = UsageInfo()
        counted: set[int] = set()
        async for i, out in merge_streams(streams):
            if i not in counted:
                counted.add(i)
                usage.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                idx = i * n + c.index
                text = c.text
                if req.echo and idx not in offsets:
                    text = self._prompt_text(out) + text
                base = offsets.get(idx, 0) + (len(text) - len(c.text))
                offsets[idx] = offsets.get(idx, 0) + len(text)
                usage.completion_tokens += len(c.token_ids)
                lp = None if req.logprobs is None else completion_logprobs(
                    c.logprobs or [], req.logprobs, base, self.tokenizer)
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": idx, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage.model_dump()})
        yield sse("[DONE]")
