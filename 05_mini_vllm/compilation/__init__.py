"""Compiled execution: `torch.compile` of the model split at attention, and CUDA graphs.

vLLM counterpart: `vllm/compilation/` (`backends.py`, `cuda_graph.py`,
`piecewise_backend.py`) and `vllm/config/compilation.py`.
"""
