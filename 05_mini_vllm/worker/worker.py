"""One worker: loads the model, sizes and allocates the KV cache, owns the runner.

vLLM counterpart: `vllm/v1/worker/gpu_worker.py` (`Worker.load_model`,
`determine_available_memory`, `initialize_from_config`).

KV budget, in order of precedence:
* `num_gpu_blocks_override` (tests use it to force preemption);
* `kv_cache_memory_bytes` when set, on any device (CPU default: 512 MiB);
* otherwise on CUDA: `gpu_memory_utilization` x total memory, minus the peak
  that a profiling forward pass of `max_num_batched_tokens` tokens reached.
Blocks are sized in the KV cache's dtype (`kv_cache_dtype`): an fp8 cache fits
2x the tokens of a bf16 one in the same bytes, 4x those of an fp32 one.

Tensor parallelism: a worker is one rank; it builds the model inside its
group (each layer keeps only its shard) and allocates the KV cache of its own
KV heads only. All ranks agree on the number of blocks (the minimum), so the
driver's block ids and block tables address the same slots on every rank.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from mini_vllm.attention.backends import default_backend, get_attn_backend
from mini_vllm.worker.cache_engine import (CPU_DEFAULT_KV_BYTES, CacheEngine, kv_bytes_per_block,
                                    num_blocks_for_budget)
from mini_vllm.distributed import GroupCoordinator, min_over_ranks, use_tp_group
from mini_vllm.compilation.config import CompilationConfig, CUDAGraphMode
from mini_vllm.forward_context import set_forward_context
from mini_vllm.worker.cudagraph_dispatcher import dummy_metadata
from mini_vllm.worker.model_forward import ModelForward
from mini_vllm.worker.model_runner import ModelRunner
from mini_vllm.models.attention import set_attention_backend
from mini_vllm.models.kv_scales import configure_kv_scales
from mini_vllm.models.loader import load_model
from mini_vllm.paged_attention import allocate_kv_cache
from mini_vllm.spec_decode.engine.auto_schedule import AutoSchedule
from mini_vllm.spec_decode.engine.eagle import EagleProposer
from mini_vllm.worker.spec_profile import measure_break_even

logger = logging.getLogger("mini_vllm")


class Worker:
    def __init__(self, config, tp_group=None, kv_connector=None) -> None:
        self.config = config
        # Chapter 6's worker-side connector (None without kv_transfer_config): built by the
        # engine core with its scheduler-side twin, handed to the runner in initialize_cache.
        self.kv_connector = kv_connector
        self.device = torch.device(config.device)
        self.tp_group = tp_group or GroupCoordinator()  # None: one rank
        with use_tp_group(self.tp_group):  # the layers shard themselves for this rank
            self.model, self.model_config = load_model(config.model, dtype=config.dtype,
                                                       device=self.device,
                                                       enable_expert_parallel=config.enable_expert_parallel,
                                                       quantization=config.quantization)
        # this rank's KV heads: all of them, or its slice under tensor parallelism
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads
        self.attention_backend = config.attention_backend or default_backend(self.device)
        set_attention_backend(self.model, self.attention_backend)
        self.compilation_config = self._graph_modes_for_backend(config)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                             f"({mc.max_position_embeddings}), got {self.max_model_len}")
        # An EAGLE head is one more attention layer in the same blocks (spec_decode/engine/eagle.py).
        self.draft_head = None
        spec = config.speculative_config
        if spec is not None and spec.method == "eagle":
            from mini_vllm.models.llama_eagle import load_eagle_head

            self.draft_head = load_eagle_head(spec.model, self.model, config.dtype, self.device,
                                              self.attention_backend)
        num_draft_layers = 0 if self.draft_head is None else len(self.draft_head.attention_layers())
        self.bytes_per_block = kv_bytes_per_block(mc.num_hidden_layers + num_draft_layers, config.block_size,
                                                  self.num_kv_heads, mc.head_dim,
                                                  config.kv_cache_torch_dtype)

    def _graph_modes_for_backend(self, config) -> CompilationConfig:
        """FULL graphs capture attention too, which only a capture-safe backend allows
        (vLLM: the backend's `cudagraph_support`). Asked for by name with another
        backend, that is an error; by default, FULL falls back to NONE and
        FULL_AND_PIECEWISE to PIECEWISE (attention then runs eagerly between pieces)."""
        cc = config.compilation_config
        backend = get_attn_backend(self.attention_backend)
        if self.device.type != "cuda" or not cc.cudagraph_mode.has_full() or backend.full_cudagraph_support:
            return cc
        if config.cudagraph_mode_asked:
            raise ValueError(f"compilation_config.cudagraph_mode {cc.cudagraph_mode.name} captures attention, which "
                             f"the {self.attention_backend!r} backend cannot run inside a CUDA graph: use "
                             "attention_backend='triton', or cudagraph_mode PIECEWISE or NONE")
        fallback = (CUDAGraphMode.PIECEWISE if cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
                    else CUDAGraphMode.NONE)
        logger.info("attention backend %r is not capture-safe: cudagraph_mode %s -> %s", self.attention_backend,
                    cc.cudagraph_mode.name, fallback.name)
        return dataclasses.replace(cc, cudagraph_mode=fallback)

    def determine_num_blocks(self, max_num_batched_tokens: int) -> tuple[int, int]:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            n_gpu = cfg.num_gpu_blocks_override
        elif self.device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
            n_gpu = self._profile_cuda_blocks(max_num_batched_tokens)
        else:  # an explicit byte budget wins on CUDA too, as in vLLM
            budget = cfg.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
            n_gpu = num_blocks_for_budget(budget, self.bytes_per_block, "kv_cache_memory_bytes")
        n_gpu = min_over_ranks(n_gpu, self.tp_group)  # block ids mean the same on every rank
        n_cpu = cfg.num_cpu_blocks + int(cfg.swap_space * (1 << 30) // self.bytes_per_block)
        return n_gpu, n_cpu

    @torch.inference_mode()
    def _profile_cuda_blocks(self, num_tokens: int) -> int:
        """Run the largest forward pass once and give the KV cache what is left of
        `gpu_memory_utilization x total` after: the weights and the activations' peak
        (what the caching allocator reserved at most, fragmentation included), the
        memory outside PyTorch's allocator (CUDA context, cuBLAS workspaces, loaded
        kernels), the sampler's buffers at max_num_seqs rows, and the CUDA graphs
        (`_graph_memory`). vLLM: `Worker.determine_available_memory`."""
        cfg, mc, bs = self.config, self.model_config, self.config.block_size
        num_tokens = min(num_tokens, self.max_model_len)
        n_blocks = -(-num_tokens // bs)
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        tmp = [allocate_kv_cache(n_blocks, bs, self.num_kv_heads, mc.head_dim,
                                 cfg.kv_cache_torch_dtype, dev) for _ in range(mc.num_hidden_layers)]
        for layer, kv in zip(self.model.attention_layers(), tmp):
            layer.kv_cache = kv
        md = dummy_metadata(num_tokens, 1, bs, dev)
        md.slot_mapping = torch.arange(num_tokens, device=dev)  # the heaviest step also writes every slot
        md.block_tables = torch.arange(n_blocks, dtype=torch.int32, device=dev)[None]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        with set_forward_context(md):
            hidden = self.model(ids, torch.arange(num_tokens, device=dev))
        rows = min(cfg.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        # The sampler's worst case: top-k/top-p sort the whole vocabulary of every row.
        torch.sort(logits.softmax(dim=-1), dim=-1, descending=True)
        del logits, hidden
        torch.cuda.synchronize(dev)
        tmp_bytes = n_blocks * self.bytes_per_block
        peak = torch.cuda.max_memory_reserved(dev) - tmp_bytes
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        graphs = self._graph_memory(tmp, n_blocks)
        del tmp
        torch.cuda.empty_cache()
        budget = int(total * cfg.gpu_memory_utilization) - peak - non_torch - graphs
        n = num_blocks_for_budget(budget, self.bytes_per_block, "gpu_memory_utilization budget")
        logger.info("profiling: torch peak %.2f GiB, outside torch %.2f GiB, CUDA graphs %.2f GiB; "
                    "KV cache %d blocks (%.2f GiB)", peak / 2**30, non_torch / 2**30, graphs / 2**30, n,
                    n * self.bytes_per_block / 2**30)
        return n

    def _graph_memory(self, tmp_cache, n_blocks: int) -> int:
        """Bytes the CUDA graphs will hold, measured: capture the largest size
        (its pool holds the biggest intermediates, which smaller graphs reuse),
        then the smallest (what each further graph adds), on the profiling cache."""
        cc = self.compilation_config
        if cc.cudagraph_mode == CUDAGraphMode.NONE:
            return 0
        sizes = cc.cudagraph_capture_sizes
        deltas = []
        probe = ModelForward(self.model, cc, self.device, max_blocks=n_blocks)
        for size in dict.fromkeys([sizes[-1], sizes[0]]):
            torch.cuda.synchronize(self.device)
            free = torch.cuda.mem_get_info(self.device)[0]
            probe.capture(n_blocks, self.config.block_size, sizes=[size])
            deltas.append(max(0, free - torch.cuda.mem_get_info(self.device)[0]))
        del probe
        per_extra = deltas[-1] if len(deltas) > 1 else 0
        return deltas[0] + per_extra * (len(sizes) - 1)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> None:
        mc, cfg = self.model_config, self.config
        head = self.draft_head
        self.cache_engine = CacheEngine(
            mc.num_hidden_layers, num_gpu_blocks, num_cpu_blocks, cfg.block_size, self.num_kv_heads,
            mc.head_dim, cfg.kv_cache_torch_dtype, self.device,
            num_draft_layers=0 if head is None else len(head.attention_layers()),
            num_scratch_blocks=0 if head is None else EagleProposer.scratch_blocks_needed(
                max_num_seqs, cfg.speculative_config.num_speculative_tokens, cfg.block_size))
        if self.kv_connector is not None:  # it reads and writes these tensors in place
            self.kv_connector.register_kv_caches(self.cache_engine.gpu_cache)
        proposer = (None if cfg.speculative_config is None
                    else self._make_proposer(cfg.speculative_config, num_gpu_blocks))
        self.model_runner = ModelRunner(self.model, mc, self.cache_engine, cfg.block_size,
                                        max_num_seqs, self.max_model_len, self.device,
                                        logprobs_mode=cfg.logprobs_mode,
                                        tokenizer_path=cfg.tokenizer or cfg.model,
                                        kv_connector=self.kv_connector, proposer=proposer,
                                        async_scheduling=cfg.async_scheduling,
                                        compilation_config=self.compilation_config,
                                        spec_tokens_for_batch=None if cfg.speculative_config is None
                                        else cfg.speculative_config.num_tokens_for_batch)
        # Scales before capture: a captured launch keeps the scale it was captured with.
        layers = self.kv_scale_layers(proposer)
        configure_kv_scales(layers, cfg.kv_cache_torch_dtype, calculate=False)
        self.model_runner.capture_model()
        spec = cfg.speculative_config
        if spec is not None and spec.num_speculative_tokens_per_batch_size == "auto":
            self._measure_spec_schedule(max_num_seqs)
        if cfg.calculate_kv_scales:  # after the warm-up and measuring steps: from the first real step
            configure_kv_scales(layers, cfg.kv_cache_torch_dtype, calculate=True)

    def kv_scale_layers(self, proposer) -> list:
        """Every attention layer that writes an fp8-capable cache of this worker: the target's,
        an EAGLE head's and a draft model's (each has its own k_scale / v_scale)."""
        layers = list(self.model.attention_layers())
        if self.draft_head is not None:
            layers += self.draft_head.attention_layers()
        from mini_vllm.spec_decode.engine.proposers import DraftModelProposer

        if isinstance(proposer, DraftModelProposer):
            layers += proposer.draft.attention_layers()
        return layers

    def _measure_spec_schedule(self, max_num_seqs: int) -> None:
        """The default batch-size schedule of drafts (`spec_decode/engine/auto_schedule.py`), from
        dummy steps timed now, after capture and before the first request."""
        runner, k = self.model_runner, self.config.speculative_config.num_speculative_tokens
        start = time.perf_counter()
        schedule = AutoSchedule(k, measure_break_even(runner, k, max_num_seqs), runner.step_sampler.verifier.totals)
        runner.drafter.spec_tokens_for_batch = schedule
        logger.info("speculative decoding: measured in %.1f s: %s; drafting while the mean acceptance length "
                    "exceeds it (num_speculative_tokens_per_batch_size=None drafts k at every batch size)",
                    time.perf_counter() - start, schedule.describe())

    def _make_proposer(self, spec, num_blocks: int):
        from mini_vllm.spec_decode import NgramProposer
        from mini_vllm.spec_decode.engine.proposers import DraftModelProposer

        if spec.method == "ngram":
            return NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                                 k=spec.num_speculative_tokens)
        if spec.method == "eagle":
            return EagleProposer(self.draft_head, spec.num_speculative_tokens, self.config.block_size,
                                 self.cache_engine.draft_cache[0], num_blocks, self.device)
        draft, dcfg = load_model(spec.model, dtype=self.config.dtype, device=self.device)
        if dcfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size ({dcfg.vocab_size}) must "
                             f"equal the target's ({self.model_config.vocab_size})")
        set_attention_backend(draft, self.attention_backend)
        # Enough blocks that the draft never runs out before the target: every
        # token the target holds, plus k lookahead slots and a partial block per request.
        bs, k = self.config.block_size, spec.num_speculative_tokens
        num_blocks += self.config.max_num_seqs * (1 + -(-k // bs))
        return DraftModelProposer(draft, dcfg, k, num_blocks, bs, self.config.kv_cache_torch_dtype, self.device)

    def use_model_runner(self, runner_cls) -> None:
        """Rebuild the runner as `runner_cls` on this worker's model and KV cache
        (`ModelRunner`'s first seven arguments): how the Chapter 5 exercise plugs its
        own runner into a real engine (`mini_vllm.exercise.plug_runner`), before any request."""
        cfg = self.config
        self.model_runner = runner_cls(self.model, self.model_config, self.cache_engine, cfg.block_size,
                                       cfg.max_num_seqs, self.max_model_len, self.device)

    def use_eagle_proposer(self, proposer_cls) -> None:
        """Rebuild the EAGLE proposer as `proposer_cls` (an `EagleProposerBase`) on the same head
        and KV tensor: how the Chapter 5 exercise plugs its own `propose` into a real engine
        (`mini_vllm.exercise.plug_eagle`), before any request."""
        old = self.model_runner.drafter.proposer
        self.model_runner.drafter.proposer = proposer_cls(old.head, old.k, old.bs, self.cache_engine.draft_cache[0],
                                                  old.num_pool_blocks, self.device)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def spec_decoding_stats(self):
        """This rank's `metrics.stats.SpecDecodingStats` (None without speculative
        decoding); the engine core asks for it through `collective_rpc`."""
        if self.config.speculative_config is None:
            return None
        return self.model_runner.step_sampler.verifier.stats()
