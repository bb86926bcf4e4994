"""The scheduler's copy-on-write plumbing (Chapter 2's `fork`, seen from Chapter 3).

The engine forks no request since parallel sampling moved to the front end, and a
prefix hit never covers a block a request writes into (the lookup stops short of
the last token). A forked request still can, and then the KV cache manager copies
the shared block before the write (`allocate_slots`): the scheduler must tell the
runner both the copy (`blocks_to_copy`) and that the request's block table changed
in place (`replace_block_ids`), or the runner appends the new block and keeps
writing into the shared one. Reference implementation only (no exercise variant):
this is given plumbing, not the learner's schedule().
"""
from mini_vllm.scheduler import ModelRunnerOutput, Request, SchedulerSamplingParams, Scheduler, SchedulerConfig


def test_a_write_into_a_forked_block_replaces_the_block_table():
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), 16, 4,
                  enable_prefix_caching=False)
    parent = Request("p", list(range(3, 9)), SchedulerSamplingParams(max_tokens=8))  # 6 tokens: blocks of 4 + 2
    s.add_request(parent)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput.from_dict({"p": [20]}))
    kv = s.kv_cache_manager
    child = Request("c", list(range(3, 9)), SchedulerSamplingParams(max_tokens=8))
    kv.fork(parent, child)  # both now hold the partial second block (ref count 2)
    shared = kv.get_block_ids("p")
    so = s.schedule()  # the parent writes position 6, inside the shared block
    assert so.blocks_to_copy, "the write into a shared partial block copied nothing (copy-on-write lost)"
    (cached,) = [c for c in so.scheduled_cached_reqs if c.req_id == "p"]
    assert cached.replace_block_ids, ("after copy-on-write the parent's block table must be replaced, not "
                                      "appended to: the runner would keep writing into the shared block")
    assert list(cached.new_block_ids) == list(kv.get_block_ids("p")) != list(shared), \
        f"the parent's table {cached.new_block_ids} is not its blocks after the copy {kv.get_block_ids('p')}"
