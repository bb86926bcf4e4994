"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

vLLM counterpart: `vllm/entrypoints/openai/completion/protocol.py`,
`chat_completion/protocol.py` and `serve/engine/protocol.py`. Field names and
defaults follow OpenAI's API reference, plus vLLM's sampling extras
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`allowed_token_ids`, `bad_words`, `prompt_logprobs`, `structured_outputs`, ...).

Invariants:
- No silent no-ops: every field of a request model is honoured or rejected
  with a 400 naming it, and a field the models do not know is a 400 too
  (`extra="forbid"`; vLLM only logs a warning).
- Every string anywhere in a request (fields, list items, dict keys and
  values) is valid Unicode: JSON's "\\ud800" escape decodes to a lone
  surrogate, which no tokenizer, grammar compiler or JSON encoder accepts,
  so it is a 400 naming the field here, before anything reads it.
- These models check only *types* (and which fields go together). Ranges
  (temperature >= 0, 0 < top_p <= 1, n >= 1, ...) are checked once, by
  `SamplingParams`, so the server and the offline `LLM` reject exactly the
  same values with the same message. `to_sampling_params` is the one place
  where API names become engine names; a field the request leaves out takes
  the server's default (the model's generation_config.json, vLLM's
  `--generation-config auto`), then OpenAI's.
"""
from __future__ import annotations

import uuid
from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mini_vllm.sampling_params import _CONSTRAINTS as CONSTRAINTS
from mini_vllm.sampling_params import MAX_STOP_STRINGS, SamplingParams, StructuredOutputsParams, check_encodable


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _check_text(name: str, value) -> None:
    """check_encodable on every string inside `value` (nested lists and dicts, keys too)."""
    if isinstance(value, str):
        check_encodable(name, value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(name, k)
            _check_text(name, v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_text(name, v)


class OpenAIBaseModel(BaseModel):
    # An unknown field is a 400 naming it: accepting it would silently ignore it. Strict
    # types: "5" is not an int nor 1 a bool, as the OpenAPI document says (pydantic's lax
    # mode would accept what the document calls invalid). An int is still a valid float.
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value, info: ValidationInfo):
        # Nested models run this on their own fields, so pydantic's error location
        # names the exact field (messages.0.content.0.text).
        _check_text(info.field_name, value)
        return value


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk (with include_usage)


class JsonSchemaFormat(OpenAIBaseModel):
    # name and description label the schema for the caller (vLLM reads neither);
    # the schema is always enforced exactly, whatever `strict` says.
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# The SamplingParams fields a request cannot set, and why. Every other SamplingParams
# field is a request field of the same name that reaches the engine's SamplingParams
# (`tests/test_server_sampling_fields.py` fails on a field that is neither, and on a
# request field whose value is dropped on its way).
ENGINE_ONLY_SAMPLING_FIELDS = {
    "skip_reading_prefix_cache": "an offline knob (LLM.generate); vLLM's API derives it from prompt_logprobs",
    "detokenize": "the API always returns text",
    "_bad_words_token_ids": "the engine's processor derives it from bad_words",
}


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None -> 1.0 (OpenAI's default)
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # an end-user id for the caller's records; it changes nothing (as in OpenAI)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict | None = None  # vLLM's StructuredOutputsParams fields
    priority: int = 0  # lower is served first; needs the server's --policy priority

    # Defaults of the fields a request may leave out (vLLM's _DEFAULT_SAMPLING_PARAMS).
    _DEFAULTS: ClassVar[dict] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}

    @staticmethod
    def check_max_output(name: str, value: int | None, max_model_len: int) -> None:
        """vLLM's rule: more output tokens than the whole context holds is a 400. A
        max_tokens that overflows only together with the prompt is served and stops
        at the context (finish_reason "length"), as vLLM does."""
        if value is not None and value > max_model_len:
            raise ValueError(f"{name} cannot be greater than max_model_len ({max_model_len}), got {value}; "
                             "request fewer output tokens")

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")

    def structured(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs (vLLM's); structured_outputs may add
        options (disable_any_whitespace) to a response_format constraint."""
        rf, so = self.response_format, dict(self.structured_outputs or {})
        if rf is None or rf.type == "text":
            return StructuredOutputsParams.from_any(so or None)
        if any(k in so for k in CONSTRAINTS):
            raise ValueError("response_format and structured_outputs cannot both constrain the output; give one")
        if rf.type == "json_object":
            return StructuredOutputsParams.from_any({**so, "json_object": True})
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams.from_any({**so, "json": rf.json_schema.schema_})

    def _params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None,
                **extra) -> SamplingParams:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:  # vLLM's API bound, as OpenAI's
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings (MINI_VLLM_MAX_STOP_STRINGS), "
                             f"got {len(self.stop)}")
        d = {**self._DEFAULTS, **(defaults or {})}
        picked = {k: getattr(self, k) if getattr(self, k) is not None else d[k] for k in self._DEFAULTS}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, **picked,
            seed=self.seed, stop=self.stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.structured(), **extra)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # null means 16 too, as in vLLM; 0 only with echo (the prompt alone)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's; echo with logprobs implies it

    def to_sampling_params(self, max_model_len: int, defaults: dict | None = None) -> SamplingParams:
        self.check_stream_options()
        self.check_max_output("max_tokens", self.max_tokens, max_model_len)
        mt = 16 if self.max_tokens is None else self.max_tokens
        if mt == 0 and not self.echo:
            raise ValueError("max_tokens must be an int >= 1 (0 only with echo=true, to score the prompt), got 0")
        plp = self.prompt_logprobs
        if plp is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream=true (use echo with logprobs)")
        if plp is None and self.echo:
            plp = self.logprobs
        # max_tokens=0 with echo: generate one token (the engine's minimum) and drop it.
        return self._params(1 if mt == 0 else mt, self.logprobs, defaults, prompt_logprobs=plp)


class ContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # handed to the chat template with the message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        d = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        return d


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None

    def check_tools(self) -> None:
        """vLLM's rules without a tool-call parser (--enable-auto-tool-choice
        --tool-call-parser): with tool_choice "none" the tools are only shown to the
        chat template and the reply is plain text, so that is served; "auto"
        (the default once tools are given), "required" or a named function would
        need the reply parsed into tool calls, so they are a 400."""
        if self.tool_choice == "none":
            return
        if self.tools and self.tool_choice is None:
            raise ValueError("tools need a tool-call parser when tool_choice is 'auto' (the default with tools), "
                             "and this server has none; send tool_choice 'none' to show the tools to the model "
                             "without parsing its reply")
        if self.tool_choice is not None:
            raise ValueError("tool_choice needs a tool-call parser, and this server has none; only 'none' is "
                             "accepted")

    def tools_for_template(self, exclude_when_none: bool = False) -> list[dict] | None:
        """The tools as the chat template sees them (vLLM's tool_dicts); None with
        --exclude-tools-when-tool-choice-none and tool_choice "none"."""
        if not self.tools or (exclude_when_none and self.tool_choice == "none"):
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def to_sampling_params(self, max_model_len: int, default_max_tokens: int,
                           defaults: dict | None = None) -> SamplingParams:
        """`default_max_tokens`: the room left in the context, used when the request
        and the generation config give no max_tokens."""
        self.check_tools()
        self.check_stream_options()
        self.check_max_output("max_tokens", self.max_tokens, max_model_len)
        self.check_max_output("max_completion_tokens", self.max_completion_tokens, max_model_len)
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if mt is None:
            mt = min(default_max_tokens, (defaults or {}).get("max_tokens", default_max_tokens))
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(mt, lp, defaults)


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
