"""Chapter 5 benchmark: the engine sampler's fast paths against Chapter 4's sampling.

Batch 16 at vocab 6,144 (the course's tiny models) and 151,936 (Qwen3), with
flat (3 * N(0, 1): a nucleus of thousands of tokens, wider than the sampler's
1,024 top-p candidates) and peaked (6 * N(0, 1): a nucleus of a few) logits; four
batches: all greedy, all random without filters, top-k 50, top-p 0.9. Three
ways to sample one token per row:
- engine `Sampler` (argmax only when greedy, no sort without filters, topk for top-k)
- Chapter 4 `logits_to_probs` + exponential race as it is now (skips the sort when no row filters)
- Chapter 4 as first written: always `apply_top_k_top_p_pytorch` (a full sort) + softmax + race
Before timing, greedy results are checked equal across paths and each path's
tokens are checked to lie in the filtered set. Best of N single calls
(the CPU is shared), torch.set_num_threads(2).
Run: .venv/bin/python benchmarks/bench_engine_sampler.py
"""
import time

import torch

from mini_vllm.sample.sampler import Sampler
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.random_draws import generate_exponential_noise
from mini_vllm.spec_decode.sampling import (TemperatureTopKTopP, apply_top_k_top_p_pytorch, logits_to_probs,
                                            sample_from_probs)

BATCH = 16
CASES = {  # name: (engine params, Chapter 4 temperature, top_k, top_p)
    "all greedy": (dict(temperature=0.0), 0.0, 0, 1.0),
    "random, no filter": (dict(temperature=0.8), 0.8, 0, 1.0),
    "top-k 50": (dict(temperature=0.8, top_k=50), 0.8, 50, 1.0),
    "top-p 0.9": (dict(temperature=0.8, top_p=0.9), 0.8, 0, 0.9),
}


def best_of(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ch4_now(logits, meta):
    probs = logits_to_probs(logits, meta)
    noise = generate_exponential_noise(logits.shape[0], logits.shape[1])
    return torch.where(meta.is_greedy, probs.argmax(-1), sample_from_probs(probs, noise))


def ch4_always_sort(logits, meta):
    greedy = meta.is_greedy
    temp = torch.where(greedy, 1.0, meta.temperature)
    probs = apply_top_k_top_p_pytorch(logits / temp[:, None], meta.top_k, meta.top_p).softmax(-1)
    noise = generate_exponential_noise(logits.shape[0], logits.shape[1])
    return torch.where(greedy, probs.argmax(-1), sample_from_probs(probs, noise))


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    sampler = Sampler()
    for vocab, scale in ((6_144, 3.0), (151_936, 3.0), (151_936, 6.0)):
        repeats = 30 if vocab < 10_000 else 8
        logits = scale * torch.randn(BATCH, vocab)
        ch4_top_p = TemperatureTopKTopP.make([0.8] * BATCH, None, [0.9] * BATCH)
        nucleus = int((logits_to_probs(logits, ch4_top_p) > 0).sum(1).median())
        print(f"batch {BATCH}, vocab {vocab:,}, logits {scale} * N(0, 1) (top-p 0.9 keeps ~{nucleus} tokens) "
              f"(ms, best of {repeats}, engine {3 * repeats}; ratio = Chapter 4 time / engine time)")
        print(f"  {'case':<18} {'engine':>8} {'ch4 now':>9} {'ch4 sort':>9} {'x now':>7} {'x sort':>7}")
        for name, (params, temp, k, p) in CASES.items():
            md = SamplingMetadata.from_params([SamplingParams(**params)] * BATCH, [[0]] * BATCH,
                                              [[] for _ in range(BATCH)], [None] * BATCH, [None] * BATCH, vocab)
            meta = TemperatureTopKTopP.make([temp] * BATCH, [k] * BATCH, [p] * BATCH)
            got = [sampler(logits, md).sampled_token_ids, ch4_now(logits, meta), ch4_always_sort(logits, meta)]
            allowed = logits_to_probs(logits, meta) > 0
            for tokens in got:
                assert bool(allowed.gather(1, tokens[:, None]).all()), f"{name}: a token outside the filtered set"
            if temp == 0.0:
                assert all(torch.equal(got[0], t) for t in got[1:]), "greedy paths disagree"
            t_eng = best_of(lambda: sampler(logits, md), 3 * repeats)  # cheap: more tries against noise
            t_now = best_of(lambda: ch4_now(logits, meta), repeats)
            t_sort = best_of(lambda: ch4_always_sort(logits, meta), repeats)
            print(f"  {name:<18} {t_eng * 1e3:8.3f} {t_now * 1e3:9.3f} {t_sort * 1e3:9.3f} "
                  f"{t_now / t_eng:7.1f} {t_sort / t_eng:7.1f}")
    params = [SamplingParams(temperature=0.0)] * BATCH
    t_md = best_of(lambda: SamplingMetadata.from_params(params, [[0]] * BATCH, [[]] * BATCH, [None] * BATCH,
                                                        [None] * BATCH, 6_144), 200)
    print(f"SamplingMetadata.from_params, {BATCH} greedy rows: {t_md * 1e6:.1f} us")


if __name__ == "__main__":
    main()
