"""Asynchronous scheduling without a wait: a step's output is deferred, and the
next step reads its sampled tokens on the device.

vLLM counterparts: `AsyncGPUModelRunnerOutput` in `vllm/v1/worker/gpu_model_runner.py`
(the sampled ids copied to pinned host memory behind the step's kernels, an event
recorded, `get_output()` waiting for it in the engine core's thread), the
`prev_sampled_token_ids` feedback of `_prepare_input_ids`, and `CpuGpuBuffer`
(pinned host staging for every per-step upload).

Why: the batch queue lets the core schedule step N + 1 while step N runs, but a
runner that waits for N's tokens on the host before it prepares N + 1 still leaves
the device idle for all of its host work, every step. So, with asynchronous
scheduling and no speculative decoding:

* step N returns once its kernels are queued: its sampled ids stay on the device,
  and their copy to the host is queued behind them (`DeferredStepOutput`);
* step N + 1's input ids are built on the host with a stale entry where N's token
  goes, uploaded without a wait (`HostStaging`), and that entry is overwritten on
  the device from N's tensor (`feedback_indices`);
* only after N + 1's kernels are queued does the runner wait for N's copy and
  append N's tokens to its host-side state (`DeferredOutputs.settle`), so the device
  always has the next step queued behind the one it runs.

Invariants: when a step starts, at most one earlier output is unsettled (the
previous step's); the step thread is the only writer of the runner's state, so it
alone settles (the core thread only reads the token lists); a step whose sampling
reads the token history (penalties, min_tokens, bad words, a grammar) settles
before it prepares, and gains no overlap.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from mini_vllm.sample.param_effects import reads_history
from mini_vllm.scheduler import ModelRunnerOutput
from mini_vllm.worker.input_batch import StepInputs
from mini_vllm.worker.step_outputs import OutputMode, StepSampler, prompt_logprobs_dict


class HostStaging:
    """Pinned host buffers for per-step copies between host and device, used in turn.

    On CUDA a copy from pageable host memory may wait for the whole stream, and a
    copy to pageable memory always does; pinned buffers make both asynchronous. Two
    buffers per kind are enough: the step that writes a buffer again is prepared only
    after the step that used it last was settled, and settling waits for its copies.
    On a CPU there is nothing to stage: `upload` wraps the arrays and `download`
    returns the tensor itself."""

    def __init__(self, device: torch.device, max_tokens: int) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._up: list[torch.Tensor | None] = [None, None]
        self._down = [torch.empty(max_tokens, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if self.on_cuda else []
        self._turn_up = self._turn_down = 0

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays (any numeric dtypes and shapes) on the device, as views of one
        transfer; dtypes and shapes are kept."""
        if not self.on_cuda:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        layout = packed_layout(arrays)
        total = layout[0][-1]
        buf = self._up[self._turn_up]
        if buf is None or buf.numel() < total:
            buf = self._up[self._turn_up] = torch.empty(max(total, 1 << 16), dtype=torch.uint8, pin_memory=True)
        self._turn_up ^= 1
        pack_into(buf, arrays, layout)
        return unpack(buf[:total].to(self.device, non_blocking=True), arrays, layout)

    def download(self, tokens: torch.Tensor) -> torch.Tensor:
        """A host copy of the int64 tensor, complete once the stream passes this
        point (record an event after it and wait for that)."""
        if not self.on_cuda:
            return tokens
        out = self._down[self._turn_down][:tokens.numel()]
        self._turn_down ^= 1
        out.copy_(tokens, non_blocking=True)
        return out


