"""The bodies the server answers with, as pydantic models, for its OpenAPI document.

vLLM counterpart: the response classes of `vllm/entrypoints/openai/completion/protocol.py`
(`CompletionResponse`, `CompletionStreamResponse`, `CompletionLogProbs`),
`chat_completion/protocol.py` (`ChatCompletionResponse`, `ChatCompletionLogProbs`) and
`serve/tokenize/protocol.py` (`TokenizeResponse`, `DetokenizeResponse`).

The handlers build their bodies as plain dicts (a pydantic object per streamed
chunk would cost the hot path); these models describe exactly those dicts, and
the OpenAPI fuzz test (`tests/test_server_fuzz.py`) checks every JSON answer it
provokes against them, so the document cannot drift from what is sent. Fields a
handler sends as null are declared nullable, and none is left out.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mini_vllm.entrypoints.openai.protocol import UsageInfo, random_id


class _Strict(BaseModel):
    # additionalProperties: false in the document, so an undeclared field sent is a mismatch.
    model_config = ConfigDict(extra="forbid")


class CompletionLogProbs(_Strict):
    """The legacy completions shape; nulls where nothing scored a token (an echoed first
    prompt token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Strict):
    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # only when asked for


class CompletionResponse(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str


class CompletionStreamChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None


class CompletionStreamResponse(_Strict):
    """One event of a completions stream; the last (with include_usage) has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None  # the last event with include_usage; every event with continuous_usage_stats
    system_fingerprint: str | None = None  # on the event that ends the stream's content


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[ChatLogprobEntry]


class ChatMessageOut(_Strict):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Strict):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None


class ChatCompletionResponse(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str


class ChatDelta(_Strict):
    role: Literal["assistant"] | None = None  # the first event of each choice
    content: str | None = None


class ChatStreamChoice(_Strict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None  # absent on the first (role) event


class ChatCompletionStreamResponse(_Strict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TokenizeResponse(_Strict):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None


class DetokenizeResponse(_Strict):
    prompt: str


class VersionResponse(_Strict):
    version: str


class ModelPermission(_Strict):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Strict):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mini-vllm"
    root: str | None = None
    parent: str | None = None  # set for adapters in vLLM; a base model has none
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(_Strict):
    object: str = "list"
    data: list[ModelCard]
