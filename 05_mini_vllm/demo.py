"""`make demo`: the engine on the course's tiny model, on this CPU.

`--model tiny-py-moe` serves the course's mixture-of-experts model instead
(`make demo DEMO_ARGS="--model tiny-py-moe"`; trained by `make moe-model`).

Serves a batch of Python-code prompts with continuous batching (requests join
while others are decoding), streams one of them token by token, and prints
the engine's statistics. The prompts share a file header, so later requests
hit the prefix cache.
"""
from __future__ import annotations

import sys
import time

import torch

from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.course.tiny_models import MOE_NAME, TARGET_NAME, model_path

DEMO_MODELS = {TARGET_NAME: "5.5M parameters, Qwen3 architecture",
               MOE_NAME: "8.5M parameters, Qwen3-MoE: 8 experts, 2 active per token"}

HEADER = ('"""Utilities for working with files, paths and processes.\n\n'
          'This module is part of the standard library.\n"""\n\nimport os\nimport sys\n\n')
BODIES = ["def read_lines(path):\n", "class Cache:\n    def __init__(self", "def main(argv=None):\n",
          "def _walk(top, onerror=None):\n", "class Timer(object):\n", "def quote(s):\n    ",
          "def join(a, *p):\n", "def split_ext(name):\n", "    for entry in os.scandir(path):\n",
          "def which(cmd, mode=os.F_OK", "class Error(Exception):\n    pass\n\n\nclass ",
          "if __name__ == '__main__':\n"]


def main(num_requests: int = 48, max_tokens: int = 48, stream_id: str = "req-0",
         speculative: str | None = None, model: str = TARGET_NAME) -> dict:
    if model not in DEMO_MODELS:
        raise ValueError(f"model must be one of {list(DEMO_MODELS)}, got {model!r}")
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and robust on a busy machine
    print(f"mini-vLLM demo: {model} ({DEMO_MODELS[model]}) on the CPU\n")
    spec = None
    if speculative == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4}
    elif speculative == "draft":
        spec = {"method": "draft_model", "model": str(model_path("tiny-py-draft")), "num_speculative_tokens": 3}
    elif speculative == "eagle":
        spec = {"method": "eagle", "model": str(model_path("tiny-py-eagle")), "num_speculative_tokens": 3}
    def make_engine():
        return LLMEngine.from_engine_args(str(model_path(model)), dtype="float32",
                                          speculative_config=spec,
                                          max_num_seqs=32, max_num_batched_tokens=256, block_size=16,
                                          kv_cache_memory_bytes=32 << 20)

    # The CPU kernels compile on their first call (about 13 s in a fresh clone, then
    # read from numba's disk cache): a throwaway engine pays that before the clock starts,
    # so the statistics below are the engine's, not the compiler's.
    t0 = time.monotonic()
    warm = make_engine()
    warm.add_request("warm-up", HEADER, SamplingParams(max_tokens=2, temperature=0.7), output_kind="delta")
    while warm.has_unfinished_requests():
        warm.step()
    warm.shutdown()
    print(f"(compiled or loaded the CPU kernels in {time.monotonic() - t0:.1f} s)\n")
    eng = make_engine()
    prompts = [HEADER + BODIES[i % len(BODIES)] for i in range(num_requests)]
    # No per-request seed: the global generator, seeded once, makes the run
    # repeatable, and unseeded requests may take drafts when speculation is on.
    torch.manual_seed(0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, ignore_eos=True)
    pending = list(enumerate(prompts))
    eng.metrics.start_time = time.monotonic()
    print(f"streaming {stream_id} (its prompt ends with {BODIES[0]!r}):\n" + "-" * 60)
    sys.stdout.write(BODIES[0])
    step = 0
    while pending or eng.has_unfinished_requests():
        for _ in range(4 if step % 2 == 0 else 0):  # arrivals: 4 new requests every other step
            if pending:
                i, p = pending.pop(0)
                eng.add_request(f"req-{i}", p, sp, output_kind="delta")
        for out in eng.step():
            if out.request_id == stream_id and out.outputs:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
        step += 1
    s = eng.get_stats()
    print("\n" + "-" * 60)
    mc = eng.model_config  # what the engine loaded, not what was asked for
    rows = [("model served", f"{mc.model_type}, {mc.num_experts or 'no'} experts"),
            ("requests finished", f"{s['requests_finished']}"),
            ("engine steps", f"{eng.metrics.num_steps}"),
            ("output tokens / s", f"{s['output_tok_per_s']:.1f}"),
            ("prompt tokens / s", f"{s['prompt_tok_per_s']:.1f}"),
            ("TTFT p50 / p99", f"{s['ttft_p50_s'] * 1e3:.0f} ms / {s['ttft_p99_s'] * 1e3:.0f} ms"),
            ("inter-token latency p50 / p99", f"{s['itl_p50_s'] * 1e3:.1f} ms / {s['itl_p99_s'] * 1e3:.1f} ms"),
            ("prefix-cache hit rate", f"{100 * s['prefix_cache_hit_rate']:.1f}%"),
            ("KV cache usage (max)", f"{100 * s['kv_cache_usage_max']:.1f}% of "
                                     f"{eng.num_gpu_blocks} blocks"),
            ("preemptions", f"{s['num_preemptions']}")]
    if spec is not None:
        per_pos = ", ".join(f"{a:.2f}" for a in s["spec_acceptance_per_position"])
        mal = s["spec_mean_acceptance_length"]
        rows += [("speculative decoding", f"{speculative}, k = {spec['num_speculative_tokens']}"),
                 # num_speculative_tokens_per_batch_size left out: the engine's measured schedule
                 ("draft schedule", "measured: drafts only at batch sizes where the mean acceptance "
                                    "length beats the break-even timed at start-up "
                                    "(spec_decode/engine/auto_schedule.py)"),
                 ("draft acceptance rate", f"{100 * s['spec_acceptance_rate']:.1f}% "
                                           f"of {s['spec_num_drafts']} draft tokens"),
                 ("acceptance per position", per_pos),
                 # vLLM's definition: tokens per verify step, the bonus token included
                 ("mean acceptance length", "no drafts verified" if mal is None else
                  f"{mal:.2f} (1 + accepted / {s['spec_num_draft_sequences']} draft sequences)")]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return s


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculative", choices=["ngram", "draft", "eagle"], default=None,
                    help="turn on speculative decoding (n-gram, the tiny draft model, or the EAGLE head "
                         "models/tiny-py-eagle)")
    ap.add_argument("--model", choices=list(DEMO_MODELS), default=TARGET_NAME,
                    help="the model served (tiny-py-moe: the mixture-of-experts one)")
    args = ap.parse_args()
    main(speculative=args.speculative, model=args.model)
