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
