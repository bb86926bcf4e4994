"""How `benchmarks/vllm_side.py` reads real vLLM's speculative-decoding counters: summed
over label sets from an `LLM.get_metrics()` snapshot, turned into one phase's growth, and
into the rates vLLM's own log line prints. Fake snapshot objects stand in for vLLM's
`vllm.v1.metrics.reader.Counter` / `Vector` (the helpers read only their fields), so these
tests need no vLLM."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_side import spec_counters, spec_delta, spec_summary  # noqa: E402


def counter(name: str, value: int, model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(name=name, labels={"model_name": model, "engine": "0"}, value=value)


def vector(values: list[int], model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                           labels={"model_name": model, "engine": "0"}, values=values)


def snapshot(drafts: int, tokens: int, accepted: int, per_pos: list[int], model: str = "m") -> list:
    return [counter("vllm:spec_decode_num_drafts", drafts, model),
            counter("vllm:spec_decode_num_draft_tokens", tokens, model),
            counter("vllm:spec_decode_num_accepted_tokens", accepted, model),
            vector(per_pos, model),
            counter("vllm:prompt_tokens", 999, model)]  # not a spec-decode counter


def test_counters_are_read_by_name_and_summed_over_label_sets():
    # Two LLM instances in one process (the runner's job list) leave two label sets behind.
    got = spec_counters(snapshot(10, 30, 7, [5, 2, 0], "a") + snapshot(4, 12, 3, [2, 1, 0], "b"))
    assert got == {"num_drafts": 14, "num_draft_tokens": 42, "num_accepted_tokens": 10,
                   "num_accepted_tokens_per_pos": [7, 3, 0]}, \
        f"counters must be summed over every label set, and other metrics ignored, got {got}"
    assert spec_counters([counter("vllm:prompt_tokens", 5)])["num_drafts"] == 0, \
        "an engine without speculative decoding must read as zero drafts"


def test_a_phase_reports_what_the_counters_grew_by_not_their_running_totals():
    before = spec_counters(snapshot(100, 300, 40, [30, 10, 0]))
    after = spec_counters(snapshot(122, 366, 50, [37, 13, 0]))
    d = spec_delta(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (22, 66, 10), \
        f"a phase's counters must be the growth over the phase (earlier phases excluded), got {d}"
    assert d["num_accepted_tokens_per_pos"] == [7, 3, 0], \
        f"per-position counts must be the growth over the phase too, got {d['num_accepted_tokens_per_pos']}"
    assert d["mean_acceptance_length"] == pytest.approx(1 + 10 / 22), \
        f"the phase's rates must come from the phase's growth, not the totals, got {d['mean_acceptance_length']}"


def test_rates_are_vllms_mean_acceptance_length_and_per_position_rates():
    # One real run (vLLM 0.32, tiny target, an EAGLE head, k = 3): 122 drafts, 34 accepted.
    s = spec_summary({"num_drafts": 122, "num_draft_tokens": 366, "num_accepted_tokens": 34,
                      "num_accepted_tokens_per_pos": [30, 4, 0]})
    assert s["mean_acceptance_length"] == pytest.approx(1 + 34 / 122), \
        f"mean acceptance length is 1 (the target's own token) + accepted / drafts, got {s['mean_acceptance_length']}"
    assert s["draft_acceptance_rate"] == pytest.approx(34 / 366), \
        f"the draft acceptance rate divides by draft tokens, not drafts, got {s['draft_acceptance_rate']}"
    assert s["acceptance_rate_per_pos"] == pytest.approx([30 / 122, 4 / 122, 0.0]), \
        f"position j's rate is accepted at j / drafts, as vLLM's log line prints, got {s['acceptance_rate_per_pos']}"


def test_rates_are_undefined_before_any_draft():
    s = spec_summary({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "num_accepted_tokens_per_pos": [0, 0]})
    assert s == {"mean_acceptance_length": None, "draft_acceptance_rate": None,
                 "acceptance_rate_per_pos": [None, None]}, \
        f"with no drafts the rates must be None (vLLM leaves them undefined), not 1.0 or 0.0, got {s}"
