"""The engine (vLLM: `vllm/v1/engine/`) and the messages between its two halves.

The front end (`llm_engine.LLMEngine`, `async_llm.AsyncLLM`: `processor`,
`output_processor`, `detokenizer`) talks to the engine core (`core.EngineCore`:
scheduler + executor) through a client (`core_client`), in-process or, by
default, with the core in its own process (`core.EngineCoreProc`) over ZeroMQ.
What crosses is defined here, as in vLLM's `vllm/v1/engine/__init__.py`:
`EngineCoreRequest` in, `EngineCoreOutputs` out, both plain dataclasses that
`mini_vllm.serial_utils` encodes with msgpack (no pickle).
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any

from mini_vllm.metrics.stats import SchedulerStats, SpecDecodingStats
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import EngineCoreOutput


def multiprocessing_enabled() -> bool:
    """vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING`: on by default; "0" keeps the core
    in the caller's process (notebooks, debuggers, the exercises and most tests)."""
    value = os.environ.get("MINI_VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MINI_VLLM_ENABLE_V1_MULTIPROCESSING must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass
class EngineCoreRequest:
    """One validated request (vLLM's `EngineCoreRequest`), built by the front
    end's `Processor`; the core turns it into a scheduler `Request`.

    `prompt` is the text when the prompt was text (outputs echo it), else None;
    `sampling_params` are final (defaults filled in, bad words as token ids,
    `max_tokens` capped to the context), so the core checks nothing again."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    cache_salt: str | None = None  # tenants with different salts never share cached blocks


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every message to the core (vLLM's enum of the same name)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreOutputType(bytes, enum.Enum):
    """The first frame of every message from the core."""

    OUTPUTS = b"\x00"   # one step's EngineCoreOutputs
    READY = b"\x01"     # the handshake: EngineCoreReady, once, after the KV cache exists
    UTILITY = b"\x02"   # the answer to one utility call: UtilityOutput
    DEAD = b"\x03"      # the core failed: a message, then the process exits


@dataclass
class EngineCoreReady:
    """What the front end needs from the core before it can validate a request
    (vLLM sends the same facts in its startup handshake)."""

    max_model_len: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    pid: int


@dataclass
class UtilityOutput:
    """The result of `call_utility(method, *args)`: `result`, or `failure` (the error's text)."""

    call_id: int
    result: Any = None
    failure: str | None = None


@dataclass
class EngineCoreOutputs:
    """Everything one core step produced (vLLM's `EngineCoreOutputs`).

    Stats ride along so that the front end, which owns metrics, never has to
    ask the core: the scheduler's snapshot, the requests scheduled for the
    first time (queue time), the prompt tokens computed, and when each phase of
    the step started and ended (`timestamps`: time.monotonic(), comparable
    across processes on one machine), which the step timeline draws.
    `spec_decoding_stats` holds the step's verified drafts, None for a step
    without any (vLLM carries it inside `SchedulerStats`; here that is Chapter
    3's record, so it rides beside it)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    first_scheduled: list[str] = field(default_factory=list)
    num_prompt_tokens_computed: int = 0
    timestamps: dict[str, float] = field(default_factory=dict)
    spec_decoding_stats: SpecDecodingStats | None = None

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent in schedule, execute and update (the engine's metrics)."""
        t = self.timestamps
        if not t:
            return {}
        # Asynchronously scheduled steps also wait in the queue: execute counts from their start.
        start = t.get("execute_start", t["scheduled"])
        return {"schedule": t["scheduled"] - t["start"], "execute": t["executed"] - start,
                "update": t["updated"] - t["executed"]}

