"""The persistent batch's sampling parameters, one row per request.

vLLM counterpart: the sampling half of `vllm/v1/worker/gpu_input_batch.py`
(`InputBatch`: `temperature_cpu`, `top_p_cpu`, `top_k_cpu`, the penalty
columns, `generators`, `min_tokens`, `bad_words_token_ids`, `logit_bias`,
`allowed_token_ids_mask`, `_make_sampling_metadata`, `refresh_metadata`).

`SamplingMetadata.from_params` rebuilds every tensor from Python objects, so a
decode step of an unchanged batch would redo the same work every step. Here a
request's parameters are written once into its row of the columns when it
joins the batch (`add_request`) and cleared when it leaves (`remove_request`);
`move_row` follows the batch when it condenses. A step's `SamplingMetadata`
is gathered from the columns only when the rows it samples changed; otherwise
the previous step's object comes back with only what truly changes per step
refreshed: the output tokens (penalties, bad words), the min_tokens rows still
short of their minimum, and the structured-output bitmask (seed 001 §4.6.2).

Invariants:
* row r of every column describes the request in batch row r; a row no
  request with engine `SamplingParams` owns holds the neutral values (greedy,
  filters off, no penalty, no logprobs) and `has_params[r]` is False;
* the sparse columns (generators, min_tokens, bad words, logit bias, allowed
  ids) have a key only for the rows that use them;
* the cached metadata belong to the current rows: every add, remove and move
  empties the cache;
* `refresh_metadata` equals `SamplingMetadata.from_params` over the same
  requests, field by field (tests/test_ch5_persistent_sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sampling_params import _SAMPLING_EPS, SamplingParams

# One step samples at most two row sets (plain rows, rows verifying drafts),
# so two cached entries make an unchanged batch rebuild nothing.
_MAX_CACHED = 2


@dataclass
class _CachedMetadata:
    metadata: SamplingMetadata
    # (metadata row, (min_tokens, stop ids)) of every row with a min_tokens rule:
    # the per-step refresh keeps those whose output is still too short.
    min_tokens_rows: list[tuple[int, tuple[int, set[int]]]]


class SamplingColumns:
    def __init__(self, max_num_seqs: int, vocab_size: int) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        n = max_num_seqs
        self.has_params = np.zeros(n, dtype=bool)
        self.temperature = np.zeros(n, dtype=np.float32)  # 0.0 exactly for greedy rows
        self.top_p = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence_penalties = np.zeros(n, dtype=np.float32)
        self.frequency_penalties = np.zeros(n, dtype=np.float32)
        self.repetition_penalties = np.ones(n, dtype=np.float32)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # -1: no logprobs
        # Whether a row uses a filter or a penalty, decided on the Python values
        # as `from_params` does (a float32 column may round 1 - 1e-9 to 1.0).
        self.uses_top_p = np.zeros(n, dtype=bool)
        self.uses_top_k = np.zeros(n, dtype=bool)
        self.uses_min_p = np.zeros(n, dtype=bool)
        self.has_penalty = np.zeros(n, dtype=bool)
        # (column, neutral value): what remove_request writes and move_row copies.
        self._dense = ((self.has_params, False), (self.temperature, 0.0), (self.top_p, 1.0),
                       (self.top_k, 0), (self.min_p, 0.0), (self.presence_penalties, 0.0),
                       (self.frequency_penalties, 0.0), (self.repetition_penalties, 1.0),
                       (self.num_logprobs, -1), (self.uses_top_p, False), (self.uses_top_k, False),
                       (self.uses_min_p, False), (self.has_penalty, False))
        # Sparse columns, keyed by row.
        self.generators: dict[int, torch.Generator] = {}
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        self.logit_bias: dict[int, dict[int, float]] = {}
        self._sparse = (self.generators, self.min_tokens, self.bad_words_token_ids, self.logit_bias)
        # [max_num_seqs, V] bool, True where a row may NOT sample; allocated when
        # the first request restricts its tokens (V may be 150k columns).
        self.allowed_token_ids_mask: torch.Tensor | None = None
        self.allowed_rows: set[int] = set()
        self._cache: dict[tuple, _CachedMetadata] = {}

    # ------------------------------------------------------------ rows
    def add_request(self, row: int, params, generator: torch.Generator | None, eos_token_id: int | None) -> None:
        """Write a request's row once, when it joins the batch."""
        self.remove_request(row)  # a request added again (resumed, new block table) starts clean
        if not isinstance(params, SamplingParams):
            # A Chapter 3 scheduler's own params (stop rules only, the model-free
            # runner test): the row holds no sampling parameters and cannot sample.
            return
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be in [0, vocab_size={self.vocab_size}], got {params.logprobs}")
        greedy = params.temperature < _SAMPLING_EPS
        self.has_params[row] = True
        self.temperature[row] = 0.0 if greedy else float(params.temperature)
        # SamplingParams already reset a greedy request's filters to disabled.
        self.top_p[row], self.top_k[row], self.min_p[row] = float(params.top_p), params.top_k, float(params.min_p)
        self.uses_top_p[row] = params.top_p < 1.0
        self.uses_top_k[row] = 0 < params.top_k < self.vocab_size
        self.uses_min_p[row] = params.min_p > 0.0
        self.presence_penalties[row] = float(params.presence_penalty)
        self.frequency_penalties[row] = float(params.frequency_penalty)
        self.repetition_penalties[row] = float(params.repetition_penalty)
        self.has_penalty[row] = not (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                                     and params.repetition_penalty == 1.0)
        if params.logprobs is not None:
            self.num_logprobs[row] = params.logprobs
        if not greedy and params.seed is not None:
            if generator is None:
                raise ValueError(f"a request with seed={params.seed} needs its torch.Generator")
            self.generators[row] = generator  # the request's own: it persists across steps
        if params.min_tokens > 0:
            stop_ids = set(params.stop_token_ids)
            if eos_token_id is not None and not params.ignore_eos:
                stop_ids.add(int(eos_token_id))
            if stop_ids:
                self.min_tokens[row] = (params.min_tokens, stop_ids)
        if params._bad_words_token_ids:
            self.bad_words_token_ids[row] = params._bad_words_token_ids
        if params.logit_bias:
            self.logit_bias[row] = params.logit_bias
        if params.allowed_token_ids:
            if self.allowed_token_ids_mask is None:
                self.allowed_token_ids_mask = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.bool)
            self.allowed_token_ids_mask[row] = True
            self.allowed_token_ids_mask[row, torch.tensor(params.allowed_token_ids)] = False
            self.allowed_rows.add(row)

    def remove_request(self, row: int) -> None:
        """Clear a row: a later request in this row must not inherit anything."""
        for col, neutral in self._dense:
            col[row] = neutral
        for sparse in self._sparse:
            sparse.pop(row, None)
        if row in self.allowed_rows:
            self.allowed_rows.discard(row)
            self.allowed_token_ids_mask[row] = False
        self._cache.clear()

    def move_row(self, src: int, dst: int) -> None:
        """Move row `src` into the empty row `dst` (the batch condensing); `src` ends empty."""
        for col, _ in self._dense:
            col[dst] = col[src]
        for sparse in self._sparse:
            if src in sparse:
                sparse[dst] = sparse[src]
        if src in self.allowed_rows:
            self.allowed_token_ids_mask[dst] = self.allowed_token_ids_mask[src]
            self.allowed_rows.add(dst)
        self.remove_request(src)

    # ------------------------------------------------------------ metadata
    def refresh_metadata(self, rows: list[int], token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
                         output_token_ids: list[list[int]], device,
                         token_bitmask: torch.Tensor | None = None) -> SamplingMetadata:
        """The metadata of the requests in batch rows `rows`, in that order.

        token_ids / num_prompt_tokens: the batch's token rows and prompt lengths
        (read only on a rebuild, for the penalties' prompt tokens);
        output_token_ids and token_bitmask: this step's, one entry / row per
        request. The returned object is reused by the next call with the same
        rows: read it before calling again."""
        if len(output_token_ids) != len(rows):
            raise ValueError(f"output_token_ids must have one entry per request ({len(rows)}), "
                             f"got {len(output_token_ids)}")
        words = -(-self.vocab_size // 32)
        if token_bitmask is not None and token_bitmask.shape != (len(rows), words):
            raise ValueError(f"token_bitmask must be [{len(rows)}, {words}] (rows, words of 32 tokens), "
                             f"got {tuple(token_bitmask.shape)}")
        key = (tuple(rows), str(device))
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            cached = self._cache[key] = self._make_sampling_metadata(rows, token_ids, num_prompt_tokens, device)
        md = cached.metadata
        # The per-step parts: every other field depends on the rows alone.
        md.output_token_ids = output_token_ids
        md.min_tokens = {i: rule for i, rule in cached.min_tokens_rows if len(output_token_ids[i]) < rule[0]}
        md.token_bitmask = token_bitmask
        return md

    def _make_sampling_metadata(self, rows: list[int], token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
                                device) -> _CachedMetadata:
        """Gather the rows' columns into tensors (the rebuild after the rows changed)."""
        idx = np.asarray(rows, dtype=np.int64)
        batch = len(rows)
        missing = np.flatnonzero(~self.has_params[idx])
        if missing.size:
            raise ValueError(f"params[{int(missing[0])}] must be a mini_vllm SamplingParams: batch row "
                             f"{rows[int(missing[0])]} holds none (a Chapter 3 request cannot sample)")

        def gather(col: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(col[idx]).to(device)  # col[idx] is a copy: later writes do not leak in

        temperature = gather(self.temperature)
        greedy = self.temperature[idx] == 0.0
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        top_p = top_k = min_p = None
        if not all_greedy:
            top_p = gather(self.top_p) if self.uses_top_p[idx].any() else None
            top_k = gather(self.top_k) if self.uses_top_k[idx].any() else None
            min_p = gather(self.min_p) if self.uses_min_p[idx].any() else None
        no_penalties = not bool(self.has_penalty[idx].any())
        if no_penalties:
            ones = torch.ones(batch, dtype=torch.float32, device=device)
            zeros = torch.zeros(batch, dtype=torch.float32, device=device)
            presence, frequency, repetition, prompt = zeros, zeros, ones, None
        else:
            presence, frequency = gather(self.presence_penalties), gather(self.frequency_penalties)
            repetition = gather(self.repetition_penalties)
            # [B, longest prompt], padded with vocab_size (an id no token has), from the token rows.
            lens = num_prompt_tokens[idx]
            padded = token_ids[idx, :int(lens.max())]
            padded[np.arange(padded.shape[1]) >= lens[:, None]] = self.vocab_size
            prompt = torch.from_numpy(padded).to(device)
        max_lp = int(self.num_logprobs[idx].max()) if batch else -1

        # Sparse columns: metadata row i is batch row rows[i].
        generators, bad_words, bias, min_tokens_rows, allowed_any = {}, {}, [], [], False
        if any(self._sparse) or self.allowed_rows:  # a plain batch skips the loop
            for i, r in enumerate(rows):
                if r in self.generators:
                    generators[i] = self.generators[r]
                if r in self.bad_words_token_ids:
                    bad_words[i] = self.bad_words_token_ids[r]
                if r in self.logit_bias:
                    bias.extend((i, t, b) for t, b in self.logit_bias[r].items())
                if r in self.min_tokens:
                    min_tokens_rows.append((i, self.min_tokens[r]))
                allowed_any = allowed_any or r in self.allowed_rows
        allowed = self.allowed_token_ids_mask[torch.from_numpy(idx)].to(device) if allowed_any else None
        logit_bias = None
        if bias:
            r, c, v = zip(*bias)
            logit_bias = (torch.tensor(r, device=device), torch.tensor(c, device=device),
                          torch.tensor(v, dtype=torch.float32, device=device))
        md = SamplingMetadata(
            temperature=temperature, all_greedy=all_greedy, all_random=all_random,
            top_p=top_p, top_k=top_k, min_p=min_p, generators=generators,
            max_num_logprobs=None if max_lp < 0 else max_lp, no_penalties=no_penalties,
            prompt_token_ids=prompt, output_token_ids=[], presence_penalties=presence,
            frequency_penalties=frequency, repetition_penalties=repetition, min_tokens={},
            allowed_token_ids_mask=allowed, bad_words_token_ids=bad_words, logit_bias=logit_bias,
            token_bitmask=None)
        return _CachedMetadata(md, min_tokens_rows)
