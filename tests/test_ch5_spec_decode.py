"""Speculative decoding inside the engine: n-gram, draft-model and EAGLE proposers
(EAGLE's own checks are in `test_ch5_eagle.py`).

Oracles: the same engine without speculation (greedy tokens must be
identical; sampled tokens must have the same distribution), a fresh prefill's
KV (after rejections the cache must hold exactly what a prefill writes), and
HF's own greedy continuation of the draft model (the draft-model proposer's drafts).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from engine_utils import ALWAYS_DRAFT, assert_pool_full, make_llm, model_runner, run_greedy
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import load_tiny_tokenizer, model_path

DRAFT = str(model_path("tiny-py-draft"))
EAGLE = str(model_path("tiny-py-eagle"))
METHODS = ["ngram", "draft_model", "eagle"]


def spec(method: str, k: int) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                **ALWAYS_DRAFT}
    return {"method": method, "model": EAGLE if method == "eagle" else DRAFT, "num_speculative_tokens": k,
            **ALWAYS_DRAFT}


@pytest.fixture(scope="module")
def code_prompts():
    tok = load_tiny_tokenizer()
    texts = ["def __init__(self, name, value=None):\n        self.name = name\n        self.value = ",
             "import os\nimport sys\nimport re\nimport ", "for i in range(10):\n    print(i)\nfor j in range(",
             "class Error(Exception):\n    pass\n\n\nclass "]
    return [tok(t)["input_ids"] for t in texts]


def assert_draft_kv_freed(llm) -> None:
    """The draft model's own KV (`spec_decode.engine.proposers.DraftModelProposer`) is
    held only for requests in the persistent batch: a finished or preempted
    request's draft blocks come back as soon as the runner hears of it (the
    next step's SchedulerOutput, so the last requests of a run still hold theirs)."""
    from mini_vllm.spec_decode.engine.proposers import DraftModelProposer

    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.collective_rpc(lambda worker: worker.model_runner)[0]
    proposer = runner.drafter.proposer
    if not isinstance(proposer, DraftModelProposer):
        return  # Chapter 4's n-gram lookup keeps nothing per request
    stale = sorted(set(proposer.blocks) - set(runner.input_batch.req_id_to_index))
    assert not stale, (f"draft KV blocks leaked: requests {stale} left the batch but still hold "
                       f"{sum(len(proposer.blocks[r]) for r in stale)} draft blocks (never freed)")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_identical_to_no_speculation(method, k, code_prompts):
    base = run_greedy(make_llm(block_size=8), code_prompts, 24)
    llm = make_llm(block_size=8, speculative_config=spec(method, k))
    assert run_greedy(llm, code_prompts, 24) == base, f"{method} k={k} changed greedy tokens"
    stats = llm.llm_engine.engine_core.call_utility("spec_decoding_stats")
    assert stats["num_accepted"] > 0, "no draft was ever accepted: speculation did not run"
    assert_pool_full(llm)
    run_greedy(llm, code_prompts[:1], 2)  # its first step tells the runner the others finished
    assert_draft_kv_freed(llm)


