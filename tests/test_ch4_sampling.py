"""Chapter 4: temperature / top-k / top-p processing against a per-row oracle."""
import math

import torch
from hypothesis import given, strategies as st


def oracle_probs(logits, temperature, top_k, top_p):
    """Plain-Python processing of one row (lists, no vectorisation)."""
    vocab = len(logits)
    if temperature == 0:
        temperature, top_k, top_p = 1.0, 0, 1.0
    scaled = [x / temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: -scaled[i])  # stable: ties keep index order
    keep = order[: top_k] if 0 < top_k < vocab else order
    m = max(scaled[i] for i in keep)
    z = sum(math.exp(scaled[i] - m) for i in keep)
    mass, final = 0.0, []
    for i in keep:
        if final and mass >= top_p:
            break
        final.append(i)
        mass += math.exp(scaled[i] - m) / z
    m = max(scaled[i] for i in final)
    z = sum(math.exp(scaled[i] - m) for i in final)
    return [math.exp(scaled[i] - m) / z if i in final else 0.0 for i in range(vocab)]


@given(st.integers(1, 20), st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 25),
       st.sampled_from([0.1, 0.5, 0.9, 1.0]), st.integers(0, 2**31 - 1))
def test_logits_to_probs_matches_oracle(chapter, vocab, temperature, top_k, top_p, seed):
    sd = chapter("spec_decode")
    # Distinct logits so that sort-order ties cannot make the oracle and the code disagree.
    logits = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).float() * 0.37
    sampling = sd.TemperatureTopKTopP.make([temperature], [top_k], [top_p])
    got = sd.logits_to_probs(logits[None], sampling)[0]
    want = torch.tensor(oracle_probs(logits.tolist(), temperature, top_k, top_p))
    assert torch.allclose(got, want, atol=1e-5), f"processed probabilities differ from the oracle:\n{got}\n{want}"
    assert ((got > 0) == (want > 0)).all(), "the kept top-k/top-p set differs from the oracle"


def test_per_request_rows_expand(chapter):
    sd = chapter("spec_decode")
    logits = torch.randn(5, 6)
    sampling = sd.TemperatureTopKTopP.make([0.0, 0.5], [0, 2], [1.0, 1.0])
    probs = sd.logits_to_probs(logits, sampling, torch.tensor([2, 3]))
    assert torch.allclose(probs[:2], logits[:2].softmax(-1)), "greedy rows keep the raw softmax"
    assert ((probs[2:] > 0).sum(-1) == 2).all(), "top_k = 2 must keep exactly two tokens per row"
