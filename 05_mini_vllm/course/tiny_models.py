"""Load the course's own tiny checkpoints (trained by ``training/train_tiny_lm.py``;
the editor fine-tuned from the target by ``training/finetune_editor.py``; the EAGLE
head for the target by ``training/train_eagle.py``; the mixture of experts upcycled
from the target by ``training/train_moe.py``).

The engine loads these exactly like a downloaded Hugging Face checkpoint (vLLM's
counterpart: ``vllm/model_executor/model_loader/default_loader.py``), only from the
repository's ``models/`` folder and always offline.

Invariants:
  * ``models_dir()`` is ``$MINI_VLLM_MODELS_DIR`` when set, else ``<repo>/models``.
  * Loading never touches the network (``HF_HUB_OFFLINE=1`` and ``local_files_only``).
  * The weights are stored in bf16; ``load_tiny_model`` casts to the requested dtype.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

TARGET_NAME = "tiny-py-target"
DRAFT_NAME = "tiny-py-draft"
EDITOR_NAME = "tiny-py-editor"  # the target fine-tuned to copy (training/finetune_editor.py)
MODEL_NAMES = (TARGET_NAME, DRAFT_NAME, EDITOR_NAME)
# Draft heads: not language models of their own (training/train_eagle.py); they run on the target.
EAGLE_NAME = "tiny-py-eagle"
HEAD_NAMES = (EAGLE_NAME,)
# A Qwen3-MoE (training/train_moe.py), kept out of MODEL_NAMES, whose members are dense Qwen3s.
MOE_NAME = "tiny-py-moe"
MOE_NAMES = (MOE_NAME,)


def models_dir() -> Path:
    env = os.environ.get("MINI_VLLM_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def model_path(name: str) -> Path:
    if name not in MODEL_NAMES + HEAD_NAMES + MOE_NAMES:
        raise ValueError(f"name must be one of {MODEL_NAMES + HEAD_NAMES + MOE_NAMES}, got {name!r}")
    path = models_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; run `make models` or set MINI_VLLM_MODELS_DIR")
    return path


def corpus_files(split: str) -> list[Path]:
    """The models' training ("train") or held-out ("val") standard-library files,
    in the order of `models/corpus_files.txt`, as far as this interpreter has them."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = [ln.split("\t") for ln in (models_dir() / "corpus_files.txt").read_text().splitlines()
            if ln and not ln.startswith("#")]
    return [root / r[1] for r in rows if r[0] == split and (root / r[1]).is_file()]


def load_tiny_tokenizer(name: str = TARGET_NAME):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path(name), local_files_only=True)


def load_tiny_model(name: str = TARGET_NAME, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=dtype, local_files_only=True)
    return model.to(device).eval()