@pytest.mark.parametrize("method", METHODS)
def test_dynamic_speculation_drafts_only_at_small_batches(method, code_prompts):
    """num_speculative_tokens_per_batch_size [[1, 2, 3], [3, 64, 0]]: a step
    after one of 3 or more requests verifies no drafts; once 2 requests remain,
    drafts come back (for EAGLE only for requests that start then: the head does not
    run at k = 0). Greedy tokens stay those of no speculation."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 10, 30, 40)]
    prompts = [{"prompt_token_ids": p} for p in code_prompts]
    base = [o.outputs[0].token_ids for o in make_llm(block_size=8).generate(prompts, params, use_tqdm=False)]
    cfg = dict(spec(method, 3), num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 64, 0]])
    llm = make_llm(block_size=8, speculative_config=cfg, multiprocess_mode=False)
    runner = model_runner(llm)
    steps, real = [], runner.execute_model

    def record(so):  # (requests in the step, drafts it verifies)
        steps.append((len(so.num_scheduled_tokens), sum(map(len, so.scheduled_spec_decode_tokens.values()))))
        return real(so)

    runner.execute_model = record
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == base, f"{method}: dynamic speculation changed greedy tokens"
    after_big = [d for (b, _), (_, d) in zip(steps, steps[1:]) if b >= 3]
    assert after_big and not any(after_big), \
        f"{method}: drafts verified after a step of 3 or more requests, where the schedule says 0: {steps}"
    if method == "eagle":  # no head pass in those steps: these requests draft no more (test_ch5_eagle.py)
        assert not any(d for _, d in steps), f"eagle: requests computed without the head drafted later: {steps}"
    else:
        assert any(d for b, d in steps if b <= 2), f"{method}: no drafts once 2 requests remained: {steps}"
    assert_pool_full(llm)


def test_dynamic_speculation_refuses_async_scheduling():
    cfg = dict(spec("draft_model", 2), num_speculative_tokens_per_batch_size=[[1, 4, 2], [5, 64, 0]])
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        make_llm(speculative_config=cfg, async_scheduling=True)


@st.composite
def spec_workloads(draw):
    n = draw(st.integers(2, 5))
    motif = draw(st.lists(st.integers(2, 6000), min_size=2, max_size=6))
    prompts = []
    for _ in range(n):
        reps = draw(st.integers(1, 6))  # repetitive prompts give the n-gram proposer matches
        tail = draw(st.lists(st.integers(2, 6000), min_size=1, max_size=12))
        prompts.append(motif * reps + tail if draw(st.booleans()) else tail + motif * reps)
    max_tokens = draw(st.lists(st.integers(1, 14), min_size=n, max_size=n))
    plain = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # requests that get no drafts
    return prompts, max_tokens, plain


@settings(max_examples=10)
@given(spec_workloads(), st.sampled_from(METHODS), st.integers(1, 5),
       st.sampled_from([None, 16]), st.booleans())
def test_greedy_identical_over_workloads(work, method, k, budget, tiny_kv):
    """Spec and non-spec requests in one batch, chunked prefill, prefix hits, preemption."""
    prompts, max_tokens, plain = work
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1 if p else None)
           for m, p in zip(max_tokens, plain)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    base = [o.outputs[0].token_ids for o in make_llm(block_size=8, max_model_len=128)
            .generate(inputs, sps, use_tqdm=False)]
    kw = dict(block_size=8, max_model_len=128, speculative_config=spec(method, k))
    if budget:
        kw["max_num_batched_tokens"] = budget
    if tiny_kv:
        kw["num_gpu_blocks_override"] = max(-(-(len(p) + m + k) // 8) for p, m in zip(prompts, max_tokens)) + 1
    llm = make_llm(**kw)
    got = [o.outputs[0].token_ids for o in llm.generate(inputs, sps, use_tqdm=False)]
    assert got == base, f"{method} k={k} budget={budget} tiny_kv={tiny_kv}: greedy tokens changed"
    assert_pool_full(llm)
    assert_draft_kv_freed(llm)


TOP_K = 50


def _first_tokens(llm, prompt, n_req: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True)  # t2 can be a draft
    outs = llm.generate([{"prompt_token_ids": prompt}] * n_req, sp, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids for o in outs])


def _homogeneous(a: torch.Tensor, b: torch.Tensor, alpha: float) -> bool:
    """Two-sample chi-square on the second token, rare tokens pooled."""
    toks = sorted(set(a[:, 1].tolist()) | set(b[:, 1].tolist()))
    rows = [[int((x[:, 1] == t).sum()) for t in toks] for x in (a, b)]
    keep = [j for j in range(len(toks)) if rows[0][j] + rows[1][j] >= 10]
    other = [sum(r[j] for j in range(len(toks)) if j not in keep) for r in rows]
    return chi2_contingency([[r[j] for j in keep] + [o] for r, o in zip(rows, other)])[1] >= alpha


def _draft_model_draft_of(prompt: list[int]):
    """The draft model's proposal after prompt + [t1] (HF transformers)."""
    from mini_vllm.course.tiny_models import load_tiny_model

    draft = load_tiny_model("tiny-py-draft")
    return lambda t1: int(draft(torch.tensor([prompt + [t1]])).logits[0, -1].argmax())


@torch.no_grad()
def agreement_z(samples: torch.Tensor, prompt: list[int], draft_of) -> float:
    """z-score of how often token 2 equals the proposer's draft d(t1) = draft_of(t1).

    Oracle (HF transformers): under the target, P(t2 = d | t1) = p(d | prompt, t1)
    after temperature 1 and top-k; the count of agreements has mean sum(p_i) and
    variance sum(p_i (1 - p_i)). Accepting drafts too often pushes z up."""
    from mini_vllm.course.tiny_models import load_tiny_model

    target = load_tiny_model("tiny-py-target")
    p_agree, d_of = {}, {}
    for t1 in set(samples[:, 0].tolist()):
        ids = torch.tensor([prompt + [t1]])
        d = draft_of(t1)
        logits = target(ids).logits[0, -1].float()
        kth = logits.topk(TOP_K).values[-1]
        probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
        p_agree[t1], d_of[t1] = float(probs[d]), d
    p = torch.tensor([p_agree[int(t1)] for t1 in samples[:, 0]])
    hits = sum(int(row[1]) == d_of[int(row[0])] for row in samples.tolist())
    return (hits - float(p.sum())) / float((p * (1 - p)).sum().sqrt())


