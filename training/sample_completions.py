"""Print greedy continuations of a few prompts from both tiny models.

    python training/sample_completions.py [--max-new-tokens 48]

Greedy decoding through Hugging Face `generate` alone (no engine yet); the models stop
early when they emit <|endoftext|>, which the training corpus puts after every file.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mini_vllm.course.tiny_models import MODEL_NAMES, load_tiny_model, load_tiny_tokenizer  # noqa: E402

# The last two show the trailing-space effect: the tokenizer glues a space to the next word
# (" os"), so a prompt ending in a bare space starts from a token the model rarely saw mid-line.
PROMPTS = ["def __init__(self", "import ", "class ", "import", "class"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    if not 1 <= args.max_new_tokens <= 1024:
        raise ValueError(f"max_new_tokens must be in [1, 1024], got {args.max_new_tokens}")
    torch.set_num_threads(2)
    tok = load_tiny_tokenizer()
    for name in MODEL_NAMES:
        model = load_tiny_model(name)
        print(f"===== {name} =====")
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            print(f"--- prompt {prompt!r} ({out.shape[1] - ids.shape[1]} new tokens)")
            print(tok.decode(out[0]))


if __name__ == "__main__":
    main()
