"""Which of the project's modules one plain decode step runs code in, grouped by where they live.

No vLLM counterpart. The question it answers is a reader's: to follow one decode step of
the default engine (one request, greedy, the engine core in this process), which files
must I open? It steps the engine past its prefill, then records every Python function
entered during one `EngineCore.step()` (a profile hook, not a sampler, so nothing is
missed) and prints each project module with its call count.

Groups: `runner` is Chapter 5's path from the core to the model and back (engine core,
executor, worker, sampler, attention metadata, forward context); `model` the model's
layers; `kernels` the compiled and interpreted kernels; `chapters 2-3` the scheduler and
the KV-cache manager the learner built earlier. Which kernels run depends on the CPU.

    .venv/bin/python benchmarks/decode_path_modules.py [--model models/tiny-py-target]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def group(module: str) -> str:
    top = module.split("/")[0]
    if top in ("scheduler", "kvcache"):
        return "chapters 2-3"
    if top == "kernels":
        return "kernels"
    if top == "models":
        return "model"
    return "runner"


def trace_one_decode_step(model: str) -> collections.Counter:
    from mini_vllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=256, multiprocess_mode=False, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    llm.llm_engine.add_request("a", "def f(x):", SamplingParams(max_tokens=8, temperature=0))
    for _ in range(3):  # the prefill, then two decodes: every lazy import and cache is warm
        core.step()
    calls: collections.Counter = collections.Counter()

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and "/mini_vllm/" in name:
            calls[name.split("/mini_vllm/", 1)[1]] += 1

    sys.setprofile(hook)
    try:
        core.step()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-py-target"))
    calls = trace_one_decode_step(ap.parse_args().model)
    by_group: dict[str, list[str]] = collections.defaultdict(list)
    for module in sorted(calls):
        by_group[group(module)].append(module)
    for g in ("runner", "model", "kernels", "chapters 2-3"):
        print(f"{g}: {len(by_group[g])} modules")
        for module in by_group[g]:
            print(f"  {calls[module]:5d} calls  {module}")
    print(f"all: {len(calls)} modules")


if __name__ == "__main__":
    main()
