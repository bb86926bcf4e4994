"""Per-request sampling parameters of the engine (vLLM: `vllm/sampling_params.py`).

`SamplingParams` extends Chapter 3's `SchedulerSamplingParams`
(max_tokens, stop_token_ids, ignore_eos) with everything the sampler reads,
under vLLM's field names and defaults, so a scheduler built in Chapter 3 keeps
working on engine requests unchanged.

Invariants after construction (each violation is a ValueError naming the
field and its allowed range, checked once here so the sampler never has to):
- 1 <= n <= MAX_N_SEQUENCES; 0 <= temperature <= 2; 0 < top_p <= 1;
  top_k == -1 or top_k >= 0 (-1 and 0 both disable top-k; -1 is stored as 0);
  0 <= min_p <= 1; presence/frequency penalties in [-2, 2];
  repetition_penalty > 0; max_tokens >= 1; 0 <= min_tokens <= max_tokens;
  logprobs and prompt_logprobs None or >= 0; seed None or an int64 (what
  torch's generators and vLLM's API take); `stop` and `bad_words` are lists
  of non-empty strings that UTF-8 can encode (no lone surrogates), at most
  MAX_NUM_BAD_WORDS bad words and MAX_STOP_TOKEN_IDS stop token ids (vLLM's
  bounds; the API also allows at most MAX_STOP_STRINGS stop strings);
  logit_bias maps int token ids to finite biases, clamped to [-100, 100]
  (vLLM's range); allowed_token_ids is None or a non-empty list of ids >= 0;
  structured_outputs is None or a `StructuredOutputsParams` with exactly one
  constraint (a JSON schema nested at most MAX_JSON_SCHEMA_DEPTH levels). Token ids are checked against the vocabulary by the engine,
  which knows it.
- n > 1 needs sampling: greedy samples would all be the same (vLLM rejects it).
- skip_reading_prefix_cache defaults to `prompt_logprobs is not None`, as in
  vLLM: cached blocks have no logits, so such a request computes its whole
  prompt (it still writes its blocks to the cache for others).
- A request is greedy when temperature < _SAMPLING_EPS. Greedy requests ignore
  top_k, top_p and min_p (they are reset to their disabled values), because
  the argmax of the unfiltered distribution is already the top token.
"""
from __future__ import annotations

import copy
import math
import os
import enum
from dataclasses import dataclass, field, fields

