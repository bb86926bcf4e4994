"""Structured outputs: what a grammar costs per engine step.

vLLM counterpart: `vllm/v1/structured_output/` (xgrammar backend); vLLM's
benchmark is `benchmarks/benchmark_serving_structured_output.py`.

Three measurements, best of N calls each (the CPU is shared):
1. the grammar work of one step for a batch of B constrained requests: feed
   each matcher the token sampled last step and fill its bitmask row
   (xgrammar's `GrammarMatcher`), for a JSON schema, a regex and a choice;
2. applying a [B, V / 32] bitmask to [B, V] logits: the sampler's pure
   PyTorch path (`unpack_token_bitmask` + masked_fill, used without xgrammar)
   against xgrammar's `apply_token_bitmask_inplace` (what the sampler calls
   when xgrammar is installed), at the tiny vocabulary (6,144) and Qwen3's
   (151,936);
3. the engine's decode step on the tiny target with 0, half and all of 16
   requests constrained by a JSON schema, as a ratio to the unconstrained step.
Also printed: the first compile of each constraint (the compiler caches it).
Run: .venv/bin/python benchmarks/bench_structured_outputs.py
"""
import json
import time

import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.sample.sampler import apply_token_bitmask, unpack_token_bitmask
from mini_vllm.sampling_params import StructuredOutputsParams as SO
from mini_vllm.structured_output import get_backend
from mini_vllm.course.tiny_models import load_tiny_tokenizer, model_path

SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}}}
CONSTRAINTS = {"json schema": SO(json=SCHEMA, disable_any_whitespace=True), "regex": SO(regex=r"[a-z_]{1,60}"),
               "choice (3)": SO(choice=["yes", "no", "maybe so"])}
BATCH = 16


def best_of(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def grammar_step_cost(backend, tok):
    print(f"1. grammar work per step, batch {BATCH} (advance one token + fill the bitmask row)")
    for name, so in CONSTRAINTS.items():
        t = time.perf_counter()
        compiled = backend.compile(SO(**{**so.__dict__}))  # a fresh object: the compiler cache still hits
        compile_s = time.perf_counter() - t
        grammars = [backend.new_grammar(so) for _ in range(BATCH)]
        bitmask = backend.allocate_bitmask(BATCH)
        # Walk every matcher a few tokens in: the first allowed token each time.
        for g in grammars:
            out = []
            for _ in range(4):
                g.advance(out)
                g.fill_bitmask(bitmask, 0)
                allowed = apply_token_bitmask(torch.zeros(1, backend.vocab_size), bitmask[:1])
                out.append(int(allowed[0].argmax()))
        assert compiled is not None

        def step():
            for j, g in enumerate(grammars):
                g.fill_bitmask(bitmask, j)

        print(f"   {name:12s} fill {best_of(step, 20) * 1e3:7.3f} ms   (first compile {compile_s * 1e3:.2f} ms)")


def apply_cost():
    import xgrammar as xgr

    print("2. applying the bitmask to the logits (batch 16)")
    for vocab in (6144, 151936):
        logits = torch.randn(BATCH, vocab)
        bitmask = torch.randint(-2**31, 2**31 - 1, (BATCH, -(-vocab // 32)), dtype=torch.int64).to(torch.int32)
        ours = best_of(lambda: logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf")), 20)
        theirs = best_of(lambda: apply_token_bitmask(logits, bitmask), 20)  # clone + xgrammar's kernel
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf")), want)
        print(f"   vocab {vocab:7d}: PyTorch unpacking {ours * 1e3:6.3f} ms, xgrammar kernel (with the clone) "
              f"{theirs * 1e3:6.3f} ms ({ours / theirs:.1f}x)")


def engine_step_cost():
    print(f"3. engine decode step, {BATCH} requests, tiny target (ratio to no constraint)")
    llm = LLM(str(model_path("tiny-py-target")), dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20,
              attention_backend="torch")
    eng = llm.llm_engine
    llm.generate(["def f(x):\n    return "] * BATCH, SamplingParams(max_tokens=8, seed=0), use_tqdm=False)  # warm-up
    base = None
    for n_constrained in (0, BATCH // 2, BATCH):
        sps = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True,
                              structured_outputs=CONSTRAINTS["json schema"] if i < n_constrained else None)
               for i in range(BATCH)]
        for i, sp in enumerate(sps):
            eng.add_request(f"{n_constrained}-{i}", "def f(x):\n    return ", sp)
        times = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        step = sorted(times[2:])[len(times[2:]) // 2]  # median decode step, prefill steps skipped
        base = base or step
        print(f"   {n_constrained:2d} constrained: {step * 1e3:6.2f} ms/step ({step / base:.2f}x)")


def main():
    torch.set_num_threads(2)
    tok = load_tiny_tokenizer()
    backend = get_backend(str(model_path("tiny-py-target")), 6144, tok)
    grammar_step_cost(backend, tok)
    apply_cost()
    engine_step_cost()


if __name__ == "__main__":
    main()
