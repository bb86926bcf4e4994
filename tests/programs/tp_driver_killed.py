"""A tensor-parallel driver that dies by SIGKILL while its worker runs.

Run by tests/test_tp_failures.py: builds a tp=2 engine on the CPU, prints the
rank-1 worker's PID (one line), then kills itself with SIGKILL (no finalizer
runs). The test checks that the worker notices its peer's closed sockets and
exits.

No arguments; the test sets OMP_NUM_THREADS.
"""
import os
import signal


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from mini_vllm import LLM
    from mini_vllm.course.tiny_models import model_path

    llm = LLM(str(model_path("tiny-py-target")), device="cpu", kv_cache_memory_bytes=8 << 20,
              tensor_parallel_size=2)
    print(llm.llm_engine.engine_core.engine_core.executor.procs[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":  # spawned workers re-import this module: it must start nothing
    main()
