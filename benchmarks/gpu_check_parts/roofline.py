"""Roofline accounting of the throughput run: what each step had to move and compute, and its floor.

No vLLM file counts this; the arithmetic is the one behind vLLM's and
nano-vllm's published throughput figures. Every engine step is recorded from
the engine's own schedule (`ScheduleRecorder` wraps `Scheduler.schedule`),
then costed:

  bytes  = weights (every linear and the LM head, read once a step)
         + KV read  (every scheduled sequence's seq_len cached positions, once)
         + KV written (the step's new tokens)
         + logits (fp32, written by the LM head and read by the sampler, per sampled row)
  FLOPs  = 2 x linear parameters x tokens + 2 x LM head x sampled rows
         + attention 4 x layers x heads x head_dim x (keys each query sees)
  floor  = max(bytes / measured copy bandwidth, FLOPs / dense peak)

Activations are left out (a floor: whatever else the engine moves only adds).
The workload's floor is the sum of its steps' floors; engine time / floor is
the figure every change is judged by. Steps are split into two phases: those
that carry prompt tokens ("prefill", mixed with decodes) and pure decodes.
A profiler window on each phase (`profile_windows`) gives device-busy time,
host-only time and the top kernels, plus the GEMMs' achieved FLOP rate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch's device name (first match wins).
PEAK_BF16_FLOPS = [("H200", 989.4e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989.4e12),
                   ("A100", 312e12), ("L40S", 362e12), ("RTX 4090", 165e12)]
GEMM_KERNEL_MARKS = ("gemm", "xmma", "cutlass", "matmul", "aten::mm", "aten::addmm", "aten::linear", "nvjet")


def published_flops(name: str) -> float | None:
    return next((f for key, f in PEAK_BF16_FLOPS if key in name), None)


@dataclass(frozen=True)
class ModelCost:
    """What one token and one step cost a decoder-only transformer (Llama/Qwen shape)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: dict, dtype_bytes: int = 2) -> "ModelCost":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                   cfg["num_key_value_heads"], head_dim, cfg["intermediate_size"], cfg["vocab_size"], dtype_bytes)

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's linears (q, k, v, o, gate, up, down); norms are negligible."""
        h, d = self.hidden, self.head_dim
        per_layer = h * d * (2 * self.heads + 2 * self.kv_heads) + 3 * h * self.intermediate
        return self.layers * per_layer

    @property
    def weight_bytes(self) -> int:
        """Read once a step: the linears and the LM head (the embedding rows a step gathers are activations)."""
        return (self.linear_params + self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class StepRecord:
    """One engine step as the scheduler decided it: (tokens already cached, new tokens) per sequence."""

    t: float                          # perf_counter when schedule() returned
    seqs: list[tuple[int, int]]       # (num_computed_tokens before the step, scheduled tokens)
    sampled: int                      # rows that sample a token
    prompt_tokens: int                # prompt tokens computed (> 0: a "prefill" step)


def step_cost(m: ModelCost, s: StepRecord) -> dict:
    tokens = sum(n for _, n in s.seqs)
    kv_read = sum(c + n for c, n in s.seqs) * m.kv_bytes_per_token
    kv_write = tokens * m.kv_bytes_per_token
    logits = 2 * 4 * m.vocab * s.sampled
    keys_seen = sum(n * c + n * (n + 1) // 2 for c, n in s.seqs)  # query t of a chunk sees c + t + 1 keys
    gemm = 2 * m.linear_params * tokens + 2 * m.vocab * m.hidden * s.sampled
    attn = 4 * m.layers * m.heads * m.head_dim * keys_seen
    return {"weights": m.weight_bytes, "kv_read": kv_read, "kv_write": kv_write, "logits": logits,
            "bytes": m.weight_bytes + kv_read + kv_write + logits, "gemm_flops": gemm, "flops": gemm + attn}


def floor_s(cost: dict, copy_bw: float, peak_flops: float) -> float:
    return max(cost["bytes"] / copy_bw, cost["flops"] / peak_flops)


@dataclass
class ScheduleRecorder:
    """Records every step a scheduler makes while installed (an instance attribute
    shadows the method; `close` removes it). Costs a perf_counter and a list a step."""

    scheduler: object
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        inner = self.scheduler.schedule

        def schedule():
            so = inner()
            ctx = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            ctx.update({r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs})
            if so.total_num_scheduled_tokens:
                self.steps.append(StepRecord(time.perf_counter(),
                                             [(ctx[r], n) for r, n in so.num_scheduled_tokens.items()],
                                             len(so.sampling_req_ids), so.num_prompt_tokens))
            return so

        self.scheduler.schedule = schedule

    def close(self) -> None:
        del self.scheduler.schedule


def phase_of(s: StepRecord) -> str:
    return "prefill" if s.prompt_tokens > 0 else "decode"


def account(m: ModelCost, steps: list[StepRecord], end_t: float, copy_bw: float, peak_flops: float) -> dict:
    """The workload's floor, its bytes and FLOPs, and per phase the engine's wall
    time (a step lasts until the next one is scheduled; the last until end_t)
    against the floor of the same steps."""
    phases = {p: {"steps": 0, "wall_s": 0.0, "floor_s": 0.0, "bytes": 0, "flops": 0, "tokens": 0}
              for p in ("prefill", "decode")}
    totals = {"weights": 0, "kv_read": 0, "kv_write": 0, "logits": 0, "bytes": 0, "flops": 0}
    for i, s in enumerate(steps):
        c = step_cost(m, s)
        ph = phases[phase_of(s)]
        ph["steps"] += 1
        ph["wall_s"] += (steps[i + 1].t if i + 1 < len(steps) else end_t) - s.t
        ph["floor_s"] += floor_s(c, copy_bw, peak_flops)
        ph["bytes"] += c["bytes"]
        ph["flops"] += c["flops"]
        ph["tokens"] += sum(n for _, n in s.seqs)
        for k in totals:
            totals[k] += c[k]
    for ph in phases.values():
        ph["wall_over_floor"] = ph["wall_s"] / ph["floor_s"] if ph["floor_s"] else None
    floor = sum(ph["floor_s"] for ph in phases.values())
    wall = sum(ph["wall_s"] for ph in phases.values())
    return {"copy_bytes_per_s": copy_bw, "peak_flops": peak_flops, "steps": len(steps), "totals": totals,
            "floor_s": floor, "wall_s": wall, "wall_over_floor": wall / floor if floor else None,
            "phases": phases, "kv_bytes_per_token": m.kv_bytes_per_token, "weight_bytes": m.weight_bytes}


def measured_matmul_flops(device: str, small: bool) -> float:
    """FLOP/s of a large square matmul (bf16 on CUDA, fp32 on a CPU): the peak
    when the device's published one is unknown, and a check on it otherwise."""
    import torch

    from gpu_check_parts.attention_bw import _time

    n = 512 if small else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _time(lambda: a @ b, 3 if small else 20, device)


def config_of(model_dir: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(model_dir) / "config.json").read_text())


def model_free_schedule(reqs, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int) -> list[StepRecord]:
    """The steps the engine's scheduler (Chapter 3, no model) makes for `reqs`
    [(prompt ids, max_tokens)] with this KV pool: the schedule whose floor the
    GPU run is judged by, computed on any CPU. Timestamps are step indices."""
    from mini_vllm.scheduler import Scheduler, SchedulerConfig
    from mini_vllm.scheduler.output import ModelRunnerOutput
    from mini_vllm.scheduler.request import Request, SchedulerSamplingParams

    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len)
    sched = Scheduler(config, num_blocks, block_size, enable_prefix_caching=False)
    live = {}
    for i, (prompt, max_tokens) in enumerate(reqs):
        r = Request(str(i), list(prompt), SchedulerSamplingParams(max_tokens=max_tokens, ignore_eos=True))
        sched.add_request(r)
        live[r.request_id] = r
    rec = ScheduleRecorder(sched)
    try:
        while sched.has_unfinished_requests():
            out = sched.schedule()
            if not out.num_scheduled_tokens:
                raise RuntimeError("the scheduler made no progress with requests pending")
            rec.steps[-1].t = float(len(rec.steps) - 1)  # a step index: no clock in a model-free run
            sampled = {rid: [1] if rid in out.sampling_req_ids else [] for rid in out.num_scheduled_tokens}
            sched.update_from_output(out, ModelRunnerOutput.from_dict(sampled))
    finally:
        rec.close()
    return rec.steps
