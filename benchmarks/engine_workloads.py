"""Workloads shared by the engine benchmarks: prompts cut from the Python
standard library (the tiny models' held-out `val` files first), tokenized
with the tiny model's tokenizer. Deterministic for a given seed."""
from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from mini_vllm.course.tiny_models import load_tiny_tokenizer, models_dir


def corpus_token_stream(tok, max_files: int = 60) -> list[int]:
    rows = [ln.split("\t")[:2] for ln in (models_dir() / "corpus_files.txt").read_text().splitlines()
            if ln and not ln.startswith("#")]
    rows.sort(key=lambda r: r[0] != "val")  # held-out files first
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for _, rel in rows[:max_files]:
        path = root / rel
        if path.is_file():
            ids += tok(path.read_text(encoding="utf-8", errors="replace"), verbose=False)["input_ids"]
    if len(ids) < 10_000:
        raise RuntimeError("the standard library sources are missing; the workload needs them")
    return ids


def sample_requests(n: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int = 0):
    """n (prompt_token_ids, max_tokens) pairs, lengths uniform in the ranges."""
    tok = load_tiny_tokenizer()
    stream = corpus_token_stream(tok)
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        n_in, n_out = rng.randint(*in_range), rng.randint(*out_range)
        start = rng.randrange(0, len(stream) - n_in)
        reqs.append((stream[start:start + n_in], n_out))
    return reqs


def qwen3_06b_checkpoint() -> Path:
    """A Qwen3-0.6B-shaped checkpoint with random bf16 weights (written by
    `gpu_check_parts/checkpoint.py`'s `write_checkpoint`), made once and kept in
    $MINI_VLLM_BENCH_DIR (default ~/.cache/mini_vllm/bench): 1.2 GB, too large to
    commit. The tiny models' tokenizer is copied beside it, so both engines start
    as they would on a real folder; its 6,144 ids are valid ids of the 151,936-token
    vocabulary, and the workload runs with detokenize off (sampled ids past 6,143
    have no text). `complete` marks a finished write: an interrupted one is redone."""
    import os
    import shutil

    from gpu_check_parts.checkpoint import write_checkpoint
    from mini_vllm.course.tiny_models import model_path

    base = Path(os.environ.get("MINI_VLLM_BENCH_DIR", Path.home() / ".cache" / "mini_vllm" / "bench"))
    folder = base / "qwen3-0.6b-random-bf16"
    if not (folder / "complete").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        print(f"writing a random Qwen3-0.6B-shaped bf16 checkpoint to {folder} (once; about a minute)", flush=True)
        write_checkpoint(folder, small=False, device="cpu")
        tiny = model_path("tiny-py-target")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy2(tiny / name, folder / name)
        (folder / "complete").write_text("ok\n")
    return folder
