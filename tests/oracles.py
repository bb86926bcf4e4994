"""Independent oracles that the chapters are checked against.

They use contiguous tensors and the textbook formulas only, never the code under
test, so a bug in paging cannot hide in both sides.
"""
from __future__ import annotations

import math

import torch


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention for one sequence from contiguous K/V, in float64.

    q: [q_len, num_heads, head_dim], the LAST q_len positions of the sequence.
    k, v: [seq_len, num_kv_heads, head_dim], positions 0..seq_len-1.
    Query t (0-based within q) sits at position seq_len - q_len + t and sees
    keys 0..that position. Returns [q_len, num_heads, head_dim] in q's dtype.
    """
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf, kf, vf = q.double(), k.double(), v.double()
    kf = kf.repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
    vf = vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)


def filtered_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The sampler's processed distribution in plain Python floats (float64, no torch).

    Order as vLLM: temperature, min-p (p >= min_p * max p), top-k (every token
    >= the k-th largest probability: ties kept), renormalise, top-p (keep a
    token iff the mass strictly more likely than it is < top_p), renormalise.
    """
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    p = [x / sum(p) for x in p]
    keep = [x >= min_p * max(p) for x in p]
    if 0 < top_k < len(p):
        kth = sorted((x for x, k in zip(p, keep) if k), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and x >= kth for x, k in zip(p, keep)]
    s = sum(x for x, k in zip(p, keep) if k)
    q = [x / s if k else 0.0 for x, k in zip(p, keep)]
    if top_p < 1.0:
        q = [x if sum(y for y in q if y > x) < top_p else 0.0 for x in q]
        q = [x / sum(q) for x in q]
    return q
