"""mini-vLLM: vLLM rebuilt chapter by chapter.

Each chapter folder is a subpackage of this one:

- `mini_vllm.paged_attention`  (01_paged_attention/)
- `mini_vllm.kvcache`          (02_kvcache/)
- `mini_vllm.scheduler`        (03_scheduler/)
- `mini_vllm.spec_decode`      (04_spec_decode/)
- `mini_vllm.global_cache`     (06_global_prefix_cache/)
- `mini_vllm.kernels`          (kernels/, Triton)

This folder (05_mini_vllm/) holds the engine that composes them.
"""

__version__ = "0.1.0"
