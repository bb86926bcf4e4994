"""The synchronous engine: requests in, streaming `RequestOutput`s out.

vLLM counterpart: `vllm/v1/engine/llm_engine.py` (`LLMEngine`: `add_request`,
`step`, `abort_request`, `has_unfinished_requests`). Its parts, as in vLLM:
`processor` (`engine/processor.py`: tokenizer, input checks), `engine_core`
(a client of `engine/core.py`'s scheduler + executor, `engine/core_client.py`)
and `output_processor` (`engine/output_processor.py`: detokenizer,
`RequestOutput`s). By default the core runs in its own process and steps on
its own while this process detokenizes; `MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0`
keeps it in this process (`engine_core.engine_core` is then the `EngineCore`).

One `step()` = one core step (scheduler step + forward pass) + detokenization
of what it produced. Every request is validated completely (by the processor) before
anything about it is stored, so a bad request raises a ValueError that names
the field and its allowed range and leaves the engine and the other requests
untouched.

Where a request finishes (one rule, two deciders, one path):
stop tokens, max_tokens and length are decided in the scheduler
(`update_from_output`); stop strings in the detokenizer, which reports them to
LLMEngine.step, which aborts them in the engine core (vLLM:
`OutputProcessor.process_outputs` returns `reqs_to_abort`). Stop strings
cannot move into the scheduler: they are matched on text, which only the
detokenizer has. In-process, the core frees their blocks before its next
schedule; with the core in its own process, a step already under way may
still compute one more token for them, which the output processor drops.
"""
from __future__ import annotations

import logging
import time

from mini_vllm.config import EngineConfig
from mini_vllm.engine import EngineCoreOutputs, EngineCoreRequest, multiprocessing_enabled
from mini_vllm.engine.core_client import InprocClient, SyncMPClient
from mini_vllm.engine.output_processor import OutputProcessor
from mini_vllm.engine.parallel_sampling import ParentRequest
from mini_vllm.engine.processor import Processor, load_tokenizer
from mini_vllm.generation_config import get_diff_sampling_param
from mini_vllm.metrics.loggers import EngineMetrics, LoggingStatLogger
from mini_vllm.models.checkpoint_checks import check_checkpoint
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger("mini_vllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, executor_class=None,
                 multiprocess_mode: bool | None = None, client=None) -> None:
        """`multiprocess_mode=None` follows MINI_VLLM_ENABLE_V1_MULTIPROCESSING (default
        on). `client`: a core client built by the caller (`AsyncLLM` passes its
        `AsyncMPClient` and drives this front end itself, without `step()`)."""
        self.config = config
        # What the caller's process can check it checks before any engine process starts
        # (vLLM's order): a missing folder, weights or architecture raises vLLM's error here.
        # (AsyncLLM, which builds its client before this, has checked already.)
        self.model_config = check_checkpoint(config.model, config.quantization, config.dtype)
        mp = multiprocessing_enabled() if multiprocess_mode is None else multiprocess_mode
        if client is None:
            client = SyncMPClient(config, executor_class) if mp else InprocClient(config, executor_class)
        self.engine_core = client
        ready = self.engine_core.ready
        self.max_model_len = ready.max_model_len
        # The KV pool's size, for clients that plan memory (beam search checks a beam fits).
        self.num_gpu_blocks, self.num_cpu_blocks = ready.num_gpu_blocks, ready.num_cpu_blocks
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.stat_logger = LoggingStatLogger(config.stats_log_interval_s) if config.log_stats else None
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        eos = eos if eos is not None else (self.model_config.eos_token_ids or (None,))[0]
        # The checkpoint's default sampling fields (vLLM's --generation-config).
        self.default_sampling_params = get_diff_sampling_param(config.model, config.generation_config)
        self.processor = Processor(config, self.model_config, self.max_model_len, self.tokenizer,
                                   self.default_sampling_params, self.num_gpu_blocks, eos)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id every request carries to the core (the processor owns it)."""
        return self.processor.eos_token_id

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        tok = kwargs.pop("tokenizer_obj", None)
        executor_class = kwargs.pop("executor_class", None)
        mp = kwargs.pop("multiprocess_mode", None)
        return cls(EngineConfig.from_kwargs(model, **kwargs), tok, executor_class, mp)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    output_kind: str = "cumulative") -> None:
        """Add one request. `prompt` is raw (a str, token ids or a dict), which the
        processor validates here, or an `EngineCoreRequest` that
        `self.processor.process_inputs` returned (vLLM's `add_request` takes
        both): that one is stored as it is, with its own params, arrival time and
        priority, so a caller that validated a batch first checks nothing twice."""
        request_id = str(request_id)
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, EngineCoreRequest):
            if prompt.request_id != request_id:
                raise ValueError(f"request_id {request_id!r} must match the processed request's "
                                 f"request_id {prompt.request_id!r}")
            if params is not None:
                raise ValueError("params must be None for a processed request: its own are final")
            request = prompt
        else:
            request = self.processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids,
                                          request.sampling_params, output_kind, request.arrival_time)
        sent: list[str] = []
        try:
            for child in ParentRequest(request).child_requests():  # n > 1: the front end fans out
                self.engine_core.add_request(child)
                sent.append(child.request_id)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            if sent:
                self.engine_core.abort_requests(sent)
            raise

    def abort_request(self, request_ids) -> None:
        """Stop requests now; their KV blocks return to the pool at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core = [c for rid in request_ids for c in self.output_processor.core_ids(rid)]
        self.engine_core.abort_requests(core)
        self.output_processor.abort_requests(request_ids)

    def shutdown(self) -> None:
        """Stop the core (its process, and the workers of tensor parallelism); also
        runs on garbage collection and at exit."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Requests the front end still waits for (vLLM asks its output processor too:
        the core holds nothing the front end has not been told about)."""
        return bool(self.output_processor.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    # ---------------------------------------------------------------- step
    def step(self):
        """One core step's outputs (blocks until the core has taken it); raises
        `EngineDeadError` if the core died."""
        return self.process_engine_outputs(self.engine_core.get_output())

    def process_engine_outputs(self, res: EngineCoreOutputs) -> list:
        """The front end's half of a step: detokenize, build `RequestOutput`s, abort
        what stop strings finished, record metrics."""
        now = time.monotonic()
        self.output_processor.mark_scheduled(res.first_scheduled, now)
        t0 = time.perf_counter()
        outs, stopped, it = self.output_processor.process_outputs(res.outputs, now)
        if stopped:  # stop strings: the detokenizer decided; the core frees their blocks
            self.engine_core.abort_requests(stopped)
        timings = {**res.timings, "detokenize": time.perf_counter() - t0}
        it.num_prompt_tokens = res.num_prompt_tokens_computed
        self.metrics.record(it, res.scheduler_stats, timings)
        if self.stat_logger is not None:
            self.stat_logger.record(it, res.scheduler_stats)
        return outs

    def get_stats(self) -> dict:
        out = self.metrics.summary()
        spec = self.engine_core.call_utility("spec_decoding_stats")
        if spec is not None:
            out["spec_acceptance_rate"] = spec["acceptance_rate"]
            out["spec_acceptance_per_position"] = spec["acceptance_per_position"]
            out["spec_num_drafts"] = spec["num_drafts"]  # draft tokens
            out["spec_num_draft_sequences"] = spec["num_draft_sequences"]
            out["spec_mean_acceptance_length"] = spec["mean_acceptance_length"]  # None before any draft
        return out
