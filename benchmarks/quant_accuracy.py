"""What 8-bit weights cost in accuracy: each quantization mode against the unquantized engine,
on the course's own models and held-out corpus.

    .venv/bin/python benchmarks/quant_accuracy.py            # the table (about a minute)

Per mode, through the engine (`LLM`), the same dtype as the unquantized run:
* greedy agreement: generations of GEN_TOKENS tokens from GEN_PROMPTS corpus prompts; the
  fraction of generated tokens before the first token that differs from the unquantized
  engine's (1.0: every continuation identical);
* top-1 agreement and the largest top-1 logprob gap, teacher-forced: on WINDOWS held-out
  windows of SEQ tokens (the `val` files, which no training step saw), `prompt_logprobs`
  gives each position's most likely token and its logprob; agreement is the fraction of
  positions whose most likely token is the same, the gap the largest |difference| of the
  top-1 logprobs;
* perplexity of the held-out windows: exp(-mean logprob of the actual next tokens).

`tests/test_ch5_quant_weights.py` runs `measure` on a smaller sample and holds each mode
to thresholds derived from this script's output (written beside them there).
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WINDOWS, SEQ = 8, 256
GEN_PROMPTS, GEN_TOKENS = 16, 32
COMMON = dict(block_size=32, kv_cache_memory_bytes=64 << 20, max_num_seqs=64)


def heldout_windows(windows: int, seq: int) -> list[list[int]]:
    """`windows` windows of `seq` + 1 tokens from the held-out files, in corpus order."""
    from mini_vllm.course.tiny_models import corpus_files, load_tiny_tokenizer
    tok = load_tiny_tokenizer()
    ids: list[int] = []
    for path in corpus_files("val"):
        ids += tok.encode(path.read_text(encoding="utf-8")) + [tok.eos_token_id]
        if len(ids) > windows * (seq + 1):
            break
    if len(ids) < windows * (seq + 1):
        raise RuntimeError("held-out files missing: models/corpus_files.txt does not match this Python")
    return [ids[i * (seq + 1):(i + 1) * (seq + 1)] for i in range(windows)]


def gen_prompts(n: int, seed: int = 21) -> list[list[int]]:
    from engine_workloads import sample_requests
    return [p for p, _ in sample_requests(n, (16, 200), (1, 1), seed=seed)]


def run_engine(model: str, dtype: str, quantization: str | None, windows, prompts, gen_tokens: int) -> dict:
    """Teacher-forced top-1 tokens and logprobs, actual-token logprobs, greedy generations."""
    from mini_vllm import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, quantization=quantization, **COMMON)
    scored = llm.generate([{"prompt_token_ids": w} for w in windows],
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    top1, actual = [], []
    for w, out in zip(windows, scored):
        for pos, lps in enumerate(out.prompt_logprobs[1:], start=1):
            best = min(lps.items(), key=lambda kv: kv[1].rank)
            top1.append((best[0], best[1].logprob))
            actual.append(lps[w[pos]].logprob)
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    del llm
    return {"top1": top1, "actual": actual, "gen": [list(o.outputs[0].token_ids) for o in gen]}


def compare(ref: dict, got: dict) -> dict:
    agree = sum(a[0] == b[0] for a, b in zip(ref["top1"], got["top1"])) / len(ref["top1"])
    gap = max(abs(a[1] - b[1]) for a, b in zip(ref["top1"], got["top1"]))
    same = 0
    for a, b in zip(ref["gen"], got["gen"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += n
    total = sum(len(a) for a in ref["gen"])
    return {"greedy_agreement": same / total, "top1_agreement": agree, "top1_logprob_gap": gap,
            "ppl": math.exp(-sum(got["actual"]) / len(got["actual"])),
            "ppl_ref": math.exp(-sum(ref["actual"]) / len(ref["actual"]))}


def measure(model: str, dtype: str, modes, windows: int = WINDOWS, seq: int = SEQ,
            prompts: int = GEN_PROMPTS, gen_tokens: int = GEN_TOKENS) -> dict[str, dict]:
    """{mode: compare(unquantized, mode)} for one checkpoint and dtype."""
    w, p = heldout_windows(windows, seq), gen_prompts(prompts)
    ref = run_engine(model, dtype, None, w, p, gen_tokens)
    return {m: compare(ref, run_engine(model, dtype, m, w, p, gen_tokens)) for m in modes}


MODES = {"bfloat16": ("fp8_per_tensor", "fp8_per_channel", "int8_per_channel_weight_only"),
         "float32": ("int8_per_channel_weight_only",)}


def main() -> None:
    import torch
    from mini_vllm.course.tiny_models import model_path
    from machine import machine_line
    torch.set_num_threads(1)
    random.seed(0)
    print(machine_line((1,)))
    print(f"held-out: {WINDOWS} windows x {SEQ} tokens; greedy: {GEN_PROMPTS} prompts x {GEN_TOKENS} tokens")
    print("| model | dtype | quantization | greedy agreement | top-1 agreement | largest top-1 logprob gap "
          "| perplexity (unquantized) |")
    print("|---|---|---|---|---|---|---|")
    for name in ("tiny-py-target", "tiny-py-draft"):
        for dtype, modes in MODES.items():
            for mode, r in measure(str(model_path(name)), dtype, modes).items():
                print(f"| {name} | {dtype} | {mode} | {r['greedy_agreement']:.3f} | {r['top1_agreement']:.4f} | "
                      f"{r['top1_logprob_gap']:.3f} | {r['ppl']:.3f} ({r['ppl_ref']:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