def packed_layout(arrays) -> tuple[list[int], list[int]]:
    """(byte offsets, byte sizes) of the arrays in one buffer, each at an 8-byte
    boundary so every view is aligned; offsets[-1] is the buffer's length."""
    sizes = [int(a.size) * a.itemsize for a in arrays]
    offsets = np.cumsum([0] + [-(-n // 8) * 8 for n in sizes]).tolist()
    return offsets, sizes


def pack_into(buf: torch.Tensor, arrays, layout) -> None:
    """Write the arrays' bytes into the uint8 tensor `buf` at their `packed_layout`."""
    host = buf.numpy()
    offsets, sizes = layout
    for a, off, n in zip(arrays, offsets, sizes):
        host[off:off + n] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def unpack(flat: torch.Tensor, arrays, layout) -> list[torch.Tensor]:
    """Views of the uint8 tensor `flat` (a copy of a packed buffer) with the arrays' dtypes and shapes."""
    offsets, sizes = layout
    return [flat[off:off + n].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, off, n in zip(arrays, offsets, sizes)]


class DeferredStepOutput:
    """One step's ModelRunnerOutput whose tokens are still on their way to the host.

    `tokens` (device, int64, one per sampling request, in `sample_req_ids` order) is
    what the next step reads in place; `get_output()` waits for the host copy and
    builds the ModelRunnerOutput (any thread, any number of times: the lists are
    made once)."""

    def __init__(self, req_ids: list[str], sample_req_ids: list[str], tokens: torch.Tensor | None,
                 staging: HostStaging, logprobs=None, logprob_counts: dict[str, int] | None = None,
                 prompt_logprobs: dict | None = None) -> None:
        self.req_ids = req_ids
        self.index = {r: j for j, r in enumerate(sample_req_ids)}
        self.tokens = tokens
        self._host = staging.download(tokens) if tokens is not None else None
        # Logprobs are rare and wide: fresh pinned copies, queued with the tokens'.
        self._logprobs = None if logprobs is None else [
            t.to("cpu", non_blocking=True) if not staging.on_cuda else _pinned_copy(t)
            for t in (logprobs.logprob_token_ids, logprobs.logprobs, logprobs.selected_token_ranks)]
        self._logprob_counts = logprob_counts or {}
        self._prompt_logprobs = prompt_logprobs
        self._event = None
        if staging.on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._lock = threading.Lock()
        self._lists: tuple[dict, dict] | None = None

    def lists(self) -> tuple[dict[str, list[int]], dict[str, list]]:
        """(sampled tokens per scheduled request, logprobs per request that asked)."""
        with self._lock:
            if self._lists is None:
                if self._event is not None:
                    self._event.synchronize()
                toks = self._host.tolist() if self._host is not None else []
                sampled: dict[str, list[int]] = {r: [] for r in self.req_ids}
                for r, j in self.index.items():
                    sampled[r] = [int(toks[j])]
                logprobs: dict[str, list] = {}
                if self._logprobs is not None:
                    ids_l, lps_l, ranks_l = (t.tolist() for t in self._logprobs)
                    for r, n in self._logprob_counts.items():
                        j = self.index[r]
                        logprobs[r] = [(ids_l[j][:n + 1], lps_l[j][:n + 1], ranks_l[j])]
                self._lists = (sampled, logprobs)
            return self._lists

    def get_output(self) -> ModelRunnerOutput:
        sampled, logprobs = self.lists()
        mro = ModelRunnerOutput.from_dict(sampled)
        mro.logprobs = logprobs or None
        mro.prompt_logprobs_dict = self._prompt_logprobs or None
        return mro


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def feedback_indices(pending: DeferredStepOutput, req_ids: list[str], num_tokens: np.ndarray,
                     computed: np.ndarray, num_sched: np.ndarray, query_start_loc: np.ndarray
                     ) -> tuple[list[int], list[int]]:
    """(rows of this step's input ids, entries of `pending.tokens`) for the tokens the
    host does not know yet: request i's token sampled by the pending step sits at
    position num_tokens[i] (the first one its host row lacks), which this step reads
    when that position is among the ones it computes."""
    dst, src = [], []
    for i, rid in enumerate(req_ids):
        j = pending.index.get(rid)
        if j is None:
            continue
        pos = int(num_tokens[i])
        lo = int(computed[i])
        if lo <= pos < lo + int(num_sched[i]):
            dst.append(int(query_start_loc[i]) + pos - lo)
            src.append(j)
    return dst, src


class DeferredOutputs(OutputMode):
    """The output mode of asynchronous scheduling without speculation: `finish` samples
    on the device and returns a `DeferredStepOutput` at once; `pending` is the previous
    step's output until its tokens are appended to the request states (settled)."""

    def __init__(self, model, sampler: StepSampler, staging: HostStaging) -> None:
        self.model, self.sampler, self.staging = model, sampler, staging
        self.pending: DeferredStepOutput | None = None

    def before_step(self, so) -> None:
        requests = self.sampler.requests
        if self.pending is not None and any(
                r in so.num_scheduled_tokens and reads_history(requests[r].sampling_params)
                for r in self.pending.index if r in requests):
            self.settle()  # this step's sampling reads the pending tokens on the host

    def settle(self) -> None:
        """Append the pending step's tokens to the requests and their rows (waits for
        its copy to the host); a request that finished meanwhile is skipped."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.sampler.input_batch.append_sampled(self.sampler.requests, pending.lists()[0])

    def pending_rows(self, req_ids, num_tokens, computed, num_sched, query_start_loc):
        if self.pending is None:
            return [], []
        return feedback_indices(self.pending, req_ids, num_tokens, computed, num_sched, query_start_loc)

    def feed_back(self, input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        input_ids[dst] = self.pending.tokens[src]

    def empty(self) -> ModelRunnerOutput:
        self.settle()
        return ModelRunnerOutput([], {}, [])

    def finish(self, step: StepInputs, hidden: torch.Tensor) -> DeferredStepOutput:
        """Sample on the device and return without waiting. The tokens' copy to the host
        is queued behind this step's kernels, and only then is the previous step settled
        (its copy was queued before them, so that wait is for it alone)."""
        rids = [step.req_ids[i] for i in step.sample_req]
        tokens = lp = None
        counts: dict[str, int] = {}
        if rids:
            states, out = self.sampler.sample_on_device(
                self.model.compute_logits(hidden.index_select(0, step.logit_rows)), rids)
            tokens, lp = out.sampled_token_ids, out.logprobs_tensors
            if lp is not None:
                counts = {st.req_id: st.sampling_params.logprobs for st in states
                          if st.sampling_params.logprobs is not None}
        plps = prompt_logprobs_dict(self.model, self.sampler.requests, hidden, step)
        deferred = DeferredStepOutput(step.req_ids, rids, tokens, self.staging, lp, counts, plps)
        self.settle()
        self.pending = deferred
        return deferred
