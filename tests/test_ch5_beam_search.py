"""Beam search on the engine (05_mini_vllm/beam_search.py) against two oracles.

* Hugging Face `generate(num_beams=W, do_sample=False)` in fp32: the best
  sequence of the tiny target (real stdlib code prompts) and of random tiny
  configs, and, with EOS, HF's canonical mode (length_penalty=0,
  early_stopping="never").
* A plain-PyTorch beam search with vLLM's rules (top-2W per beam, EOS
  candidates to the finished list, score = cum_logprob / len ** penalty over
  prompt + output) that recomputes every sequence from scratch with HF's model:
  all W returned beams and their scores, with EOS and length penalties.

Memory: each round re-submits every live beam as a one-token request, and
prefix caching finds the beams' common prefix (vLLM v1's design). While a
round runs, the blocks in use are exactly the union of its requests' block
tables with shared prefix blocks counted once, the peak is far below W
unshared sequences, each request computes only its last partial block, a
finished round holds no block, and every block is back at the end. The
search touches only LLMEngine's public request API.
"""
from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine_utils import assert_pool_full, make_llm, target_path
from hf_configs import tiny_config
from mini_vllm import BeamSearchParams
from mini_vllm.beam_search import run_beam_search


# Wider initialisation than the model tests: peaked distributions leave no near-ties
# between candidates, where float rounding could pick either beam.
def _tiny(cls, **kw):
    return tiny_config(cls, initializer_range=0.4, **kw)


RANDOM_CONFIGS = {
    "llama-mha-untied": lambda: _tiny(LlamaConfig, num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=False),
    "qwen2-gqa4-tied": lambda: _tiny(Qwen2Config, num_attention_heads=4, num_key_value_heads=1,
                                     tie_word_embeddings=True),
    "qwen3-gqa2-untied-bias": lambda: _tiny(Qwen3Config, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, attention_bias=True, tie_word_embeddings=False),
}


def _code_prompts(tok) -> list[list[int]]:
    import heapq
    import json
    import textwrap as tw
    srcs = [inspect.getsource(heapq.nsmallest), inspect.getsource(tw.dedent), inspect.getsource(json.dumps)]
    return [tok(textwrap.dedent(s))["input_ids"][:n] for s, n in zip(srcs, (40, 57, 23))]


def _hf(path, eos=None):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = eos
    return hf


def hf_beam(hf, prompt, w, n, **kw):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=w, do_sample=False,
                      max_new_tokens=n, num_return_sequences=1, pad_token_id=0, top_k=None, top_p=None,
                      temperature=None, return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), float(out.sequences_scores[0])


@torch.no_grad()
def reference_beam_search(hf, prompt, w, n, eos, length_penalty, ignore_eos=False):
    """vLLM's rules, recomputing every beam from scratch (no KV cache at all)."""
    live, done = [(list(prompt), 0.0)], []

    def score(beam):  # written out again: the module's scorer is under test
        toks, cum = beam
        return cum / (len(toks) - (toks[-1] == eos)) ** length_penalty

    for _ in range(n):
        lps = torch.log_softmax(hf(torch.tensor([t for t, _ in live])).logits[:, -1].float(), -1)
        top = lps.topk(2 * w, dim=-1)
        cands = []
        for (toks, cum), vals, ids in zip(live, top.values.tolist(), top.indices.tolist()):
            for lp, t in zip(vals, ids):
                (done if t == eos and not ignore_eos else cands).append((toks + [t], cum + lp))
        live = sorted(cands, key=score, reverse=True)[:w]
    return sorted(done + live, key=score, reverse=True)[:w]


@pytest.fixture(scope="module")
def random_checkpoints(tmp_path_factory):
    out = {}
    for i, (name, make) in enumerate(RANDOM_CONFIGS.items()):
        torch.manual_seed(2000 + i)
        hf = AutoModelForCausalLM.from_config(make())
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def target_llm():
    return make_llm(max_num_seqs=16)


@pytest.mark.parametrize("width", [2, 4])
def test_tiny_target_best_sequence_matches_hf(target_llm, width):
    n = 12
    prompts = _code_prompts(target_llm.get_tokenizer())
    outs = target_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                  BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True))
    hf = _hf(target_path())
    for p, o in zip(prompts, outs):
        best = o.sequences[0]
        hf_toks, hf_score = hf_beam(hf, p, width, n, early_stopping=True)
        assert best.tokens[:len(p)] == p, "a beam must start with its prompt"
        assert best.tokens[len(p):] == hf_toks, (
            "best beam differs from HF num_beams search: wrong candidate ranking, a fork that "
            "lost or kept the wrong KV, or a cut beam's blocks reused while still shared")
        # HF scores with length_penalty=1 over the output length only.
        assert math.isclose(best.cum_logprob, hf_score * n, rel_tol=1e-4, abs_tol=1e-3), \
            "cumulative log-prob of the best beam differs from HF's beam score"
        assert len(o.sequences) == width and best.text is not None, (
            f"beam search must return beam_width={width} sequences with their text detokenized: got "
            f"{len(o.sequences)}, best text {best.text!r}")
    assert_pool_full(target_llm)


