"""Train an EAGLE-1 draft head for tiny-py-target on the course corpus, on CPU.

    python training/train_eagle.py --out models/tiny-py-eagle      # what `make eagle-model` runs

Data: the target's training split (CPython standard library files, split by file
as in `corpus.py`), tokenised with the target's tokenizer. Each step reads random
windows, runs the frozen target once for its final hidden states f and logits z
(matmuls in bf16 under autocast, weights and optimizer in float32), and trains the head (`eagle_head.py`) to
match z one token further ahead.

Training-time test: the head is unrolled for --ttt-steps draft steps per
window, as at inference: step 1 reads the target's features, each later step
reads the head's own output of the step before and attends, through
`ttt_mask`, to exactly the keys it would see in the engine. Step j's loss is
the cross-entropy against the target's distribution at t + j (distillation,
so the head learns the target's choices, not the corpus's), weighted 0.8^(j-1).

Evaluation (`evaluate_head`): the target writes greedy continuations of
held-out prompts; along them a draft is accepted exactly when it equals the
next token, so the chain from every position gives the acceptance per draft
position and the mean acceptance length 1 + E[accepted] at k = 1..5.
Deterministic for a given --seed and --threads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from corpus import collect_files, python_version, stdlib_root
from eagle_head import EagleHead, save_head, ttt_mask


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=Path("models/tiny-py-target"))
    p.add_argument("--out", type=Path, default=Path("models/tiny-py-eagle"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--probe", action="store_true", help="time 5 steps and exit")
    return p.parse_args(argv)


def encode_split(tok: Tokenizer, files, split: str, eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch([f.text for f in files if f.split == split]):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def target_features(target, ids: torch.Tensor):
    """Final (normed) hidden states and logits of the frozen target, float32."""
    f = target.model(input_ids=ids).last_hidden_state
    return f, target.lm_head(f)


def unroll(head: EagleHead, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor, T: int, K: int):
    """The head's outputs for steps 1..K from every start t < T: list of [B, T, H].

    ids [B, T + K] are the chain's input tokens (x[t + j] at step j), feats[:, :T]
    the target's features. Step j's query sits at position t + j - 1."""
    B = ids.shape[0]
    pos = torch.arange(T).expand(B, T)
    keys, values, outs, hidden = [], [], [], feats[:, :T]
    for j in range(1, K + 1):
        h0, q, k, v = head.qkv(F.embedding(ids[:, j:j + T], embed), hidden, pos + (j - 1))
        keys.append(k)
        values.append(v)
        hidden = head.finish(h0, q, torch.cat(keys, 1), torch.cat(values, 1), ttt_mask(T, j))
        outs.append(hidden)
    return outs


def loss_of(head, embed, target, batch: torch.Tensor, T: int, K: int):
    feats, logits = target_features(target, batch)                 # batch [B, T + K]
    outs = unroll(head, embed, batch, feats, T, K)
    total, accs = 0.0, []
    for j, g in enumerate(outs, start=1):
        teacher = logits[:, j:j + T].softmax(-1)                      # the target at t + j
        draft = F.log_softmax(g @ embed.T, -1)
        total = total + 0.8 ** (j - 1) * -(teacher * draft).sum(-1).mean()
        accs.append((draft.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return total, accs


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))


@torch.no_grad()
def evaluate_head(head, target, prompts: list[torch.Tensor], new_tokens: int, max_k: int = 5) -> dict:
    """Acceptance along the target's own greedy continuations (see the module docstring)."""
    embed = target.model.embed_tokens.weight
    accepted_runs = []                       # per chain start: accepted drafts out of max_k
    for p in prompts:
        seq = target.generate(p[None], max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=target.config.pad_token_id)[0]
        n0, T = len(p), len(seq) - max_k - 1          # chains start after positions n0-1 .. T-1
        feats, _ = target_features(target, seq[None])
        ids = seq[None]
        outs = unroll(head, embed, ids, feats, T, max_k)
        drafts = torch.stack([(g @ embed.T).argmax(-1)[0] for g in outs])     # [k, T]
        for t in range(n0 - 1, T):
            n = 0
            while n < max_k and int(drafts[n, t]) == int(seq[t + n + 2]):
                n += 1
            accepted_runs.append(n)
    runs = torch.tensor(accepted_runs)
    per_pos = [float((runs >= j).float().mean() / max(1e-9, (runs >= j - 1).float().mean()))
               for j in range(1, max_k + 1)]
    return dict(prompts=len(prompts), chains=len(accepted_runs), acceptance_per_position=[round(a, 4) for a in per_pos],
                mean_acceptance_length={k: round(1 + float(runs.clamp(max=k).float().mean()), 4)
                                        for k in range(1, max_k + 1)})


