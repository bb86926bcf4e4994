"""Speculative decoding configuration (counterpart of `SpeculativeConfig` in
`vllm/config/speculative.py`).

`LLM(..., speculative_config={...})` takes vLLM's field names:
* {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
* {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
* {"method": "eagle", "model": PATH, "num_speculative_tokens": k}: an EAGLE-1 head
  (`EagleLlamaForCausalLM`, vLLM's format) trained on the target's hidden states
Every bad value is a ValueError naming the field and its allowed range; a
missing draft folder is a FileNotFoundError. The draft model's vocabulary is
checked against the target's when the draft is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "draft_model", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo!r} and {hi!r}")
        else:
            if not self.model:
                raise ValueError("speculative_config.model (the draft model's or head's folder) is "
                                 f"required for method {self.method!r}")
            if not Path(self.model).is_dir():
                raise FileNotFoundError(f"speculative_config.model: draft model folder {self.model} "
                                        "does not exist")
