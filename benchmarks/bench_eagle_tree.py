"""EAGLE-2 dynamic draft trees against the linear chain, with the course's head, on held-out code.

For each configuration, along the target's own greedy continuation of --prompts held-out
prompts (64 tokens each, --tokens new tokens), at every position: the tree the head drafts
(`training/eagle_tree.py`) and how many of its tokens greedy verification accepts. Printed:
* the mean acceptance length L (tokens per target forward, the bonus token included);
* the rows the target verifies per request (root + kept nodes) and the head's passes;
* the speed-up at batch 1 that the engine's own step costs predict,
      L * T(1) / (T(1 + budget) + H(4) + (depth - 1) * H(top_k)),
  where T(n) is the engine's target forward and LM head over one sequence of n tokens, and H(n)
  the head's forward and LM head over n rows, timed in this process on dummy steps under
  inference mode, as the engine runs them (`mini_vllm/worker/spec_profile.py`'s: the fastest of
  5 calls, the sizes' calls alternating). The engine serves chains only (trees
  need tree attention in its paged kernels), so the tree rows are a prediction; the chain row
  can be checked against `bench_spec_vs_vllm.py`'s measured batch-1 speed-up.

Run: .venv/bin/python benchmarks/bench_eagle_tree.py [--prompts 16] [--tokens 96] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench_spec_vs_vllm import held_out_prompts
from machine import machine_line
from mini_vllm import LLM
from mini_vllm.course.tiny_models import model_path
from vllm_side import pin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from eagle_head import load_head  # noqa: E402
from eagle_tree import TreeDrafter  # noqa: E402
from train_eagle import target_features  # noqa: E402

# (name, depth, top_k, budget): budget = kept nodes, verified with the root in one forward
CONFIGS = [("chain k=3", 3, 1, 3), ("chain k=5", 5, 1, 5), ("tree 4x2 / 7", 4, 2, 7),
           ("tree 5x4 / 15", 5, 4, 15), ("tree 6x8 / 31", 6, 8, 31)]


def acceptance(prompts, new_tokens: int) -> dict[str, float]:
    target = AutoModelForCausalLM.from_pretrained(str(model_path("tiny-py-target")), dtype=torch.float32,
                                                  local_files_only=True).eval()
    head = load_head(model_path("tiny-py-eagle"))
    embed = target.model.embed_tokens.weight
    accepted = {name: [] for name, *_ in CONFIGS}
    with torch.no_grad():
        for p in prompts:
            p = torch.tensor(p)
            seq = target.generate(p[None], max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=target.config.pad_token_id)[0]
            feats, _ = target_features(target, seq[None])
            drafter = TreeDrafter(head, embed, seq, feats[0])
            for t in range(len(p) - 1, len(seq) - 8):   # room for the deepest tree's path
                rest = seq[t + 2:].tolist()
                for name, depth, top_k, budget in CONFIGS:
                    accepted[name].append(drafter.draft(t, depth, top_k, budget).accepted(rest))
    return {name: 1 + sum(a) / len(a) for name, a in accepted.items()}


def step_costs() -> tuple[dict[int, float], dict[int, float]]:
    """T(n) and H(n) in seconds, from the engine's runner (see the module docstring)."""
    from mini_vllm.worker import spec_profile as sp
    llm = LLM(str(model_path("tiny-py-target")), dtype="float32", multiprocess_mode=False,
              kv_cache_memory_bytes=64 << 20,
              speculative_config={"method": "eagle", "model": str(model_path("tiny-py-eagle")),
                                  "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": None})
    runner = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner
    rows = sorted({1} | {1 + c[3] for c in CONFIGS})   # the target over one sequence of n tokens
    widths = sorted({1, 4} | {c[2] for c in CONFIGS})  # the head over n one-token rows
    with torch.inference_mode():
        T = dict(zip(rows, sp._best_times([sp._target_step(runner, 1, n) for n in rows], runner.device)))
        H = dict(zip(widths, sp._best_times([sp._proposer_pass(runner, n, 1) for n in widths], runner.device)))
    llm.shutdown()
    return T, H


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(machine_line([args.threads]))
    pin(args.threads)
    lengths = acceptance(held_out_prompts(args.prompts), args.tokens)
    T, H = step_costs()
    print(f"\n{args.prompts} held-out prompts x {args.tokens} greedy tokens; costs timed at batch 1 "
          f"({args.threads} thread{'s' * (args.threads > 1)}): T(1) {T[1] * 1e3:.2f} ms")
    print(f"{'draft':>16}{'L':>8}{'rows':>6}{'T(rows) ms':>12}{'head ms':>9}{'predicted':>11}")
    for name, depth, top_k, budget in CONFIGS:
        head = H[4] + (depth - 1) * H[top_k]
        verify = T[1 + budget]
        print(f"{name:>16}{lengths[name]:>8.3f}{1 + budget:>6}{verify * 1e3:>12.2f}{head * 1e3:>9.2f}"
              f"{lengths[name] * T[1] / (verify + head):>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
