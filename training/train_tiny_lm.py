"""Train the course's tiny target and draft language models on the Python standard library.

    python training/train_tiny_lm.py --out models          # what `make models` runs

Steps: corpus (stdlib .py files, split by file) -> byte-level BPE tokenizer -> target
(Qwen3 architecture) -> draft (same tokenizer, smaller Qwen3) -> evaluation of the
saved bf16 checkpoints -> model cards. Deterministic given --seed: data order comes from a
seeded torch.Generator and all training runs on CPU in one process.

Each model is trained for a fixed number of optimizer steps. A wall-clock cap
(--*-max-minutes) can stop a run early; the best-so-far checkpoint (lowest validation
loss) is what gets saved, and the card's command names the step it stopped at so the
run can be reproduced exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from corpus import collect_files, python_version, stdlib_root, write_file_list
from evaluate import evaluate_and_write_cards
from tokenizer import EOS, PAD, save_tokenizer, train_tokenizer

ARCHS = {
    # hidden, layers, heads, kv heads, head_dim, mlp width
    "tiny-py-target": dict(hidden_size=256, num_hidden_layers=5, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=768),
    "tiny-py-draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, intermediate_size=384),
}
MAX_POSITIONS = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--target-steps", type=int, default=1200)
    p.add_argument("--draft-steps", type=int, default=1500)
    p.add_argument("--target-stop-at", type=int, default=None, help="stop after this step (schedule unchanged)")
    p.add_argument("--draft-stop-at", type=int, default=None)
    p.add_argument("--target-max-minutes", type=float, default=None, help="wall-clock cap; records the stop step")
    p.add_argument("--draft-max-minutes", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available); same data order and init on both")
    p.add_argument("--stdlib", default=None, help="stdlib folder to read (default: this interpreter's)")
    p.add_argument("--stdlib-version", default=None, help="version label of --stdlib (default: this interpreter's)")
    p.add_argument("--probe", action="store_true", help="time 5 steps of each model and exit")
    return p.parse_args(argv)


def build_config(name: str, vocab_size: int, eos_id: int, pad_id: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
                       bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                       attention_dropout=0.0, **ARCHS[name])


def encode_split(tok, files, split: str, eos_id: int) -> torch.Tensor:
    """Concatenate the split's files in sorted order, each followed by EOS so the model learns to stop."""
    texts = [f.text for f in files if f.split == split]
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def optimizer_step(model, opt, batch: torch.Tensor, lr: float) -> float:
    """One next-token step on `batch` [B, T + 1] at learning rate `lr`; returns the loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


@torch.no_grad()
def val_loss(model, val_ids: torch.Tensor, seq_len: int, max_chunks: int = 24) -> float:
    """Mean next-token loss over the first max_chunks contiguous windows of the validation stream."""
    model.eval()
    n = min(max_chunks, (len(val_ids) - 1) // seq_len)
    dev = next(model.parameters()).device
    x = val_ids[: n * seq_len].view(n, seq_len).long().to(dev)
    y = val_ids[1: n * seq_len + 1].view(n, seq_len).long().to(dev)
    losses = [torch.nn.functional.cross_entropy(model(input_ids=x[i:i + 8]).logits.flatten(0, 1), y[i:i + 8].flatten())
              for i in range(0, n, 8)]
    model.train()
    return float(torch.stack(losses).mean())


def save_bf16(model, out_dir: Path) -> None:
    """The model as bf16 safetensors in out_dir; the model itself stays in exact fp32."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32).load_state_dict(state)  # keep training in exact fp32, not bf16-rounded


def save_model(model, tok_dir: Path, out_dir: Path, eos_id: int, pad_id: int) -> None:
    """bf16 safetensors + generation_config + tokenizer files, exactly like a hub checkpoint."""
    save_bf16(model, out_dir)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id,
                     do_sample=False, max_new_tokens=64).save_pretrained(out_dir)
    for f in tok_dir.iterdir():
        (out_dir / f.name).write_bytes(f.read_bytes())


