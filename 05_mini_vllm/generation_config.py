"""Default sampling parameters from a checkpoint's `generation_config.json`.

vLLM counterpart: `ModelConfig.get_diff_sampling_param` and
`try_get_generation_config` in `vllm/config/model.py`, chosen by
`--generation-config`:
- "auto" (the default): the model folder's generation_config.json;
- "vllm": none, vLLM's neutral defaults (temperature 1, no top-k / top-p, ...);
- a folder: the generation_config.json in it.

Only values that differ from transformers' own defaults count (vLLM reads the
file's diff against `GenerationConfig()`), and only the sampling fields vLLM
takes: temperature, top_p, top_k, min_p, the three penalties, and
max_new_tokens, which becomes `max_tokens`. A request's own values always win;
`max_tokens` from here applies only to requests that give none.
"""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("mini_vllm")

SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                   "top_p", "min_p", "max_new_tokens")


def get_diff_sampling_param(model_path: str, generation_config: str = "auto") -> dict:
    """{sampling field: value} that the checkpoint sets; {} for "vllm" or no file."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_path if generation_config == "auto" else generation_config)
    if generation_config != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json; "
                         f"{folder} has none")
    if not (folder / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(str(folder), local_files_only=True).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: {folder}/generation_config.json cannot be read: {e}") from None
    out = {k: diff[k] for k in SAMPLING_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.info("default sampling parameters from %s/generation_config.json: %s "
                    "(--generation-config vllm ignores them)", folder, out)
    return out
