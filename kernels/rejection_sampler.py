"""Triton rejection sampler for speculative decoding.

vLLM counterpart: `rejection_greedy_sample_kernel`, `rejection_random_sample_kernel`
and `sample_recovered_tokens_kernel` in `vllm/v1/sample/rejection_sampler.py`,
fused here into one kernel.

Same contract, same draws and same output as the PyTorch versions in
`mini_vllm.spec_decode.rejection_sampler` (see that module's docstring):
output [B, max_k + 1] int64, -1 after the first rejection.

Grid: one program per request, `(batch,)`. The accept walk is sequential
*within* a request (position i matters only if positions < i were accepted) but
independent *across* requests, so a request is the natural unit of work. Each
program loops over its draft positions and stops doing work after the first
rejection; the vocabulary (argmax for greedy, recovery for random) is scanned
in BLOCK_V chunks so any vocabulary size fits. All arithmetic is fp32, with the
same operations as the PyTorch versions (`u * q(x) < p(x)`,
`max(p - q, 0) * RESIDUAL_SCALE / noise`) so the results agree exactly; argmax
ties go to the lowest index, as torch's. The exact 2**64 scale keeps a
denormal residual's ratio from rounding to 0 (see the PyTorch module).
"""
from __future__ import annotations

import torch

from .triton_setup import require_triton_mode

require_triton_mode(__name__)  # before triton is first imported: see triton_setup.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PLACEHOLDER_TOKEN_ID = -1
# Same value as `mini_vllm.spec_decode.rejection_sampler.RESIDUAL_SCALE`
# (kernels may not import from chapters; the tests compare the two outputs).
RESIDUAL_SCALE = 2.0 ** 64


@triton.jit
def _row_argmax(probs_ptr, row, vocab, BLOCK_V: tl.constexpr):
    best_val = -1.0
    best_idx = 0
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(probs_ptr + row + offs, mask=offs < vocab, other=-1.0)
        m = tl.max(p, axis=0)
        i = tl.argmax(p, axis=0) + v0
        better = m > best_val  # strict: an earlier block wins ties, like torch.argmax
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    return best_idx


@triton.jit
def _recover(target_ptr, draft_probs_ptr, noise_ptr, row, noise_row, x, vocab,
             HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """argmax(max(p - q, 0) * SCALE / noise), or argmax(p * SCALE / noise) if
    the residual is all zero. SCALE = 2**64 (exact) lifts denormal residuals."""
    best_r = -1.0
    idx_r = 0
    best_p = -1.0
    idx_p = 0
    max_res = 0.0
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        p = tl.load(target_ptr + row + offs, mask=mask, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + row + offs, mask=mask, other=0.0)
        else:
            q = tl.where(offs == x, 1.0, 0.0)
        res = tl.maximum(p - q, 0.0)
        e = tl.load(noise_ptr + noise_row + offs, mask=mask, other=1.0)
        s_r = tl.where(mask, res * 18446744073709551616.0 / e, -1.0)  # RESIDUAL_SCALE
        s_p = tl.where(mask, p * 18446744073709551616.0 / e, -1.0)
        m_r = tl.max(s_r, axis=0)
        i_r = tl.argmax(s_r, axis=0) + v0
        m_p = tl.max(s_p, axis=0)
        i_p = tl.argmax(s_p, axis=0) + v0
        better_r = m_r > best_r
        idx_r = tl.where(better_r, i_r, idx_r)
        best_r = tl.where(better_r, m_r, best_r)
        better_p = m_p > best_p
        idx_p = tl.where(better_p, i_p, idx_p)
        best_p = tl.where(better_p, m_p, best_p)
        max_res = tl.maximum(max_res, tl.max(res, axis=0))
    return tl.where(max_res > 0.0, idx_r, idx_p)


@triton.jit
def _rejection_sample_kernel(
    out_ptr, out_stride, draft_ptr, start_ptr, num_draft_ptr, draft_probs_ptr, target_ptr,
    bonus_ptr, greedy_ptr, uniform_ptr, noise_ptr, vocab,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(start_ptr + b)
    k = tl.load(num_draft_ptr + b)
    greedy = tl.load(greedy_ptr + b)
    out_row = out_ptr + b.to(tl.int64) * out_stride
    noise_row = b.to(tl.int64) * vocab
    rejected = 0
    for i in range(0, k):
        if rejected == 0:
            t = start + i
            x = tl.load(draft_ptr + t)
            row = t.to(tl.int64) * vocab
            if greedy != 0:
                tok = _row_argmax(target_ptr, row, vocab, BLOCK_V).to(tl.int64)
                if tok != x:
                    tl.store(out_row + i, tok)
                    rejected = 1
                else:
                    tl.store(out_row + i, x)
            else:
                p_x = tl.load(target_ptr + row + x)
                if HAS_DRAFT_PROBS:
                    q_x = tl.load(draft_probs_ptr + row + x)
                else:
                    q_x = 1.0
                u = tl.load(uniform_ptr + t)
                if u * q_x < p_x:
                    tl.store(out_row + i, x)
                else:
                    tok = _recover(target_ptr, draft_probs_ptr, noise_ptr, row, noise_row, x, vocab,
                                   HAS_DRAFT_PROBS, BLOCK_V).to(tl.int64)
                    tl.store(out_row + i, tok)
                    rejected = 1
    if rejected == 0:
        tl.store(out_row + k, tl.load(bonus_ptr + b))


def rejection_sample_triton(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise,
    block_v: int = 1024,
) -> torch.Tensor:
    """Launch the kernel. Inputs as in `mini_vllm.spec_decode.rejection_sample`;
    the full argument checks live there (`validate_rejection_inputs`); this
    launcher checks only what memory safety needs."""
    if target_probs.dim() != 2 or recovery_noise.dim() != 2:
        raise ValueError("target_probs and recovery_noise must be 2-D [rows, vocab]")
    batch, vocab = num_draft_tokens.shape[0], target_probs.shape[1]
    total = draft_token_ids.shape[0]
    if int(num_draft_tokens.sum()) != total or target_probs.shape[0] != total:
        raise ValueError("num_draft_tokens must sum to len(draft_token_ids) == target_probs rows")
    if tuple(recovery_noise.shape) != (batch, vocab):
        raise ValueError(f"recovery_noise must have shape {(batch, vocab)}, got {tuple(recovery_noise.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != tuple(target_probs.shape):
        raise ValueError("draft_probs must have the shape of target_probs")
    if total and (int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= vocab):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab})")
    device = target_probs.device
    max_k = int(num_draft_tokens.max()) if batch else 0
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    num = num_draft_tokens.to(device=device, dtype=torch.int32)
    starts = (torch.cumsum(num, 0) - num).to(torch.int32)
    # A dummy one-element buffer stands in for empty inputs so no pointer is null.
    drafts = draft_token_ids.to(device=device, dtype=torch.int64).contiguous() if total else torch.zeros(1, dtype=torch.int64, device=device)
    target = target_probs.float().contiguous() if total else torch.zeros(1, vocab, device=device)
    uniform = uniform_probs.float().contiguous() if total else torch.zeros(1, device=device)
    dprobs = target if draft_probs is None else (draft_probs.float().contiguous() if total else target)
    block_v = min(block_v, triton.next_power_of_2(vocab))
    _rejection_sample_kernel[(batch,)](
        out, out.stride(0), drafts, starts, num, dprobs, target,
        bonus_token_ids.to(device=device, dtype=torch.int64).contiguous(),
        is_greedy.to(device=device, dtype=torch.int32).contiguous(), uniform,
        recovery_noise.float().contiguous(), vocab,
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v,
    )
    return out
