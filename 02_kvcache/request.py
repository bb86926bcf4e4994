"""A minimal request, enough for the KV cache manager.

The manager is duck-typed: it reads only the attributes below, so Chapter 3's
`Request` (or anything with these fields) works too. This stand-in lets
Chapter 2 be tested without importing a higher chapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimpleRequest:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = -1  # -1: the whole initial token list is the prompt
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    def __post_init__(self):
        self.all_token_ids = list(self.all_token_ids)
        if self.num_prompt_tokens == -1:
            self.num_prompt_tokens = len(self.all_token_ids)
        if not 0 <= self.num_prompt_tokens <= len(self.all_token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [0, {len(self.all_token_ids)}], "
                f"got {self.num_prompt_tokens}")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Append one generated token (it becomes part of `all_token_ids`)."""
        self.all_token_ids.append(token_id)
