"""Train a byte-level BPE tokenizer (``tokenizers`` library) and wrap it for AutoTokenizer.

The pre-tokenizer is a regex Split with the Qwen2 pattern followed by ByteLevel, so
digits are split one by one and runs of indentation become single pieces. Byte-level
BPE can encode any string and decodes it back exactly (no UNK, no normalisation).

The saved ``tokenizer_config.json`` names ``PreTrainedTokenizerFast``: AutoTokenizer then
loads ``tokenizer.json`` verbatim, instead of rebuilding a ``qwen2`` tokenizer its own way.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END]  # ids 0..3, in this order

# The Qwen2 pre-tokenization pattern (letters, single digits, punctuation runs, newlines, spaces).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "pad_token": PAD, "bos_token": None, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,  # decode must return the exact bytes
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]}, indent=2) + "\n")
