"""Token position -> physical cache slot.

vLLM counterpart: `BlockTable.compute_slot_mapping` in
`vllm/v1/worker/block_table.py`. A slot is a flat index into the cache viewed
as [num_blocks * block_size, ...]:

    slot = block_tables[req, pos // block_size] * block_size + pos % block_size

Invariant: the result never depends on a -1 (padding) table entry; asking for
one is a ValueError rather than a silent wrap-around.

Chapter 5's engine computes the same mapping under the same name on host numpy
arrays (`worker/prepare_inputs.py`), without these checks: its scheduler has
allocated every block it schedules, and the checks would cost every step.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.validation import check_tensor

from .checks import INDEX_DTYPES


def compute_slot_mapping(block_tables, req_indices, positions, block_size: int) -> torch.Tensor:
    """block_tables [num_reqs, max_blocks] int32; req_indices, positions [num_tokens].
    Returns int64 [num_tokens]."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    check_tensor("req_indices", req_indices, ndim=1, dtypes=INDEX_DTYPES, device=block_tables.device)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=block_tables.device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if req_indices.shape != positions.shape:
        raise ValueError(f"req_indices shape {tuple(req_indices.shape)} must equal positions shape {tuple(positions.shape)}")
    num_reqs, max_blocks = block_tables.shape
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=block_tables.device)
    if int(req_indices.min()) < 0 or int(req_indices.max()) >= num_reqs:
        raise ValueError(f"req_indices must be in [0, {num_reqs}), got range "
                         f"[{int(req_indices.min())}, {int(req_indices.max())}]")
    if int(positions.min()) < 0 or int(positions.max()) >= max_blocks * block_size:
        raise ValueError(f"positions must be in [0, max_blocks * block_size = {max_blocks * block_size}), "
                         f"got range [{int(positions.min())}, {int(positions.max())}]")
    req = req_indices.long()
    pos = positions.long()
    block_ids = block_tables[req, pos // block_size].long()
    if int(block_ids.min()) < 0:
        t = int((block_ids < 0).nonzero()[0])
        raise ValueError(f"block_tables has no block (entry -1) for request {int(req[t])} "
                         f"position {int(pos[t])}: allocate it before computing its slot")
    return block_ids * block_size + pos % block_size
