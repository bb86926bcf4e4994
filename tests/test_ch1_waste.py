"""Chapter 1: the memory-waste experiment (seed 001 §3.3, Fig. 3.2)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from mini_vllm.paged_attention import waste


def test_trace_is_deterministic_and_within_max_len():
    a = waste.synthetic_trace("ShareGPT", 300, seed=1)
    assert a == waste.synthetic_trace("ShareGPT", 300, seed=1), "same seed must give the same trace"
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= waste.MAX_LEN for r in a), \
        "a trace request has an empty prompt or output, or exceeds MAX_LEN tokens"


def test_trace_means_follow_thesis_ratios():
    """seed 001 §3.6: ShareGPT prompts 8.4x and outputs 5.8x longer than Alpaca's (clipping
    to 2048 tokens shifts them a little, hence the loose band)."""
    s = waste.synthetic_trace("ShareGPT", 4000)
    a = waste.synthetic_trace("Alpaca", 4000)
    pr = np.mean([r.prompt_len for r in s]) / np.mean([r.prompt_len for r in a])
    orr = np.mean([r.output_len for r in s]) / np.mean([r.output_len for r in a])
    assert 7.0 < pr < 9.5 and 5.0 < orr < 6.5, f"ratios {pr:.2f}, {orr:.2f} drifted from 8.4 / 5.8"


@given(st.integers(1, 1500), st.integers(1, 500), st.sampled_from(waste.PAGED_BLOCK_SIZES))
def test_paged_waste_is_less_than_one_block_per_request(p, o, b):
    """Paged allocation never holds a full unused block: 0 <= alloc - used < B at every iteration."""
    req = waste.TraceRequest(p, o)
    used = waste.used_slots(req)
    alloc = waste.allocation(f"Paged (B={b})", req, used)
    slack = alloc - used
    assert slack.min() >= 0, "allocated fewer slots than tokens stored"
    assert slack.max() < b, f"slack {slack.max()} >= block size {b}: an extra block was allocated"
    assert (alloc % b == 0).all(), "paged allocation must be whole blocks"


@given(st.integers(1, 1000), st.integers(1, 1000))
def test_orca_schemes_never_under_allocate(p, o):
    req = waste.TraceRequest(p, o)
    used = waste.used_slots(req)
    for scheme in ("Orca (Max)", "Orca (Pow2)", "Orca (Oracle)"):
        assert (waste.allocation(scheme, req, used) >= used).all(), f"{scheme} holds fewer slots than tokens"


def test_waste_table_shape_and_ordering():
    rows = waste.waste_table(num_requests=300)
    assert len(rows) == 2 * len(waste.SCHEMES), f"{len(rows)} rows, expected one per (dataset, scheme)"
    for ds in waste.DATASETS:
        eff = {r["scheme"]: r["effective_pct"] for r in rows if r["dataset"] == ds}
        assert eff["Orca (Max)"] < eff["Orca (Pow2)"] <= eff["Orca (Oracle)"], f"{ds}: more reservation must not waste less"
        assert eff["Orca (Oracle)"] < eff["Paged (B=16)"], f"{ds}: paging must beat even exact reservation"
        assert eff["Paged (B=8)"] >= eff["Paged (B=16)"] >= eff["Paged (B=32)"] >= eff["Paged (B=128)"], \
            f"{ds}: a larger block must not waste less (internal fragmentation grows with the block size)"
        for r in rows:
            assert r["effective_pct"] + r["reserved_pct"] + r["internal_frag_pct"] == pytest.approx(100.0), \
                f"{r['dataset']} {r['scheme']}: effective + reserved + internal fragmentation must cover all slots"
            if r["scheme"].startswith("Paged"):
                b = int(r["scheme"][len("Paged (B="):-1])
                assert r["max_slack_per_request"] < b, \
                    f"{r['scheme']}: a request held a whole unused block ({r['max_slack_per_request']} slots)"


def test_measure_on_a_hand_computed_request():
    """P=3, O=3: used = 3, 4, 5. Oracle allocates 6 each time -> 12/18; B=4 allocates 4, 4, 8 -> 12/16."""
    trace = [waste.TraceRequest(3, 3)]
    assert waste.measure(trace, "Orca (Oracle)")["effective_pct"] == pytest.approx(100 * 12 / 18), \
        "Oracle must reserve exactly prompt + output = 6 slots at each of the 3 iterations"
    assert waste.measure(trace, "Orca (Pow2)")["effective_pct"] == pytest.approx(100 * 12 / 21), \
        "Pow2 must reserve the prompt plus the next power of two of the output (3 + 4 = 7 slots) at each iteration"
    assert waste.measure(trace, "Orca (Max)")["effective_pct"] == pytest.approx(100 * 12 / (3 * 2048)), \
        "Max must reserve MAX_LEN = 2048 slots at every iteration"
