"""Speculative decoding configuration (counterpart of `SpeculativeConfig` in
`vllm/config/speculative.py`).

`LLM(..., speculative_config={...})` takes vLLM's field names:
* {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
* {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
* {"method": "eagle", "model": PATH, "num_speculative_tokens": k}: an EAGLE-1 head
  (`EagleLlamaForCausalLM`, vLLM's format) trained on the target's hidden states
Any method also takes `num_speculative_tokens_per_batch_size`:
* left out ("auto"), the engine's default and not vLLM's: the engine measures at
  start-up where drafting stops paying and drafts only below that batch size
  (`spec_decode/engine/auto_schedule.py`); it falls back to None under asynchronous
  scheduling and tensor parallelism, which need a draft length known in advance;
* None: vLLM's default, k drafts at every batch size;
* vLLM's dynamic speculative decoding, a list of inclusive batch-size ranges
[(first, last, k), ...] sorted, non-overlapping, starting at 1, k in
[0, num_speculative_tokens]. After a step that scheduled n requests, the
proposer drafts `num_tokens_for_batch(n)` tokens per request (a size between
or past the ranges keeps the k of the range before it); k = 0 turns drafting
off at large batches, where verifying drafts costs more than it saves. EAGLE's
head does not run at all then (vLLM's still writes its KV), so a step with k = 0
costs what a step without speculation costs; the requests it computed lack the
head's KV there and draft no more, while requests that start later do
(`spec_decode/engine/head_kv.py`). The engine logs each switch.
vLLM caps a k above num_speculative_tokens; here that is an error.
Every bad value is a ValueError naming the field and its allowed range; a
missing draft folder is a FileNotFoundError. The draft model's vocabulary is
checked against the target's when the draft is loaded.
"""
from __future__ import annotations

import dataclasses
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
    num_speculative_tokens_per_batch_size: list | str | None = "auto"

    @classmethod
    def from_any(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """None, a dict of vLLM's field names, or a SpeculativeConfig (copied: the engine
        may adjust its schedule, which must not reach the caller's object)."""
        if d is None:
            return None
        if isinstance(d, cls):
            return dataclasses.replace(d)
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "num_speculative_tokens_per_batch_size"}
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
        schedule = self.num_speculative_tokens_per_batch_size
        if isinstance(schedule, str) and schedule != "auto":
            raise ValueError("speculative_config.num_speculative_tokens_per_batch_size must be \"auto\" (the "
                             "default: measured), None (always k) or a list of [first, last, k], "
                             f"got {schedule!r}")
        if schedule is not None and schedule != "auto":
            self.num_speculative_tokens_per_batch_size = self._checked_schedule(
                self.num_speculative_tokens_per_batch_size, k)
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

    @staticmethod
    def _checked_schedule(schedule, k: int) -> list[tuple[int, int, int]]:
        name = "speculative_config.num_speculative_tokens_per_batch_size"
        if not isinstance(schedule, (list, tuple)) or not schedule:
            raise ValueError(f"{name} must be a non-empty list of [first, last, k] batch-size ranges, "
                             f"got {schedule!r}")
        out = []
        for entry in schedule:
            if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
                raise ValueError(f"{name}: each entry must be [first, last, k] (three ints), got {entry!r}")
            first, last, n = entry
            if not 1 <= first <= last:
                raise ValueError(f"{name}: a range needs 1 <= first <= last, got {entry!r}")
            if not 0 <= n <= k:
                raise ValueError(f"{name}: k must be in [0, num_speculative_tokens={k}], got {entry!r}")
            out.append((first, last, n))
        out.sort()
        if out[0][0] != 1:
            raise ValueError(f"{name}: the first range must start at batch size 1, got {out[0]!r}")
        for (_, prev_last, _), (first, _, _) in zip(out, out[1:]):
            if first <= prev_last:
                raise ValueError(f"{name}: ranges overlap ({prev_last} and {first})")
        return out

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """Drafts per request after a step of `batch_size` requests: the k of the
        last range starting at or below it (num_speculative_tokens without a schedule).
        "auto" is the worker's to resolve (`worker/spec_profile.py`); until then, k."""
        if self.num_speculative_tokens_per_batch_size in (None, "auto"):
            return self.num_speculative_tokens
        k = 0
        for first, _, n in self.num_speculative_tokens_per_batch_size:
            if first > batch_size:
                break
            k = n
        return k
