"""Chapter 3 simulator and cost model, checked against independent references:
the least-squares fit against known constants, the paged simulator against
the (separately written) Orca-Oracle simulator when memory never binds, and
the static batcher against a hand computation."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.scheduler import SchedulerConfig
from mini_vllm.scheduler.cost_model import CostModel, fit_cost_model, kv_read
from mini_vllm.scheduler.simulator import (SimRequest, make_workload, simulate_paged,
                                           simulate_reservation, simulate_static)

COST = CostModel(1e-3, 2e-5, 1e-7)


def test_fit_recovers_known_constants():
    rows = [(t, kv, COST.step_time(t, kv)) for t in (1, 8, 64, 300) for kv in (10, 500, 9000)]
    fit, r2 = fit_cost_model(rows)
    assert fit.a == pytest.approx(COST.a, rel=1e-6) and fit.b == pytest.approx(COST.b, rel=1e-6), (
        f"least-squares fit missed the known per-step and per-token constants: a={fit.a} b={fit.b}")
    assert fit.c == pytest.approx(COST.c, rel=1e-6) and r2 == pytest.approx(1.0), (
        f"least-squares fit missed the per-KV-read constant or the exact data did not give R^2 = 1: c={fit.c} r2={r2}")


def test_kv_read_counts_causal_reads():
    # Brute force: query at position p reads p + 1 entries.
    for c, d in ((0, 1), (0, 7), (5, 1), (9, 4)):
        assert kv_read(c, d) == sum(p + 1 for p in range(c, c + d)), (
            f"kv_read({c}, {d}) = {kv_read(c, d)}: a query at position p reads p + 1 entries (off by one, or not "
            "causal?)")


@given(n=st.integers(1, 12), rate=st.floats(1.0, 200.0), seed=st.integers(0, 50))
def test_paged_equals_oracle_when_memory_never_binds(n, rate, seed):
    """Two independent implementations of iteration-level FCFS batching must
    give identical token times when neither memory nor sequences bind."""
    w = make_workload("Alpaca", n, rate, seed)
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048,
                          enable_chunked_prefill=False)
    a = simulate_paged(w, COST, cfg, num_blocks=n * 128 + 1, block_size=16)
    b = simulate_reservation(w, COST, "Orca (Oracle)", kv_tokens=n * 2048)
    for x, y in zip(a.requests, b.requests):
        assert x.token_times == pytest.approx(y.token_times, rel=1e-12), \
            "paged scheduler and reservation baseline disagree on an unconstrained workload"


def test_static_batch_by_hand():
    w = [SimRequest(0.0, 4, 2), SimRequest(0.0, 6, 3), SimRequest(0.0, 5, 1)]
    r = simulate_static(w, COST, kv_tokens=2 * 2048)  # batch size 2
    t1 = COST.step_time(10, kv_read(0, 4) + kv_read(0, 6))
    t2 = t1 + COST.step_time(2, 5 + 7)
    t3 = t2 + COST.step_time(2, 6 + 8)
    t4 = t3 + COST.step_time(5, kv_read(0, 5))
    assert r.requests[0].token_times == pytest.approx([t1, t2]), (
        "request 0's token times differ from the hand computation (the batch prefill + one decode): "
        f"{r.requests[0].token_times}")
    assert r.requests[1].token_times == pytest.approx([t1, t2, t3]), (
        "request 1's token times differ: a finished request must keep its slot in the static batch until the batch "
        f"ends, got {r.requests[1].token_times}")
    assert r.requests[2].token_times == pytest.approx([t4]), "third request waits for the whole batch"
    m = r.metrics()
    assert m["finished"] == 3 and m["avg_batched_reqs"] == pytest.approx((2 * 3 + 1) / 4), (
        f"static batch metrics wrong: want 3 finished and (2*3+1)/4 requests per step, got {m}")
