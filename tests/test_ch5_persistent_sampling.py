"""Chapter 5: the persistent batch's sampling columns equal `from_params`.

The runner no longer rebuilds `SamplingMetadata` from Python objects every
step: `InputBatch.add_request` writes a request's sampling row once,
`remove_request` clears it, condensing moves it, and `refresh_metadata`
gathers the rows only when the rows that sample changed, refreshing only the
per-step fields otherwise (vLLM: `gpu_input_batch.py`). The oracle is
`SamplingMetadata.from_params` over the same requests, rebuilt from scratch
every step; every field must match after requests join, leave, are preempted
and resume, with mixed parameters. Reference only (no `chapter` fixture): the
exercise runner reads the same `InputBatch`.
"""
import dataclasses
import random

import numpy as np
import pytest
import torch

from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch
from mini_vllm.worker.model_runner import ModelRunner
from runner_fakes import bare_runner

VOCAB = 64
WORDS = -(-VOCAB // 32)
EOS = 1
MAX_REQS, MAX_LEN = 12, 96  # every kind fits in one batch

KINDS = {  # mixed parameters, each touching other columns
    "greedy": dict(temperature=0.0),
    "greedy_logprobs_penalty": dict(temperature=0.0, logprobs=3, repetition_penalty=1.3),
    "seeded_top_k": dict(temperature=0.8, top_k=5, seed=7),
    "top_p_min_p": dict(temperature=1.0, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    "min_tokens": dict(temperature=0.9, min_tokens=3, stop_token_ids=[0]),
    "min_tokens_no_stop": dict(min_tokens=2, ignore_eos=True),  # nothing to mask: no rule
    "logit_bias": dict(temperature=0.5, logit_bias={3: 2.0, 4: -1.0}),
    "allowed": dict(temperature=1.0, allowed_token_ids=[1, 3, 10, 11]),
    "bad_words": dict(temperature=0.0, bad_words=["x"], _bad_words_token_ids=[[7], [8, 9]]),
    "everything": dict(temperature=1.2, seed=3, top_p=0.8, top_k=9, logprobs=5, frequency_penalty=0.2,
                       min_tokens=4, logit_bias={1: 1.5}, allowed_token_ids=[1, 2, 5, 9, 12],
                       bad_words=["y"], _bad_words_token_ids=[[12]]),
}

# The mistake each field catches when it differs from from_params.
BUGS = {
    "temperature": "a row not written on join / not cleared on leave, or a stale cached metadata reused "
                   "after the batch changed",
    "all_greedy": "the greedy flags come from stale rows (row not cleared, or stale cache)",
    "all_random": "the greedy flags come from stale rows (row not cleared, or stale cache)",
    "top_p": "the top-p column or its in-use flag is stale (row not cleared / not moved on condense)",
    "top_k": "the top-k column or its in-use flag is stale (row not cleared / not moved on condense)",
    "min_p": "the min-p column or its in-use flag is stale (row not cleared / not moved on condense)",
    "generators": "a seeded row lost or kept the wrong generator (not moved on condense, not cleared on "
                  "leave, or a new generator on resume)",
    "max_num_logprobs": "the logprobs column is stale (row not cleared on leave)",
    "no_penalties": "the penalty flag is stale (row not cleared on leave)",
    "prompt_token_ids": "the penalties' prompt rows are wrong (num_prompt_tokens not written or not moved "
                        "on condense, or padding not vocab_size)",
    "output_token_ids": "output tokens not refreshed per step (a reused metadata kept last step's)",
    "presence_penalties": "the presence column is stale (row not cleared / not moved)",
    "frequency_penalties": "the frequency column is stale (row not cleared / not moved)",
    "repetition_penalties": "the repetition column is stale (row not cleared / not moved)",
    "min_tokens": "min_tokens rows not refreshed per step, or a stale rule on a reused row",
    "allowed_token_ids_mask": "a removed row's allowed_token_ids mask left behind, or not moved on condense",
    "bad_words_token_ids": "bad words keyed by an old row (not cleared on leave / not moved on condense)",
    "logit_bias": "logit bias keyed by an old row (not cleared on leave / not moved on condense)",
    "token_bitmask": "the structured-output bitmask not refreshed per step",
}


def assert_same(got: SamplingMetadata, want: SamplingMetadata, where: str) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)  # a loop over the declared fields
        msg = f"{where}: {f.name} differs from from_params: {BUGS[f.name]}"
        if b is None:
            assert a is None, f"{msg} (got {a!r}, want None)"
        elif isinstance(b, tuple):  # logit_bias: (rows, cols, values)
            assert isinstance(a, tuple) and len(a) == len(b), msg
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and torch.equal(x, y), f"{msg} (got {a}, want {b})"
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{msg} (got {a!r}, want a tensor)"
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{msg} (got {a}, want {b})"
        elif f.name == "generators":
            assert a.keys() == b.keys() and all(a[i] is b[i] for i in b), f"{msg} (got rows {sorted(a)}, " \
                f"want {sorted(b)})"
        else:
            assert a == b, f"{msg} (got {a!r}, want {b!r})"


class Harness:
    """The runner's side of a scripted sequence: request states and the persistent batch."""

    def __init__(self) -> None:
        self.batch = InputBatch(MAX_REQS, MAX_LEN, 4, VOCAB)
        self.states: dict[str, CachedRequestState] = {}
        self.running: list[str] = []  # the step's order (new and resumed requests at the end)
        self.steps = 0
        self.bitmask_gen = torch.Generator().manual_seed(5)

    def join(self, rid: str, kind: str) -> None:
        p = SamplingParams(**KINDS[kind])
        gen = None if p.seed is None else torch.Generator().manual_seed(p.seed)
        k = len(self.states) + 3 * len(rid)
        prompt = [(7 * k + 5 * i) % VOCAB for i in range(2 + k % 6)]  # lengths differ: padding matters
        st = CachedRequestState(rid, prompt, list(prompt), [], 0, p, EOS, gen)
        self.states[rid] = st
        self.batch.add_request(st)
        self.running.append(rid)

    def finish(self, rid: str) -> None:
        self.batch.remove_request(rid)
        del self.states[rid]
        self.running.remove(rid)

    def preempt(self, rid: str) -> None:
        self.batch.remove_request(rid)  # the state stays: it comes back with its tokens and generator
        self.running.remove(rid)

    def resume(self, rid: str) -> None:
        self.batch.add_request(self.states[rid])
        self.running.append(rid)

    def sample(self, rids: list[str], bitmask: bool = False) -> SamplingMetadata:
        """refresh_metadata for `rids`, checked against from_params right away."""
        states = [self.states[r] for r in rids]
        outs = [s.output_token_ids for s in states]
        mask = None
        if bitmask:
            mask = torch.randint(-2**31, 2**31 - 1, (len(rids), WORDS), dtype=torch.int32,
                                 generator=self.bitmask_gen)
        got = self.batch.refresh_metadata(rids, outs, "cpu", mask)
        want = SamplingMetadata.from_params(
            [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], [s.generator for s in states],
            [s.eos_token_id for s in states], VOCAB, "cpu", token_bitmask=mask)
        assert_same(got, want, f"step {self.steps}, requests {rids}")
        return got

    def end_step(self, rids: list[str]) -> None:
        """Every sampled request gets one token (as the next SchedulerOutput brings it)."""
        for rid in rids:
            st = self.states[rid]
            tok = (13 * len(st.token_ids) + len(rid)) % (VOCAB - 2) + 2
            st.token_ids.append(tok)
            self.batch.append_token_ids(self.batch.req_id_to_index[rid], [tok])
        self.steps += 1

    def step(self, rids: list[str] | None = None, bitmask: bool = False) -> SamplingMetadata:
        rids = list(self.running) if rids is None else rids
        md = self.sample(rids, bitmask)
        self.end_step(rids)
        return md


def test_scripted_joins_leaves_preemption_resume():
    h = Harness()
    for rid, kind in (("a", "greedy"), ("b", "seeded_top_k"), ("c", "penalties")):
        h.join(rid, kind)
    first = h.step()
    again = h.step()
    assert again.temperature is first.temperature, \
        "nothing joined or left, yet the metadata was rebuilt: the cached metadata is never reused"
    for rid, kind in (("d", "min_tokens"), ("e", "logit_bias"), ("f", "allowed")):
        h.join(rid, kind)
    h.finish("a")  # condense: the last row (f) moves into a's row
    h.step()
    h.step()  # d's min_tokens rule still applies (1 output of 3)
    h.preempt("b")
    h.join("g", "bad_words")
    h.step(bitmask=True)  # d: 2 outputs of 3
    before = h.step(bitmask=True)  # d reaches its minimum on a reused metadata: its rule must go
    assert h.batch.refresh_metadata(list(h.running), [h.states[r].output_token_ids for r in h.running],
                                    "cpu").temperature is before.temperature, "an unchanged batch rebuilt"
    h.resume("b")  # same generator, a new row
    h.finish("c")
    h.step()
    h.step(rids=list(reversed(h.running)))  # the same rows in another order: another metadata
    # Plain rows and draft-verifying rows: two row sets in one step, both cached.
    for _ in range(3):
        plain, spec = h.running[::2], h.running[1::2]
        h.sample(plain)
        h.sample(spec, bitmask=True)
        h.end_step(plain + spec)
    h.join("p", "greedy_logprobs_penalty")
    h.join("q", "min_tokens_no_stop")
    h.step()
    h.step(rids=h.running[1:])  # one request mid-prompt: it does not sample
    # A row reused by another request at the same position: no stale row, no stale cache.
    for rid in list(h.running):
        h.finish(rid)
    assert h.batch.num_reqs == 0 and not h.states, "set-up: every request has finished"
    h.join("x", "everything")
    h.step()
    h.step()
    h.finish("x")
    h.join("y", "greedy")  # row 0 again, sampled alone again: must not see x's parameters
    h.step()
    h.join("z", "top_p_min_p")
    h.step()


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences(seed):
    rng = random.Random(seed)
    h = Harness()
    preempted: list[str] = []
    for n in range(60):
        r = rng.random()
        if h.running and r < 0.2:
            h.finish(rng.choice(h.running))
        elif h.running and r < 0.35:
            rid = rng.choice(h.running)
            h.preempt(rid)
            preempted.append(rid)
        elif preempted and r < 0.55:
            h.resume(preempted.pop(rng.randrange(len(preempted))))
        elif len(h.running) + len(preempted) < MAX_REQS and r < 0.85:
            h.join(f"r{n}", rng.choice(list(KINDS)))
        rids = [x for x in h.running if rng.random() > 0.1]  # some requests are mid-prompt
        if rng.random() < 0.2:
            rng.shuffle(rids)
        if rng.random() < 0.3 and len(rids) > 1:  # two row sets this step
            cut = rng.randrange(1, len(rids))
            h.sample(rids[:cut])
            h.sample(rids[cut:], bitmask=True)
            h.end_step(rids)
        else:
            h.step(rids, bitmask=rng.random() < 0.3)


def test_columns_cleared_after_the_batch_empties():
    h = Harness()
    for i, kind in enumerate(KINDS):
        if i < MAX_REQS:
            h.join(f"k{i}", kind)
    h.step()
    for rid in list(h.running):
        h.finish(rid)
    cols = h.batch.sampling
    assert not (cols.has_params.any() or cols.generators or cols.min_tokens or cols.bad_words_token_ids
                or cols.logit_bias or cols.allowed_rows), "an empty batch still holds sampling rows: a row " \
        "is not cleared on removal"
    assert cols.allowed_token_ids_mask is None or not cols.allowed_token_ids_mask.any(), \
        "an empty batch still restricts tokens: the allowed_token_ids mask row is not cleared on removal"
    assert (cols.temperature == 0).all() and (cols.top_p == 1).all() and (cols.repetition_penalties == 1).all(), \
        "removed rows do not hold the neutral values"


# ------------------------------------------------------ through the runner
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_runner_metadata_equals_from_params_under_preemption(mode):
    """The real `_update_states` from a Chapter 3 scheduler that preempts: the
    runner's metadata (sampling columns) equals from_params at every step."""
    kw = dict(max_num_batched_tokens=64, max_num_seqs=4)
    if mode == "swap":
        kw.update(preemption_mode="swap", num_cpu_blocks=64)
    sched = Scheduler(SchedulerConfig(max_model_len=64, **kw), 12, 4, enable_prefix_caching=False)
    runner = bare_runner(ModelRunner, VOCAB, 12, 4, 4)
    kinds = list(KINDS)
    for i in range(7):
        params = dict(KINDS[kinds[i % len(kinds)]], max_tokens=8 + i)  # stop id 0 is never sampled below
        sched.add_request(Request(str(i), [(11 * i + j) % (VOCAB - 2) + 2 for j in range(6 + 3 * i)],
                                  SamplingParams(**params), eos_token_id=EOS))
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 300, "the scheduler did not finish"
        so = sched.schedule()
        runner._update_states(so)
        sampled = {}
        if so.num_scheduled_tokens:
            _, _, _, req_ids, _, sample_req = runner._prepare_inputs(so)
            rids = [req_ids[i] for i in sample_req]
            states = [runner.requests[r] for r in rids]
            got = runner.step_sampler.metadata(states, "cpu")
            want = SamplingMetadata.from_params(
                [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
                [s.output_token_ids for s in states], [s.generator for s in states],
                [s.eos_token_id for s in states], VOCAB, "cpu")
            assert_same(got, want, f"runner step {steps}, requests {rids}")
            sampled = {r: [] for r in req_ids}
            for r in rids:
                sampled[r] = [(7 * len(runner.requests[r].token_ids) + int(r)) % (VOCAB - 2) + 2]
        sched.update_from_output(so, ModelRunnerOutput.from_dict(sampled))
    runner._update_states(sched.schedule())
    assert sched.num_preemptions > 0, "set-up: the scheduler must preempt"
    assert runner.input_batch.num_reqs == 0 and not runner.input_batch.sampling.has_params.any(), \
        "finished requests left sampling rows in the batch"


def test_greedy_and_seeded_tokens_unchanged():
    """The sampler gives the same tokens from either metadata, step after step
    (the seeded rows' generators advance the same way)."""
    h_inc, h_ref = Harness(), Harness()
    kinds = ["greedy", "seeded_top_k", "everything", "greedy_logprobs_penalty", "bad_words"]
    for h in (h_inc, h_ref):
        for i, kind in enumerate(kinds):
            h.join(f"s{i}", kind)
    sampler, g = Sampler(), torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(len(kinds), VOCAB, generator=g)
        tokens = []
        for h, incremental in ((h_inc, True), (h_ref, False)):
            rids = list(h.running)
            states = [h.states[r] for r in rids]
            if incremental:
                md = h.batch.refresh_metadata(rids, [s.output_token_ids for s in states], "cpu")
            else:
                md = SamplingMetadata.from_params(
                    [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
                    [s.output_token_ids for s in states], [s.generator for s in states],
                    [s.eos_token_id for s in states], VOCAB, "cpu")
            torch.manual_seed(step)  # (no row draws from the global generator; belt and braces)
            toks = sampler(logits, md).sampled_token_ids.tolist()
            tokens.append(toks)
            for rid, t in zip(rids, toks):
                h.states[rid].token_ids.append(t)
                h.batch.append_token_ids(h.batch.req_id_to_index[rid], [t])
        assert tokens[0] == tokens[1], (f"step {step}: the incremental metadata samples other tokens "
                                        f"({tokens[0]} vs {tokens[1]}): greedy or seeded sampling changed")


def test_prompt_rows_padded_from_the_token_rows():
    h = Harness()
    h.join("p1", "penalties")
    h.join("p2", "greedy")
    h.step()  # outputs exist from now on: they must stay out of the prompt rows
    md = h.step()
    assert len(h.states["p1"].prompt_token_ids) != len(h.states["p2"].prompt_token_ids), "set-up: lengths differ"
    want = np.full((2, md.prompt_token_ids.shape[1]), VOCAB)
    for i, rid in enumerate(["p1", "p2"]):
        p = h.states[rid].prompt_token_ids
        want[i, :len(p)] = p
    assert md.prompt_token_ids.tolist() == want.tolist(), \
        "the penalties' prompt rows must be each prompt padded with vocab_size (outputs excluded)"
