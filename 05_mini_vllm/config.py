"""Engine configuration (counterpart of `vllm/engine/arg_utils.py` `EngineArgs`
and the `vllm/config/` dataclasses it builds).

`EngineConfig` gathers every knob of the engine in one validated object and
hands the scheduler its own `SchedulerConfig` (Chapter 3). Invariants checked
at construction, each a ValueError that names the field and its allowed range:
* block_size in {8, 16, 32} (the sizes the kernels and tests cover);
* dtype is one of float32 / bfloat16 / float16 (or their short names), resolved in
  place to its torch.dtype (vLLM's `ModelConfig.dtype`);
* kv_cache_dtype is one of vLLM's "auto", "fp8", "fp8_e4m3", "fp8_e5m2"; a
  True calculate_kv_scales needs an fp8 one, no KV connector and no CUDA graphs;
* exactly one KV budget applies: `num_gpu_blocks_override` when set, else
  `kv_cache_memory_bytes` when set (any device), else `gpu_memory_utilization`
  on CUDA and 512 MiB on CPU.

As in vLLM's `VllmConfig`, a field holds the resolved object after construction:
`speculative_config` a `SpeculativeConfig` (or None), `compilation_config` a
`CompilationConfig` with every default filled in for the device, `dtype` a torch.dtype.
Each also accepts its resolved form, so a resolved config can be built again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from mini_vllm.attention.backends import BACKEND_NAMES
from mini_vllm.compilation.config import CompilationConfig, CUDAGraphMode
from mini_vllm.models.quantization import check_quantization
from mini_vllm.kernels.kv_cache_dtype import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from mini_vllm.scheduler import POLICIES, PREEMPTION_MODES, SchedulerConfig

if TYPE_CHECKING:  # imported in __post_init__: importing mini_vllm does not load Chapter 4
    from mini_vllm.spec_decode.engine.config import SpeculativeConfig

logger = logging.getLogger("mini_vllm")

# vLLM's `LogprobsMode` (vllm/config/model.py): what a request's logprobs describe.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float": torch.float32}
BLOCK_SIZES = (8, 16, 32)


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a matching torch.dtype, got {dtype!r}")


@dataclass
class EngineConfig:
    model: str = ""
    dtype: str | torch.dtype = "float32"  # resolved to a torch.dtype in __post_init__
    # vLLM's --quantization: 8-bit linear weights (models/quantization/: "fp8", "fp8_per_tensor",
    # "fp8_per_channel", "compressed-tensors", "int8_per_channel_weight_only"); None: what the
    # checkpoint's quantization_config says, else none. A value that contradicts it is an error.
    quantization: str | None = None
    device: str = "auto"                 # "auto" -> cuda when available, else cpu
    attention_backend: str | None = None  # None -> triton on CUDA, cpu (compiled kernel) on CPU
    block_size: int = 16
    max_model_len: int | None = None      # None -> the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # None -> 2048 (chunked) or max_model_len
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0               # swap space, in blocks
    swap_space: float = 0.0               # swap space in GiB (vLLM v0's name); adds blocks
    kv_cache_memory_bytes: int | None = None  # any device; unset: 512 MiB on CPU
    # vLLM's --kv-cache-dtype: "auto" (the model's dtype) or an fp8 format ("fp8" = "fp8_e4m3",
    # "fp8_e5m2"), per-tensor k_scale / v_scale per layer from the checkpoint, else 1.0
    # (kernels/kv_cache_dtype.py, models/kv_scales.py).
    kv_cache_dtype: str = "auto"
    # vLLM's former --calculate-kv-scales: compute each layer's scales from the first step's K/V.
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1         # ranks; > 1 runs MultiprocExecutor (gloo/NCCL)
    # vLLM's --enable-expert-parallel: with tensor_parallel_size > 1 a mixture of experts puts
    # num_experts / tp whole experts on each rank instead of every expert's 1/tp columns
    # (models/fused_moe/layer.py); a dense model refuses it.
    enable_expert_parallel: bool = False
    tokenizer: str | None = None
    log_stats: bool = False
    # vLLM's field names (spec_decode/engine/config.py); resolved to a SpeculativeConfig or None.
    speculative_config: dict | SpeculativeConfig | None = None
    stats_log_interval_s: float = 5.0
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask
    # for (-1: the whole vocabulary). The server passes vLLM's default, 20;
    # offline the course keeps no cap (tests compare whole distributions).
    max_logprobs: int = -1
    # vLLM's --logprobs-mode: what logprobs describe. "raw_logprobs" (vLLM's default): the
    # model's distribution before penalties, temperature and filters; "processed_logprobs":
    # the one sampled from; "raw_logits" / "processed_logits": the logits at those points.
    logprobs_mode: str = "raw_logprobs"
    # vLLM's --generation-config: "auto" (the model folder's generation_config.json
    # gives default sampling parameters), "vllm" (ignore it) or a folder holding one.
    generation_config: str = "auto"
    # vLLM's --structured-outputs-config; the one key read here: {"disable_any_whitespace":
    # bool}, the default of every request's StructuredOutputsParams.disable_any_whitespace.
    structured_outputs_config: dict | None = None
    # Chapter 6: vLLM's KVTransferConfig shape ({"kv_connector", "kv_role",
    # "kv_connector_extra_config"}); None = no KV connector.
    kv_transfer_config: dict | None = None
    # vLLM's --async-scheduling (seed 001 §4.6.1): the core schedules step N + 1
    # while step N runs, with a placeholder for each token in flight. None decides
    # as vLLM 0.32 does: on for CUDA unless something incompatible is asked for
    # (here: n-gram speculation, more than one rank, a KV connector), off on a
    # CPU (vLLM's CPU platform turns it off: the step runs on the cores the
    # scheduler would overlap with). True with an incompatible option is an error.
    async_scheduling: bool | None = None
    # vLLM's --compilation-config / -O and --enforce-eager (`compilation/config.py`):
    # torch.compile of the forward and CUDA graphs. Resolved for the device below, with
    # enforce_eager, into a CompilationConfig with every default filled in.
    compilation_config: dict | int | CompilationConfig | None = None
    enforce_eager: bool = False
    # True when the user named a cudagraph_mode: a mode the engine cannot run is then an
    # error, where a default one falls back. Recorded before compilation_config is resolved.
    cudagraph_mode_asked: bool = field(init=False, repr=False)
    kv_cache_torch_dtype: torch.dtype = field(init=False, repr=False)  # the cache tensors' dtype

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        self.kv_cache_torch_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        from mini_vllm.spec_decode.engine.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attention_backend is not None and self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be None or one of {BACKEND_NAMES}, "
                             f"got {self.attention_backend!r}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size!r}")
        for name in ("max_num_seqs", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        self.cudagraph_mode_asked = (isinstance(self.compilation_config, dict)
                                     and "cudagraph_mode" in self.compilation_config)
        self.compilation_config = CompilationConfig.from_any(self.compilation_config).resolve(
            torch.device(self.device).type, self.max_num_seqs if isinstance(self.max_num_seqs, int) else 1,
            self.enforce_eager)
        if self.tensor_parallel_size > 1 and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            # Each rank would capture its collectives in its own graphs; not built here.
            if self.cudagraph_mode_asked:
                raise ValueError("compilation_config.cudagraph_mode must be NONE when tensor_parallel_size > 1, "
                                 f"got {self.compilation_config.cudagraph_mode.name}")
            self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None (decide by device) or a bool, "
                             f"got {self.async_scheduling!r}")
        # A connector saves blocks by known tokens and the TP driver broadcasts in step
        # order: neither is placeholder-aware. Speculation needs a known draft length (k
        # placeholders per step, filled by the runner): a draft model has one; the n-gram
        # lookup may find fewer drafts or none (vLLM 0.32 refuses its CPU n-gram too). EAGLE
        # runs synchronously here for now: its pass 1 needs the step's tokens on the host.
        # A batch-size schedule of draft lengths (num_speculative_tokens_per_batch_size) breaks
        # that known length too; the measured one ("auto", the default) gives way below.
        spec = self.speculative_config
        spec_ok = spec is None or (spec.method == "draft_model"
                                   and spec.num_speculative_tokens_per_batch_size in (None, "auto"))
        blockers = [(name, value) for name, value, ok in (
            ("tensor_parallel_size", self.tensor_parallel_size, self.tensor_parallel_size == 1),
            ("speculative_config", self.speculative_config, spec_ok),
            ("kv_transfer_config", self.kv_transfer_config, self.kv_transfer_config is None)) if not ok]
        if self.async_scheduling is None:
            self.async_scheduling = torch.device(self.device).type == "cuda" and not blockers
        elif self.async_scheduling and blockers:
            name, value = blockers[0]
            raise ValueError(f"async_scheduling=True needs {name} unset (1 for tensor_parallel_size; "
                             f"for speculative_config, method 'draft_model' without "
                             f"num_speculative_tokens_per_batch_size is allowed), got {value!r}")
        if spec is not None and spec.num_speculative_tokens_per_batch_size == "auto" \
                and (self.async_scheduling or self.tensor_parallel_size > 1):
            # Both need every step's draft length known in advance (the scheduler's placeholders;
            # ranks that would each measure their own schedule and disagree): vLLM's "always k".
            logger.info("speculative decoding: k drafts at every batch size (%s); the measured schedule "
                        "needs synchronous scheduling on one rank",
                        "async_scheduling" if self.async_scheduling else "tensor_parallel_size > 1")
            spec.num_speculative_tokens_per_batch_size = None
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        if self.tensor_parallel_size > 1 and self.kv_transfer_config is not None:
            # The connector reads rank 0's cache only; each rank's blocks would need
            # their own pool keys (rank in the key), which Chapter 6 does not have yet.
            raise ValueError("kv_transfer_config must be None when tensor_parallel_size > 1 (got "
                             f"tensor_parallel_size={self.tensor_parallel_size}): the KV pool is not "
                             "sharded by rank")
        if self.tensor_parallel_size > 1 and spec is not None and spec.method == "eagle":
            # The head's layer would need its heads split like the target's; not built yet.
            raise ValueError("speculative_config.method 'eagle' needs tensor_parallel_size 1, got "
                             f"{self.tensor_parallel_size}")
        self._check_kv_scales_options()
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.swap_space < 0 or not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError("swap_space must be >= 0 GiB and num_cpu_blocks an int >= 0, "
                             f"got {self.swap_space!r} and {self.num_cpu_blocks!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or an int >= 0, got {self.max_logprobs!r}")
        soc = self.structured_outputs_config
        if soc is not None and (not isinstance(soc, dict) or set(soc) - {"disable_any_whitespace"}
                                or not isinstance(soc.get("disable_any_whitespace", False), bool)):
            raise ValueError("structured_outputs_config must be None or {'disable_any_whitespace': bool}, "
                             f"got {soc!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                             f"got {self.generation_config!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        check_quantization(self.quantization)  # ValueError naming the allowed values

    def _check_kv_scales_options(self) -> None:
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}")
        if not self.calculate_kv_scales:
            return
        if self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True needs an fp8 kv_cache_dtype ('fp8', 'fp8_e4m3', "
                             "'fp8_e5m2'), got 'auto'")
        if self.kv_transfer_config is not None:
            # Blocks shared through the pool would be read with another engine's computed scales.
            raise ValueError("calculate_kv_scales=True needs kv_transfer_config None: each engine would "
                             "compute its own scales, so a pooled fp8 block would mean other values")
        if torch.device(self.device).type == "cuda" and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            # A captured launch keeps the scale it was captured with (1.0), not the computed one.
            raise ValueError("calculate_kv_scales=True needs compilation_config.cudagraph_mode NONE (or "
                             "enforce_eager) on CUDA, got " + self.compilation_config.cudagraph_mode.name)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """vLLM-style `LLM(model, **engine_args)`: unknown names are an error."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def scheduler_config(self, max_model_len: int, num_cpu_blocks: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(2048, max_model_len) if not self.enable_chunked_prefill else 2048
        return SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.policy,
            preemption_mode=self.preemption_mode, num_cpu_blocks=num_cpu_blocks,
            async_scheduling=self.async_scheduling,
            num_spec_tokens=0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens)
