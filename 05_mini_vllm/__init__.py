"""mini-vLLM: vLLM rebuilt chapter by chapter.

Each chapter folder is a subpackage of this one:

- `mini_vllm.paged_attention`  (01_paged_attention/)
- `mini_vllm.kvcache`          (02_kvcache/)
- `mini_vllm.scheduler`        (03_scheduler/)
- `mini_vllm.spec_decode`      (04_spec_decode/)
- `mini_vllm.global_cache`     (06_global_prefix_cache/)
- `mini_vllm.kernels`          (kernels/, Triton)

This folder (05_mini_vllm/) holds the engine that composes them:

    from mini_vllm import LLM, SamplingParams
    llm = LLM("models/tiny-py-target")
    llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The engine's public names, imported lazily so that `import mini_vllm.kvcache`
# (a chapter) does not pull in the whole engine, models and transformers.
_LAZY = {
    "LLM": "mini_vllm.entrypoints.llm",
    "LLMEngine": "mini_vllm.engine.llm_engine",
    "EngineConfig": "mini_vllm.config",
    "SamplingParams": "mini_vllm.sampling_params",
    "RequestOutput": "mini_vllm.outputs",
    "CompletionOutput": "mini_vllm.outputs",
    "Logprob": "mini_vllm.outputs",
    "BeamSearchParams": "mini_vllm.beam_search",
}
__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # never run: the same names, spelled out for editors and type checkers
    from mini_vllm.beam_search import BeamSearchParams
    from mini_vllm.config import EngineConfig
    from mini_vllm.engine.llm_engine import LLMEngine
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.outputs import CompletionOutput, Logprob, RequestOutput
    from mini_vllm.sampling_params import SamplingParams


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mini_vllm' has no attribute {name!r}")