@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_random_configs_match_hf(random_checkpoints, name):
    path, n = random_checkpoints[name], 10
    llm = make_llm(str(path), block_size=8, max_model_len=128, max_num_seqs=8)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 97, (k,), generator=g).tolist() for k in (5, 13, 21)]
    hf = _hf(path)
    for width in (2, 4):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True))
        for p, o in zip(prompts, outs):
            assert o.sequences[0].tokens[len(p):] == hf_beam(hf, p, width, n, early_stopping=True)[0], \
                f"{name}, width {width}: best beam differs from HF's"
        assert_pool_full(llm)


def _eos_checkpoint(tmp_path, seed=2024, step=2, prompt_len=3):
    """A random model whose EOS is the token greedy decoding emits at `step`:
    the search meets EOS early, on its best path."""
    torch.manual_seed(seed)
    # Llama: transformers makes no tokenizer for a bare Llama folder, so the engine takes
    # EOS from config.json (for a bare Qwen folder it invents one whose EOS is 0).
    hf = AutoModelForCausalLM.from_config(RANDOM_CONFIGS["llama-mha-untied"]()).eval()
    prompt = torch.randint(3, 97, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = torch.tensor([prompt])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=step + 1, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    eos = greedy[step]
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    hf.save_pretrained(tmp_path)
    return tmp_path, prompt, eos


def test_eos_and_length_penalty_match_reference(tmp_path):
    path, prompt, eos = _eos_checkpoint(tmp_path)
    w, n = 3, 10
    llm = make_llm(str(path), block_size=8, max_model_len=128, max_num_seqs=8)
    hf = _hf(path, eos)
    best_reasons = []
    for length_penalty in (0.0, 1.0, 3.0):
        (out,) = llm.beam_search({"prompt_token_ids": prompt},
                                 BeamSearchParams(beam_width=w, max_tokens=n, length_penalty=length_penalty))
        ref = reference_beam_search(hf, prompt, w, n, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref], (
            f"length_penalty={length_penalty}: the W returned beams differ from vLLM's rules "
            "(EOS candidates to the finished list, score over prompt + output)")
        for s, (toks, cum) in zip(out.sequences, ref):
            assert math.isclose(s.cum_logprob, cum, rel_tol=1e-4, abs_tol=1e-4), "beam log-prob differs"
            assert s.finish_reason == ("stop" if toks[-1] == eos else "length"), "wrong finish_reason"
        best_reasons.append(out.sequences[0].finish_reason)
        assert_pool_full(llm)
    # Short EOS beams win without a penalty, long ones with a strong penalty.
    assert best_reasons[0] == "stop" and best_reasons[-1] == "length", \
        f"setup: the length penalty should change the winner, got {best_reasons}"


def test_eos_best_sequence_matches_hf_canonical_mode(tmp_path):
    path, prompt, eos = _eos_checkpoint(tmp_path)
    llm = make_llm(str(path), block_size=8, max_model_len=128, max_num_seqs=8)
    (out,) = llm.beam_search({"prompt_token_ids": prompt},
                             BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0))
    hf_toks, _ = hf_beam(_hf(path, eos), prompt, 3, 10, early_stopping="never", length_penalty=0.0)
    assert hf_toks[-1] == eos, "setup: HF's best beam should end with EOS"
    assert out.sequences[0].tokens[len(prompt):] == hf_toks, "best EOS-finished beam differs from HF's"
    assert_pool_full(llm)


# ------------------------------------------------------------------ memory
def _long_prompt(tok, n=200) -> list[int]:
    import collections
    return tok(textwrap.dedent(inspect.getsource(collections.OrderedDict)))["input_ids"][:n]


def _check_tables(core, log=None) -> None:
    """Blocks in use == union of the live requests' tables, ref counts == sharers."""
    kv, sched = core.scheduler.kv_cache_manager, core.scheduler
    tables = [kv.get_block_ids(r) for r in sched.requests]
    sharers: dict[int, int] = {}
    for t in tables:
        for b in t:
            sharers[b] = sharers.get(b, 0) + 1
    in_use = {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt > 0}
    assert in_use == sharers, "a block is held by no live beam request (leak) or its ref count is off"
    if log is not None:
        log.append((len(sharers), sum(len(t) for t in tables)))


