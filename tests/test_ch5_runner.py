"""The model runner's persistent batch and flat inputs, without a model (runs
under --impl=exercise too, on the exercise's ModelRunner).

A real Chapter 3 scheduler drives the runner step by step through chunked
prefill, prefix hits, preemption (recompute and swap) and finished requests.
The runner sees only the SchedulerOutputs; the oracle is the scheduler's own
state (its Request objects and KV cache manager), which the runner never
reads: after `_update_states` every scheduled request's row must hold the
scheduler's tokens, computed count and block table, and `_prepare_inputs`
must give each token its position, id and slot, and sample exactly the
requests whose known tokens are all computed.
"""
import numpy as np
import pytest

from mini_vllm.scheduler import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from mini_vllm.scheduler.request import SchedulerSamplingParams

from runner_fakes import bare_runner

VOCAB = 500


SCENARIOS = {
    # name: (scheduler config, num_gpu_blocks, block size, prefix caching)
    "chunked_prefill_and_prefix_hits": (dict(max_num_batched_tokens=24, max_num_seqs=4), 64, 4, True),
    "recompute_preemption": (dict(max_num_batched_tokens=64, max_num_seqs=4), 12, 4, True),
    "swap_preemption": (dict(max_num_batched_tokens=64, max_num_seqs=4, preemption_mode="swap",
                             num_cpu_blocks=64), 12, 4, False),
}


def prompts():
    shared = list(range(10, 30))
    return [shared + [31, 32, 33], shared + [41, 42], list(range(100, 117)), shared + [31, 32, 33], [7, 8, 9]]


def fake_token(req_id: str, position: int) -> int:
    return (int(req_id) * 131 + position * 17) % (VOCAB - 2) + 2


def check_batch(runner, sched, so):
    batch = runner.input_batch
    rows = batch.req_id_to_index
    assert sorted(rows.values()) == list(range(len(rows))), \
        f"rows must be 0..num_reqs-1 (condensed after removals), got {sorted(rows.values())}"
    for rid in so.finished_req_ids:
        assert rid not in runner.requests and rid not in rows, f"finished request {rid} is still in the runner"
    for rid in so.preempted_req_ids:
        assert rid not in rows, f"preempted request {rid} still has a batch row"
        assert rid in runner.requests, f"preempted request {rid} lost its state (a swapped one comes back with it)"
    for rid, d in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        assert rid in rows, f"scheduled request {rid} has no batch row"
        r = rows[rid]
        n = int(batch.num_tokens[r])
        assert batch.token_ids_cpu[r, :n].tolist() == list(req.all_token_ids), (
            f"request {rid}: the row's tokens {batch.token_ids_cpu[r, :n].tolist()} differ from the scheduler's "
            f"{list(req.all_token_ids)} (new tokens of a cached request appended? a resumed one rewritten?)")
        assert int(batch.num_computed_tokens[r]) == req.num_computed_tokens - d, \
            f"request {rid}: num_computed_tokens is not the scheduler's before this step"
        want = list(sched.kv_cache_manager.get_block_ids(rid))
        got = batch.block_table[r, :int(batch.num_blocks[r])].tolist()
        assert got == want, (f"request {rid}: block table {got} differs from the scheduler's {want} "
                             "(new blocks appended? replaced after preemption or copy-on-write?)")
        assert (batch.block_table[r, len(want):] == -1).all(), f"request {rid}: stale entries after its blocks"


def check_inputs(runner, sched, so, out, block_size):
    input_ids, positions, md, req_ids, logit_rows, sample_req = out
    assert req_ids == list(so.num_scheduled_tokens), "req_ids must follow so.num_scheduled_tokens"
    want_pos, want_ids, want_slots, cu, want_rows, want_sample = [], [], [], [0], [], []
    for i, (rid, d) in enumerate(so.num_scheduled_tokens.items()):
        req = sched.requests[rid]
        c = req.num_computed_tokens - d
        blocks = sched.kv_cache_manager.get_block_ids(rid)
        for p in range(c, c + d):
            want_pos.append(p)
            want_ids.append(req.all_token_ids[p])
            want_slots.append(blocks[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + d)
        if c + d >= req.num_tokens:
            want_sample.append(i)
            want_rows.append(cu[-1] - 1)
    assert positions.tolist() == want_pos, "positions must run c .. c + Δ - 1 per request, in batch order"
    assert input_ids.tolist() == want_ids, "input ids must be the tokens at those positions"
    assert md.slot_mapping.tolist() == want_slots, "slot = block_table[p // B] * B + p % B of the scheduler's blocks"
    assert md.cu_seqlens_q.tolist() == cu and md.query_lens_cpu == [b - a for a, b in zip(cu, cu[1:])], \
        "query start locations / query lengths"
    seq = [sched.requests[r].num_computed_tokens for r in req_ids]
    assert md.seq_lens.tolist() == seq and md.seq_lens_cpu == seq, "seq_lens must be c + Δ (the keys each query sees)"
    assert md.max_seq_len == max(seq) and md.max_query_len == max(md.query_lens_cpu), (
        f"max_seq_len / max_query_len must be the batch maxima of seq_lens and query lens, got {md.max_seq_len} "
        f"{md.max_query_len}")
    md.validate(sched.num_gpu_blocks, block_size)
    for i, rid in enumerate(req_ids):
        n = -(-seq[i] // block_size)
        assert md.block_tables[i, :n].tolist() == list(sched.kv_cache_manager.get_block_ids(rid))[:n], \
            f"block_tables row {i} must be request {rid}'s table"
    assert list(sample_req) == want_sample, (f"requests that sample: got {list(sample_req)}, want {want_sample} "
                                            "(a prompt that completes this step samples; a mid-prompt chunk does not)")
    assert list(logit_rows) == want_rows, "a sampling request's logit row is the row of its last scheduled token"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_runner_mirrors_the_scheduler(chapter, name):
    cfg_kw, num_blocks, bs, caching = SCENARIOS[name]
    sched = Scheduler(SchedulerConfig(max_model_len=64, **cfg_kw), num_blocks, bs, enable_prefix_caching=caching)
    runner = bare_runner(chapter("engine").ModelRunner, VOCAB, num_blocks, bs, cfg_kw["max_num_seqs"])
    for i, p in enumerate(prompts()):
        sched.add_request(Request(str(i), p, SchedulerSamplingParams(max_tokens=6 + i, ignore_eos=True)))
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 200, "the scheduler did not finish"
        so = sched.schedule()
        runner._update_states(so)
        check_batch(runner, sched, so)
        sampled = {}
        if so.num_scheduled_tokens:
            out = runner._prepare_inputs(so)
            check_inputs(runner, sched, so, out, bs)
            _, _, _, req_ids, _, sample_req = out
            sampled = {r: [] for r in req_ids}
            for i in sample_req:
                req = sched.requests[req_ids[i]]
                sampled[req_ids[i]] = [fake_token(req_ids[i], req.num_tokens)]
        sched.update_from_output(so, ModelRunnerOutput.from_dict(sampled))
    runner._update_states(sched.schedule())  # the last finished ids reach the runner
    assert not runner.requests and runner.input_batch.num_reqs == 0, "finished requests left state in the runner"
    if name != "chunked_prefill_and_prefix_hits":
        assert sched.num_preemptions > 0, f"set-up: {name} must preempt"
    else:
        assert sched.kv_cache_manager.prefix_cache_stats.hits > 0, "set-up: the shared prefix must hit"
