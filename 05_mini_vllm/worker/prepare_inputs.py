"""Turn one step's schedule into the flat tensors of a varlen forward pass.

vLLM counterpart: `GPUModelRunner._prepare_inputs` in
`vllm/v1/worker/gpu_model_runner.py` (and `BlockTable.compute_slot_mapping` in
`vllm/v1/worker/block_table.py`). Everything is vectorised with numpy over the
T scheduled tokens: no Python loop per token or per request.

For the i-th scheduled request with c_i tokens already computed and Δ_i
scheduled this step (seed 001 §4.4.2, Table 4.1):
* its query rows are cu[i]:cu[i+1] with cu = [0, cumsum(Δ)] (query_start_loc);
* its token positions are c_i, c_i + 1, ..., c_i + Δ_i - 1;
* the KV of position p goes to slot block_table[i][p // B] * B + p % B;
* attention reads seq_len_i = c_i + Δ_i keys.
"""
from __future__ import annotations

import numpy as np


def compute_query_start_loc(num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[num_reqs + 1] int32: 0, then the running sum of Δ (a request's rows start there)."""
    out = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_tokens, out=out[1:])
    return out


def compute_positions(num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """[T] int64: the absolute position of every scheduled token, request by request."""
    num_scheduled_tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    total = int(num_scheduled_tokens.sum())
    starts = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens  # first row of each request
    req_indices = np.repeat(np.arange(len(num_scheduled_tokens)), num_scheduled_tokens)
    offsets = np.arange(total, dtype=np.int64) - starts[req_indices]  # 0..Δ_i - 1 within a request
    return np.asarray(num_computed_tokens, dtype=np.int64)[req_indices] + offsets


def compute_slot_mapping(block_table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """[T] int64: the cache slot of every scheduled token.

    block_table [num_reqs, max_blocks] (row i is the i-th scheduled request's
    table), req_indices [T] (which row each token belongs to), positions [T].
    """
    block_numbers = block_table[req_indices, positions // block_size].astype(np.int64)
    return block_numbers * block_size + positions % block_size