def test_beams_share_prefix_blocks_through_prefix_caching(target_llm):
    llm, w, n, bs = target_llm, 4, 24, 16
    core = llm.llm_engine.engine_core.engine_core
    prompt = _long_prompt(llm.get_tokenizer())
    log, scheduled = [], []
    real_schedule = core.scheduler.schedule

    def watched_schedule():  # while a round runs: its requests hold their blocks
        so = real_schedule()
        scheduled.append(so.total_num_scheduled_tokens)
        _check_tables(core, log)
        return so

    core.scheduler.schedule = watched_schedule
    try:
        # After every step the finished round's requests hold nothing: only unfinished ones own blocks.
        (out,) = run_beam_search(llm.llm_engine, [prompt], BeamSearchParams(w, n, ignore_eos=True),
                                 on_step=lambda eng: _check_tables(eng.engine_core.engine_core))
    finally:
        del core.scheduler.schedule
    # Round r re-submits W beams of len(prompt) + r tokens; prefix caching gives each all but
    # its last partial block (the block holding the last token is never a hit).
    tail = lambda length: length - bs * ((length - 1) // bs)
    bound = len(prompt) + sum(w * tail(len(prompt) + r) for r in range(1, n))
    assert sum(scheduled) <= bound, \
        "beams recomputed full blocks: a re-submitted beam must find its prefix in the prefix cache"
    unshared_w = w * -(-(len(prompt) + n) // bs)  # W sequences with their own copies
    peak = max(u for u, _ in log)
    assert peak <= 0.5 * unshared_w, f"peak {peak} blocks: beams do not share the prompt (W copies = {unshared_w})"
    assert all(u < t for u, t in log if t > -(-len(prompt) // bs) + 1), \
        "with several beams in a round, distinct blocks must be fewer than the tables' total"
    assert len(out.sequences) == w, f"beam search returned {len(out.sequences)} sequences, not beam_width={w}"
    assert_pool_full(llm)


class _PublicEngine:
    """Only LLMEngine's public request API and configuration; no engine core."""

    def __init__(self, engine) -> None:
        self._e = engine
        for name in ("add_request", "step", "abort_request", "has_unfinished_requests", "get_tokenizer",
                     "processor", "config", "model_config", "max_model_len", "num_gpu_blocks",
                     "eos_token_id"):
            setattr(self, name, getattr(engine, name))


def test_search_is_a_client_of_the_engine(target_llm):
    prompts = [{"prompt_token_ids": p} for p in _code_prompts(target_llm.get_tokenizer())[:2]]
    params = BeamSearchParams(3, 6, ignore_eos=True)
    want = [[s.tokens for s in o.sequences] for o in target_llm.beam_search(prompts, params)]
    got = run_beam_search(_PublicEngine(target_llm.llm_engine), prompts, params)
    assert [[s.tokens for s in o.sequences] for o in got] == want, \
        "beam search must run on LLMEngine's public API alone (no engine core, no scheduler)"
    assert_pool_full(target_llm)


def test_constrained_engine_gives_the_same_beams(target_llm):
    """Beams that wait for max_num_seqs, chunked prefill and a pool too small to
    keep the beams' prefixes cached change the schedule, never the result, and
    leak nothing."""
    tok = target_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in _code_prompts(tok) + [_long_prompt(tok, 120)]]
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    roomy = target_llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
    q0, h0 = roomy.queries, roomy.hits
    want = [[s.tokens for s in o.sequences] for o in target_llm.beam_search(prompts, params)]
    roomy_hit_rate = (roomy.hits - h0) / (roomy.queries - q0)
    # 12 blocks: one 140-token beam (9 blocks) fits, the 120-token prompt's 4 beams at once do not.
    small = make_llm(max_num_seqs=8, max_num_batched_tokens=48, num_gpu_blocks_override=12)
    got = [[s.tokens for s in o.sequences] for o in small.beam_search(prompts, params)]
    assert got == want, "scheduling pressure changed the beams: an evicted or waiting beam lost state"
    st = small.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
    assert st.hits / st.queries < roomy_hit_rate, \
        "setup: the small pool should evict the beams' cached prefixes, so that they are recomputed"
    assert_pool_full(small)
    # 8 blocks of 16 tokens cannot hold one 140-token beam (120 + 20): a clear error before any step.
    tiny = make_llm(max_num_seqs=8, max_num_batched_tokens=48, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="too small for a beam of 140 tokens"):
        tiny.beam_search(prompts, params)
    assert_pool_full(tiny)


def test_temperature_one_scores_like_greedy(target_llm):
    # log_softmax(logits / 1) == log_softmax(logits): same beams, though the sampled
    # tokens (which the search ignores) are now random.
    prompts = [{"prompt_token_ids": p} for p in _code_prompts(target_llm.get_tokenizer())[:2]]
    a = target_llm.beam_search(prompts, BeamSearchParams(3, 8, ignore_eos=True))
    b = target_llm.beam_search(prompts, BeamSearchParams(3, 8, ignore_eos=True, temperature=1.0))
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b], (
        "temperature=1.0 changed the beams: the search must rank by the unscaled log-probs, not by the sampled tokens")
    assert_pool_full(target_llm)


# -------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos")])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kw)


def test_bad_calls_raise_and_leave_the_engine_idle(target_llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        target_llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=17, max_tokens=4))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        target_llm.beam_search([[5, 6, 7]], {"beam_width": 2})
    with pytest.raises(ValueError, match="max_tokens"):  # all prompts checked before any starts
        target_llm.beam_search([[5, 6, 7], [5] * 1020], BeamSearchParams(2, 8))
    assert_pool_full(target_llm)
