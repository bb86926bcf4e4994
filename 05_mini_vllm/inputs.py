"""Prompt inputs shared by the entry points: one prompt or many, as a list.

vLLM counterpart: `vllm/inputs/` (`data.py`: the prompt types `TextPrompt`
and `TokensPrompt`; `parse.py`: `parse_and_batch_prompt`, which turns one
prompt or a batch into a list).

A prompt is a str (text), a list of token ids, or a dict with "prompt"
(text) or "prompt_token_ids"; `engine/processor.py` validates each one. This
module imports nothing of the engine, so `entrypoints/llm.py` and
`beam_search.py` both use it without importing each other.
"""
from __future__ import annotations


def as_prompt_list(prompts) -> list:
    """One prompt or a list of prompts -> a list of prompts. A flat list of
    ints is one prompt given as token ids, not a batch of one-token prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
