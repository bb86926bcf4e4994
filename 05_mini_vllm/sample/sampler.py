"""The engine's sampler: one token per request from the model's logits.

vLLM counterpart: `vllm/v1/sample/sampler.py` (`Sampler`, `SamplerOutput`,
`LogprobsTensors` in `vllm/v1/outputs.py`, penalties in
`vllm/v1/sample/ops/penalties.py`).

Processing order (as vLLM; the runner's grammar bitmask comes first, as
`apply_grammar_bitmask` in `vllm/v1/structured_output/utils.py` runs before
the sampler): structured-output bitmask -> allowed_token_ids -> bad_words ->
min_tokens (mask stop ids) -> logit_bias -> penalties (repetition over prompt
+ output, presence / frequency over output) -> greedy argmax for greedy rows
-> temperature -> min-p -> top-k / top-p -> exponential race. Invariants:
- A greedy row's token is the argmax of its penalised logits, whatever else
  is in the batch.
- A seeded row's noise comes from its own generator only, so its tokens do
  not depend on its batch neighbours.
- Logprobs follow vLLM's `logprobs_mode`. The default, "raw_logprobs", is the
  model's own distribution: log-softmax of the logits as they reach the sampler
  (after the structured-output bitmask, which the runner applies first, before
  every other step). "processed_logprobs" is the distribution actually sampled
  from (after penalties, temperature and filters; greedy rows: the penalised
  logits at temperature 1). "raw_logits" / "processed_logits" return the
  logits themselves at those two points.
Fast paths: all-greedy is a single argmax (no softmax); no filter means no
sort; top-k and top-p cut inside a `torch.topk` and the race then runs over
those candidates only; no penalties means no bincount.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_vllm.config import LOGPROBS_MODES
from mini_vllm.sample.ops.topk_topp import apply_min_p, random_sample, random_sample_candidates, top_k_top_p_filter
from mini_vllm.sample.metadata import SamplingMetadata


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit, the first one on a tie (as `argmax`).
    `max(dim).indices` gives the same index: on the CPU, torch's argmax over rows of
    a vocabulary is about 3x slower (128 rows x 6,144: 1.4 ms against 0.46 ms, one
    thread), paid every step."""
    return logits.max(dim=-1).indices


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled token, columns 1..N the top-N of the row."""

    logprob_token_ids: torch.Tensor  # [B, N + 1] int64
    logprobs: torch.Tensor  # [B, N + 1] float32
    selected_token_ranks: torch.Tensor  # [B] int64, 1 = most likely (ties share the worse rank)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]]) -> torch.Tensor:
    """-inf on the stop ids of rows still under their min_tokens (in place)."""
    rows = [i for i, (_, ids) in min_tokens.items() for _ in ids]
    cols = [t for _, ids in min_tokens.values() for t in ids]
    logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [256, 8]: bit j of byte b


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 -> [B, vocab] bool allowed. Bit j of word w is token 32 w + j
    (xgrammar's layout); read as little-endian bytes, byte k of word w holds
    tokens 32 w + 8 k .. 32 w + 8 k + 7, so one table lookup per byte unpacks it."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [B, 4 W], little-endian (x86, ARM)
    bits = _BYTE_BITS.to(bitmask.device)[as_bytes]  # [B, 4 W, 8]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the structured-output bitmask forbids the token (a new tensor).
    xgrammar's kernel when it is installed (vLLM calls the same one; ~7x faster
    on a 152k vocabulary on CPU), else the unpacking above."""
    try:
        import xgrammar as xgr
    except ImportError:
        return logits.masked_fill(~unpack_token_bitmask(bitmask, logits.shape[1]), float("-inf"))
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device))
    return out


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's rule (in place): a bad word's last token is banned when the output
    already ends with the word's other tokens (a one-token word: always)."""
    for i, words in bad_words.items():
        out = output_token_ids[i]
        for w in words:
            prefix = w[:-1]
            if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix):]) == prefix):
                logits[i, w[-1]] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties on logits [B, V] (returns a new tensor).

    repetition r: a token seen in the prompt or output gets l / r if l > 0,
    else l * r (both push it down when r > 1). frequency f: l -= f * count in
    output. presence p: l -= p if the token occurs in the output.
    """
    batch, vocab = logits.shape
    device = logits.device
    width = max((len(o) for o in md.output_token_ids), default=0)
    out = torch.tensor([list(o) + [vocab] * (width - len(o)) for o in md.output_token_ids],
                       dtype=torch.int64, device=device).reshape(batch, width)
    # One spare bin at index vocab absorbs the padding.
    counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, md.prompt_token_ids.to(device), True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = torch.where(seen, md.repetition_penalties.to(device).unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalties.to(device).unsqueeze(1) * counts
    return logits - md.presence_penalties.to(device).unsqueeze(1) * (counts > 0).to(logits.dtype)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor) -> LogprobsTensors:
    """Top-N values plus the sampled token's value and rank, from a [B, V] tensor of
    logprobs (or logits: ranks and top-N are the same either way)."""
    selected = logprobs.gather(1, sampled.unsqueeze(1))
    # Rank = how many tokens are at least as likely (vLLM's definition).
    ranks = (logprobs >= selected).sum(dim=-1)
    top_vals, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([selected, top_vals], dim=1),
        selected_token_ranks=ranks,
    )


class Sampler:
    """Stateless but for its `logprobs_mode`; call `forward(logits, metadata)` (or the object)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, md)

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.batch_size:
            raise ValueError(f"logits must be [batch={md.batch_size}, vocab], got shape {tuple(logits.shape)}")
        logits = logits.float()
        # Every step below that works in place clones first: the caller's logits are never modified.
        if md.token_bitmask is not None:
            logits = apply_token_bitmask(logits, md.token_bitmask)
        raw = None
        if md.max_num_logprobs is not None and self.logprobs_mode.startswith("raw"):
            # vLLM's default: what the model itself predicts, before any request's processing.
            raw = logits.log_softmax(dim=-1) if self.logprobs_mode == "raw_logprobs" else logits.clone()
        if md.allowed_token_ids_mask is not None:
            logits = logits.masked_fill(md.allowed_token_ids_mask.to(logits.device), float("-inf"))
        if md.bad_words_token_ids:
            logits = apply_bad_words(logits.clone(), md.bad_words_token_ids, md.output_token_ids)
        if md.min_tokens:
            logits = apply_min_tokens(logits.clone(), md.min_tokens)
        if md.logit_bias is not None:
            rows, cols, vals = (t.to(logits.device) for t in md.logit_bias)
            logits = logits.index_put((rows, cols), vals, accumulate=True)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)

        if md.all_greedy:  # (an empty batch counts as all greedy)
            sampled, processed = greedy_argmax(logits), logits
        else:
            greedy_sampled = None if md.all_random else greedy_argmax(logits)
            temp = md.temperature.to(logits.device)
            is_greedy = temp == 0.0
            if not md.all_random:
                temp = torch.where(is_greedy, 1.0, temp)  # no 0-division; result replaced below
            processed = logits / temp.unsqueeze(1)
            if md.min_p is not None:
                processed = apply_min_p(processed, md.min_p)
            candidates = None
            if md.top_k is not None or md.top_p is not None:
                processed, candidates = top_k_top_p_filter(processed, md.top_k, md.top_p)
            if candidates is not None and bool((candidates[2] | is_greedy).all()):
                # Every random row's kept tokens are among C candidates: race C, not V.
                sampled = random_sample_candidates(candidates[0], candidates[1], md.generators, logits.shape[1])
            else:
                sampled = random_sample(processed, md.generators)
            if greedy_sampled is not None:
                sampled = torch.where(is_greedy, greedy_sampled, sampled)

        lp = None
        if md.max_num_logprobs is not None:
            if raw is None:
                raw = processed.log_softmax(dim=-1) if self.logprobs_mode == "processed_logprobs" else processed
            lp = gather_logprobs(raw, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=lp)
