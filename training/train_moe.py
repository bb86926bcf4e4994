"""Upcycle tiny-py-target into `tiny-py-moe`, a Qwen3-MoE (8 experts, top-2) the engine serves.

    python training/train_moe.py --out models/tiny-py-moe      # what `make moe-model` runs

Why upcycling: the course's MoE chapter needs a model whose text is readable and whose router
has learned something, so that the load per expert it plots is a real distribution. Trained
from scratch on 2 CPU cores it would not get there in 30 minutes (a dense target step of
16 x 256 tokens took about 9 s here, and the target needed 16M tokens). Sparse upcycling
starts from the trained dense model instead: embeddings, attention and norms are copied, and
each layer's MLP becomes the experts, so only the router and the experts' specialisation
have to be learned.

Experts (fine-grained upcycling): the dense MLP's 768 SiLU neurons are cut into 4 slices of
192; experts e and e + 4 start from slice e (gate, up and down rows), each with its own small
Gaussian perturbation so that the two copies can diverge. Full-width copies (the original
recipe) would make 8 x 768-wide experts, a 47 MB bf16 checkpoint; slices keep it at 17 MB
and the active width per token (2 x 192) at half the dense MLP's. A token's two renormalised
weights sum to 1 and a slice holds 1/4 of the neurons, so the down projection is scaled up
(--down-scale): x4 would make the block's output, averaged over random routing, equal to the
dense MLP's; measured on 2,048 held-out tokens right after upcycling, x3 is best (loss 4.00,
against 4.11 at x4 and 4.09 at x2; the dense model: 3.14), so x3 is the default. The router
starts random and small (near-uniform routing); training recovers the rest.

Training: next-token cross-entropy on the target's training split (same corpus, tokenizer and
held-out files, `corpus.py`), plus transformers' Switch-style load-balancing loss on the router
logits (`output_router_logits`), per layer and averaged (weight --aux-coef; 2.0 = top_k means
perfectly balanced); AdamW on every parameter, warm-up then cosine. Validation every --eval-every steps; the checkpoint with the
lowest validation loss is saved (bf16, `save_pretrained`), then reloaded for the card.
--max-minutes caps the wall clock (the card's command then names --stop-at).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from evaluate import EVAL_WINDOWS, logits_on, sha256, split_ids, unigram_loss  # noqa: E402
from machine import machine_line  # noqa: E402
from train_tiny_lm import lr_at, save_bf16, val_loss  # noqa: E402

COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAMPLE_PROMPT = "def read_config(path):\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=Path("models/tiny-py-target"))
    p.add_argument("--out", type=Path, default=Path("models/tiny-py-moe"))
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=192, help="moe_intermediate_size; divides the dense MLP")
    p.add_argument("--down-scale", type=float, default=3.0, help="factor on the experts' down projections")
    p.add_argument("--noise", type=float, default=0.05, help="perturbation std, relative to each matrix's std")
    p.add_argument("--aux-coef", type=float, default=0.02)
    p.add_argument("--steps", type=int, default=600, help="planned steps (the lr schedule)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (schedule unchanged)")
    p.add_argument("--max-minutes", type=float, default=24.0, help="wall-clock cap of the training loop")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def moe_config(dense, args) -> Qwen3MoeConfig:
    """The dense config's attention, embedding and norm shapes; every layer sparse."""
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "rope_parameters")
    return Qwen3MoeConfig(**{k: getattr(dense, k) for k in keep}, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=args.aux_coef, output_router_logits=False)


@torch.no_grad()
def upcycle(dense: Qwen3ForCausalLM, args) -> Qwen3MoeForCausalLM:
    """Everything but the MLPs copied; each MLP's neuron slices copied into the experts, perturbed."""
    torch.manual_seed(args.seed)
    moe = Qwen3MoeForCausalLM(moe_config(dense.config, args))
    sd = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(sd, strict=False)
    assert not unexpected and all(".mlp." in k for k in missing), (missing, unexpected)
    width, n_slices = dense.config.intermediate_size, dense.config.intermediate_size // args.expert_width
    assert n_slices * args.expert_width == width, "--expert-width must divide the dense MLP width"
    for layer, block in zip(dense.model.layers, moe.model.layers):
        gate, up, down = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight
        for e in range(args.experts):
            cols = slice((e % n_slices) * args.expert_width, (e % n_slices + 1) * args.expert_width)
            g, u, d = gate[cols], up[cols], down[:, cols] * args.down_scale
            g, u, d = (w + args.noise * w.std() * torch.randn_like(w) for w in (g, u, d))
            block.mlp.experts.gate_up_proj[e] = torch.cat([g, u])
            block.mlp.experts.down_proj[e] = d
        block.mlp.gate.weight.normal_(0.0, 0.02)  # small: near-uniform routing at the start
    return moe


