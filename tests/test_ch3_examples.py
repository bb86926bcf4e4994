"""Chapter 3 by hand: one small, deterministic scenario per classic scheduling mistake.

The state machine in `test_ch3_stateful.py` finds these mistakes too, but only
by chance and after minutes of shrinking, often reported as a hang. Each test
here builds the one situation that exposes a single mistake, checks the very
step where it shows, and names the mistake in its message.
"""
import pytest


@pytest.fixture(scope="module")
def mod(chapter):
    return chapter("scheduler")


def make(mod, num_blocks, block_size=4, caching=False, **cfg):
    cfg.setdefault("max_model_len", 16)
    cfg.setdefault("max_num_batched_tokens", 64)
    return mod.Scheduler(mod.SchedulerConfig(**cfg), num_blocks, block_size,
                         enable_prefix_caching=caching)


def req(mod, rid, n_prompt, max_tokens, arrival, priority=0):
    return mod.Request(rid, [1] * n_prompt, mod.SchedulerSamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       eos_token_id=0, arrival_time=arrival, priority=priority)


def add(s, *reqs):
    for r in reqs:
        s.add_request(r)


def step(mod, s):
    """schedule() + a runner that samples token 5 for every request that completes its tokens."""
    out = s.schedule()
    assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens, (
        f"{out.num_scheduled_tokens} schedules {out.total_num_scheduled_tokens} tokens, over the "
        f"budget of {s.config.max_num_batched_tokens}: charge every Δ to the budget")
    s.update_from_output(out, mod.ModelRunnerOutput.from_dict({r: [5] for r in out.num_scheduled_tokens}))
    return out


def step_until_preempted(mod, s, max_steps):
    """Step until a step preempts something; returns that step's output (the
    last one if none did)."""
    for _ in range(max_steps):
        out = step(mod, s)
        if out.preempted_req_ids:
            break
    return out


def new_ids(out):
    return [n.req_id for n in out.scheduled_new_reqs]


# ---- admission order ------------------------------------------------------------
def test_fcfs_head_of_line_blocking(mod):
    """4 blocks of 4. A (8 tokens) takes 2; B (12 tokens, 3 blocks) does not fit;
    C (4 tokens, 1 block) would. FCFS must not let C overtake B."""
    s = make(mod, num_blocks=4)
    add(s, req(mod, "A", 8, 8, 0), req(mod, "B", 12, 4, 1), req(mod, "C", 4, 1, 2))
    out = step(mod, s)
    assert out.num_scheduled_tokens == {"A": 8}, (
        f"step 1 scheduled {out.num_scheduled_tokens}, expected only A: under FCFS a waiting request "
        "that does not fit (B) blocks every later one (stop admitting at the first failure, break, "
        "not continue), otherwise a stream of small requests starves B")
    first = {}
    for i in range(40):
        if not s.has_unfinished_requests():
            break
        for rid in step(mod, s).num_scheduled_tokens:
            first.setdefault(rid, i)
    assert not s.has_unfinished_requests() and first["B"] <= first["C"], \
        f"first steps {first}: B must be admitted no later than C under FCFS"


def test_running_requests_are_scheduled_before_waiting_ones(mod):
    """Budget 8: A decodes (Δ = 1), then B's 20-token prompt takes the 7 left."""
    s = make(mod, num_blocks=16, max_num_batched_tokens=8, max_model_len=32)
    add(s, req(mod, "A", 4, 10, 0))
    step(mod, s)
    add(s, req(mod, "B", 20, 1, 1))
    out = step(mod, s)
    assert out.num_scheduled_tokens == {"A": 1, "B": 7}, (
        f"scheduled {out.num_scheduled_tokens}, expected {{'A': 1, 'B': 7}}: running requests must be "
        "scheduled before waiting ones are admitted, or a new prompt eats the budget and running "
        "requests stall")
    assert list(out.num_scheduled_tokens)[0] == "A", "the running request must be scheduled first"


def test_no_admission_in_a_step_that_preempted(mod):
    """4 blocks of 4, budget 5. At the step where A needs its third block, B is
    preempted (freeing 2 blocks); a 4-token chunk of B would fit again at once."""
    s = make(mod, num_blocks=4, max_num_batched_tokens=5)
    add(s, req(mod, "A", 4, 12, 0), req(mod, "B", 4, 12, 1))
    out = step_until_preempted(mod, s, 20)
    assert out.preempted_req_ids == {"B"}, (
        f"preempted {out.preempted_req_ids}, expected B: under fcfs the victim is the last admitted "
        "running request not yet scheduled in this step")
    assert out.num_scheduled_tokens == {"A": 1} and new_ids(out) == [], (
        f"the step that preempted B also scheduled {out.num_scheduled_tokens} (new: {new_ids(out)}): "
        "after a preemption, admit no waiting request in the same step (the blocks were freed "
        "for running requests; re-admitting the victim at once just thrashes)")


@pytest.mark.parametrize("policy", ["fcfs", "srtf"])
def test_no_newcomer_admitted_in_a_step_that_preempted(mod, policy):
    """The same rule for a newcomer, and under srtf, where admission and running
    requests interleave: 4 blocks of 4; A and B fill the pool, each decode needs
    a new block, and a 1-token C waits. A's decode preempts B; C would fit in a
    block B freed."""
    s = make(mod, num_blocks=4, policy=policy)
    add(s, req(mod, "A", 8, 8, 0), req(mod, "B", 7, 8, 1))
    step(mod, s)  # A and B prefill: 2 blocks each, the pool is full
    add(s, req(mod, "C", 1, 4, 2))
    out = step(mod, s)
    assert "B" in out.preempted_req_ids, (
        f"preempted {out.preempted_req_ids}: A's decode needs a block and only B can give one back "
        "(the latest arrival of equal priority)")
    assert "C" not in out.num_scheduled_tokens, (
        f"{policy} admitted C in the step that preempted B ({out.num_scheduled_tokens}): after a "
        "preemption no waiting request is admitted in the same step, under any policy")


