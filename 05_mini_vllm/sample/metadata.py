"""The batch's sampling parameters as tensors (vLLM: `vllm/v1/sample/metadata.py`).

Row i of every field belongs to request i of the batch (the logits row the
sampler reads). Invariants:
- temperature [B] float32 is 0.0 exactly for greedy rows; all_greedy /
  all_random say whether every row is greedy / none is.
- top_p, top_k, min_p are [B] tensors, or None when no row uses that filter;
  greedy rows always hold the disabled value (1.0, 0, 0.0).
- generators maps a row to the torch.Generator of a seeded random request;
  the generator belongs to the request and persists across steps.
- no_penalties is True iff every row has presence = frequency = 0 and
  repetition = 1; prompt_token_ids [B, Lp] (padded with vocab_size) is built
  only when some row has a penalty.
- min_tokens maps a row still short of its min_tokens to (min_tokens, ids to
  mask): its stop_token_ids plus EOS unless ignore_eos.
- max_num_logprobs is the largest logprobs request of the batch, or None.
- allowed_token_ids_mask [B, V] bool is True where a row may NOT sample (vLLM's
  polarity), None when no row restricts; bad_words_token_ids maps a row to its
  bad words as token-id lists; logit_bias is (rows, cols, values) to add, or
  None; token_bitmask [B, ceil(V / 32)] int32 (bit j of word w allows token
  32 w + j, xgrammar's layout) holds the structured-output rows, None when no
  row is constrained.
An all-greedy batch without penalties, min_tokens or logprobs builds only the
temperature tensor.

`from_params` builds all of it from scratch, the readable reference. The
engine's runner does not call it every step: its persistent batch keeps the
parameters as columns (`sample/sampling_columns.py`) and rebuilds the
metadata only when the rows that sample change, refreshing only the per-step
fields (output_token_ids, min_tokens, token_bitmask) otherwise; both give the
same metadata (tests/test_ch5_persistent_sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_vllm.sampling_params import _SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    allowed_token_ids_mask: torch.Tensor | None = None
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    token_bitmask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    # The two members Chapter 4's rejection sampler reads besides what the
    # probabilities step reads (`spec_decode.engine.verifier.compute_probs` here), so
    # the engine verifies drafts from this metadata too.
    @property
    def is_greedy(self) -> torch.Tensor:
        """[B] bool: the greedy rows."""
        return self.temperature == 0.0

    def validate(self, batch_size: int | None = None) -> None:
        """Raise if the metadata has another number of rows than the batch
        (`from_params` has already checked every value)."""
        if batch_size is not None and self.batch_size != batch_size:
            raise ValueError(f"sampling metadata has {self.batch_size} requests but the batch has {batch_size}")

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device="cpu",
        token_bitmask: torch.Tensor | None = None,
    ) -> "SamplingMetadata":
        """Build the batch's metadata; every list has one entry per row."""
        batch = len(params)
        for name, lst in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids),
                          ("generators", generators), ("eos_token_ids", eos_token_ids)):
            if len(lst) != batch:
                raise ValueError(f"{name} must have one entry per request ({batch}), got {len(lst)}")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] must be a mini_vllm SamplingParams, got {type(p).__name__}")
            if p.logprobs is not None and p.logprobs > vocab_size:
                raise ValueError(f"params[{i}].logprobs must be in [0, vocab_size={vocab_size}], got {p.logprobs}")

        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        temperature = torch.tensor(temps, dtype=torch.float32, device=device)

        top_p = top_k = min_p = None
        gens: dict[int, torch.Generator] = {}
        if not all_greedy:
            # SamplingParams already reset greedy rows' filters to disabled.
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device)
            if any(0 < p.top_k < vocab_size for p in params):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device)
            for i, (p, g, gen) in enumerate(zip(params, greedy, generators)):
                if not g and p.seed is not None:
                    if gen is None:
                        raise ValueError(f"generators[{i}] must be a torch.Generator: params[{i}] has seed={p.seed}")
                    gens[i] = gen

        no_penalties = all(p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
                           for p in params)
        if no_penalties:
            ones = torch.ones(batch, dtype=torch.float32, device=device)
            zeros = torch.zeros(batch, dtype=torch.float32, device=device)
            presence, frequency, repetition, prompt = zeros, zeros, ones, None
        else:
            presence = torch.tensor([float(p.presence_penalty) for p in params], dtype=torch.float32, device=device)
            frequency = torch.tensor([float(p.frequency_penalty) for p in params], dtype=torch.float32, device=device)
            repetition = torch.tensor([float(p.repetition_penalty) for p in params], dtype=torch.float32, device=device)
            prompt = _pad(prompt_token_ids, vocab_size, device)

        min_tokens: dict[int, tuple[int, set[int]]] = {}
        for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if len(out) < p.min_tokens:
                stop_ids = set(p.stop_token_ids)
                if eos is not None and not p.ignore_eos:
                    stop_ids.add(int(eos))
                if stop_ids:
                    min_tokens[i] = (p.min_tokens, stop_ids)

        allowed = None
        if any(p.allowed_token_ids for p in params):
            allowed = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed[i] = True
                    allowed[i, torch.tensor(p.allowed_token_ids, device=device)] = False
        bad_words = {i: p._bad_words_token_ids for i, p in enumerate(params) if p._bad_words_token_ids}
        bias = None
        if any(p.logit_bias for p in params):
            triples = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
            r, c, v = zip(*triples)
            bias = (torch.tensor(r, device=device), torch.tensor(c, device=device),
                    torch.tensor(v, dtype=torch.float32, device=device))
        if token_bitmask is not None and token_bitmask.shape != (batch, -(-vocab_size // 32)):
            raise ValueError(f"token_bitmask must be [{batch}, {-(-vocab_size // 32)}] (rows, words of 32 "
                             f"tokens), got {tuple(token_bitmask.shape)}")

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=gens,
            max_num_logprobs=max(logprobs) if logprobs else None,
            no_penalties=no_penalties,
            prompt_token_ids=prompt,
            output_token_ids=output_token_ids,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            min_tokens=min_tokens,
            allowed_token_ids_mask=allowed,
            bad_words_token_ids=bad_words,
            logit_bias=bias,
            token_bitmask=token_bitmask,
        )


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """[B, max_len] int64 with `pad` after each row (pad = vocab_size: an id no token has)."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
