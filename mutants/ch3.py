"""Chapter 3 mutants: classic scheduling mistakes planted in the reference.

Each must make `tests/test_ch3_*.py` fail; the hand-built examples run first
so the first failure names the mistake.
"""
from mutants.core import Mutant

TESTS = [
    "tests/test_ch3_examples.py",
    "tests/test_ch3_scheduler.py",
    "tests/test_ch3_regressions.py",
    "tests/test_ch3_stateful.py",
]
SCHED = "03_scheduler/scheduler.py"
SCHED_BASE = "03_scheduler/scheduler_base.py"
STEP = "03_scheduler/step.py"
STEP_BASE = "03_scheduler/step_base.py"

_FCFS_LOOP = """\
            for req in running_order(self):
                if st.budget == 0:
                    break
                st.schedule_running(req)
            if not st.preempted:
                for req in waiting_order(self):
                    if st.budget == 0 or not st.try_admit(req):
                        break
"""
_WAITING_FIRST = """\
            run = running_order(self)
            for req in waiting_order(self):
                if st.budget == 0 or not st.try_admit(req):
                    break
            for req in run:
                if st.budget == 0:
                    break
                st.schedule_running(req)
"""

MUTANTS: list[Mutant] = [
    Mutant(
        name="fcfs_skips_blocked_request",
        path=SCHED,
        old="                    if st.budget == 0 or not st.try_admit(req):\n                        break",
        new="                    if st.budget == 0 or not st.try_admit(req):\n                        continue",
        tests=TESTS,
        why="FCFS admission skips a waiting request that does not fit and admits a later one",
    ),
    Mutant(
        name="waiting_before_running",
        path=SCHED,
        old=_FCFS_LOOP,
        new=_WAITING_FIRST,
        tests=TESTS,
        why="waiting requests are admitted before running ones are scheduled: decodes stall",
    ),
    Mutant(
        name="admit_after_preemption",
        path=SCHED,
        old="            if not st.preempted:\n                for req in waiting_order(self):",
        new="            if True:\n                for req in waiting_order(self):",
        tests=TESTS,
        why="more requests admitted in a step that had to preempt: the victim thrashes",
    ),
    Mutant(
        name="srtf_failed_admission_ends_step",
        path=SCHED,
        old="cands, deltas = [], []",
        new="break",
        tests=TESTS,
        why="SRTF ends the whole step when the shortest candidate does not fit: running requests stall",
    ),
    Mutant(
        name="fcfs_victim_by_priority",
        path=STEP,
        old='        if self.cfg.policy == "fcfs":\n            return cands[-1][3]\n',
        new="",
        tests=TESTS,
        why="FCFS picks its preemption victim by the priority field instead of admission order",
    ),
    Mutant(
        name="victim_first_admitted",
        path=STEP,
        old="return cands[-1][3]",
        new="return cands[0][3]",
        tests=TESTS,
        why="FCFS preempts the oldest running request instead of the last admitted",
    ),
    Mutant(
        name="priority_victim_highest",
        path=STEP,
        old="return max(cands, key=lambda c: c[:3])[3]",
        new="return min(cands, key=lambda c: c[:3])[3]",
        tests=TESTS,
        why="the priority policy preempts the most important request instead of the least",
    ),
    Mutant(
        name="scheduled_after_self_preemption",
        path=STEP,
        old="            if victim is req:\n                return\n",
        new="",
        tests=TESTS,
        why="a request that preempted itself goes on allocating and is scheduled while PREEMPTED",
    ),
    Mutant(
        name="recompute_keeps_computed",
        path=SCHED_BASE,
        old="req.num_computed_tokens = 0  # Table 4.1, preemption row",
        new="pass",
        tests=TESTS,
        why="a recompute preemption drops the KV but keeps num_computed_tokens",
    ),
    Mutant(
        name="partial_prefill_without_chunking",
        path=STEP,
        old="if d <= 0 or (d < req.num_tokens - computed and not cfg.enable_chunked_prefill):",
        new="if d <= 0:",
        tests=TESTS,
        why="with chunked prefill off, a prompt is admitted with whatever budget is left",
    ),
    Mutant(
        name="max_num_seqs_ignored",
        path=STEP,
        old="if len(self.running) >= cfg.max_num_seqs or self.budget <= 0:",
        new="if self.budget <= 0:",
        tests=TESTS,
        why="admission ignores max_num_seqs",
    ),
    Mutant(
        name="running_delta_not_charged",
        path=STEP_BASE,
        old="        self.budget -= d\n        self.num_scheduled[rid] = d\n        if n_spec:",
        new="        self.num_scheduled[rid] = d\n        if n_spec:",
        tests=TESTS,
        why="a running request's Δ is not charged to the token budget",
    ),
    Mutant(
        name="prefix_hit_not_computed",
        path=SCHED_BASE,
        old="req.num_computed_tokens = n_hit + n_ext  # Table 4.1, prefix caching row",
        new="pass",
        tests=TESTS,
        why="admission with prefix hits leaves num_computed_tokens at 0 (hits recomputed, KV misplaced)",
    ),
    Mutant(
        name="no_draft_rollback",
        path=SCHED_BASE,
        old="req.num_computed_tokens -= rejected  # Table 4.1, speculative decoding row",
        new="pass",
        tests=TESTS,
        why="rejected draft tokens are not rolled back from num_computed_tokens",
    ),
    Mutant(
        name="placeholder_never_subtracted",
        path=SCHED,
        old="""        req.num_output_placeholders -= len(sampled)
        if req.num_tokens_sent""",
        new="""        if req.num_tokens_sent""",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="a token that arrives under async scheduling leaves its placeholder behind: positions run ahead",
    ),
    Mutant(
        name="placeholder_for_a_step_that_does_not_sample",
        path=SCHED,
        old="if samples and self.config.async_scheduling:",
        new="if self.config.async_scheduling:",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="a mid-prefill chunk counts a placeholder for a token no step will sample",
    ),
    Mutant(
        name="no_placeholder_drafts_under_async",
        path=SCHED,
        old="                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.config.num_spec_tokens",
        new="                req.spec_token_ids = []",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="under async speculation the next step is scheduled without drafts: speculation stops",
    ),
    Mutant(
        name="placeholder_drafts_on_a_step_that_does_not_sample",
        path=SCHED,
        old="""            if req.spec_decode:
                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.config.num_spec_tokens""",
        new="""        if self.config.async_scheduling and req.spec_decode:
                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.config.num_spec_tokens""",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="a mid-prefill chunk (no sample) gets placeholder drafts: drafts to verify against prompt positions",
    ),
    Mutant(
        name="rejected_draft_placeholders_kept",
        path=SCHED_BASE,
        old="                req.num_output_placeholders -= rejected",
        new="                pass",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="a rejected draft keeps its placeholder: positions run ahead of every token that exists",
    ),
    Mutant(
        name="placeholder_drafts_for_a_request_without_drafts",
        path=SCHED,
        old="            if req.spec_decode:",
        new="            if True:",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="a seeded or logprobs request gets drafts the engine's verifier cannot reproduce",
    ),
    Mutant(
        name="appended_token_sent_again",
        path=SCHED,
        old="req.num_tokens_sent += len(sampled)  # the runner appended them itself",
        new="pass  # the runner appended them itself",
        tests=["tests/test_ch3_async_placeholders.py"],
        why="tokens the runner appended itself are sent to it again in the next step's new_token_ids",
    ),
    Mutant(
        name="probe_lookups_counted",
        path=STEP_BASE,
        old="return self.kv.get_computed_blocks(req, record_stats=False)",
        new="return self.kv.get_computed_blocks(req)",
        tests=TESTS,
        why="every prefix-cache probe (SRTF refreshes each candidate every step) counts as a lookup: "
            "the hit-rate statistics are inflated",
    ),
    Mutant(
        name="srtf_admits_after_preemption",
        path=SCHED,
        old="admit_ok = cands and not st.preempted and len(st.running) < cfg.max_num_seqs",
        new="admit_ok = cands and len(st.running) < cfg.max_num_seqs",
        tests=TESTS,
        why="srtf admits a waiting request into the blocks a preemption just freed, in the same step",
    ),
]

