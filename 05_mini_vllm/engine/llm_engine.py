"""The synchronous engine: requests in, streaming `RequestOutput`s out.

vLLM counterpart: `vllm/v1/engine/llm_engine.py` (`LLMEngine`: `add_request`,
`step`, `abort_request`, `has_unfinished_requests`). Its parts, as in vLLM:
`processor` (`engine/processor.py`: tokenizer, input checks), `engine_core`
(`engine/core.py`: scheduler + executor) and `output_processor`
(`engine/output_processor.py`: detokenizer, `RequestOutput`s).

One `step()` = one scheduler step + one forward pass + detokenization of what
it produced. Every request is validated completely (by the processor) before
anything about it is stored, so a bad request raises a ValueError that names
the field and its allowed range and leaves the engine and the other requests
untouched.

Where a request finishes (one rule, two deciders, one path):
stop tokens, max_tokens and length are decided in the scheduler
(`update_from_output`); stop strings in the detokenizer, which reports them to
LLMEngine.step, which finishes them in the engine core before the next
schedule (`EngineCore.finish_requests(ids, FINISHED_STOPPED)`). Stop strings
cannot move into the scheduler: they are matched on text, which only the
detokenizer has (vLLM: `OutputProcessor.process_outputs` returns
`reqs_to_abort`, and `LLMEngine.step` aborts them in the engine core).
"""
from __future__ import annotations

import logging
import time

from mini_vllm.config import EngineConfig
from mini_vllm.engine.core import EngineCore
from mini_vllm.generation_config import get_diff_sampling_param
from mini_vllm.metrics.loggers import EngineMetrics, LoggingStatLogger
from mini_vllm.engine.output_processor import OutputProcessor
from mini_vllm.engine.processor import EngineCoreRequest, Processor, load_tokenizer
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import Request, RequestStatus

logger = logging.getLogger("mini_vllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, executor_class=None) -> None:
        self.config = config
        self.engine_core = EngineCore(config, executor_class)
        self.model_config = self.engine_core.model_config
        self.max_model_len = self.engine_core.max_model_len
        # The KV pool's size, for clients that plan memory (beam search checks a beam fits).
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.stat_logger = LoggingStatLogger(config.stats_log_interval_s) if config.log_stats else None
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else (self.model_config.eos_token_ids or (None,))[0]
        # The checkpoint's default sampling fields (vLLM's --generation-config).
        self.default_sampling_params = get_diff_sampling_param(config.model, config.generation_config)
        self.processor = Processor(config, self.model_config, self.max_model_len, self.tokenizer,
                                   self.default_sampling_params)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        tok = kwargs.pop("tokenizer_obj", None)
        executor_class = kwargs.pop("executor_class", None)
        return cls(EngineConfig.from_kwargs(model, **kwargs), tok, executor_class)

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
        ids, params, arrival = request.prompt_token_ids, request.sampling_params, request.arrival_time
        req = Request(request_id, ids, params, eos_token_id=self.eos_token_id, arrival_time=arrival,
                      priority=request.priority)
        self.output_processor.add_request(request_id, request.prompt, ids, params, output_kind, arrival)
        try:
            self.engine_core.add_request(req)
        except ValueError:
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids) -> None:
        """Stop requests now; their KV blocks return to the pool at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core = [c for rid in request_ids for c in self.output_processor.core_ids(rid)]
        self.engine_core.abort_requests(core)
        self.output_processor.abort_requests(request_ids)

    def shutdown(self) -> None:
        """Stop worker processes (tensor parallelism); also runs on garbage collection and exit."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states) or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    # ---------------------------------------------------------------- step
    def step(self):
        res = self.engine_core.step()
        now = time.monotonic()
        self.output_processor.mark_scheduled(res.first_scheduled, now)
        t0 = time.perf_counter()
        outs, stopped, it = self.output_processor.process_outputs(res.outputs, now)
        if stopped:  # stop strings: the detokenizer decided, the core frees before the next schedule
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        res.timings["detokenize"] = time.perf_counter() - t0
        it.num_prompt_tokens = res.num_prompt_tokens_computed
        self.metrics.record(it, res.scheduler_stats, res.timings)
        if self.stat_logger is not None:
            self.stat_logger.record(it, res.scheduler_stats)
        return outs

    def get_stats(self) -> dict:
        out = self.metrics.summary()
        spec = self.engine_core.spec_decoding_stats()
        if spec is not None:
            out["spec_acceptance_rate"] = spec["acceptance_rate"]
            out["spec_acceptance_per_position"] = spec["acceptance_per_position"]
            out["spec_num_drafts"] = spec["num_drafts"]
        return out
