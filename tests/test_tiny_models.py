"""The committed tiny models: offline loading, exact tokenizer round-trip, real learning.

These run on a fresh clone without training: they read models/ and the running
interpreter's standard library (the held-out files named in models/corpus_files.txt).
"""
import json
import os
import re
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mini_vllm.course import tiny_models

NAMES = (tiny_models.TARGET_NAME, tiny_models.DRAFT_NAME)  # trained from scratch; the editor is tested below
SEQ, WINDOWS = 256, 8           # held-out slice scored by the loss tests: 2,048 tokens
CLEAR_MARGIN_NATS = 1.0         # "clearly better" than unigram: a factor e in perplexity


def corpus_rows():
    path = tiny_models.models_dir() / "corpus_files.txt"
    return [ln.split("\t")[:2] for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]


def stdlib_texts(split, every=1):
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = [rel for s, rel in corpus_rows() if s == split][::every]
    return [(root / rel).read_text(encoding="utf-8") for rel in rows if (root / rel).is_file()]


@pytest.fixture(scope="module")
def tok():
    return tiny_models.load_tiny_tokenizer()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {n: tiny_models.load_tiny_model(n) for n in NAMES}


@pytest.fixture(scope="module")
def heldout(tok):
    texts = stdlib_texts("val")
    assert len(texts) >= 10, "held-out files missing: models/corpus_files.txt does not match this Python"
    ids = []
    for t in texts:
        ids += tok.encode(t) + [tok.eos_token_id]
    ids = torch.tensor(ids[: SEQ * WINDOWS + 1])
    return ids[:-1].view(WINDOWS, SEQ), ids[1:].view(WINDOWS, SEQ)


@pytest.mark.parametrize("name", tiny_models.MODEL_NAMES)
def test_loads_offline_through_auto_classes(name, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_models.models_dir() / name
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen3", "the engine expects a standard Qwen3 checkpoint"
    n = sum(p.numel() for p in model.parameters())
    lo, hi = (0.5e6, 2e6) if name == tiny_models.DRAFT_NAME else (5e6, 15e6)
    assert lo <= n <= hi, f"{name} has {n:,} parameters, outside its size class"
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>"), \
        "generation_config must stop on the tokenizer's end-of-text token"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes <= {"BF16", "F16"}, f"weights must be committed in half precision, found {dtypes}"


@pytest.mark.parametrize("name", tiny_models.MODEL_NAMES[1:])
def test_every_model_shares_the_targets_tokenizer(name):
    d = tiny_models.models_dir()
    assert (d / tiny_models.TARGET_NAME / "tokenizer.json").read_bytes() == (d / name / "tokenizer.json").read_bytes(), \
        "speculative decoding compares token ids, so the models need the identical vocabulary"


def test_roundtrip_on_heldout_files(tok):
    texts = stdlib_texts("val")
    texts += ["x = 'caf\u00e9' \u2192 \U0001F40D\n\ttab\r\nCRLF  ", "", "<|endoftext|> literal"]
    for t in texts:
        assert tok.decode(tok.encode(t)) == t, "byte-level BPE must decode to the exact input text"


def test_auto_tokenizer_encodes_like_the_trained_tokenizer_json(tok):
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(tiny_models.models_dir() / tiny_models.TARGET_NAME / "tokenizer.json"))
    for t in stdlib_texts("val")[:5] + ["    def f(x):\n        return x**2  # 123\n"]:
        assert tok.encode(t) == raw.encode(t).ids, \
            "AutoTokenizer rebuilt the tokenizer differently from training: ids would not match the model"


def test_special_tokens_and_chat_template(tok):
    for s in ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(s)) == 1, f"{s} must be one atomic token, not split by BPE"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def unigram_nll(tok, targets):
    ids = []
    for t in stdlib_texts("train", every=8):   # every 8th training file: frequencies, not the model
        ids += tok.encode(t) + [tok.eos_token_id]
    counts = torch.bincount(torch.tensor(ids), minlength=len(tok)).double() + 1.0
    return float(-(counts / counts.sum()).log()[targets.flatten()].mean())


@torch.no_grad()
def test_validation_loss_clearly_beats_unigram(tok, models, heldout):
    x, y = heldout
    base = unigram_nll(tok, y)
    for name, model in models.items():
        loss = float(torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()))
        assert loss <= base - CLEAR_MARGIN_NATS, \
            f"{name}: held-out loss {loss:.3f} is not {CLEAR_MARGIN_NATS} nat below unigram {base:.3f}: it learned no context"
        card = (tiny_models.models_dir() / name / "README.md").read_text()
        stated = float(re.search(r"\| validation loss \| ([0-9.]+) nats/token", card).group(1))
        metrics = json.loads((tiny_models.models_dir() / name / "training_metrics.json").read_text())
        assert stated == metrics["eval"]["val_loss"], "card and metrics file disagree"
        assert stated <= base - CLEAR_MARGIN_NATS, f"{name}: the card states a loss no better than unigram"


@torch.no_grad()
def test_draft_agrees_with_target_better_than_a_constant_guess(models, heldout):
    x, _ = heldout
    t = models[tiny_models.TARGET_NAME](input_ids=x).logits.argmax(-1)
    d = models[tiny_models.DRAFT_NAME](input_ids=x).logits.argmax(-1)
    alpha = float((t == d).double().mean())
    mode_rate = float((t == torch.mode(t.flatten()).values).double().mean())
    assert alpha > mode_rate + 0.1, \
        f"draft agreement {alpha:.3f} barely beats always guessing the target's commonest token ({mode_rate:.3f})"
    card_alpha = json.loads((tiny_models.models_dir() / tiny_models.DRAFT_NAME / "training_metrics.json")
                            .read_text())["greedy_agreement_alpha"]
    assert 0.0 < card_alpha < 1.0


def test_bad_name_and_dtype_raise_value_error():
    with pytest.raises(ValueError, match="name"):
        tiny_models.load_tiny_model("gpt-5")
    with pytest.raises(ValueError, match="dtype"):
        tiny_models.load_tiny_model(tiny_models.TARGET_NAME, dtype=torch.int8)


def test_models_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MINI_VLLM_MODELS_DIR", str(tmp_path))
    assert tiny_models.models_dir() == tmp_path
    with pytest.raises(FileNotFoundError):
        tiny_models.load_tiny_model(tiny_models.TARGET_NAME)
