"""The plan of one `Scheduler.schedule()` call and its given book-keeping (part
of the logic of `vllm/v1/core/sched/scheduler.py`, split out to keep files
small and to give the exercise this plumbing without the lesson's answers).

A step state decides; it never changes the scheduler, its queues or its
requests. Its inputs are explicit: the config, the running batch (copied,
never changed) and the collaborators whose resources a decision takes, the
KV cache manager (slots allocated, and a victim's freed, as the step decides,
so that each decision sees the blocks the earlier ones took or gave back),
the CPU block pool (swap preemption) and an optional KV connector (Chapter 6).
What it decides is its plan: Δ per request (`num_scheduled`), the victims
(`preempted`), the newcomers (`admitted`), the new block ids and the swaps.
`Scheduler._apply_plan` then moves the requests and builds the output.

The lesson's decisions (`schedule_running`, `pick_victim`, `try_admit`) are in
`step.py` (the reference) and `exercise.py` (the learner's); both subclass
`StepStateBase`.
"""
from __future__ import annotations

from mini_vllm.kvcache.kv_cache_utils import cdiv  # Chapter 2


class StepStateBase:
    def __init__(self, kv_cache_manager, config, running, cpu_block_pool, connector=None) -> None:
        self.kv = kv_cache_manager
        self.cfg = config
        self.cpu_block_pool = cpu_block_pool
        self.connector = connector
        # The running batch as this step leaves it: the scheduler's running list
        # in admission order, less this step's victims, plus its admissions.
        self.running: list = list(running)
        self.budget = config.max_num_batched_tokens  # tokens left in this step
        self.num_scheduled: dict[str, int] = {}  # req_id -> Δ, in the order decided
        self.spec: dict[str, list[int]] = {}  # req_id -> drafts verified this step
        # Victims, in the order preempted: req_id -> the CPU blocks now holding
        # its KV (swap), or None (recompute: its KV is dropped).
        self.preempted: dict[str, list[int] | None] = {}
        self.admitted: list = []  # newcomers, in the order admitted
        # Admissions that the runner learns in full: (request, block table,
        # prefix-hit tokens, tokens a KV connector loads).
        self.new_reqs: list[tuple[object, list[int], int, int]] = []
        # Requests the runner knows: req_id -> (back from a swap, block ids: all
        # of them after a swap, the new ones otherwise).
        self.cached: dict[str, tuple[bool, list[int]]] = {}
        self.swap_out: list[tuple[int, int]] = []  # (gpu, cpu)
        self.swap_in: list[tuple[int, int]] = []  # (cpu, gpu)

    # ---------------------------------------------------------------- Δ
    @staticmethod
    def remaining(req) -> int:
        return req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens

    def delta(self, req, computed: int, total: int) -> int:
        """Δ = min(remaining, budget left), capped by max_model_len and, for
        prefills, by long_prefill_token_threshold (a chunking knob: ignored
        without chunked prefill, where a prefill must go in one piece)."""
        d = min(total - computed, self.budget, self.cfg.max_model_len - computed)
        thr = self.cfg.long_prefill_token_threshold
        if thr and self.cfg.enable_chunked_prefill and req.num_tokens - computed > 1:
            d = min(d, thr)
        return d

    def _hits(self, req):
        """(hit blocks, hit tokens): the request's prefix-cache hit, never its
        last token (Chapter 2's lookup stops short of it: it must be computed
        to sample from it).

        A probe: SRTF looks every candidate up each step and a request may wait
        many steps, so the lookup does not count in `prefix_cache_stats`; the
        scheduler counts one lookup per admission when it applies the plan.
        """
        if req.skip_reading_prefix_cache:  # vLLM: no lookup, not counted
            return [], 0
        return self.kv.get_computed_blocks(req, record_stats=False)

    def refresh(self, cands) -> list[int]:
        """Remaining Δ of each admission candidate after prefix-cache lookup."""
        out = []
        for req in cands:
            if req.swapped_cpu_block_ids:
                out.append(req.num_tokens - req.num_computed_tokens)
            else:
                out.append(req.num_tokens - self._hits(req)[1])
        return out

    # ------------------------------------------------------- decisions made
    def _commit_running(self, req, d: int, n_spec: int, new_blocks) -> None:
        """Record a running request's Δ (its blocks are allocated): charge the
        budget, note its drafts and its new block ids for the runner."""
        rid = req.request_id
        self.budget -= d
        self.num_scheduled[rid] = d
        if n_spec:
            self.spec[rid] = list(req.spec_token_ids[:n_spec])
        self.cached[rid] = (False, [b.block_id for b in new_blocks] if new_blocks else [])  # decode: usually none

    def preempt(self, victim) -> None:
        """Preempt a running request not scheduled in this step: its GPU blocks
        are freed now (the next allocation may take them); under swap, with room
        in the CPU pool, its computed KV is copied out first (the runner copies
        before the forward pass), otherwise it will recompute."""
        rid = victim.request_id
        assert rid not in self.num_scheduled, "a request scheduled in this step cannot be preempted"
        self.running.remove(victim)
        n_keep = cdiv(victim.num_computed_tokens, self.kv.block_size)
        cpu = None
        if self.cfg.preemption_mode == "swap" and n_keep > 0:
            cpu = self.cpu_block_pool.allocate(n_keep)
        if cpu is not None:
            self.swap_out.extend(zip(self.kv.get_block_ids(rid)[:n_keep], cpu))
        self.kv.free(victim)
        self.preempted[rid] = cpu

    def _commit_admission(self, req, d: int, n_hit: int, swapped: bool, n_ext: int = 0) -> None:
        """Record an admission (its blocks are allocated): it joins the running
        batch, the budget is charged, and the runner will learn its whole block
        table, after a swap-in of its KV from CPU or, otherwise, with its
        prefix hits (`n_hit`) and connector tokens (`n_ext`) as computed."""
        rid = req.request_id
        self.running.append(req)
        self.admitted.append(req)
        self.budget -= d
        self.num_scheduled[rid] = d
        block_ids = list(self.kv.get_block_ids(rid))
        if swapped:
            cpu = req.swapped_cpu_block_ids
            self.swap_in.extend(zip(cpu, block_ids[:len(cpu)]))
            self.cached[rid] = (True, block_ids)
        else:
            self.new_reqs.append((req, block_ids, n_hit, n_ext))
