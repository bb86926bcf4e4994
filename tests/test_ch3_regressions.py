"""Chapter 3: regression tests for bugs found by acceptance testing.

Oracles: hand-built scenarios whose correct outcome follows from the rules
(vLLM's FCFS preempts the last admitted request; statistics count each
admitted request once), and a brute-force active-set solver for the
non-negative least-squares fit.
"""
import itertools
import signal

import numpy as np
import pytest
import torch

from mini_vllm.scheduler import (ModelRunnerOutput, Request, RequestStatus, SchedulerSamplingParams, Scheduler,
                                 SchedulerConfig)
from mini_vllm.scheduler import cost_model, simulator


# ---------------------------------------------------------------- simulator
@pytest.fixture
def alarm():
    """Turn a hang into a failure: the old simulator looped forever."""
    def on_alarm(signum, frame):
        raise TimeoutError("Orca simulator hang bug: simulate_reservation never returned")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", ["reservation over kv_tokens", "prompt over token budget"])
def test_reservation_simulator_rejects_unadmittable_head(alarm, case):
    cost = cost_model.CostModel(1e-3, 1e-6, 1e-9)
    if case == "reservation over kv_tokens":
        work = [simulator.SimRequest(0.0, 100, 50)]  # Oracle reserves 150 > 120
        kw, match = dict(kv_tokens=120), "kv_tokens"
    else:
        work = [simulator.SimRequest(0.0, 300, 5)]
        kw, match = dict(kv_tokens=10_000, max_num_batched_tokens=256), "max_num_batched_tokens"
    with pytest.raises(ValueError, match=match):
        simulator.simulate_reservation(work, cost, "Orca (Oracle)", **kw)


# ------------------------------------------------------------ FCFS victim
def two_full_requests(policy):
    """A (priority 5) is admitted before B (priority 0); both prefills fill the
    4-block pool, so A's first decode token needs a block and forces a preemption."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=16, policy=policy),
                  num_gpu_blocks=4, block_size=4)
    a = Request("A", list(range(10, 18)), SchedulerSamplingParams(max_tokens=4), arrival_time=0.0, priority=5)
    b = Request("B", list(range(20, 28)), SchedulerSamplingParams(max_tokens=4), arrival_time=1.0, priority=0)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"A", "B"}, (
        f"setup: both prompts must fit the 4-block pool in one step, scheduled {set(out.num_scheduled_tokens)}")
    s.update_from_output(out, ModelRunnerOutput.from_dict({"A": [1], "B": [2]}))
    return s, s.schedule()


def test_fcfs_preempts_last_admitted_not_lowest_priority():
    _, out = two_full_requests("fcfs")
    assert out.preempted_req_ids == {"B"}, (
        "FCFS victim bug: under fcfs the last-admitted request (B) must be preempted, "
        f"the priority field ignored; got {out.preempted_req_ids}")
    assert set(out.num_scheduled_tokens) == {"A"}, (
        "FCFS victim bug: the preempted B was scheduled anyway, or A lost its decode; scheduled "
        f"{set(out.num_scheduled_tokens)}")


def test_priority_policy_still_preempts_by_priority():
    _, out = two_full_requests("priority")
    assert out.preempted_req_ids == {"A"}, "under policy=priority the lowest priority (A, value 5) is the victim"


# -------------------------------------------------------- prefix-cache stats
def test_prefix_cache_stats_count_each_admitted_request_once():
    """SRTF looks every candidate up each step; only admissions may count."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32, max_num_seqs=1, policy="srtf"),
                  num_gpu_blocks=64, block_size=4)
    prefix = list(range(100, 108))  # two full blocks shared by every prompt
    prompts = [prefix + list(range(200 + 10 * i, 202 + 10 * i + i)) for i in range(4)]  # lengths 10..13
    for i, p in enumerate(prompts):
        s.add_request(Request(f"r{i}", p, SchedulerSamplingParams(max_tokens=2, ignore_eos=True),
                              arrival_time=float(i)))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput.from_dict({r: [7] for r in out.num_scheduled_tokens}))
        steps += 1
        assert steps < 50, (
            "4 short requests did not finish in 50 steps: SRTF starves a request, or a finished one stays queued")
    st = s.kv_cache_manager.prefix_cache_stats
    assert st.requests == 4, f"inflated prefix-cache stats bug: 4 admitted requests counted as {st.requests}"
    assert st.queries == sum(map(len, prompts)), "queries must be the admitted prompts' tokens, once each"
    # The shortest prompt runs first with no hit; the other three hit the shared 8-token prefix.
    assert st.hits == 3 * len(prefix), f"hits must be 3 x 8 shared tokens, got {st.hits}"


