"""`POST /v1/completions`: prompts in, text out, whole or as Server-Sent Events.

vLLM counterpart: `vllm/entrypoints/openai/completion/serving.py`
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
- echo with logprobs scores the prompt too (the engine's prompt logprobs; the
  first token has null entries), which is how lm-eval's log-likelihood tasks
  use the API; max_tokens=0 with echo returns the prompt alone (the engine
  still samples one token, which is dropped but counted in usage, as in vLLM).
- Non-streamed responses, and the last chunk of a stream, carry
  `system_fingerprint`; `stream_options.continuous_usage_stats` puts each
  choice's running usage in every chunk.
"""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from mini_vllm.entrypoints.openai.protocol import CompletionRequest, UsageInfo, random_id
from mini_vllm.entrypoints.openai.serving_engine import (OpenAIServing, clamp_logprob, error_response, merge_streams,
                                                  sse, value_error_response)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def completion_logprobs(token_ids, entries, k: int, offset: int, tokenizer) -> dict:
    """Legacy logprobs for a run of tokens; `offset` is the text length before them.

    An entry is None where nothing scored the token (the first prompt token):
    its logprob and top_logprobs are null, as in vLLM's `_create_completion_logprobs`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, d in zip(token_ids, entries):
        if d is None:
            text = tokenizer.decode([tid]) if tokenizer is not None else str(tid)
            lp, top = None, None
        else:
            tok = d[tid]
            text = tok.decoded_token if tok.decoded_token is not None else str(tid)
            lp, top = clamp_logprob(tok.logprob), {}
            for t, e in sorted(d.items(), key=lambda kv: kv[1].rank or 0):
                if e.rank is not None and e.rank <= k or t == tid:
                    top.setdefault(e.decoded_token if e.decoded_token is not None else str(t), clamp_logprob(e.logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_logprobs_json(plp) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None or {id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if d is None else {str(t): {"logprob": clamp_logprob(e.logprob), "rank": e.rank,
                                             "decoded_token": e.decoded_token} for t, e in d.items()}
            for d in plp]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, is_disconnected=None):
        if (err := self.models.check(req.model)) is not None:
            return err
        if req.suffix:
            return error_response("suffix is not supported", 400, "suffix")
        try:
            prompts = _prompts(req.prompt)
            params = req.to_sampling_params(self.engine.max_model_len, self.default_sampling_params)
        except ValueError as e:
            return value_error_response(e)
        return await self.serve(req, prompts, params, random_id("cmpl"), is_disconnected)

    def _echo(self, req, out, c, prompt_lps):
        """(text, token ids, logprob entries) of one choice's first output: with echo
        the prompt comes first, and max_tokens=0 returns the prompt alone."""
        if not req.echo:
            return c.text, list(c.token_ids), list(c.logprobs or [])
        prompt = self._prompt_text(out)
        plp = list(prompt_lps) if prompt_lps is not None else [None] * len(out.prompt_token_ids)
        if req.max_tokens == 0:
            return prompt, list(out.prompt_token_ids), plp
        return prompt + c.text, list(out.prompt_token_ids) + list(c.token_ids), plp + list(c.logprobs or [])

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
            for c in sorted(out.outputs, key=lambda c: c.index):
                usage.completion_tokens += len(c.token_ids)
                text, ids, entries = self._echo(req, out, c, out.prompt_logprobs)
                lp = None if req.logprobs is None else completion_logprobs(ids, entries, req.logprobs, 0,
                                                                           self.tokenizer)
                choice = {"index": i * n + c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": model, "choices": choices, "usage": usage.model_dump(),
                             "system_fingerprint": self.system_fingerprint})

    async def _stream(self, req, streams, rid, model):
        n, created = req.n, int(time.time())
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = include_usage and bool(so.continuous_usage_stats)
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        n_prompt: dict[int, int] = {}  # prompt index -> its tokens
        n_out: dict[int, int] = {}  # choice index -> tokens sent
        prompt_lps: dict[int, list] = {}  # delta outputs carry prompt logprobs once per prompt
        async for i, out in merge_streams(streams):
            n_prompt.setdefault(i, len(out.prompt_token_ids))
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                idx = i * n + c.index
                if idx not in offsets:  # the choice's first chunk: the prompt goes first with echo
                    text, ids, entries = self._echo(req, out, c, prompt_lps.get(i))
                else:
                    text, ids, entries = c.text, list(c.token_ids), list(c.logprobs or [])
                base = offsets.get(idx, 0)
                offsets[idx] = base + len(text)
                n_out[idx] = n_out.get(idx, 0) + len(c.token_ids)
                lp = None if req.logprobs is None else completion_logprobs(ids, entries, req.logprobs, base,
                                                                           self.tokenizer)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": idx, "text": text, "logprobs": lp,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if continuous:  # vLLM: this choice's tokens so far
                    chunk["usage"] = UsageInfo(prompt_tokens=n_prompt[i], completion_tokens=n_out[idx],
                                               total_tokens=n_prompt[i] + n_out[idx]).model_dump()
                if c.finish_reason is not None and not include_usage:
                    chunk["system_fingerprint"] = self.system_fingerprint
                yield sse(chunk)
        if include_usage:
            p, g = sum(n_prompt.values()), sum(n_out.values())
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": UsageInfo(prompt_tokens=p, completion_tokens=g,
                                                         total_tokens=p + g).model_dump(),
                       "system_fingerprint": self.system_fingerprint})
        yield sse("[DONE]")