def balance_loss(router_logits, num_experts: int, k: int) -> torch.Tensor:
    """transformers' Switch loss for each layer on its own, averaged. Handed every layer at once,
    `load_balancing_loss_func` pools their counts: a trial run balanced the pool while layer 1
    sent 0.4% of its assignments to each of two experts."""
    return torch.stack([load_balancing_loss_func((lg,), num_experts, k) for lg in router_logits]).mean()


def train_step(model, opt, batch, lr, aux_coef) -> tuple[float, float]:
    for g in opt.param_groups:
        g["lr"] = lr
    out = model(input_ids=batch[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    aux = balance_loss(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
    opt.zero_grad(set_to_none=True)
    (ce + aux_coef * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce.item(), aux.item()


def save(model, base: Path, out: Path) -> None:
    """bf16 safetensors + the base's generation config and tokenizer files, byte for byte."""
    save_bf16(model, out)
    for name in COPIED_FILES:
        (out / name).write_bytes((base / name).read_bytes())


@torch.no_grad()
def expert_load(model, x: torch.Tensor) -> list[list[float]]:
    """Per layer: the share of the (token, slot) assignments each expert received on x."""
    k, E = model.config.num_experts_per_tok, model.config.num_experts
    counts = torch.zeros(model.config.num_hidden_layers, E)
    for i in range(0, len(x), 8):
        out = model(input_ids=x[i:i + 8], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            counts[layer] += torch.bincount(logits.topk(k, -1).indices.flatten(), minlength=E).float()
    return (counts / counts.sum(1, keepdim=True)).round(decimals=4).tolist()


@torch.no_grad()
def evaluate(out: Path, base: Path, train: torch.Tensor, val: torch.Tensor, seq_len: int) -> dict:
    """On the saved bf16 files (upcast to fp32), the held-out windows evaluate.py scores the dense models on."""
    n = min(EVAL_WINDOWS, (len(val) - 1) // seq_len)
    x, y = val[: n * seq_len].view(n, seq_len), val[1: n * seq_len + 1].view(n, seq_len)
    res = dict(eval_tokens=n * seq_len, unigram_val_loss=round(unigram_loss(train, y.flatten(), model_vocab(base)), 4))
    for name, path in (("moe", out), ("dense", base)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        logits = logits_on(model, x)
        res[f"{name}_val_loss"] = round(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())), 4)
        res[f"{name}_val_top1_accuracy"] = round(float((logits.argmax(-1) == y).double().mean()), 4)
    res["expert_load"] = expert_load(model := AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), x)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(SAMPLE_PROMPT, return_tensors="pt").input_ids
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    res["sample"] = tok.decode(gen[0])
    return res


def model_vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def command_for(args, stopped_at: int | None) -> str:
    cmd = (f"python training/train_moe.py --out {args.out.as_posix()} --steps {args.steps} --seed {args.seed} "
           f"--threads {args.threads}")
    return cmd + (f" --stop-at {stopped_at}" if stopped_at is not None else "")


def write_card(out: Path, meta: dict) -> None:
    a, r, ev = meta["args"], meta["run"], meta["eval"]
    load = "\n".join(f"| {i} | " + " | ".join(f"{v:.3f}" for v in row) + f" | {max(row) / min(row):.1f} |"
                     for i, row in enumerate(ev["expert_load"]))
    n_e = len(ev["expert_load"][0])
    (out / "README.md").write_text(f"""# tiny-py-moe

`tiny-py-target` upcycled into a Qwen3-MoE and fine-tuned on the same corpus (`training/train_moe.py`):
every layer's MLP is replaced by {a['experts']} experts of width {a['expert_width']}, top-{a['top_k']}, renormalised
(`norm_topk_prob`). Same tokenizer, attention and embeddings as `tiny-py-target`; loads offline with
`AutoModelForCausalLM` and in the engine (`mini_vllm.LLM("models/tiny-py-moe")`).

| | |
|---|---|
| base | `tiny-py-target` (dense MLP 768 cut into {768 // a['expert_width']} slices; expert e starts from slice e mod {768 // a['expert_width']}, perturbed, down projection x{meta['down_scale']}) |
| parameters | {meta['parameters']:,} ({meta['active_parameters']:,} active per token) |
| data | the target's training split ({meta['train_tokens']:,} tokens), random windows of {a['seq_len']} |
| loss | cross-entropy + {a['aux_coef']} x load-balancing loss (transformers' `load_balancing_loss_func` per layer, averaged; {a['top_k']}.0 = balanced) |
| training | AdamW (lr {a['lr']}, warm-up then cosine to 10%), batch {a['batch_size']} x {a['seq_len']}, {r['steps_run']} of {a['steps']} planned steps; checkpoint kept from step {r['best_step']} (best validation loss) |
| wall time | {r['minutes']} min of training, {meta['total_minutes']} min in all, {a['threads']} threads |
| machine | {meta['machine']} |
| weights | bf16 `model.safetensors`, sha256 `{meta['sha256']}` |

## Results (saved bf16 weights upcast to fp32, {ev['eval_tokens']:,} held-out tokens, the windows of the dense cards)

| | validation loss (nats/token) | top-1 accuracy |
|---|---|---|
| tiny-py-moe | {ev['moe_val_loss']} | {ev['moe_val_top1_accuracy']} |
| tiny-py-target (dense, MLP 768) | {ev['dense_val_loss']} | {ev['dense_val_top1_accuracy']} |
| upcycled, before fine-tuning | {r['initial_val_loss']} (first {a['seq_len'] * 24:,} tokens) | |
| unigram baseline | {ev['unigram_val_loss']} | |

Load per expert on the same held-out tokens (share of the top-{a['top_k']} assignments; uniform = {1 / n_e:.3f}):

| layer | """ + " | ".join(f"e{e}" for e in range(n_e)) + " | max / min |\n|" + "---|" * (n_e + 2) + f"""
{load}

Greedy continuation of `{SAMPLE_PROMPT!r}` (transformers' `generate`):

```
{ev['sample']}
```

## Reproduce

```
{meta['command']}
```

Training history (step, train cross-entropy EMA, load-balancing loss EMA, validation loss on 6,144 tokens, minutes):
""" + "\n".join(f"- {h['step']}: {h['train_ce']} / {h['aux']} / {h['val_loss']} / {h['minutes']}"
               for h in r["history"]) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(args.base)
    models_dir = args.base.parent
    train, val = split_ids(tok, models_dir, "train"), split_ids(tok, models_dir, "val")
    dense = Qwen3ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    model = upcycle(dense, args).train()
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - expert_params + expert_params * args.top_k // args.experts
    initial = val_loss(model, val, args.seq_len)
    print(f"{n_params:,} parameters ({active:,} active); upcycled val loss {initial:.3f} "
          f"(dense {val_loss(dense, val, args.seq_len):.3f})", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    limit = min(args.steps, args.stop_at or args.steps)
    best, best_step, history, ce_ema, aux_ema, t0 = float("inf"), 0, [], 0.0, 0.0, time.time()
    stopped_at = None
    for step in range(limit):
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train[s: s + args.seq_len + 1] for s in starts.tolist()])
        ce, aux = train_step(model, opt, batch, lr_at(step, args.steps, args.lr), args.aux_coef)
        ce_ema, aux_ema = (0.9 * ce_ema + 0.1 * ce, 0.9 * aux_ema + 0.1 * aux) if step else (ce, aux)
        done, minutes = step + 1, (time.time() - t0) / 60
        out_of_time = minutes > args.max_minutes
        if done % args.eval_every == 0 or done == limit or out_of_time:
            v = val_loss(model, val, args.seq_len)
            history.append(dict(step=done, train_ce=round(ce_ema, 4), aux=round(aux_ema, 4), val_loss=round(v, 4),
                                minutes=round(minutes, 2)))
            print(f"step {done}/{args.steps} ce {ce_ema:.3f} aux {aux_ema:.3f} val {v:.3f} {minutes:.1f} min",
                  flush=True)
            if v < best:
                best, best_step = v, done
                save(model, args.base, args.out)
        if out_of_time:
            stopped_at = done
            print(f"wall-clock cap reached at step {done}", flush=True)
            break
    run = dict(steps_run=stopped_at or limit, best_step=best_step, val_loss_during_training=round(best, 4),
               initial_val_loss=round(initial, 4), minutes=round((time.time() - t0) / 60, 1), history=history)
    ev = evaluate(args.out, args.base, train, val, args.seq_len)
    meta = dict(args={k: v.as_posix() if isinstance(v, Path) else v for k, v in vars(args).items()},
                down_scale=args.down_scale, parameters=n_params, active_parameters=active,
                train_tokens=len(train), run=run, eval=ev,
                command=command_for(args, stopped_at if stopped_at is not None else args.stop_at),
                machine=machine_line((args.threads,)), sha256=sha256(args.out / "model.safetensors"))
    meta["total_minutes"] = round((time.time() - t_start) / 60, 1)
    (args.out / "training_metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_card(args.out, meta)
    print(f"val loss {ev['moe_val_loss']} (dense {ev['dense_val_loss']}, unigram {ev['unigram_val_loss']}); "
          f"{meta['total_minutes']} min", flush=True)


if __name__ == "__main__":
    main()