def test_chunked_prefill_off_admits_whole_prompts_only(mod):
    """Budget 16: A and A2 decode (2 tokens), B's 15-token prompt needs 15 of the 14 left."""
    s = make(mod, num_blocks=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    add(s, req(mod, "A", 4, 10, 0), req(mod, "A2", 4, 10, 1))
    step(mod, s)
    add(s, req(mod, "B", 15, 1, 2))
    out = step(mod, s)
    assert out.num_scheduled_tokens == {"A": 1, "A2": 1}, (
        f"scheduled {out.num_scheduled_tokens} without chunked prefill: a prompt that does not fit "
        "whole in the budget left must wait, not be admitted with a partial chunk")


def test_max_num_seqs_caps_running_requests(mod):
    s = make(mod, num_blocks=16, max_num_seqs=2)
    add(s, *(req(mod, f"r{i}", 4, 4, i) for i in range(3)))
    out = step(mod, s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and len(s.running) == 2, (
        f"scheduled {out.num_scheduled_tokens} with max_num_seqs=2: admission must stop once "
        "max_num_seqs requests are running")


# ---- SRTF ---------------------------------------------------------------------------
def test_srtf_failed_admission_does_not_stop_the_step(mod):
    """2 blocks of 8. U (decode) and R (prefill in chunks of 4) hold one block
    each. S (5 tokens) is shorter than R's remaining 8, so SRTF tries it first;
    it needs a block and none is free. R's next chunk fits in its own block."""
    s = make(mod, num_blocks=2, block_size=8, policy="srtf", long_prefill_token_threshold=4)
    add(s, req(mod, "R", 12, 1, 0), req(mod, "U", 3, 4, 1))
    assert step(mod, s).num_scheduled_tokens == {"U": 3, "R": 4}, "setup: U and R admitted"
    add(s, req(mod, "S", 5, 1, 2))
    out = step(mod, s)
    assert out.num_scheduled_tokens == {"U": 1, "R": 4}, (
        f"scheduled {out.num_scheduled_tokens}, expected {{'U': 1, 'R': 4}}: when the shortest "
        "candidate does not fit, stop admitting but keep scheduling the running requests (ending "
        "the whole step there stalls every running request behind one that never fits)")


# ---- preemption -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim(mod, policy):
    """A (arrived first, low priority 1) and B (arrived second, high priority 0)
    decode until A needs a block that is not there. FCFS preempts the last
    admitted (B) whatever the priorities; priority preempts the lowest priority (A)."""
    s = make(mod, num_blocks=4, policy=policy)
    add(s, req(mod, "A", 4, 12, 0, priority=1), req(mod, "B", 4, 12, 1, priority=0))
    preempted = step_until_preempted(mod, s, 10).preempted_req_ids
    want = {"fcfs": {"B"}, "priority": {"A"}}[policy]
    assert preempted == want, (
        f"{policy} preempted {preempted or 'nothing'}, expected {want}: the victim is the last "
        "admitted running request under fcfs (priorities ignored) and the lowest priority "
        "(largest value), then latest arrival, under priority")


def test_a_request_that_preempts_itself_is_not_scheduled(mod):
    """5 blocks of 4; A and B each hold 2 and both need a third in the same
    step. A is scheduled first and takes the last free block; B has no other
    victim than itself."""
    s = make(mod, num_blocks=5, max_model_len=20)
    add(s, req(mod, "A", 4, 12, 0), req(mod, "B", 4, 12, 1))
    try:
        out = step_until_preempted(mod, s, 10)
    except Exception as e:
        raise AssertionError(
            f"the steps up to B's self-preemption raised {e!r}: a request that had to preempt itself "
            "must stop there (return); going on, it asks for a victim again and none is left "
            "(every other running request is already scheduled in this step)") from e
    assert out.preempted_req_ids == {"B"}, (
        f"preempted {out.preempted_req_ids}, expected B (itself): A is already scheduled in this "
        "step, so it can no longer be the victim")
    both = out.preempted_req_ids & set(out.num_scheduled_tokens)
    assert not both and out.num_scheduled_tokens == {"A": 1}, (
        f"{sorted(both) or out.num_scheduled_tokens}: a request that had to preempt itself to find "
        "blocks must stop there (return), not go on to allocate and be scheduled while PREEMPTED")


def test_recompute_preemption_restarts_from_zero(mod):
    s = make(mod, num_blocks=4)
    a, b = req(mod, "A", 4, 12, 0), req(mod, "B", 4, 12, 1)
    add(s, a, b)
    out = step_until_preempted(mod, s, 10)
    assert out.preempted_req_ids == {"B"}, \
        f"preempted {out.preempted_req_ids}, expected B (the last admitted, under fcfs)"
    assert b.num_computed_tokens == 0 and s.kv_cache_manager.get_block_ids("B") == [], (
        f"B after a recompute preemption: num_computed_tokens {b.num_computed_tokens}, blocks "
        f"{s.kv_cache_manager.get_block_ids('B')}: its KV is dropped, so it must restart from 0 "
        "with no blocks (Table 4.1, preemption row)")
    for _ in range(20):
        out = step(mod, s)
        if "B" in new_ids(out):
            break
    (nr,) = [n for n in out.scheduled_new_reqs if n.req_id == "B"]
    assert nr.num_computed_tokens == 0 and out.num_scheduled_tokens["B"] == len(nr.token_ids) > 4, \
        "the resumed request is new to the runner and recomputes prompt + output in one pass"
