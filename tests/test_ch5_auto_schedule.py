"""The engine's measured default for dynamic speculative decoding
(`spec_decode/engine/auto_schedule.py`, `worker/spec_profile.py`).

Oracles: the rule written out by hand on made-up costs (no test here reads a
clock: the profiler's timings are replaced by known costs, and the engine's
measured break-evens by chosen ones), and the engine without speculation for
tokens.
"""
from __future__ import annotations

import pytest

from engine_utils import make_llm, model_runner, run_greedy
from mini_vllm.course.tiny_models import model_path
from mini_vllm.metrics.stats import SpecDecodingStats
from mini_vllm.spec_decode.engine.auto_schedule import MIN_DRAFT_SEQUENCES, AutoSchedule
from mini_vllm.spec_decode.engine.config import SpeculativeConfig
import mini_vllm.worker.spec_profile as spec_profile

EAGLE = str(model_path("tiny-py-eagle"))
PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42, 43], [100, 7, 7, 90, 12], [3, 1, 4, 1, 5, 9, 2, 6]]


def _observed(k: int, lengths: list[int]) -> SpecDecodingStats:
    """Totals after draft sequences of k drafts with these mean acceptance lengths (1 + accepted)."""
    t = SpecDecodingStats()
    for n in lengths:
        t.observe_draft(k, n - 1)
    return t


def test_prior_and_rounding_up_between_measured_sizes():
    s = AutoSchedule(3, [(1, 1.5), (2, 2.5), (4, 3.9), (8, 4.2)], SpecDecodingStats())
    got = [s(b) for b in range(1, 10)]
    assert got == [3, 3, 3, 3, 0, 0, 0, 0, 0], (
        f"batch 3 must take batch 4's break-even (3.9 < 4: drafts), 5..8 batch 8's (4.2: none), 9 none "
        f"(past the last measured size); a batch size rounded down, or an optimistic prior missing, fails this: {got}")


def test_measured_acceptance_replaces_the_prior():
    totals = _observed(3, [2] * (MIN_DRAFT_SEQUENCES - 1))
    s = AutoSchedule(3, [(1, 1.5), (2, 2.5), (4, 3.0)], totals)
    assert s(4) == 3, "with fewer than MIN_DRAFT_SEQUENCES verified the prior (k + 1) must still decide"
    totals.observe_draft(3, 1)  # now 16 sequences: L = 1 + 16 / 16 = 2.0
    assert s.acceptance_length() == pytest.approx(2.0)
    assert [s(b) for b in (1, 2, 4)] == [3, 0, 0], (
        "with a measured mean acceptance length of 2.0 only batch 1 (break-even 1.5) pays; the schedule must read "
        "the verifier's totals live, not a copy taken when it was built")


def test_break_even_equal_to_the_acceptance_length_does_not_draft():
    s = AutoSchedule(3, [(1, 2.0)], _observed(3, [2] * MIN_DRAFT_SEQUENCES))
    assert s(1) == 0, "drafting only pays when L * T(B) exceeds V(B): L == c is a tie, and a tie drafts nothing"


def test_a_noisy_dip_does_not_turn_drafting_back_on():
    s = AutoSchedule(3, [(1, 1.5), (2, 3.5), (4, 2.0), (8, 3.8)], _observed(3, [3] * MIN_DRAFT_SEQUENCES))
    assert s.costs == [1.5, 3.5, 3.5, 3.8], f"break-evens must be made non-decreasing (a running maximum): {s.costs}"
    assert [s(b) for b in (1, 2, 3, 4)] == [3, 0, 0, 0], "a batch of 4 drafted after a batch of 2 did not"


@pytest.mark.parametrize("bad", [[], [(2, 1.0), (1, 1.0)], [(1, 1.0), (1, 2.0)]])
def test_bad_break_even_tables_are_refused(bad):
    with pytest.raises(ValueError, match="break_even"):
        AutoSchedule(3, bad, SpecDecodingStats())


def test_the_ladder_doubles_and_stops_where_no_acceptance_pays(monkeypatch):
    """measure_break_even with known costs instead of timings: the target T(rows) = 1 + rows / 8,
    the proposer a fixed cost per call, so c(B) = (T(B (k + 1)) + draft) / T(B)."""
    k, per_seq = 3, [0.0]  # the proposer costs 0.5 + per_seq * B

    class Runner:
        device = "cpu"

    monkeypatch.setattr(spec_profile, "BUDGET_S", float("inf"))  # made-up costs of seconds; tried last
    monkeypatch.setattr(spec_profile, "_target_step", lambda runner, num_seqs, q: ("target", num_seqs * q))
    monkeypatch.setattr(spec_profile, "_drafting", lambda runner, num_seqs, k: ("draft", num_seqs))
    monkeypatch.setattr(spec_profile, "_best_times", lambda fns, device: [
        1 + fn[1] / 8 if fn[0] == "target" else 0.5 + per_seq[0] * fn[1] for fn in fns])

    def c(b):
        return (1 + b * (k + 1) / 8 + 0.5 + per_seq[0] * b) / (1 + b / 8)

    got = spec_profile.measure_break_even(Runner(), k, 100)
    # c(B) stays below k + 1 = 4 at every B here: the ladder runs to max_num_seqs, capped, not doubled past it
    assert [b for b, _ in got] == [1, 2, 4, 8, 16, 32, 64, 100], f"batch sizes 1, 2, 4, ... capped at 100: {got}"
    assert all(v == pytest.approx(c(b)) for b, v in got), f"c(B) must be V(B) / T(B), drafting included: {got}"
    per_seq[0] = 0.25  # c = 2.0, 2.4, 3.0, 3.75, then 4.5 at B = 16
    got = spec_profile.measure_break_even(Runner(), k, 100)
    assert [b for b, _ in got] == [1, 2, 4, 8, 16], (
        f"the ladder must stop right after the first batch size whose break-even exceeds k + 1 (16): {got}")
    assert all(v == pytest.approx(c(b)) for b, v in got), got
    # A slow machine: the calls of batch sizes 1..8 take over BUDGET_S together (6 calls of each fn
    # per size), so the ladder stops after 8 even though drafting could still pay there.
    per_seq[0] = 0.0
    monkeypatch.setattr(spec_profile, "BUDGET_S", 6 * sum(1 + b / 8 + 1 + b * (k + 1) / 8 + 0.5 for b in (1, 2, 4))
                        + 1e-9)
    got = spec_profile.measure_break_even(Runner(), k, 100)
    assert [b for b, _ in got] == [1, 2, 4, 8] and got[-1][1] <= k + 1, (
        f"the ladder must stop at the first batch size whose calls pass BUDGET_S seconds in all: {got}")