def test_sampling_with_speculation_is_lossless_and_the_test_has_power(monkeypatch):
    # Unrelated tokens: the target is uncertain there, so drafts are often rejected
    # and a sampler that wrongly accepts them shifts the distribution visibly.
    prompt = list(range(100, 140))
    assert_lossless_with_power(lambda: make_llm(max_num_seqs=256, speculative_config=spec("draft_model", 1)),
                               prompt, _draft_model_draft_of(prompt), monkeypatch, "the draft model")


def assert_lossless_with_power(make_spec_llm, prompt: list[int], draft_of, monkeypatch, who: str,
                               n: int = 400) -> None:
    """Token 2 sampled with speculation (engines from `make_spec_llm`) is distributed as without
    it: the agreement z-test against the proposer's draft `draft_of(t1)` and a chi-square
    against no speculation; then both checks must fail for a sampler that accepts every draft."""
    base = _first_tokens(make_llm(max_num_seqs=256), prompt, n, seed=1)
    llm = make_spec_llm()
    with_spec = _first_tokens(llm, prompt, n, seed=2)
    stats = llm.llm_engine.engine_core.call_utility("spec_decoding_stats")
    assert 0 < stats["num_accepted"] < stats["num_drafts"], "need both acceptances and rejections"
    z_base, z_spec = agreement_z(base, prompt, draft_of), agreement_z(with_spec, prompt, draft_of)
    assert abs(z_base) < 4.5, f"the oracle statistic is miscalibrated even without speculation (z={z_base:.2f})"
    assert abs(z_spec) < 4.5, (f"with {who} token 2 agrees with the draft too often or too rarely "
                               f"(z={z_spec:.2f})")
    assert _homogeneous(base, with_spec, 1e-3), f"token 2 is distributed differently with {who}"
    # Power: a sampler that accepts every draft must fail the same checks.
    from mini_vllm.spec_decode import RejectionSampler
    from mini_vllm.spec_decode.lossy import accept_always

    monkeypatch.setattr(RejectionSampler, "batched_sampler", staticmethod(accept_always))
    lossy = _first_tokens(make_spec_llm(), prompt, n, seed=2)
    z_lossy = agreement_z(lossy, prompt, draft_of)
    assert z_lossy > 4.5 and not _homogeneous(base, lossy, 1e-3), \
        f"the lossless checks cannot tell a sampler that accepts every draft (z={z_lossy:.2f})"


def _kv_of(llm, rid: str, n: int) -> list[torch.Tensor]:
    core = llm.llm_engine.engine_core.engine_core
    blocks = core.scheduler.kv_cache_manager.get_block_ids(rid)
    bs = core.config.block_size
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    out = []
    for k, v in core.executor.collective_rpc(lambda worker: worker.cache_engine.gpu_cache)[0]:
        out.append(torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]]))
    return out


def test_rejected_drafts_leave_the_same_kv_as_a_fresh_prefill(code_prompts):
    prompt = code_prompts[2]
    llm = make_llm(block_size=8, speculative_config=spec("draft_model", 4))
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    for _ in range(8):
        eng.step()
    stats = eng.engine_core.call_utility("spec_decoding_stats")
    assert stats["num_accepted"] < stats["num_drafts"], "no rejection happened; pick another prompt"
    req = eng.engine_core.engine_core.scheduler.requests["r"]
    n = req.num_computed_tokens
    tokens = list(req.all_token_ids)
    got = _kv_of(llm, "r", n)
    fresh = make_llm(block_size=8)
    fresh.llm_engine.add_request("f", {"prompt_token_ids": tokens[:n + 1]},
                                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    fresh.llm_engine.step()
    want = _kv_of(fresh, "f", n)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g, w, atol=1e-5), f"layer {layer}: KV after rollback differs from a fresh prefill"


