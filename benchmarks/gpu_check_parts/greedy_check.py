"""Are the engine's greedy tokens HF's, on the first requests of the workload?

No vLLM counterpart file (vLLM's tests/models/utils.py `check_logprobs_close`
asks the same question of two bf16 runs).

With random bf16 weights, the top two logits of a step are often closer than
bf16 rounding, so two correct implementations part ways after a few tokens.
Two measures, then:

* exact: the number of leading tokens equal to HF `generate` (bf16, batch 1,
  unpadded), over the first `greedy_exact_tokens` of each request;
* tie-aware (the pass/fail rule): HF in fp32 reads the prompt plus the
  engine's whole output in one forward pass; at every generated position the
  engine's token must be within `2 * noise` of the fp32 maximum logit, where
  `noise` is HF's own bf16 error on the same positions (max |bf16 - fp32|
  logit). HF bf16's own argmax always passes this rule (its token beats the
  maximum in bf16, so in fp32 it trails by at most its two errors); an engine
  that attends to a wrong slot or mask does not.
"""
from __future__ import annotations

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tie_aware_gaps(ref_logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Per position: max fp32 logit minus the fp32 logit of the token chosen (>= 0)."""
    chosen = ref_logits.gather(-1, torch.tensor(tokens, device=ref_logits.device)[:, None])[:, 0]
    return ref_logits.max(-1).values - chosen


def passes(gaps: torch.Tensor, noise: float) -> bool:
    """The rule: no chosen token trails the fp32 maximum by more than HF bf16's own two errors."""
    return bool(gaps.max().item() <= 2 * noise)


@torch.inference_mode()
def check(hf_bf16, hf_fp32, reqs, engine_tokens, n_requests: int, n_exact: int, device: str) -> dict:
    rows = []
    for (prompt, _), got in list(zip(reqs, engine_tokens))[:n_requests]:
        ids = torch.tensor([prompt], device=device)
        k = min(n_exact, len(got))
        want = hf_bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                                do_sample=False, top_k=None, top_p=None, temperature=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        seq = torch.tensor([prompt + list(got)], device=device)
        at = slice(len(prompt) - 1, len(prompt) - 1 + len(got))  # logits that chose each output token
        ref = hf_fp32(seq).logits[0, at].float()
        noise = (hf_bf16(seq).logits[0, at].float() - ref).abs().max().item()
        gaps = tie_aware_gaps(ref, list(got))
        worst = gaps.max().item()
        rows.append({"prompt_len": len(prompt), "output_len": len(got), "exact_prefix": common_prefix(got, want),
                     "exact_of": k, "max_gap": worst, "hf_bf16_noise": noise, "ok": passes(gaps, noise)})
        del ref, gaps
    return {"requests": rows, "ok": all(r["ok"] for r in rows)}
