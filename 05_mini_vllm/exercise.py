"""Chapter 5 exercise.

Fill in the stubs, then run the chapter's tests against them with
    .venv/bin/pytest -q tests/test_ch5_*.py --impl=exercise
Reference answers live in the modules named in each hint; read them after.
"""
from __future__ import annotations

import numpy as np
import torch

# ---- sampler filters ----
# Counterpart of mini_vllm/ops_topk_topp.py (vLLM: vllm/v1/sample/ops/topk_topp_sampler.py).
# Both functions take logits [B, V] float32 and per-row parameters [B], and return
# logits [B, V] where every dropped token is -inf and every kept token keeps its value.


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask each row's logits outside its top-k and top-p sets with -inf."""
    raise NotImplementedError(
        "apply_top_k_top_p: for each row b, first top-k, then top-p on what top-k kept. "
        "top-k: keep every token whose logit is >= the k-th largest logit of the row (ties with the k-th "
        "are ALL kept); top_k[b] == 0, == -1 or >= vocab keeps the whole row; top_k=None means no row uses it. "
        "top-p: renormalise the top-k survivors with softmax; keep a token iff the total probability of the "
        "tokens STRICTLY more likely than it is < top_p[b] (so equally likely tokens are kept or dropped "
        "together, and the most likely token always stays); top_p[b] == 1.0 keeps the whole row "
        "(do not let rounding in a cumulative sum drop the tail); top_p=None means no row uses it. "
        "Return a new tensor (the tests compare it with -inf masks built by hand) and raise ValueError "
        "if logits is not 2-D or top_k/top_p do not have shape [B]. Hint: sort one row's values in "
        "descending order, find the last kept position, and keep every logit >= the value there."
    )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    raise NotImplementedError(
        "apply_min_p: with p = softmax(logits[b]), keep token v iff p[v] >= min_p[b] * max(p) and set the "
        "others to -inf; min_p[b] == 0 keeps the whole row, min_p[b] == 1 keeps only the top token(s) (ties "
        "with the maximum all stay). Return a new tensor; raise ValueError if logits is not 2-D or min_p "
        "does not have shape [B]. Hint: p[v] / max(p) = exp(logits[v] - max(logits)), so no softmax is needed."
    )


# ---- runner inputs ----
# Counterpart of mini_vllm/prepare_inputs.py (vLLM: GPUModelRunner._prepare_inputs in
# vllm/v1/worker/gpu_model_runner.py). All three are vectorised numpy over the batch:
# the tests give batches of up to thousands of tokens and check every element.


def compute_query_start_loc(num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[num_reqs + 1] int32: where each request's query rows start in the flat batch."""
    raise NotImplementedError(
        "compute_query_start_loc: given Δ = num_scheduled_tokens [num_reqs] (ints >= 1), return an int32 "
        "array [num_reqs + 1] equal to [0, Δ0, Δ0+Δ1, ...]: request i owns rows out[i]:out[i+1]. "
        "An empty batch gives [0]. Hint: np.cumsum into out[1:]."
    )


def compute_positions(num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[T] int64: the absolute token position of every scheduled token."""
    raise NotImplementedError(
        "compute_positions: request i has c_i = num_computed_tokens[i] tokens in the KV cache already and "
        "Δ_i = num_scheduled_tokens[i] scheduled now; its rows hold positions c_i, c_i+1, ..., c_i+Δ_i-1, "
        "requests one after another (T = sum Δ). A decode is Δ=1 at position c_i; a prefix hit or a later "
        "chunk starts at c_i > 0, never at 0. Return int64. No Python loop over tokens: np.repeat the "
        "request index Δ_i times, then subtract each request's first row from np.arange(T)."
    )


def compute_slot_mapping(block_table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """[T] int64: the KV cache slot of every scheduled token."""
    raise NotImplementedError(
        "compute_slot_mapping: token t belongs to request req_indices[t] (a row of block_table "
        "[num_reqs, max_blocks], int32, padded with -1) and sits at positions[t]; its slot is "
        "block_table[r, p // block_size] * block_size + p % block_size (Chapter 1's slot mapping, "
        "for a whole batch at once). Return int64 (slots overflow int32 on big caches). One fancy-index, "
        "no loop."
    )


__all__ = ["apply_min_p", "apply_top_k_top_p", "compute_positions", "compute_query_start_loc",
           "compute_slot_mapping"]
