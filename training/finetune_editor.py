"""Fine-tune the tiny target into `tiny-py-editor`: the same model, taught to copy code.

    python training/finetune_editor.py --out models/tiny-py-editor   # what `make editor-model` runs

Why: prompt-lookup (n-gram) speculation pays only when the model reproduces
text that is already in its context, as a code-editing assistant does when it
rewrites a file with a small change. The 5.5M-parameter target never learned
to do that: shown a standard-library function, a marker and the function's
first line, its greedy continuation matches the function for 1-2 tokens. Real
code models learn copying from far more data; here a short fine-tune on the
same corpus does it.

Data: half of each batch is the plain training stream (so the model keeps its
language modelling), half is packed "copy" samples,
    span + "\\n# unchanged copy:\\n" + span + EOS,
with `span` a random 32-224 token window of the training files. Held-out
files give two numbers after training, written to the card: validation loss
on plain text, and teacher-forced top-1 accuracy on the copied half of
held-out copy samples (base model first, for comparison).

CPU only, deterministic for a given --seed; 2-4 s per step on one core (24 minutes for the
committed 600 steps on a shared 2-core machine).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from evaluate import split_ids  # noqa: E402
from train_tiny_lm import lr_at, optimizer_step, val_loss  # noqa: E402

MARKER = "\n# unchanged copy:\n"


def copy_sample(stream: torch.Tensor, marker: list[int], eos: int, gen: torch.Generator) -> list[int]:
    n = int(torch.randint(32, 225, (1,), generator=gen))
    s = int(torch.randint(0, len(stream) - n, (1,), generator=gen))
    span = stream[s:s + n].tolist()
    return span + marker + span + [eos]


def batch_rows(stream, marker, eos, seq_len, rows, copy_rows, gen) -> torch.Tensor:
    out = []
    for r in range(rows):
        if r < copy_rows:
            ids: list[int] = []
            while len(ids) < seq_len + 1:
                ids += copy_sample(stream, marker, eos, gen)
            out.append(torch.tensor(ids[:seq_len + 1]))
        else:
            s = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
            out.append(stream[s:s + seq_len + 1])
    return torch.stack(out).long()


@torch.no_grad()
def copy_accuracy(model, val, marker, eos, n: int = 48, seed: int = 7) -> float:
    """Teacher-forced top-1 accuracy on the copied span of held-out samples."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    hit = tot = 0
    for _ in range(n):
        ids = copy_sample(val, marker, eos, gen)
        span = (len(ids) - 1 - len(marker)) // 2
        pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        first = span + len(marker)  # predictions of the second span's tokens start here
        want = torch.tensor(ids[first:first + span])
        hit += int((pred[first - 1:first - 1 + span] == want).sum())
        tot += span
    model.train()
    return hit / tot


def write_card(out: Path, meta: dict, weights_sha: str) -> None:
    b, a, args = meta["before"], meta["after"], meta["args"]
    (out / "README.md").write_text(f"""# tiny-py-editor

`tiny-py-target` fine-tuned to reproduce code that is already in its context, so
that prompt-lookup (n-gram) speculative decoding has something to find, as it
has with a real code-editing model. Same architecture, tokenizer and vocabulary
as `tiny-py-target`; loads like any checkpoint, offline.

| | |
|---|---|
| base | `tiny-py-target` |
| data | half plain training stream, half packed copy samples `span + "\\n# unchanged copy:\\n" + span + EOS` (span: 32-224 tokens of the training files) |
| training | AdamW (lr {args['lr']}, warm-up then cosine to 10%), batch {args['batch_size']} x {args['seq_len']} tokens, {args['steps']} steps, seed {args['seed']}, CPU |
| wall time | {meta['minutes']} min |
| weights | bf16 `model.safetensors`, sha256 `{weights_sha}` |

## Results (held-out files, fp32)

| | tiny-py-target | tiny-py-editor |
|---|---|---|
| validation loss on plain text (nats/token) | {b['val_loss']:.3f} | {a['val_loss']:.3f} |
| teacher-forced top-1 accuracy on the copied half of copy samples | {b['copy_accuracy']:.3f} | {a['copy_accuracy']:.3f} |

## Reproduce

```
python training/finetune_editor.py --out models/tiny-py-editor --steps {args['steps']} --seed {args['seed']}
```
""")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=Path("models/tiny-py-target"))
    p.add_argument("--out", type=Path, default=Path("models/tiny-py-editor"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = Qwen3ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    models_dir = args.base.parent
    train, val = split_ids(tok, models_dir, "train"), split_ids(tok, models_dir, "val")
    marker, eos = tok(MARKER)["input_ids"], tok.eos_token_id
    before = dict(val_loss=val_loss(model, val, 256), copy_accuracy=copy_accuracy(model, val, marker, eos))
    print(f"base: {before}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        batch = batch_rows(train, marker, eos, args.seq_len, args.batch_size, args.batch_size // 2, gen)
        loss = optimizer_step(model, opt, batch, lr_at(step, args.steps, args.lr))
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss:.3f} "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
    after = dict(val_loss=val_loss(model, val, 256), copy_accuracy=copy_accuracy(model, val, marker, eos))
    print(f"fine-tuned: {after}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    # The base's tokenizer files byte for byte (a re-save could rewrite them).
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        (args.out / name).write_bytes((args.base / name).read_bytes())
    meta = dict(base=args.base.name, args={k: v if isinstance(v, (int, float)) else Path(v).as_posix()
                                           for k, v in vars(args).items()},
                before=before, after=after, minutes=round((time.time() - t0) / 60, 1))
    (args.out / "finetune_metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
    sha = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    write_card(args.out, meta, sha)


if __name__ == "__main__":
    main()
