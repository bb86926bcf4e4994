"""Hugging Face baselines on the workload: static batches and continuous batching.

vLLM counterpart: `benchmarks/benchmark_throughput.py --backend hf` (static
batches of HF `generate`). HF's own continuous batching (`init_continuous_batching`,
the manager behind `generate_batch`) runs too when the installed transformers has it.

Static batches: requests in workload order, left padded; a batch decodes
until its longest request is done (what static batching costs), and only the
tokens each request asked for count as output. Each batch size runs whole
batches until its time budget is spent (at least one), so tok/s comes from
the requests covered, which are listed.
"""
from __future__ import annotations

import inspect
import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def static_batches(hf, reqs, batch_size: int, budget_s: float, device: str) -> dict:
    done = useful = 0
    start = time.perf_counter()
    try:
        for i in range(0, len(reqs), batch_size):
            if i and time.perf_counter() - start >= budget_s:
                break
            chunk = reqs[i:i + batch_size]
            width, n = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, top_k=None, top_p=None, temperature=None, pad_token_id=0)
            _sync(device)
            done += len(chunk)
            useful += sum(m for _, m in chunk)
    except torch.cuda.OutOfMemoryError:  # the name older PyTorch versions also have
        return {"batch_size": batch_size, "status": "out of memory", "requests": done}
    seconds = time.perf_counter() - start
    return {"batch_size": batch_size, "status": "ok", "requests": done, "output_tokens": useful,
            "seconds": seconds, "tok_per_s": useful / seconds}


def _kwargs_known(fn, **kw) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


@torch.inference_mode()
def continuous_batching(hf, reqs, budget_s: float, small: bool) -> dict:
    """HF's continuous batching with each request's own max_new_tokens; stops
    collecting after `budget_s` (then tok/s counts finished requests only: a lower bound)."""
    if not hasattr(hf, "init_continuous_batching"):
        return {"status": "not available in this transformers"}
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(m for _, m in reqs))
    extra = {}
    if small:  # HF sizes its cache from free memory by default: on a CPU host that is many GiB
        from transformers import ContinuousBatchingConfig

        extra["continuous_batching_config"] = ContinuousBatchingConfig(
            **_kwargs_known(ContinuousBatchingConfig, num_blocks=64, max_batch_tokens=128))
    manager = hf.init_continuous_batching(**_kwargs_known(hf.init_continuous_batching, generation_config=gen,
                                                          **extra))
    manager.start()
    start = time.perf_counter()
    tokens = finished = 0
    wrong_length = []
    try:
        ids = {manager.add_request(p, request_id=f"r{i}", max_new_tokens=m): m for i, (p, m) in enumerate(reqs)}
        while finished < len(reqs):
            left = budget_s - (time.perf_counter() - start)
            if left <= 0:
                break
            out = manager.get_result(timeout=min(left, 5.0))
            if out is None or not getattr(out, "is_finished", lambda: True)():
                continue
            n = len(out.generated_tokens)
            tokens += n
            finished += 1
            if n != ids.get(out.request_id, n):
                wrong_length.append(out.request_id)
    finally:
        manager.stop(**_kwargs_known(manager.stop, block=True, timeout=30))
    seconds = time.perf_counter() - start
    return {"status": "ok" if finished == len(reqs) else "partial (lower bound)", "requests": finished,
            "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "requests_with_wrong_length": wrong_length}
