"""Chapter 3: the scheduler under random arrivals, lengths, budgets, tiny KV
pools, drafts and aborts (hypothesis stateful testing).

Every step goes through MiniRunner, which rebuilds block tables from the
SchedulerOutputs alone and writes real KV tensors, so a wrong block id, a
lost swap or a missed copy is caught by reading the cache back.
"""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

EOS = 0


@pytest.fixture(scope="module")
def mod(chapter):
    return chapter("scheduler")


def make_machine(mod):
    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(
            block_size=st.sampled_from([2, 4]),
            num_blocks=st.integers(3, 10),
            budget=st.integers(4, 48),
            max_seqs=st.integers(1, 6),
            chunked=st.booleans(),
            policy=st.sampled_from(["fcfs", "priority", "srtf", "two_level"]),
            mode=st.sampled_from(["recompute", "swap"]),
            caching=st.booleans(),
            threshold=st.sampled_from([0, 0, 3]),
        )
        def setup(self, block_size, num_blocks, budget, max_seqs, chunked, policy, mode,
                  caching, threshold):
            max_len = num_blocks * block_size
            if not chunked:
                budget = max(budget, max_len)
            self.cfg = mod.SchedulerConfig(
                max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
                policy=policy, preemption_mode=mode, staging_size=2, num_cpu_blocks=num_blocks // 2)
            self.sched = mod.Scheduler(self.cfg, num_blocks, block_size, enable_prefix_caching=caching)
            self.runner = mod.MiniRunner(self.sched, with_tensors=True, vocab=6)
            self.reqs = {}  # every request ever added, by id
            self.last_computed = {}
            self.n = 0
            self.preemptions = 0

        @rule(reqs=st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=16),
                                      st.integers(1, 10), st.integers(0, 2), st.booleans()),
                            min_size=1, max_size=4))
        def add(self, reqs):
            for args in reqs:
                self.add_one(*args)

        def add_one(self, prompt, max_tokens, priority, ignore_eos):
            req = mod.Request(f"r{self.n}", prompt,
                              mod.SchedulerSamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                              eos_token_id=EOS, arrival_time=float(self.n), priority=priority)
            self.n += 1
            total = len(prompt) + max_tokens
            if total > self.cfg.max_model_len or -(-total // self.sched.block_size) > self.sched.num_gpu_blocks:
                with pytest.raises(ValueError):
                    self.sched.add_request(req)
                return
            self.sched.add_request(req)
            self.reqs[req.request_id] = req
            self.last_computed[req.request_id] = 0

        @rule(k=st.integers(0, 3), data=st.data())
        def step(self, k, data):
            running = [r for r in self.sched.running]
            for r in running:  # propose k drafts for decoding requests
                if k and r.num_computed_tokens == r.num_tokens - 1:
                    r.spec_token_ids = [data.draw(st.integers(1, 5)) for _ in range(k)]
            before = {rid: r.num_computed_tokens for rid, r in self.reqs.items()}
            out = self.sched.schedule()
            assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()), (
                f"total_num_scheduled_tokens {out.total_num_scheduled_tokens} is not the sum of the per-request "
                f"counts {out.num_scheduled_tokens}")
            assert out.total_num_scheduled_tokens <= self.cfg.max_num_batched_tokens, \
                "token budget exceeded"
            assert len(out.num_scheduled_tokens) <= self.cfg.max_num_seqs, "max_num_seqs exceeded"
            assert all(n > 0 for n in out.num_scheduled_tokens.values()), "scheduled Δ = 0"
            for rid, r in self.reqs.items():
                if rid in out.preempted_req_ids and not r.swapped_cpu_block_ids:
                    assert r.num_computed_tokens == 0, \
                        "recompute preemption must reset num_computed_tokens to 0"
                elif not r.is_finished():
                    assert r.num_computed_tokens >= before[rid], \
                        f"{rid}: num_computed_tokens went back without a preemption"
            mro = self.runner.execute(out, self.reqs)
            self.sched.update_from_output(out, mro)
            self.runner.check_cache(self.reqs)
            self.preemptions += len(out.preempted_req_ids)

        @rule(data=st.data())
        def abort(self, data):
            live = [r for r in self.reqs.values() if not r.is_finished()]
            if not live:
                return
            req = data.draw(st.sampled_from(live))
            self.sched.finish_requests([req.request_id], mod.RequestStatus.FINISHED_ABORTED)
            assert req.is_finished(), f"finish_requests did not finish an aborted request: status {req.status.name}"
            assert self.sched.kv_cache_manager.get_block_ids(req.request_id) == [], \
                "an aborted request kept KV blocks"
            assert not req.swapped_cpu_block_ids, "an aborted request kept CPU blocks"

        @invariant()
        def blocks_accounted(self):
            if not hasattr(self, "sched"):
                return
            kv = self.sched.kv_cache_manager
            for r in self.reqs.values():
                if r.status != mod.RequestStatus.RUNNING:
                    assert kv.get_block_ids(r.request_id) == [], \
                        f"{r.request_id} ({r.status.name}) holds GPU blocks"
            assert len(self.sched.running) <= self.cfg.max_num_seqs, (
                f"{len(self.sched.running)} running requests exceed max_num_seqs {self.cfg.max_num_seqs}")

        def teardown(self):
            if not hasattr(self, "sched"):
                return
            # Drain: every admitted request fits alone, so everything finishes.
            for _ in range(2000):
                if not self.sched.has_unfinished_requests():
                    break
                out = self.sched.schedule()
                self.sched.update_from_output(out, self.runner.execute(out, self.reqs))
                self.runner.check_cache(self.reqs)
            assert not self.sched.has_unfinished_requests(), "requests never finished (hang)"
            kv = self.sched.kv_cache_manager
            assert kv.num_free_blocks == self.sched.num_gpu_blocks, "GPU blocks leaked"
            assert self.sched.cpu_block_pool.num_free_blocks == self.cfg.num_cpu_blocks, \
                "CPU blocks leaked"

    return SchedulerMachine


def test_scheduler_state_machine(mod):
    run_state_machine_as_test(make_machine(mod), settings=settings(
        settings(), stateful_step_count=30))