def test_the_engine_measures_a_schedule_and_follows_it():
    """Left out, the schedule is measured at start-up: a break-even per batch size, ascending
    from 1. With break-evens chosen here (batch 1 pays, 2 and more do not), one request
    drafts and a batch of four does not, and the tokens are the plain engine's either way."""
    plain = make_llm(multiprocess_mode=False)
    want = run_greedy(plain, PROMPTS, 24)
    llm = make_llm(multiprocess_mode=False, max_num_seqs=8,
                   speculative_config={"method": "eagle", "model": EAGLE, "num_speculative_tokens": 3})
    runner = model_runner(llm)
    schedule = runner.drafter.spec_tokens_for_batch
    assert isinstance(schedule, AutoSchedule), f"no measured schedule was installed: {schedule!r}"
    assert schedule.batch_sizes[0] == 1 and schedule.batch_sizes == sorted(schedule.batch_sizes)
    assert schedule.batch_sizes[-1] <= 8 and all(c > 0 for c in schedule.costs)
    schedule.costs = [1.0] + [10.0] * (len(schedule.costs) - 1)
    totals = runner.step_sampler.verifier.totals
    assert run_greedy(llm, PROMPTS[:1], 24) == want[:1], "greedy tokens changed under speculation"
    drafted = totals.num_draft_sequences
    assert drafted > 0, "a lone request did not draft although batch 1's break-even is 1.0"
    assert run_greedy(llm, PROMPTS, 24) == want, "greedy tokens changed under the measured schedule"
    assert totals.num_draft_sequences == drafted, (
        "a batch of four drafted although its break-even (10) exceeds any acceptance length")


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft_model", "model": str(model_path("tiny-py-draft")), "num_speculative_tokens": 2}])
def test_every_method_gets_a_measured_schedule(spec):
    """The profile runs each proposer's own passes (none for the n-gram lookup), and the engine
    serves with the schedule it measured: the plain engine's greedy tokens."""
    want = run_greedy(make_llm(multiprocess_mode=False), PROMPTS[:2], 16)
    llm = make_llm(multiprocess_mode=False, max_num_seqs=4, speculative_config=spec)
    schedule = model_runner(llm).drafter.spec_tokens_for_batch
    assert isinstance(schedule, AutoSchedule) and schedule.batch_sizes[0] == 1, f"{spec['method']}: {schedule!r}"
    assert run_greedy(llm, PROMPTS[:2], 16) == want, f"{spec['method']}: greedy tokens changed under the schedule"


def test_none_is_vllms_always_k_and_bad_values_are_refused():
    llm = make_llm(multiprocess_mode=False, speculative_config={
        "method": "eagle", "model": EAGLE, "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": None})
    runner = model_runner(llm)
    assert not isinstance(runner.drafter.spec_tokens_for_batch, AutoSchedule) \
        and [runner.drafter.num_drafts_after(b) for b in (1, 2, 64, 256)] == [2] * 4, \
        "None must mean vLLM's default: k drafts at every batch size, nothing measured"
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size.*auto"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, num_speculative_tokens_per_batch_size="measured")
    assert SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 2}) \
        .num_speculative_tokens_per_batch_size == "auto"


def test_the_measured_schedule_gives_way_where_the_draft_length_must_be_known():
    """Asynchronous scheduling (the scheduler's placeholders) and tensor parallelism (every rank
    must draft the same count) take vLLM's k at every batch size instead of "auto"; a synchronous
    engine on one rank keeps "auto"."""
    from mini_vllm.config import EngineConfig

    m = str(model_path("tiny-py-target"))
    draft = {"method": "draft_model", "model": str(model_path("tiny-py-draft")), "num_speculative_tokens": 3}
    cases = [(dict(device="cpu"), "auto", "a synchronous one-rank engine lost its measured schedule"),
             (dict(device="cpu", async_scheduling=True), None,
              "asynchronous scheduling kept a measured schedule: the scheduler's placeholders need k every step"),
             (dict(device="cuda"), None, "the CUDA default (asynchronous) kept a measured schedule"),
             (dict(device="cpu", tensor_parallel_size=2), None,
              "two ranks kept a measured schedule: each would measure its own and they could disagree")]
    for kw, want, bug in cases:
        cfg = EngineConfig(model=m, speculative_config=dict(draft), **kw)
        assert cfg.speculative_config.num_speculative_tokens_per_batch_size == want, f"{kw}: {bug}"
