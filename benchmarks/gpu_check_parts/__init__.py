"""The sections of `benchmarks/gpu_check.py` (`make gpu-check`), one module each:

  environment    run from the source tree, minimum versions, device facts
  plan           every size of the full run and of --small; the engine's arguments
  cuda_tests     the test subset that needs CUDA, run by pytest in a subprocess
  pytest_plugin  makes that pytest run import mini_vllm from this checkout
  checkpoint     a random Qwen3-0.6B-shaped checkpoint written by save_pretrained
  throughput     nano-vllm's benchmark workload: the engine, then the HF runs
  hf_baselines   HF generate in static batches, HF continuous batching
  greedy_check   the engine's greedy tokens against HF, exact and tie-aware
  attention_bw   decode attention alone: bytes/s against the device's peak
  step_profile   torch.profiler: device-busy vs wall time per decode step
  memory         gpu_memory_utilization sizing: blocks chosen, memory left
  report         the markdown rendering of the JSON report
"""