from mini_vllm.scheduler import SchedulerSamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# vLLM's ranges (vllm/sampling_params.py): temperature in [0, 2] as in OpenAI's API,
# n up to VLLM_MAX_N_SEQUENCES (each sample is a request of its own; 16384 unless the
# environment variable MINI_VLLM_MAX_N_SEQUENCES says otherwise), seeds in int64.
MAX_TEMPERATURE = 2.0
MAX_N_SEQUENCES = int(os.environ.get("MINI_VLLM_MAX_N_SEQUENCES", "16384"))
# vLLM's bounds on what one request may carry, each a cost on every step or a
# compile of the request (vLLM's VLLM_MAX_* environment variables, here MINI_VLLM_MAX_*):
# stop strings (the API's, checked in entrypoints/openai/protocol.py), stop token
# ids, bad words and their tokens in all (the processor counts those), and the
# nesting of a JSON schema given to structured outputs.
MAX_STOP_STRINGS = int(os.environ.get("MINI_VLLM_MAX_STOP_STRINGS", "4"))
MAX_STOP_TOKEN_IDS = int(os.environ.get("MINI_VLLM_MAX_STOP_TOKEN_IDS", "128"))
MAX_NUM_BAD_WORDS = int(os.environ.get("MINI_VLLM_MAX_NUM_BAD_WORDS", "128"))
MAX_BAD_WORDS_TOTAL_TOKENS = int(os.environ.get("MINI_VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "1024"))
MAX_JSON_SCHEMA_DEPTH = 64
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def check_int64(name: str, value) -> None:
    """ValueError naming `name` unless `value` is an int (not a bool) that fits in int64."""
    if not isinstance(value, int) or isinstance(value, bool) or not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be an int in [{INT64_MIN}, {INT64_MAX}] (int64), got {value!r}")


def check_encodable(name: str, text: str) -> None:
    """ValueError naming `name` when `text` holds a lone surrogate (JSON's "\\ud800"
    escape decodes to one): it is not Unicode text, and no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text; it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}, which UTF-8 cannot encode") from None


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams`): a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a
    regular expression, one of a list of strings (`choice`) or an EBNF grammar
    (`grammar`, xgrammar's GBNF dialect)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace outside strings (compact output), so a small
    # model cannot spend its tokens on indentation.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self)
                 if f.name in _CONSTRAINTS and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        if self.json is not None and (depth := json_depth(self.json)) > MAX_JSON_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.json is nested {depth} levels deep (objects and arrays); "
                             f"at most {MAX_JSON_SCHEMA_DEPTH} are allowed")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_any(cls, value) -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported field(s) {unknown}; supported: {sorted(known)}")
        return cls(**value)


def json_depth(doc) -> int:
    """How deep objects and arrays nest in a JSON document (a parsed one, or its text),
    without recursion: a schema nested 100,000 levels must not overflow the stack."""
    if isinstance(doc, str):  # brackets outside string literals
        depth = best = 0
        in_str = esc = False
        for ch in doc:
            if in_str:
                esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
            elif ch == '"':
                in_str = True
            elif ch in "[{":
                depth += 1
                best = max(best, depth)
            elif ch in "]}":
                depth -= 1
        return best
    best, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            best = max(best, d)
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return best


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's token (vLLM's `SamplingType`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x) -> bool:
    # bool is an int subclass; True as a token count or seed is a caller bug.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_range(name: str, value, ok: bool, allowed: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams(SchedulerSamplingParams):
    """Sampling parameters of one request (keyword arguments, as in vLLM)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_reading_prefix_cache: bool | None = None
    # Token ids of each bad word, set by the engine from its tokenizer (vLLM's name).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Inherited: max_tokens=16, stop_token_ids=(), ignore_eos=False.

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N_SEQUENCES:
            raise ValueError(f"n must be an int in [1, {MAX_N_SEQUENCES}], got {self.n!r}")
        _check_range("temperature", self.temperature,
                     0 <= self.temperature <= MAX_TEMPERATURE if _is_number(self.temperature) else False,
                     f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        _check_range("top_p", self.top_p, 0 < self.top_p <= 1 if _is_number(self.top_p) else False,
                     "in (0, 1] (1 disables top-p)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0 <= self.min_p <= 1 if _is_number(self.min_p) else False,
                     "in [0, 1] (0 disables min-p)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_range(name, v, -2 <= v <= 2 if _is_number(v) else False, "in [-2, 2]")
        _check_range("repetition_penalty", self.repetition_penalty,
                     self.repetition_penalty > 0 if _is_number(self.repetition_penalty) else False,
                     "> 0 (1 disables it)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")
        self._check_token_controls()
        if self.seed is not None:
            check_int64("seed", self.seed)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for s in self.stop:
            check_encodable("stop", s)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries "
                             f"(MINI_VLLM_MAX_STOP_TOKEN_IDS), got {len(self.stop_token_ids)}")
        super().__post_init__()  # normalises stop_token_ids to a tuple
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so drop them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        elif self.prompt_logprobs is not None and not self.skip_reading_prefix_cache:
            raise ValueError("skip_reading_prefix_cache must be True or None with prompt_logprobs: "
                             "prompt tokens found in the prefix cache have no logits")

    def _check_token_controls(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, structured_outputs (vLLM's checks)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids (ints), got {k!r}") from None
                if not _is_number(v) or not math.isfinite(v):
                    raise ValueError(f"logit_bias values must be finite numbers, got {v!r} for token {k!r}")
                bias[tid] = min(100.0, max(-100.0, float(v)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be None or a non-empty list of ints >= 0, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            for w in words:
                check_encodable("bad_words", w)
            if len(words) > MAX_NUM_BAD_WORDS:
                raise ValueError(f"bad_words must have at most {MAX_NUM_BAD_WORDS} entries "
                                 f"(MINI_VLLM_MAX_NUM_BAD_WORDS), got {len(words)}")
            self.bad_words = list(dict.fromkeys(words))
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Stop ids given by the user (EOS is added per request by the engine)."""
        return set(self.stop_token_ids)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM clones params per request so callers may reuse theirs)."""
        return copy.deepcopy(self)
