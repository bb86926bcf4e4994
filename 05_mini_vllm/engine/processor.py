"""Input processing: a prompt and its sampling params become one validated request.

vLLM counterpart: `vllm/v1/engine/processor.py` (`Processor.process_inputs`,
which returns the `EngineCoreRequest` of `vllm/v1/engine/__init__.py`), with
the tokenizer loading of `vllm/transformers_utils/tokenizer.py` and the
bad-words tokenization of `SamplingParams.update_from_tokenizer`.

`Processor.process_inputs` is the only place a request is checked: it
refuses a text prompt longer than the context can hold in characters (before
tokenizing it, as vLLM does), tokenizes a text prompt, checks the tokens against the vocabulary and the
context, checks what only the engine can check in the params (vocabulary,
tokenizer, grammar, `max_logprobs`) and returns an `EngineCoreRequest` whose
params are final (defaults filled in, bad words as token ids, `max_tokens`
capped to the context). `LLMEngine.add_request` accepts that object as it is,
so `LLM.generate` can validate a whole batch first (all or nothing) and then
add it without tokenizing or validating anything twice. Every error is a
ValueError that names the field and its allowed range; nothing is stored
anywhere before the engine has the validated request.
"""
from __future__ import annotations

import logging
import time

from mini_vllm.engine import EngineCoreRequest
from mini_vllm.sampling_params import MAX_BAD_WORDS_TOTAL_TOKENS, SamplingParams, check_encodable, check_int64

logger = logging.getLogger("mini_vllm")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's own tokenizer, or None when it ships none: transformers would
    otherwise build a placeholder (for Qwen folders, a 1-token vocabulary whose
    EOS id has nothing to do with the model's)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s; only token-id prompts work", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:  # a folder with weights but no tokenizer files
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts work", path, e)
        return None


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (vLLM's
    `update_from_tokenizer`: a word is banned at the start of the text and
    inside it); the spaced form only when it is a different word of as many tokens."""
    out = []
    for w in words:
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {w!r}")
        out.append(list(plain))
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    total = sum(map(len, out))
    if total > MAX_BAD_WORDS_TOTAL_TOKENS:  # vLLM's bound: each token is matched on every step
        raise ValueError(f"bad_words tokenize to {total} tokens in all (with their spaced forms); at most "
                         f"{MAX_BAD_WORDS_TOTAL_TOKENS} are allowed (MINI_VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)")
    return out


class Processor:
    """Validates requests for one engine: its config, vocabulary, context
    length, tokenizer and the checkpoint's default sampling params (the dict
    the engine holds, shared, used when a request brings no params)."""

    def __init__(self, config, model_config, max_model_len: int, tokenizer,
                 default_sampling_params: dict | None = None, num_gpu_blocks: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.default_sampling_params = {} if default_sampling_params is None else default_sampling_params
        # The KV pool's size (the core's handshake): a request that needs more blocks
        # than the whole pool could never run, so it is refused here, not in the core.
        self.num_gpu_blocks = num_gpu_blocks
        self.eos_token_id = eos_token_id
        # vLLM's `max_chars_per_token` (`get_cached_tokenizer`): no token covers more
        # characters of text than its vocabulary entry has, so a text longer than
        # max_model_len times this cannot fit, and is refused without tokenizing it.
        self.max_chars_per_token = None if tokenizer is None else max(map(len, tokenizer.get_vocab()), default=1)

    def check_text_length(self, name: str, text: str) -> None:
        """ValueError naming `name` when `text` has more characters than a prompt that
        fits the context can have (vLLM's `_text_len_check`, before tokenizing: a
        2 MB prompt would otherwise cost seconds of tokenizing to be refused)."""
        if self.max_chars_per_token is None:
            return
        max_input = self.max_model_len - 1  # a prompt must leave room for one output token
        max_chars = max_input * self.max_chars_per_token
        if len(text) > max_chars:
            raise ValueError(f"{name} is too long: you passed {len(text)} input characters. However, the "
                             f"model's context length is only {self.max_model_len} tokens, resulting in a "
                             f"maximum input length of {max_input} tokens (at most {max_chars} characters: "
                             f"{self.max_chars_per_token} per token, the tokenizer's longest). Please reduce "
                             "the length of the input prompt.")

    def process_inputs(self, request_id: str, prompt, params: SamplingParams | None,
                       arrival_time: float | None = None, priority: int = 0) -> EngineCoreRequest:
        """Validate one request; returns it as an `EngineCoreRequest`.

        `prompt`: a str, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids". `params=None` takes the engine's defaults;
        `arrival_time=None` is now (time.monotonic())."""
        params = SamplingParams(**self.default_sampling_params) if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a mini_vllm.SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            check_encodable("prompt", prompt)  # the tokenizer would raise a TypeError deep inside
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model folder has no tokenizer; pass token ids")
            self.check_text_length("prompt", prompt)
            text, ids = prompt, list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
        else:
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        vocab, limit = self.model_config.vocab_size, self.max_model_len
        if not ids:
            raise ValueError("prompt must contain at least 1 token, got an empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab}) (the vocabulary), got {bad[:5]}")
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
                             f"({limit}) to leave room for output")
        check_int64("priority", priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = self._check_params(params, len(ids))
        if self.num_gpu_blocks is not None:
            bs = self.config.block_size
            need = -(-(len(ids) + params.max_tokens) // bs)
            if need > self.num_gpu_blocks:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} "
                                 f"KV blocks of {bs} tokens but the pool has only {self.num_gpu_blocks}, so it "
                                 f"could never run: max_tokens must be <= {self.num_gpu_blocks * bs - len(ids)} for this prompt")
        return EngineCoreRequest(str(request_id), text, ids, params, arrival, priority, self.eos_token_id)

    def _check_params(self, params: SamplingParams, n_prompt: int) -> SamplingParams:
        """What only the engine can check (vocabulary, tokenizer, grammar, context);
        returns the params to run, a copy when something had to be set."""
        vocab, limit = self.model_config.vocab_size, self.max_model_len
        cap = vocab if self.config.max_logprobs == -1 else min(vocab, self.config.max_logprobs)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > cap:
                raise ValueError(f"{name} must be in [0, {cap}] (max_logprobs), got {v}")
        # Every token id ends up indexing a [rows, vocab] tensor (bias, mask, min_tokens' ban
        # of stop ids): one outside the vocabulary would raise inside a step and kill the engine.
        for name, toks in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must lie in [0, {vocab}) (the vocabulary), got {bad[:5]}")
        copy = None
        if params.bad_words and not params._bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer; this model folder has none")
            copy = params.clone()
            copy._bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this model folder has none")
            from mini_vllm.structured_output import get_backend

            if (self.config.structured_outputs_config or {}).get("disable_any_whitespace") and \
                    not params.structured_outputs.disable_any_whitespace:
                copy = copy or params.clone()  # the server's default for every request
                copy.structured_outputs.disable_any_whitespace = True
            path = self.config.tokenizer or self.config.model
            get_backend(path, vocab, self.tokenizer).validate((copy or params).structured_outputs)  # cached
        if n_prompt + params.max_tokens > limit:
            # vLLM serves such a request and stops it at the context limit ("length").
            copy = copy or params.clone()
            copy.max_tokens = limit - n_prompt
            copy.min_tokens = min(copy.min_tokens, copy.max_tokens)
        return copy or params
