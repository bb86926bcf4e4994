"""What an fp8 KV cache costs in accuracy: each kv_cache_dtype against the unquantized engine,
on the course's own models and held-out corpus.

    .venv/bin/python benchmarks/fp8_kv_accuracy.py            # the table (a few minutes)

Per KV-cache mode (vLLM's `kv_cache_dtype` "fp8_e4m3" / "fp8_e5m2", with scale 1.0, vLLM's
default, or with `calculate_kv_scales`), through the engine, the model's weights and dtype
unchanged, against `kv_cache_dtype="auto"`; the same measures as `quant_accuracy.py`
(greedy agreement, teacher-forced top-1 agreement, largest top-1 logprob gap, held-out
perplexity), on the same held-out windows and prompts. Every position of a teacher-forced
window reads its keys and values back from the fp8 cache (the backends write the step's
K/V first, then attend over the cache), so the prompt logprobs carry the quantization.

`tests/test_ch5_fp8_kv_cache.py` runs `measure` on a smaller sample and holds each mode to
thresholds derived from this script's output (written beside them there).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_accuracy import COMMON, GEN_PROMPTS, GEN_TOKENS, SEQ, WINDOWS, compare, gen_prompts, heldout_windows  # noqa: E402

# name -> engine arguments of the KV cache
MODES = {
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
    "fp8_e4m3 calculated scales": dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True),
    "fp8_e5m2 calculated scales": dict(kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True),
}


def run_engine(model: str, dtype: str, kv: dict, windows, prompts, gen_tokens: int,
               attention_backend: str | None = None) -> dict:
    """Teacher-forced top-1 tokens and logprobs, actual-token logprobs, greedy generations."""
    from mini_vllm import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, attention_backend=attention_backend, **COMMON, **kv)
    # Greedy generations first: with calculated scales, the first prefill sets them, so both
    # halves of the measure read the same scales in every run.
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    scored = llm.generate([{"prompt_token_ids": w} for w in windows],
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    top1, actual = [], []
    for w, out in zip(windows, scored):
        for pos, lps in enumerate(out.prompt_logprobs[1:], start=1):
            best = min(lps.items(), key=lambda kv_: kv_[1].rank)
            top1.append((best[0], best[1].logprob))
            actual.append(lps[w[pos]].logprob)
    del llm
    return {"top1": top1, "actual": actual, "gen": [list(o.outputs[0].token_ids) for o in gen]}


def measure(model: str, dtype: str, modes, windows: int = WINDOWS, seq: int = SEQ, prompts: int = GEN_PROMPTS,
            gen_tokens: int = GEN_TOKENS, attention_backend: str | None = None) -> dict[str, dict]:
    """{mode: compare(auto, mode)} for one checkpoint and dtype; `modes` are names of MODES."""
    w, p = heldout_windows(windows, seq), gen_prompts(prompts)
    ref = run_engine(model, dtype, {}, w, p, gen_tokens, attention_backend)
    return {m: compare(ref, run_engine(model, dtype, MODES[m], w, p, gen_tokens, attention_backend)) for m in modes}


def main() -> None:
    import torch
    from mini_vllm.course.tiny_models import model_path
    from machine import machine_line
    torch.set_num_threads(1)
    print(machine_line((1,)))
    print(f"held-out: {WINDOWS} windows x {SEQ} tokens; greedy: {GEN_PROMPTS} prompts x {GEN_TOKENS} tokens; "
          "against kv_cache_dtype='auto' in the same dtype")
    print("| model | dtype | kv cache | greedy agreement | top-1 agreement | largest top-1 logprob gap "
          "| perplexity (auto) |")
    print("|---|---|---|---|---|---|---|")
    for name in ("tiny-py-target", "tiny-py-draft"):
        for dtype in ("float32", "bfloat16"):
            for mode, r in measure(str(model_path(name)), dtype, list(MODES)).items():
                print(f"| {name} | {dtype} | {mode} | {r['greedy_agreement']:.3f} | {r['top1_agreement']:.4f} | "
                      f"{r['top1_logprob_gap']:.3f} | {r['ppl']:.3f} ({r['ppl_ref']:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