def write_card(out: Path, metrics: dict, target_config: dict) -> None:
    """README.md of the head, from its training_metrics.json."""
    a, ho = metrics["args"], metrics["held_out"]
    per_pos = " | ".join(f"{x:.3f}" for x in ho["acceptance_per_position"])
    tau = " | ".join(f"{v:.2f}" for v in ho["mean_acceptance_length"].values())
    last = metrics["history"][-1]
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    card = f"""# tiny-py-eagle

An EAGLE-1 draft head for `tiny-py-target`, trained by this course on the target's own hidden states
(`training/train_eagle.py`). It is one Llama decoder layer plus the `fc` that merges a token's embedding
with the target's final hidden state; it has no embedding or LM head of its own (it uses the target's).
vLLM 0.32 loads it as `EagleLlamaForCausalLM`:
`speculative_config={{"method": "eagle", "model": "models/tiny-py-eagle", "num_speculative_tokens": 3}}`,
and so does mini-vLLM.

| | |
|---|---|
| target | `tiny-py-target` (Qwen3, hidden {target_config["hidden_size"]}, {target_config["num_hidden_layers"]} layers), frozen |
| data | the target's training split ({metrics["train_tokens"]:,} tokens of {metrics["python"]} standard-library files), random windows of {a["seq_len"]} + {a["ttt_steps"]} tokens |
| objective | cross-entropy against the target's distribution one token further ahead, for {a["ttt_steps"]} unrolled draft steps (training-time test), weighted 0.8^(j-1) |
| steps | {a["steps"]} AdamW steps of {a["batch_size"]} windows (peak lr {a["lr"]}, warm-up then cosine), seed {a["seed"]} |
| wall time | {metrics["wall_minutes"]} min on {metrics["machine"]} ({a["threads"]} threads), bf16 matmuls under autocast{metrics.get("wall_note", "")} |
| parameters | {metrics["parameters"]:,} |
| weights | float32 `model.safetensors`, sha256 `{sha}` |

## Held-out acceptance (greedy)

The target continues {ho["prompts"]} held-out prompts (the first 64 tokens of each held-out file) greedily for {a["eval_tokens"]} tokens; along its own text a
draft is accepted exactly when it equals the next token, so every position starts a chain
({ho["chains"]} chains). Acceptance at draft position j is conditional on the drafts before it.

| draft position | 1 | 2 | 3 | 4 | 5 |
|---|---|---|---|---|---|
| acceptance | {per_pos} |

| k | 1 | 2 | 3 | 4 | 5 |
|---|---|---|---|---|---|
| mean acceptance length (1 + E[accepted]) | {tau} |

Top-1 agreement with the target during the last training step (training windows, steps 1..{a["ttt_steps"]}):
{", ".join(f"{x:.3f}" for x in last["top1_agreement"])}.

## Reproduce

```
make eagle-model        # python training/train_eagle.py --out models/tiny-py-eagle
```
"""
    (out / "README.md").write_text(card)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    tcfg = json.loads((args.target / "config.json").read_text())
    eos = tcfg["eos_token_id"]
    files = collect_files(stdlib_root())
    train_ids = encode_split(tok, files, "train", eos)
    val_files = [f for f in files if f.split == "val"]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, local_files_only=True).eval()
    for prm in target.parameters():
        prm.requires_grad_(False)
    embed = target.model.embed_tokens.weight
    print(f"corpus {python_version()}: {len(train_ids):,} train tokens, {len(val_files)} held-out files, "
          f"{time.time() - t0:.0f} s", flush=True)

    head = EagleHead(tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"],
                     tcfg["head_dim"], tcfg["intermediate_size"], tcfg["rms_norm_eps"],
                     tcfg["rope_parameters"]["rope_theta"])
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    T, K, B = args.seq_len, args.ttt_steps, args.batch_size
    history, ema = [], None
    steps = 5 if args.probe else args.steps
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - T - K, (B,), generator=gen)
        batch = torch.stack([train_ids[s:s + T + K] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr)
        # bf16 matmuls (AVX512-BF16 / AMX through oneDNN), float32 weights and optimizer
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accs = loss_of(head, embed, target, batch, T, K)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            rec = dict(step=step, loss=round(ema, 4), top1_agreement=[round(a, 3) for a in accs],
                       minutes=round((time.time() - t0) / 60, 2))
            history.append(rec)
            print(json.dumps(rec), flush=True)
    if args.probe:
        print(f"{(time.time() - t0) / 5:.2f} s/step including start-up")
        return

    # Held-out prompts: the first 64 tokens of each held-out file, then the target's own text.
    prompts = [torch.tensor(tok.encode(f.text).ids[:64]) for f in val_files[: args.eval_prompts]]
    result = evaluate_head(head, target, prompts, args.eval_tokens)
    print(json.dumps(result), flush=True)
    save_head(head, args.out, tcfg)
    metrics = dict(args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   python=python_version(), machine=cpu_name(), train_tokens=len(train_ids),
                   parameters=sum(p.numel() for p in head.parameters()),
                   wall_minutes=round((time.time() - t0) / 60, 1), history=history, held_out=result)
    (args.out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_card(args.out, metrics, tcfg)


if __name__ == "__main__":
    sys.exit(main())