def test_verification_filters_with_the_engine_sampler():
    """Drafts are verified under the engine sampler's processing, read from the
    engine's SamplingMetadata: top-k keeps every token tied with the k-th logit
    (Chapter 4's own filter keeps exactly k), temperature comes first, and a
    greedy row gets the plain softmax (only its argmax is read)."""
    from mini_vllm.sample.metadata import SamplingMetadata
    from mini_vllm.sample.ops.topk_topp import apply_top_k_top_p
    from mini_vllm.spec_decode import apply_top_k_top_p_pytorch as ch4_top_k_top_p
    from mini_vllm.spec_decode.engine.verifier import SpecVerifier, compute_probs

    params = [SamplingParams(temperature=0.5, top_k=2), SamplingParams(temperature=0), SamplingParams(top_p=0.6)]
    md = SamplingMetadata.from_params(params, [[1]] * 3, [[]] * 3, [None] * 3, [None] * 3, vocab_size=5)
    row = torch.tensor([3.0, 2.0, 2.0, 0.0, -1.0])  # tokens 1 and 2 tie at the 2nd largest logit
    logits = row.repeat(5, 1)  # request 0: one draft + bonus, request 1: bonus, request 2: one draft + bonus
    probs = compute_probs(logits, md, torch.tensor([2, 1, 2]))
    assert (probs[0] > 0).tolist() == [True, True, True, False, False], "top-k must keep ties with the k-th logit"
    assert (ch4_top_k_top_p(row[None], torch.tensor([2]), torch.tensor([1.0])) > -1e9).sum() == 2, \
        "the oracle's premise: Chapter 4's filter breaks the tie"
    assert torch.allclose(probs[0], (row * 2).masked_fill(row < 2, float("-inf")).softmax(-1)), \
        "temperature 0.5 scales the logits before the filter"
    assert torch.allclose(probs[2], row.softmax(-1)), "a greedy row is the plain softmax"
    want = apply_top_k_top_p(row[None], None, torch.tensor([0.6])).softmax(-1)[0]
    assert torch.allclose(probs[3], want) and torch.allclose(probs[4], want), "top-p as the engine sampler"
    greedy = SamplingMetadata.from_params([params[1]], [[1]], [[]], [None], [None], vocab_size=5)
    assert SpecVerifier("cpu").verify(row.repeat(3, 1), [[0, 1]], greedy) == [[0, 0]], \
        "greedy verification: accept draft 0 (the argmax), reject draft 1, emit the argmax"


def test_greedy_verification_gives_the_rejection_samplers_tokens():
    """An all-greedy batch is verified by one argmax per row (vLLM's shortcut), not by
    Chapter 4's rejection sampler; both must emit the same tokens and count the same
    accepted drafts, for drafts that match for 0..k positions."""
    from mini_vllm.sample.metadata import SamplingMetadata
    from mini_vllm.spec_decode import PLACEHOLDER_TOKEN_ID, SpecDecodeMetadata
    from mini_vllm.spec_decode.engine.verifier import SpecVerifier

    g = torch.Generator().manual_seed(0)
    ks, vocab = [3, 3, 3, 3, 1, 2], 50
    logits = torch.randn(sum(k + 1 for k in ks), vocab, generator=g)
    best = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for i, k in enumerate(ks):  # request i's drafts match the argmax for its first min(i, k) positions
        d = [best[row + j] if j < i else (best[row + j] + 1) % vocab for j in range(k)]
        drafts.append(d)
        row += k + 1
    params = [SamplingParams(temperature=0)] * len(ks)
    md = SamplingMetadata.from_params(params, [[1]] * len(ks), [[]] * len(ks), [None] * len(ks), [None] * len(ks),
                                      vocab_size=vocab)
    fast = SpecVerifier("cpu")
    got = fast.verify(logits, drafts, md)
    slow = SpecVerifier("cpu")
    out = slow.sampler(SpecDecodeMetadata.make(drafts, logits.device), None, logits, md, md.generators).tolist()
    want = [[t for t in r if t != PLACEHOLDER_TOKEN_ID] for r in out]
    assert got == want, "greedy verification must emit the rejection sampler's tokens: accepted drafts, " \
                        "then the first rejected row's argmax (or the bonus row's)"
    assert [len(e) - 1 for e in got] == [min(i, k) for i, k in enumerate(ks)], "accepted drafts miscounted"
    for d, e in zip(drafts, want):
        slow.totals.observe_draft(len(d), len(e) - 1)
    assert fast.stats() == slow.stats(), "the greedy path must count drafts and accepted tokens as the sampler's"
    tie = torch.zeros(2, vocab)
    tie[:, [7, 3]] = 1.0  # two tokens tie at the top of both rows
    assert fast.verify(tie, [[3]], SamplingMetadata.from_params(params[:1], [[1]], [[]], [None], [None],
                                                                vocab_size=vocab)) == [[3, 3]], \
        "on a tie the greedy path takes the first index, as the engine sampler's greedy_argmax does"


@pytest.mark.parametrize("cfg, err, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, ValueError, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "model"),
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
     FileNotFoundError, "draft"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 1},
     ValueError, "prompt_lookup"),
    ({"method": "ngram", "k": 2}, ValueError, "unknown"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 1]]},
     ValueError, "start at batch size 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8, 3]]},
     ValueError, r"k must be in \[0, num_speculative_tokens=2\]"),
    ({"method": "ngram", "num_speculative_tokens": 2,
      "num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 0]]}, ValueError, "overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4]]},
     ValueError, "three ints"),
])
def test_bad_speculative_config(cfg, err, match):
    with pytest.raises(err, match=match):
        make_llm(speculative_config=cfg)


def test_draft_with_another_vocabulary(tmp_path):
    from transformers import Qwen3Config, AutoModelForCausalLM

    cfg = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        make_llm(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                     "num_speculative_tokens": 2})
