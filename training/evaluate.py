"""Evaluate the saved checkpoints exactly as a user loads them, then write the model cards.

    python training/evaluate.py --out models     # redo evaluation + cards from saved models

Everything is measured on the committed bf16 weights (loaded and upcast to fp32 through
AutoModelForCausalLM), on the validation files, which no training step ever saw:
  * validation loss (nats/token) over the first EVAL_WINDOWS windows of the validation stream;
  * a unigram baseline: add-one-smoothed training-token frequencies scored on the same tokens;
  * the draft's greedy agreement with the target: the fraction of positions where both argmaxes
    agree. This is the per-token acceptance rate alpha of greedy speculative decoding.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corpus import read_file_list, stdlib_root

EVAL_WINDOWS = 48
TARGET, DRAFT = "tiny-py-target", "tiny-py-draft"


def split_ids(tok, out: Path, split: str, stdlib: str | None = None) -> torch.Tensor:
    root = stdlib_root(stdlib)
    ids = []
    for s, rel in read_file_list(out / "corpus_files.txt"):
        if s == split:
            ids.extend(tok.encode((root / rel).read_text(encoding="utf-8")))
            ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def unigram_loss(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0  # add-one: no infinite loss
    logp = (counts / counts.sum()).log()
    return float(-logp[eval_ids].mean())


@torch.no_grad()
def logits_on(model, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=x[i:i + 8]).logits for i in range(0, len(x), 8)])


def evaluate_pair(out: Path, seq_len: int, log, stdlib: str | None = None) -> dict:
    tok = AutoTokenizer.from_pretrained(out / TARGET)
    val = split_ids(tok, out, "val", stdlib)
    train = split_ids(tok, out, "train", stdlib)
    n = min(EVAL_WINDOWS, (len(val) - 1) // seq_len)
    x = val[: n * seq_len].view(n, seq_len)
    y = val[1: n * seq_len + 1].view(n, seq_len)
    res = dict(eval_tokens=n * seq_len, unigram_val_loss=round(unigram_loss(train, y.flatten(), len(tok)), 4))
    argmax = {}
    for name in (TARGET, DRAFT):
        t0 = time.time()
        model = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval()
        logits = logits_on(model, x)
        res[name] = dict(val_loss=round(float(torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten())), 4))
        res[name]["val_top1_accuracy"] = round(float((logits.argmax(-1) == y).double().mean()), 4)
        argmax[name] = logits.argmax(-1)
        log(f"eval {name}: {res[name]} ({time.time() - t0:.0f} s)")
    res["greedy_agreement_alpha"] = round(float((argmax[TARGET] == argmax[DRAFT]).double().mean()), 4)
    log(f"eval: unigram {res['unigram_val_loss']}, alpha {res['greedy_agreement_alpha']}")
    return res


def command_for(args: dict, runs: dict) -> str:
    """The command that rebuilds models/ from a checkout; only non-default options are spelled out."""
    cmd = f"python training/train_tiny_lm.py --out models --seed {args['seed']}"
    defaults = dict(vocab_size=6144, seq_len=256, batch_size=64, lr=3e-3, eval_every=100, device=None)
    for k, v in defaults.items():
        if args.get(k) != v:
            cmd += f" --{k.replace('_', '-')} {args[k]}"
    for role, name in (("target", TARGET), ("draft", DRAFT)):
        cmd += f" --{role}-steps {runs[name]['steps_planned']}"
        if runs[name]["stopped_early"]:
            cmd += f" --{role}-stop-at {runs[name]['steps_run']}"
    return cmd


def where_it_ran(meta: dict) -> str:
    a = meta["args"]
    text = f"Trained on {meta['device']} (`--device {a['device']}`)."
    if a.get("stdlib"):
        text += (f" That machine's interpreter was not {meta['python']}, so the corpus was read from a copy of the"
                 f" {meta['python']} standard library's `.py` files (`--stdlib DIR --stdlib-version '{meta['python']}'`);"
                 f" with a {meta['python']} interpreter the command below reads the same files.")
    return text


def write_card(out: Path, meta: dict, run: dict, res: dict, cmd: str) -> None:
    name, a = run["name"], run["arch"]
    other = DRAFT if name == TARGET else TARGET
    m = res[name]
    card = f"""# {name}

A tiny Qwen3-architecture causal language model trained by this course on Python source.
It loads like any downloaded checkpoint: `AutoModelForCausalLM.from_pretrained("models/{name}")`
(or `mini_vllm.course.tiny_models.load_tiny_model("{name}")`), fully offline.

