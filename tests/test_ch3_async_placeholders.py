"""Chapter 3: the placeholder rule of asynchronous scheduling (runs under --impl=exercise).

With `async_scheduling=True` the engine schedules step N + 1 before step N's
tokens are back. A request whose step samples gets one **output placeholder**
(`Scheduler._update_after_schedule`): the next schedule computes that token's
position ahead as if it were known. When the token arrives, it replaces the
placeholder (`Scheduler._replace_placeholder`), and since the runner already
appended it, it counts as sent. The oracle is the same workload scheduled
synchronously: the scheduler must emit the same tokens, finish the same way
and give back every block, with one placeholder per sampling step in flight, never more.
"""
from collections import deque

import pytest


@pytest.fixture(scope="module")
def mod(chapter):
    return chapter("scheduler")


def token(rid: str, index: int) -> int:
    """The runner's deterministic 'model': the index-th output of request rid."""
    return 2 + (sum(map(ord, rid)) * 7 + index * 13) % 50


def drive(mod, async_scheduling: bool, chunked: bool = True, num_blocks: int = 64):
    """Run a workload to the end; async keeps two steps in flight (vLLM's batch queue)."""
    cfg = mod.SchedulerConfig(max_model_len=128, max_num_batched_tokens=16 if chunked else 128, max_num_seqs=4,
                              async_scheduling=async_scheduling, enable_chunked_prefill=chunked)
    s = mod.Scheduler(cfg, num_blocks, 4, enable_prefix_caching=True)
    reqs = [mod.Request(f"r{i}", [3 + (i * 5 + j) % 40 for j in range(5 + 4 * i)],
                        mod.SchedulerSamplingParams(max_tokens=4 + i, stop_token_ids=(0,)), eos_token_id=1,
                        arrival_time=float(i)) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    trace, inflight, max_ph = [], deque(), 0
    for _ in range(500):
        if not (s.has_unfinished_requests() or inflight):
            break
        if s.has_unfinished_requests() and len(inflight) < (2 if async_scheduling else 1):
            so = s.schedule()
            trace.append(so)
            inflight.append(so)
            max_ph = max([max_ph] + [r.num_output_placeholders for r in reqs])
            over = {r.request_id: r.num_output_placeholders for r in reqs
                    if r.num_output_placeholders > len(inflight)}
            assert not over, (f"placeholders {over} with {len(inflight)} step(s) in flight: each one must stand "
                              "for a token a step in flight will sample (a placeholder never subtracted when its "
                              "token arrived, or counted for a step that samples nothing?)")
            if async_scheduling and len(inflight) < 2 and so.total_num_scheduled_tokens:
                continue  # the next step is scheduled before this one's tokens are back
        so = inflight.popleft()
        toks = {}
        for rid in so.num_scheduled_tokens:
            req = s.requests.get(rid)
            sampled = rid in so.sampling_req_ids
            toks[rid] = [token(rid, len(outputs[rid]))] if sampled and req is not None else []
        for out in s.update_from_output(so, mod.ModelRunnerOutput.from_dict(toks)):
            outputs[out.request_id] += out.new_token_ids
    else:
        pytest.fail("the workload did not finish in 500 steps")
    return s, reqs, outputs, trace, max_ph


@pytest.mark.parametrize("chunked", [True, False])
def test_async_emits_the_synchronous_tokens(mod, chunked):
    _, sync_reqs, want, _, _ = drive(mod, False, chunked)
    s, reqs, got, _, _ = drive(mod, True, chunked)
    assert got == want, ("asynchronous scheduling changed the tokens: a placeholder was counted for a step "
                         "that does not sample, or a token did not replace its placeholder")
    assert [r.get_finished_reason() for r in reqs] == [r.get_finished_reason() for r in sync_reqs], (
        "asynchronous scheduling changed a finish reason: a placeholder was taken for a real token in the stop checks")
    assert s.kv_cache_manager.usage == 0.0, "blocks leaked after every request finished"


def test_placeholders_are_bounded_and_all_replaced(mod):
    _, reqs, _, _, max_ph = drive(mod, True)
    assert max_ph == 2, (f"a request held {max_ph} placeholders with two steps in flight: one is counted per "
                         "sampling step and replaced when its token arrives (never subtracted?)" if max_ph > 2
                         else "a decoding request never had a placeholder for each of the two steps in flight: "
                              "asynchronous scheduling did not compute ahead")
    assert all(r.num_output_placeholders == 0 for r in reqs), "a placeholder outlived its token"


def test_decoding_requests_are_computed_ahead(mod):
    """Under async, a decoding request is scheduled in consecutive steps although the
    token of the first is not back yet: its placeholder stands for that position."""
    _, _, _, trace, _ = drive(mod, True)
    ahead = sum(1 for a, b in zip(trace, trace[1:]) for rid in a.sampling_req_ids & set(b.num_scheduled_tokens))
    assert ahead > 0, "no request was scheduled again before its token came back: the placeholder was not counted"


def test_tokens_the_runner_appended_are_not_sent_again(mod):
    """The runner appends the tokens it sampled itself under async; the scheduler must
    count them as sent, or the next step's new_token_ids would hand them over twice."""
    _, reqs, outputs, trace, _ = drive(mod, True)
    resent = {}
    for so in trace:
        for cr in so.scheduled_cached_reqs:
            if cr.new_token_ids and not cr.resumed_from_preemption:
                resent[cr.req_id] = resent.get(cr.req_id, 0) + len(cr.new_token_ids)
    assert not resent, f"tokens sent again to a runner that appended them itself: {resent}"


K = 3  # drafts per step in the speculative workload


def draft(rid: str, index: int) -> int:
    """The runner's deterministic drafter: right (the model's token) except at every third
    index, so some steps accept all their drafts, some a few, and some none."""
    right = token(rid, index)
    return right if index % 3 else right + 100


def drive_spec(mod, async_scheduling: bool):
    """Speculative decoding with k = K: the runner verifies the scheduled drafts against the
    model (greedy: the accepted prefix, then the model's token). Synchronous: the drafts reach
    the scheduler through update_draft_token_ids after each step. Asynchronous: the scheduler
    schedules PLACEHOLDER_TOKEN_IDs, and the runner, which knows how many tokens each request
    has emitted (steps run in order), feeds its own drafts in their place."""
    cfg = mod.SchedulerConfig(max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4,
                              async_scheduling=async_scheduling, num_spec_tokens=K)
    s = mod.Scheduler(cfg, 64, 4, enable_prefix_caching=True)
    reqs = [mod.Request(f"r{i}", [3 + (i * 5 + j) % 40 for j in range(5 + 4 * i)],
                        mod.SchedulerSamplingParams(max_tokens=9 + i, stop_token_ids=(0,)), eos_token_id=1,
                        arrival_time=float(i), spec_decode=i != 2) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    emitted = {r.request_id: 0 for r in reqs}  # the runner's count, ahead of the scheduler's
    inflight, max_ph, placeholder_steps = deque(), 0, 0
    for _ in range(500):
        if not (s.has_unfinished_requests() or inflight):
            break
        if s.has_unfinished_requests() and len(inflight) < (2 if async_scheduling else 1):
            so = s.schedule()
            placeholder_steps += any(d and all(t == mod.PLACEHOLDER_TOKEN_ID for t in d)
                                     for d in so.scheduled_spec_decode_tokens.values())
            assert not so.scheduled_spec_decode_tokens.get("r2"), \
                "drafts scheduled for r2, a request with spec_decode=False (the engine cannot verify its sampling)"
            # The step runs now, in order (the runner's view): verify, emit, propose.
            toks, drafts = {}, {}
            for rid in so.num_scheduled_tokens:
                fed = so.scheduled_spec_decode_tokens.get(rid, [])
                if rid not in so.sampling_req_ids or s.requests.get(rid) is None:
                    toks[rid] = []
                    continue
                i = emitted[rid]
                mine = [draft(rid, i + j) for j in range(len(fed))]
                assert async_scheduling or fed == mine, f"{rid}: the scheduler scheduled {fed}, drafts were {mine}"
                out = [token(rid, i)]
                for j, d in enumerate(mine):
                    if d != token(rid, i + j):
                        break
                    out.append(token(rid, i + j + 1))
                toks[rid] = out
                emitted[rid] += len(out)
                drafts[rid] = [draft(rid, emitted[rid] + j) for j in range(K)]
            inflight.append((so, toks, drafts))
            max_ph = max([max_ph] + [r.num_output_placeholders for r in reqs])
            assert max_ph <= len(inflight) * (1 + K), (
                f"{max_ph} placeholders with {len(inflight)} step(s) in flight of at most 1 + {K} tokens each: "
                "a rejected draft's placeholder was never given back, or a token did not replace its own")
            if async_scheduling and len(inflight) < 2 and so.total_num_scheduled_tokens:
                continue
        so, toks, drafts = inflight.popleft()
        for out in s.update_from_output(so, mod.ModelRunnerOutput.from_dict(toks)):
            outputs[out.request_id] += out.new_token_ids
        if not async_scheduling:
            s.update_draft_token_ids({r: d for r, d in drafts.items() if r in s.requests and s.requests[r].spec_decode})
    else:
        pytest.fail("the workload did not finish in 500 steps")
    return s, reqs, outputs, max_ph, placeholder_steps


def test_async_with_drafts_emits_the_synchronous_tokens(mod):
    """Speculative decoding under asynchronous scheduling: a step that samples puts up to
    1 + (its drafts) tokens in flight, the next step gets K placeholder drafts (none for a
    request that takes no drafts), rejected drafts give their placeholders back."""
    _, sync_reqs, want, _, _ = drive_spec(mod, False)
    s, reqs, got, max_ph, placeholder_steps = drive_spec(mod, True)
    assert placeholder_steps > 0, ("no step was scheduled with placeholder drafts: under asynchronous scheduling "
                                   "a request that sampled must get config.num_spec_tokens PLACEHOLDER_TOKEN_IDs")
    assert got == want, ("asynchronous speculation changed the tokens: placeholders counted without the step's "
                         "drafts, or the rejected drafts' placeholders kept (positions run ahead)")
    assert [r.get_finished_reason() for r in reqs] == [r.get_finished_reason() for r in sync_reqs], (
        "asynchronous speculation changed a finish reason: a placeholder draft was counted toward max_tokens or stop")
    assert all(r.num_output_placeholders == 0 for r in reqs), \
        "a placeholder outlived its step: a rejected draft's placeholder was never given back"
    assert s.kv_cache_manager.usage == 0.0, "blocks leaked after every request finished"


def test_a_mid_prefill_chunk_gets_no_placeholder_drafts(mod):
    """A step that does not sample (a chunk that stops short of the prompt's end) puts no
    token in flight, so it gets no placeholder and no placeholder drafts: the request has
    no draft to verify until a step of it has sampled. Drafts scheduled on a mid-prefill
    chunk would be verified against positions that are still prompt."""
    cfg = mod.SchedulerConfig(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4,
                              async_scheduling=True, num_spec_tokens=K)
    s = mod.Scheduler(cfg, 64, 4, enable_prefix_caching=False)
    req = mod.Request("long", list(range(3, 23)), mod.SchedulerSamplingParams(max_tokens=4), eos_token_id=1)
    s.add_request(req)
    so = s.schedule()  # 8 of 20 prompt tokens: no sample
    assert so.num_scheduled_tokens == {"long": 8} and "long" not in so.sampling_req_ids
    assert req.num_output_placeholders == 0, "a placeholder was counted for a step that samples nothing"
    assert req.spec_token_ids == [], (
        f"a mid-prefill chunk gave the request placeholder drafts {req.spec_token_ids}: drafts (and their "
        "placeholders) belong only to a step that samples")
    so2 = s.schedule()  # the next chunk, scheduled before the first one's (empty) output is back
    assert not so2.scheduled_spec_decode_tokens.get("long"), \
        "drafts scheduled for a request that is still in its prompt"