# -------------------------------------------------------- update_from_output
def running_pair():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32), num_gpu_blocks=16, block_size=4)
    for rid, base in (("x", 10), ("y", 40)):
        s.add_request(Request(rid, list(range(base, base + 5)),
                              SchedulerSamplingParams(max_tokens=8, ignore_eos=True)))
    return s, s.schedule()


def test_update_rejects_several_tokens_without_drafts():
    s, out = running_pair()
    with pytest.raises(ValueError, match="exactly 1 token"):
        s.update_from_output(out, ModelRunnerOutput.from_dict({"x": [1, 2, 3], "y": [4]}))
    assert s.requests["x"].output_token_ids == [], \
        "update_from_output count bug: several tokens without drafts were appended"


def test_update_is_all_or_nothing():
    s, out = running_pair()
    before = {r: (list(s.requests[r].all_token_ids), s.requests[r].num_computed_tokens) for r in ("x", "y")}
    with pytest.raises(ValueError, match="'y'"):
        s.update_from_output(out, ModelRunnerOutput.from_dict({"x": [1], "y": []}))  # y completed, sampled nothing
    after = {r: (list(s.requests[r].all_token_ids), s.requests[r].num_computed_tokens) for r in ("x", "y")}
    assert after == before, "update_from_output atomicity bug: x was updated before y's error was found"
    assert all(s.requests[r].status == RequestStatus.RUNNING for r in ("x", "y")), (
        "update_from_output atomicity bug: a request changed status before the step's error was found")
    # The same step with a valid output then applies cleanly.
    res = s.update_from_output(out, ModelRunnerOutput.from_dict({"x": [1], "y": [2]}))
    assert [o.new_token_ids for o in res] == [[1], [2]], (
        f"a rejected update_from_output left state behind: the valid retry emitted {[o.new_token_ids for o in res]}")


# ------------------------------------------------------------- cost model
def brute_force_nnls(A, y):
    """Exact NNLS for a few columns: best unconstrained fit over every support
    set whose solution is non-negative."""
    best, best_res = np.zeros(A.shape[1]), float(np.sum(y ** 2))
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            sub, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.all(sub >= 0):
                coef = np.zeros(A.shape[1])
                coef[list(cols)] = sub
                res = float(np.sum((A @ coef - y) ** 2))
                if res < best_res:
                    best, best_res = coef, res
    return best


def test_fit_cost_model_is_true_nnls():
    rng = np.random.default_rng(0)
    t = rng.integers(1, 2000, 40).astype(float)
    kv = t * rng.uniform(50, 400, 40)
    # Step time falling with KV reads: the unconstrained fit has c < 0, and
    # clamping c to 0 leaves a and b at the wrong values.
    y = 2e-3 + 3e-5 * t - 4e-8 * kv + rng.normal(0, 1e-5, 40)
    rows = list(zip(t.tolist(), kv.tolist(), y.tolist()))
    fit, _ = cost_model.fit_cost_model(rows)
    want = brute_force_nnls(np.stack([np.ones_like(t), t, kv], axis=1), y)
    np.testing.assert_allclose([fit.a, fit.b, fit.c], want, rtol=1e-6, atol=1e-15,
                               err_msg="fit_cost_model bug: a clamped unconstrained fit is not the NNLS optimum")


def test_measure_grid_restores_threads_on_error(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("timing failed")
    monkeypatch.setattr(cost_model, "_time_step", boom)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with pytest.raises(RuntimeError, match="timing failed"):
            cost_model.measure_grid()
        assert torch.get_num_threads() == 3, "measure_grid bug: the thread count stayed at 1 after an error"
    finally:
        torch.set_num_threads(threads)