| | |
|---|---|
| corpus | CPython standard library `.py` files of {meta['python']} (test suites and site-packages excluded; includes `pydoc_data/topics.py`); {meta['n_files']} files, {meta['n_val_files']} held out by file hash; list in `models/corpus_files.txt` |
| tokens | {meta['train_tokens']:,} train, {meta['val_tokens']:,} validation |
| tokenizer | byte-level BPE (`tokenizers`), vocab {len_vocab(out)}, Qwen2 pre-tokenizer regex, specials `<\\|endoftext\\|>` (EOS), `<\\|pad\\|>`, `<\\|im_start\\|>`, `<\\|im_end\\|>`; loads as `PreTrainedTokenizerFast` |
| architecture | `Qwen3ForCausalLM`: hidden {a['hidden_size']}, {a['num_hidden_layers']} layers, {a['num_attention_heads']} query heads, {a["num_key_value_heads"]} KV head{"s" if a["num_key_value_heads"] > 1 else ""}, head_dim {a['head_dim']}, MLP {a['intermediate_size']}, tied embeddings, context 1024 |
| parameters | {run['parameters']:,} |
| training | AdamW (lr {meta['args']['lr']}, cosine to 10%), batch {meta['args']['batch_size']} x {meta['args']['seq_len']} tokens, {run['steps_run']} of {run['steps_planned']} planned steps; checkpoint kept from step {run['best_step']} (best validation loss) |
| tokens seen | {run['tokens_seen']:,} at the kept checkpoint ({run['tokens_seen_total']:,} in the whole run) |
| wall time | {run['wall_minutes']} min on {meta['device'] if meta['device'] != 'cpu' else str(meta['args']['threads']) + ' CPU threads'} |
| seed | {meta['args']['seed']} |
| weights | bf16 `model.safetensors`, sha256 `{sha256(out / name / 'model.safetensors')}` |

## Results (measured on the saved bf16 weights, {res['eval_tokens']:,} held-out tokens)

| metric | value |
|---|---|
| final train loss (EMA of the last steps) | {run['train_loss_ema']} nats/token |
| validation loss | {m['val_loss']} nats/token |
| unigram baseline on the same tokens | {res['unigram_val_loss']} nats/token |
| validation top-1 accuracy | {m['val_top1_accuracy']} |
| greedy agreement with `{other}` (alpha) | {res['greedy_agreement_alpha']} |

Alpha is the fraction of held-out positions where the draft's and the target's argmax agree:
the per-token acceptance rate of greedy speculative decoding with this pair.

## Reproduce

{where_it_ran(meta)}

```
{cmd}
```

`make models` runs the script with its defaults (which are these settings; the device defaults to CUDA when
present). The same seed gives the same data order and initialisation on CPU, but floating-point results differ
across devices, and on 2 CPU cores the run takes many hours (see `training/README.md`). Evaluation and cards
alone: `python training/evaluate.py --out models`.
Training history (step, train loss, validation loss on a 6k-token slice, minutes):
{chr(10).join(f"- {h['step']}: {h['train_loss']} / {h['val_loss']} / {h['minutes']}" for h in run['history'])}
"""
    (out / name / "README.md").write_text(card)
    (out / name / "training_metrics.json").write_text(json.dumps(dict(
        run=run, eval=res[name], unigram_val_loss=res["unigram_val_loss"], eval_tokens=res["eval_tokens"],
        greedy_agreement_alpha=res["greedy_agreement_alpha"], command=cmd), indent=2) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def len_vocab(out: Path) -> int:
    return len(AutoTokenizer.from_pretrained(out / TARGET))


def evaluate_and_write_cards(out: Path, log, stdlib: str | None = None) -> dict:
    """stdlib: where to read the corpus files now (default: where training read them)."""
    meta = json.loads((out / "training_runs.json").read_text())
    runs = {r["name"]: r for r in meta["runs"]}
    recorded = meta["args"].get("stdlib")
    if stdlib is None and recorded and Path(recorded).is_dir():
        stdlib = recorded  # else: this interpreter's stdlib (tests assume the same Python build)
    res = evaluate_pair(out, meta["args"]["seq_len"], log, stdlib)
    cmd = command_for(meta["args"], runs)
    for run in runs.values():
        write_card(out, meta, run, res, cmd)
    (out / "evaluation.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("models"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stdlib", default=None, help="read corpus files from here (default: where training read them)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    evaluate_and_write_cards(a.out, print, a.stdlib)
