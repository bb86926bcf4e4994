"""The synchronous engine: requests in, streaming `RequestOutput`s out.

vLLM counterpart: `vllm/v1/engine/llm_engine.py` (`LLMEngine`: `add_request`,
`step`, `abort_request`, `has_unfinished_requests`), with the input checks of
`vllm/v1/engine/processor.py`.

One `step()` = one scheduler step + one forward pass + detokenization of what
it produced. Every request is validated completely before anything about it
is stored, so a bad request raises a ValueError that names the field and its
allowed range and leaves the engine and the other requests untouched.
"""
from __future__ import annotations

import logging
import time

from mini_vllm.config import EngineConfig
from mini_vllm.engine.core import EngineCore
from mini_vllm.generation_config import get_diff_sampling_param
from mini_vllm.metrics.loggers import EngineMetrics, LoggingStatLogger
from mini_vllm.engine.output_processor import OutputProcessor
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import Request

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
    return out


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, executor_class=None) -> None:
        self.config = config
        self.engine_core = EngineCore(config, executor_class)
        self.model_config = self.engine_core.model_config
        self.max_model_len = self.engine_core.max_model_len
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.stat_logger = LoggingStatLogger(config.stats_log_interval_s) if config.log_stats else None
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else (self.model_config.eos_token_ids or (None,))[0]
        # The checkpoint's default sampling fields (vLLM's --generation-config).
        self.default_sampling_params = get_diff_sampling_param(config.model, config.generation_config)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        tok = kwargs.pop("tokenizer_obj", None)
        executor_class = kwargs.pop("executor_class", None)
        return cls(EngineConfig.from_kwargs(model, **kwargs), tok, executor_class)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------ requests
    def process_inputs(self, prompt, params: SamplingParams | None) -> tuple[str | None, list[int], SamplingParams]:
        """Validate one request; returns (prompt text, prompt token ids, params)."""
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
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model folder has no tokenizer; pass token ids")
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
        return text, ids, self._check_params(params, len(ids))

    def _check_params(self, params: SamplingParams, n_prompt: int) -> SamplingParams:
        """What only the engine can check (vocabulary, tokenizer, grammar, context);
        returns the params to run, a copy when something had to be set."""
        vocab, limit = self.model_config.vocab_size, self.max_model_len
        cap = vocab if self.config.max_logprobs == -1 else min(vocab, self.config.max_logprobs)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > cap:
                raise ValueError(f"{name} must be in [0, {cap}] (max_logprobs), got {v}")
        for name, toks in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
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
            get_backend(path, vocab, self.tokenizer).compile((copy or params).structured_outputs)  # cached
        if n_prompt + params.max_tokens > limit:
            # vLLM serves such a request and stops it at the context limit ("length").
            copy = copy or params.clone()
            copy.max_tokens = limit - n_prompt
            copy.min_tokens = min(copy.min_tokens, copy.max_tokens)
        return copy or params

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    output_kind: str = "cumulative") -> None:
        request_id = str(request_id)
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, params = self.process_inputs(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, ids, params, eos_token_id=self.eos_token_id, arrival_time=arrival,
                      priority=priority)
        self.output_processor.add_request(request_id, text, ids, params, output_kind, arrival)
        try:
            self.engine_core.add_request(req)
        except ValueError:
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids) -> None:
        """Stop requests now; their KV blocks return to the pool at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core = [c for rid in request_ids for c in self.output_processor.core_ids(rid)]
        self.engine_core.abort_requests(core)
        self.output_processor.abort_requests(request_ids)

    def shutdown(self) -> None:
        """Stop worker processes (tensor parallelism); also runs on garbage collection and exit."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states) or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    # ---------------------------------------------------------------- step
    def step(self):
        res = self.engine_core.step()
        now = time.monotonic()
        self.output_processor.mark_scheduled(res.first_scheduled, now)
        t0 = time.perf_counter()
        outs, to_finish, it = self.output_processor.process_outputs(res.outputs, now)
        if to_finish:
            self.engine_core.finish_stopped(to_finish)
        res.timings["detokenize"] = time.perf_counter() - t0
        it.num_prompt_tokens = res.num_prompt_tokens_computed
        self.metrics.record(it, res.scheduler_stats, res.timings)
        if self.stat_logger is not None:
            self.stat_logger.record(it, res.scheduler_stats)
        return outs

    def get_stats(self) -> dict:
        out = self.metrics.summary()
        spec = self.engine_core.spec_decoding_stats()
        if spec is not None:
            out["spec_acceptance_rate"] = spec["acceptance_rate"]
            out["spec_acceptance_per_position"] = spec["acceptance_per_position"]
            out["spec_num_drafts"] = spec["num_drafts"]
        return out
