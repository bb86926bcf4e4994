"""Prompt logprobs: the log-probability of every prompt token under the model.

vLLM counterpart: `GPUModelRunner._get_prompt_logprobs_dict` in
`vllm/v1/worker/gpu_model_runner.py`: filled chunk by chunk as the prompt is
computed, sent once, on the step that completes the prompt.
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.sample.sampler import gather_logprobs


def prompt_logprobs_dict(model, requests: dict, hidden, req_ids: list[str], md) -> dict:
    """Log-softmax of the raw logits at every prompt row of this step, for
    requests with prompt_logprobs. Row p predicts prompt token p + 1, so a
    prompt of P tokens has P - 1 entries; the chunk starting at position s
    with q tokens fills entries s .. min(s + q, P - 1) - 1. Raw logits, as
    vLLM's default logprobs mode: no temperature or penalty applies to a
    prompt. A request preempted mid-prompt recomputes and rewrites the same
    entries."""
    out, start_row = {}, 0
    for i, rid in enumerate(req_ids):
        q = md.query_lens_cpu[i]
        row0, start_row = start_row, start_row + q
        st = requests[rid]
        k = st.sampling_params.prompt_logprobs
        if k is None or st.prompt_logprobs_sent:
            continue
        n_prompt = len(st.prompt_token_ids)
        start = md.seq_lens_cpu[i] - q  # tokens computed before this step
        if st.prompt_logprobs_in_progress is None:
            st.prompt_logprobs_in_progress = (np.zeros((n_prompt - 1, k + 1), np.int64),
                                              np.zeros((n_prompt - 1, k + 1), np.float32),
                                              np.zeros(n_prompt - 1, np.int64))
        n = min(q, n_prompt - 1 - start)
        if n > 0:
            logits = model.compute_logits(hidden[row0:row0 + n])
            targets = torch.tensor(st.prompt_token_ids[start + 1:start + 1 + n], device=logits.device)
            lp = gather_logprobs(logits.float().log_softmax(dim=-1), k, targets)
            ids, vals, ranks = st.prompt_logprobs_in_progress
            ids[start:start + n] = lp.logprob_token_ids.cpu().numpy()
            vals[start:start + n] = lp.logprobs.cpu().numpy()
            ranks[start:start + n] = lp.selected_token_ranks.cpu().numpy()
        if start + q >= n_prompt:  # the prompt is complete: this step samples its first token
            out[rid] = tuple(a.tolist() for a in st.prompt_logprobs_in_progress)
            st.prompt_logprobs_in_progress, st.prompt_logprobs_sent = None, True
    return out