def train_one(name, args, train_ids, val_ids, tok_dir, eos_id, pad_id, steps, stop_at, max_minutes, log):
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(build_config(name, args.vocab_size, eos_id, pad_id)).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{name}] parameters: {n_params:,}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)  # data order, independent of model init
    limit = steps if stop_at is None else min(stop_at, steps)
    best, best_step, history, t0 = float("inf"), 0, [], time.time()
    stopped_at, last_train = limit, float("nan")
    for step in range(limit):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s: s + args.seq_len + 1] for s in starts.tolist()]).long().to(args.device)
        loss = optimizer_step(model, opt, batch, lr_at(step, steps, args.lr))
        last_train = 0.9 * last_train + 0.1 * loss if step else loss
        done = step + 1
        out_of_time = max_minutes is not None and time.time() - t0 > 60 * max_minutes
        if done % args.eval_every == 0 or done == limit or out_of_time:
            v = val_loss(model, val_ids, args.seq_len)
            history.append(dict(step=done, train_loss=round(last_train, 4), val_loss=round(v, 4),
                                minutes=round((time.time() - t0) / 60, 2)))
            log(f"[{name}] step {done}/{steps} train {last_train:.3f} val {v:.3f} "
                f"{(time.time() - t0) / 60:.1f} min")
            if v < best:
                best, best_step = v, done
                save_model(model, tok_dir, args.out / name, eos_id, pad_id)
        if out_of_time:
            stopped_at = done
            log(f"[{name}] wall-clock cap reached at step {done}")
            break
    return dict(name=name, parameters=n_params, steps_planned=steps, steps_run=stopped_at,
                best_step=best_step, tokens_seen=best_step * args.batch_size * args.seq_len,
                tokens_seen_total=stopped_at * args.batch_size * args.seq_len,
                train_loss_ema=history[-1]["train_loss"], val_loss_during_training=best,
                wall_minutes=round((time.time() - t0) / 60, 1), history=history,
                arch=ARCHS[name], stopped_early=stopped_at < limit or stop_at is not None)


def main(argv=None):
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "training_log.txt", "a")

    def log(msg):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n"); logf.flush()

    t0 = time.time()
    root, version = stdlib_root(args.stdlib), python_version(args.stdlib_version)
    files = collect_files(root)
    write_file_list(files, args.out / "corpus_files.txt", version, root)
    log(f"corpus: {version}, {len(files)} files, {sum(len(f.text) for f in files):,} chars")
    tok = train_tokenizer([f.text for f in files if f.split == "train"], args.vocab_size)
    tok_dir = args.out / "_tokenizer"
    save_tokenizer(tok, tok_dir, MAX_POSITIONS)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    train_ids, val_ids = (encode_split(tok, files, s, eos_id) for s in ("train", "val"))
    log(f"tokenizer: vocab {tok.get_vocab_size()}, train tokens {len(train_ids):,}, val tokens {len(val_ids):,}, "
        f"{time.time() - t0:.0f} s")
    if args.probe:
        for name in ARCHS:
            t = time.time()
            train_one(name, args, train_ids, val_ids, tok_dir, eos_id, pad_id, 30, None, None, log)
            log(f"probe {name}: {(time.time() - t) / 30:.3f} s/step (30 steps, one eval, one save)")
        return
    runs = [train_one("tiny-py-target", args, train_ids, val_ids, tok_dir, eos_id, pad_id,
                      args.target_steps, args.target_stop_at, args.target_max_minutes, log),
            train_one("tiny-py-draft", args, train_ids, val_ids, tok_dir, eos_id, pad_id,
                      args.draft_steps, args.draft_stop_at, args.draft_max_minutes, log)]
    # Persist the run records first: evaluation and cards can be redone from them alone.
    (args.out / "training_runs.json").write_text(json.dumps(dict(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        python=version, device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        n_files=len(files), n_val_files=sum(f.split == "val" for f in files),
        train_tokens=len(train_ids), val_tokens=len(val_ids), runs=runs), indent=2) + "\n")
    evaluate_and_write_cards(args.out, log)
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
