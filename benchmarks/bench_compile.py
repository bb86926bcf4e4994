"""Eager (the hand-fused CPU path) vs VLLM_COMPILE (split at attention, inductor
pieces) vs STOCK_TORCH_COMPILE (one inductor graph), side by side in one run.

vLLM counterpart: what `-O0` / `-O3` change in `vllm bench latency`, measured
here on the model's forward alone (`compilation/backends.py`).

Models: (a) the course's tiny-py-target in fp32; (b) a random checkpoint shaped
like Qwen3-0.6B (hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072,
vocabulary 151,936, tied) in bf16, written with save_pretrained, with
--qwen-layers layers (default 4 of the real 28: all 28 take minutes per mode
on 2 cores; every middle layer is the same compiled piece, so per-layer cost
scales). Attention is the engine's CPU default backend ("cpu").

Steps timed (hidden states only, no logits): decode batches of 1, 8 and 32
sequences (each with 128 tokens already cached) and one 256-token prefill.
Each is the median of REPEATS calls after WARMUP calls; the three modes of one
step run back to back. Inductor compiles in this process (compile_threads=1):
its worker pool keeps importing torch in the background after a compile,
which made later timings on 2 cores 2-10x slower at random. Compile time: the first call, cold (a fresh inductor
cache directory, so nothing is reused from earlier runs) and warm (a second
compile of the same model in this process: Dynamo traces again, inductor finds
every piece in its cache).

Run: .venv/bin/python benchmarks/bench_compile.py [--qwen-layers 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch._inductor.config

from machine import cpu_info
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.compilation.backends import compile_forward
from mini_vllm.compilation.config import CompilationConfig, CompilationMode
from mini_vllm.course.tiny_models import model_path
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models import load_model
from mini_vllm.paged_attention import allocate_kv_cache

WARMUP, REPEATS = 3, 15
CONTEXT, BLOCK = 128, 16          # decode sequences already hold CONTEXT tokens
STEPS = [("decode 1", 1, 1), ("decode 8", 8, 1), ("decode 32", 32, 1), ("prefill 256", 1, 256)]
MODES = [("eager", None), ("VLLM_COMPILE", CompilationMode.VLLM_COMPILE),
         ("STOCK", CompilationMode.STOCK_TORCH_COMPILE)]


def qwen3_06b_checkpoint(layers: int, folder: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=layers, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def step_inputs(config, num_seqs: int, q_len: int, dtype):
    """Inputs and metadata of one step: num_seqs sequences of q_len new tokens each
    (after CONTEXT cached ones for decodes), blocks laid out one sequence after another."""
    past = CONTEXT if q_len == 1 else 0
    per_seq = -(-(past + q_len) // BLOCK)
    tables = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
    pos = torch.arange(past, past + q_len).repeat(num_seqs)
    seq = torch.arange(num_seqs).repeat_interleave(q_len)
    slots = tables[seq, pos // BLOCK].long() * BLOCK + pos % BLOCK
    md = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        cu_seqlens_q=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), past + q_len, dtype=torch.int32), max_query_len=q_len,
        max_seq_len=past + q_len, query_lens_cpu=[q_len] * num_seqs, seq_lens_cpu=[past + q_len] * num_seqs)
    ids = torch.randint(0, config.vocab_size, (num_seqs * q_len,))
    return ids, pos, md


def timed(fn, ids, pos, md, n: int) -> float:
    out = []
    for _ in range(n):
        md.backend_metadata = None  # a fresh step: the backend plans it again, as in the engine
        t0 = time.perf_counter()
        with set_forward_context(md):
            fn(ids, pos)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_model(name: str, path, dtype) -> list[tuple]:
    model, config = load_model(path, dtype=dtype)
    blocks = 32 * -(-(CONTEXT + 1) // BLOCK) + 256 // BLOCK
    for layer in model.attention_layers():
        layer.kv_cache = tuple(t.normal_() for t in allocate_kv_cache(
            blocks, BLOCK, config.num_key_value_heads, config.head_dim, dtype=dtype))
    steps = {label: step_inputs(config, s, q, dtype) for label, s, q in STEPS}
    fns, compile_s = {}, {}
    with torch.inference_mode():
        for label, mode in MODES:
            if mode is None:
                fns[label] = model
                continue
            times = []
            for _ in range(2):  # cold, then warm
                cf = compile_forward(model, CompilationConfig(mode=mode))
                ids, pos, md = steps["decode 8"]
                times.append(timed(cf, ids, pos, md, 1))
            fns[label], compile_s[label] = cf, times
            if mode == CompilationMode.VLLM_COMPILE:
                print(f"{name}: {cf.split_summary().splitlines()[0]}")
        ms = {}
        for label, _, _ in STEPS:
            ids, pos, md = steps[label]
            for mlabel, fn in fns.items():  # each mode warmed just before it is timed
                timed(fn, ids, pos, md, WARMUP)
                ms[mlabel, label] = 1e3 * timed(fn, ids, pos, md, REPEATS)
    rows = []
    for mlabel, _ in MODES:
        cold, warm = compile_s.get(mlabel, (None, None))
        rows.append((name, mlabel, cold, warm, [ms[mlabel, s] for s, _, _ in STEPS],
                     [ms["eager", s] / ms[mlabel, s] for s, _, _ in STEPS]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # Compile in this process: inductor's worker pool would import torch in the
    # background for seconds after the first compile, stealing the cores being timed.
    torch._inductor.config.compile_threads = 1
    # Cold compiles: a cache directory nothing was compiled into before.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mini_vllm_bench_inductor_")
    rows = bench_model("tiny-py-target fp32", model_path("tiny-py-target"), torch.float32)
    with tempfile.TemporaryDirectory() as d:
        rows += bench_model(f"Qwen3-0.6B-shape {args.qwen_layers}L bf16",
                            qwen3_06b_checkpoint(args.qwen_layers, d), torch.bfloat16)
    print(f"\nCPU: {cpu_info()['model_name']}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"forward ms (median of {REPEATS}), eager/mode speed-up in brackets")
    head = f"{'model':<28} {'mode':<13} {'compile cold/warm s':>20} " + " ".join(f"{s:>18}" for s, _, _ in STEPS)
    print(head)
    print("-" * len(head))
    for name, mode, cold, warm, ms, ratio in rows:
        comp = "-" if cold is None else f"{cold:.1f} / {warm:.1f}"
        cells = " ".join(f"{m:>9.2f} ({r:4.2f}x)" for m, r in zip(ms, ratio))
        print(f"{name:<28} {mode:<13} {comp:>20} {cells}")


if __name__ == "__main__":
    main()
