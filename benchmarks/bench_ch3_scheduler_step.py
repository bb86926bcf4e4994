"""CPU time of one scheduler step (`schedule()` + `update_from_output()`)
with 256 running decodes. Goal: <= 1 ms, since seed 001 notes that 1 ms is
about 10% of a decode step.

Run: .venv/bin/python benchmarks/bench_ch3_scheduler_step.py
"""
import time

from mini_vllm.scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig

GOAL_MS = 1.0
N = 256


def bench(policy: str, steps: int = 200) -> float:
    cfg = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=N, max_model_len=2048,
                          policy=policy)
    s = Scheduler(cfg, num_gpu_blocks=N * 40, block_size=16)
    for i in range(N):
        s.add_request(Request(f"r{i}", [i % 97 + 1] * 128,
                              SamplingParams(max_tokens=512, ignore_eos=True), arrival_time=i))
    out = s.schedule()  # admit and prefill all 256
    s.update_from_output(out, ModelRunnerOutput.from_dict({r: [1] for r in out.num_scheduled_tokens}))
    mro = ModelRunnerOutput.from_dict({f"r{i}": [1] for i in range(N)})
    t0 = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        assert len(out.num_scheduled_tokens) == N
        s.update_from_output(out, mro)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    for policy in ("fcfs", "srtf"):
        ms = bench(policy)
        print(f"policy={policy:5s} 256 running decodes: {ms:.3f} ms/step "
              f"(goal {GOAL_MS:.1f} ms, ratio to goal {ms / GOAL_MS:.2f}x)")


if __name__ == "__main__":
    main()
