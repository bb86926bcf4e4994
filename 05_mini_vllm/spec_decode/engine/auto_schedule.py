"""The engine's default for dynamic speculative decoding: draft only where it pays.

vLLM counterpart: none. vLLM 0.32 drafts `num_speculative_tokens` at every batch
size unless the user writes a schedule by hand (`num_speculative_tokens_per_batch_size`
in `vllm/config/speculative.py`). Here, when the user writes none, the engine
measures one (`speculative_config` with the field left out; pass None for vLLM's
"always k").

The rule. A step of B decoding requests without drafts costs T(B) and emits B
tokens. With k drafts each, the target verifies B * (k + 1) rows and the proposer
drafts, which costs V(B); the step emits L tokens per request, L being the mean
acceptance length (1 + accepted drafts per draft sequence). Drafting pays when

    L * T(B) > V(B),   that is   L > c(B) = V(B) / T(B),

the *break-even acceptance length* at batch size B. While the target's step is
bound by reading its weights, verifying k + 1 rows costs little more than one and
c(B) is small; once the step is bound by arithmetic, c(B) climbs towards k + 1 and
past it, where no acceptance can pay. `worker/spec_profile.py` measures c(B) once,
at start-up, on dummy steps; L is the verifier's running count.

Invariants:
* `break_even` holds c at batch sizes 1, 2, 4, ..., ascending, made non-decreasing
  (a running maximum), so drafting at B implies drafting at every smaller batch;
* a batch size between two measured ones takes the c of the next one up (the
  dearer), and a batch past the last measured one gets no drafts;
* until `MIN_DRAFT_SEQUENCES` draft sequences were verified, L is taken as
  k + 1 (every draft accepted): the engine drafts, and so learns its acceptance,
  wherever drafting could pay at all;
* the answer is k or 0; each switch is logged by the runner's side
  (`spec_decode/engine/head_kv.py` for EAGLE) and here, with the L and c that decided it.
"""
from __future__ import annotations

import bisect
import logging

from mini_vllm.metrics.stats import SpecDecodingStats

logger = logging.getLogger("mini_vllm")

# Draft sequences verified before the measured acceptance replaces the optimistic prior.
MIN_DRAFT_SEQUENCES = 16


class AutoSchedule:
    """Callable batch size -> drafts per request (k or 0), from measured break-evens
    and the verifier's running totals (read live, never copied)."""

    def __init__(self, k: int, break_even: list[tuple[int, float]], totals: SpecDecodingStats) -> None:
        if not break_even or [b for b, _ in break_even] != sorted({b for b, _ in break_even}):
            raise ValueError(f"break_even must list ascending, distinct batch sizes, got {break_even!r}")
        self.k = k
        self.batch_sizes: list[int] = [b for b, _ in break_even]
        self.costs: list[float] = []
        for _, c in break_even:  # non-decreasing: a noisy dip must not turn drafting back on
            self.costs.append(max(c, self.costs[-1]) if self.costs else c)
        self.totals = totals
        self._drafting: bool | None = None  # the latest call's answer (None before any): a change is logged

    def acceptance_length(self) -> float:
        """L: the measured mean acceptance length, or k + 1 while too few drafts were verified."""
        t = self.totals
        if t.num_draft_sequences < MIN_DRAFT_SEQUENCES:
            return float(self.k + 1)
        return 1.0 + t.num_accepted / t.num_draft_sequences

    def break_even_at(self, batch_size: int) -> float:
        """c at `batch_size`: the next measured size's; infinity past the last one."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return float("inf") if i == len(self.costs) else self.costs[i]

    def __call__(self, batch_size: int) -> int:
        length, cost = self.acceptance_length(), self.break_even_at(batch_size)
        drafting = length > cost
        if drafting != self._drafting:
            logger.info("speculative decoding (measured schedule): %s at batch size %d: mean acceptance "
                        "length %.2f %s break-even %.2f", "drafting" if drafting else "no drafts",
                        batch_size, length, ">" if drafting else "<=", cost)
        self._drafting = drafting
        return self.k if drafting else 0

    def describe(self) -> str:
        """The measured break-evens, for the start-up log line."""
        pairs = ", ".join(f"{b}: {c:.2f}" for b, c in zip(self.batch_sizes, self.costs))
        return f"break-even mean acceptance length by batch size {{{pairs}}} (k = {self.k})"
