"""EAGLE speculative decoding in the engine (`spec_decode/engine/eagle.py`, `models/llama_eagle.py`).

Oracles:
* the plain-PyTorch head of `training/eagle_head.py` (dense attention, one
  sequence) for the paged head's hidden states;
* the same reference unrolled along the engine's own greedy output: every
  draft the engine proposes must be the reference chain's draft, up to the
  first one that mismatches the continuation (after it the chains read
  different tokens);
* the engine without speculation for tokens (greedy in `test_ch5_spec_decode.py`,
  sampled here with a chi-square test that is shown to have power).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_utils import ALWAYS_DRAFT, assert_pool_full, make_llm, run_greedy
from mini_vllm import SamplingParams
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.course.tiny_models import load_tiny_model, load_tiny_tokenizer, model_path
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models.llama_eagle import load_eagle_head
from mini_vllm.models.loader import load_model
from mini_vllm.paged_attention import allocate_kv_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from eagle_head import EagleHead, load_head, save_head  # noqa: E402
from train_eagle import unroll  # noqa: E402

EAGLE = str(model_path("tiny-py-eagle"))
TARGET = model_path("tiny-py-target")


def eagle(k: int, head: str = EAGLE) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k, **ALWAYS_DRAFT}


def eagle_llm(chapter, k: int, per_batch_size=None, **kw):
    """An engine drafting with the head, its core in this process, running the proposer under
    test: the reference's, or under --impl=exercise the Chapter 5 exercise's (`plug_eagle`)."""
    spec = dict(eagle(k), num_speculative_tokens_per_batch_size=per_batch_size) if per_batch_size else eagle(k)
    llm = make_llm(speculative_config=spec, multiprocess_mode=False, **kw)
    chapter("engine").plug_eagle(llm)
    return llm


@pytest.fixture(scope="module")
def random_head(tmp_path_factory) -> Path:
    """A head with random weights (large enough that every part of it matters)."""
    torch.manual_seed(0)
    head = EagleHead(256, 4, 2, 64, 768)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    out = tmp_path_factory.mktemp("eagle") / "head"
    save_head(head, out, json.loads((TARGET / "config.json").read_text()))
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@torch.inference_mode()
def test_paged_head_equals_the_plain_pytorch_reference(random_head, backend):
    """Two prefill chunks and three one-token steps through the paged KV cache give the
    hidden states of one causal pass of the reference over the whole sequence."""
    target, _ = load_model(TARGET, dtype=torch.float32)
    head = load_eagle_head(random_head, target, torch.float32, "cpu", backend)
    bs, T = 8, 23
    kv = allocate_kv_cache(6, bs, 2, 64, torch.float32, torch.device("cpu"))
    head.attention_layers()[0].kv_cache = kv
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6144, (T,), generator=gen)
    hidden = torch.randn(T, 256, generator=gen)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)  # blocks out of order on purpose
    got = []
    for lo, hi in [(0, 12), (12, 20), (20, 21), (21, 22), (22, 23)]:
        pos = torch.arange(lo, hi)
        slots = table[0, pos // bs].long() * bs + pos % bs
        md = AttentionMetadata(slots, table, torch.tensor([0, hi - lo], dtype=torch.int32),
                               torch.tensor([hi], dtype=torch.int32), hi - lo, hi, [hi - lo], [hi])
        with set_forward_context(md):
            got.append(head(ids[lo:hi], pos, hidden[lo:hi]))
    got = torch.cat(got)
    ref = load_head(random_head)
    want = ref(target.model.embed_tokens.weight[ids][None], hidden[None], torch.arange(T)[None])[0]
    err = (got - want).abs().max().item()
    assert err < 1e-4, (f"paged EAGLE head differs from the reference by {err:.2e}: the shift, the fc input "
                        "order [embed; hidden], the missing input norm or the KV written to the wrong slots")
    logits = head.compute_logits(got[-1:])
    assert torch.equal(logits, target.compute_logits(got[-1:])), "the head must use the target's LM head"


def _record_drafts(llm, monkeypatch) -> list[tuple[str, list[int], list[int]]]:
    """Wraps the runner's EAGLE call: (request, its tokens when drafting, the drafts)."""
    import mini_vllm.worker.eagle_drafter as ed

    seen, real = [], ed.propose_eagle

    def spy(drafter, step, hidden, sampled):
        out = real(drafter, step, hidden, sampled)
        for rid, d in out.items():
            seen.append((rid, drafter.requests[rid].token_ids + sampled[rid], list(d)))
        return out

    monkeypatch.setattr(ed, "propose_eagle", spy)
    return seen


# What a wrong draft j + 1 points to, when the drafts before it were right (measured with the ch5
# mutants: `python -m mutants --chapter 5 --only eagle_...`). Draft 1 comes from the head's first
# pass over the step's kept positions; draft 2 from the chain's first step, the first to feed the
# head its own output; draft 2 is one past the last position however positions advance, so a
# wrong advance first shows at draft 3.
DRAFT_CAUSES = (
    "the head's first pass is wrong: the hidden state of the wrong position (the state at p must meet "
    "the token at p + 1), its KV not written (slot_mapping of the kept rows), or draft 1 read from a row "
    "that is not the request's last kept one",
    "the chain's first step is wrong, or a first-pass error that draft 1 survived: the head's own output "
    "not fed back as the next hidden state (the target's fed again), the previous draft not fed at the "
    "next position, or ids not shifted in the first pass (its last row gets the sampled token either way, "
    "so only the KV of the earlier positions is wrong)",
    "positions not advanced by one per chain step (draft 2 sits one past the last position either way), "
    "or the KV of the earlier drafts not written where the next step reads it",
)


@torch.no_grad()
def assert_drafts_match_reference(seen, final: dict[str, list[int]], skip=()) -> tuple[int, int]:
    """Every recorded proposal against the reference chain along the final output;
    returns (drafts compared, drafts equal to the continuation)."""
    target = load_tiny_model("tiny-py-target")
    ref = load_head(EAGLE)
    embed = target.model.embed_tokens.weight
    checked = accepted = 0
    for rid, tokens, drafts in seen:
        if rid in skip:
            continue
        seq = final[rid]
        assert seq[:len(tokens)] == tokens, f"{rid}: the drafting context is not a prefix of the output"
        L, k = len(tokens), len(drafts)
        ext = torch.tensor(seq[:L] + [0] * (k + 1))  # teacher tokens past the output are never compared
        ext[L:L + min(k, len(seq) - L)] = torch.tensor(seq[L:L + k])
        feats = target.model(input_ids=ext[None]).last_hidden_state
        want = [int((g[0, L - 2] @ embed.T).argmax()) for g in unroll(ref, embed, ext[None], feats, L - 1, k)]
        for j in range(k):
            assert drafts[j] == want[j], (f"{rid} after {L} tokens: draft {j + 1} is {drafts[j]}, the reference "
                                          f"chain says {want[j]} (drafts {drafts}, reference {want}): "
                                          + DRAFT_CAUSES[min(j, 2)])
            checked += 1
            if L + j >= len(seq) or seq[L + j] != want[j]:
                break  # the engine fed its own draft from here on; the reference the true token
            accepted += 1
    return checked, accepted


def code_prompts() -> list[list[int]]:
    tok = load_tiny_tokenizer()
    texts = ["def __init__(self, name, value=None):\n        self.name = name\n",
             "import os\nimport sys\n\n\ndef main(argv):\n    ", "class Error(Exception):\n    pass\n\n\n"]
    return [tok(t)["input_ids"] for t in texts]


def test_engine_drafts_are_the_reference_chain(monkeypatch, chapter):
    """Along the engine's own greedy output (chunked prefill: 16-token budget), each
    proposal equals the reference's drafts as far as the reference reads the same tokens."""
    llm = eagle_llm(chapter, 4, block_size=8, max_num_batched_tokens=16)
    seen = _record_drafts(llm, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in code_prompts()],
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    final = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    checked, accepted = assert_drafts_match_reference(seen, final)
    assert checked >= 60 and accepted >= 20, f"too few drafts compared ({checked}, {accepted} matching)"
    assert_pool_full(llm)


def test_no_head_at_large_batches_and_requests_with_gaps_stop_drafting(monkeypatch, chapter):
    """Dynamic speculation (num_speculative_tokens_per_batch_size): no drafts after a step
    of 3 or more requests, 4 after a step of 1 or 2, and no head pass at all in a step that
    drafts nothing (spec_decode/engine/head_kv.py). Then:
    * the requests computed in such steps lack the head's KV there, so they draft no more,
      even once fewer than 3 remain;
    * a request whose prompt hits blocks written by them drafts nothing either;
    * a fresh request drafts, and its drafts are the reference chain's (which reads the
      head's KV of every earlier position, in blocks the first requests may have freed);
    * every request's tokens are those of the engine without speculation."""
    import mini_vllm.worker.eagle_drafter as ed
    from mini_vllm.models.llama_eagle import EagleLlamaForCausalLM

    llm = eagle_llm(chapter, 4, per_batch_size=[[1, 2, 4], [3, 64, 0]], block_size=8, enable_prefix_caching=True)
    seen, steps, head_calls = _record_drafts(llm, monkeypatch), [], [0]
    recording, head_forward = ed.propose_eagle, EagleLlamaForCausalLM.forward  # the first: _record_drafts' spy

    def count(drafter, step, *a):
        before = head_calls[0]
        out = recording(drafter, step, *a)
        steps.append((len(step.req_ids), sum(len(d) for d in out.values()), head_calls[0] - before))
        return out

    def counted_forward(self, *a, **kw):
        head_calls[0] += 1
        return head_forward(self, *a, **kw)

    monkeypatch.setattr(ed, "propose_eagle", count)
    monkeypatch.setattr(EagleLlamaForCausalLM, "forward", counted_forward)
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 20, 60, 70)]
    prompts = code_prompts() + [list(range(40, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert any(b <= 2 for b, _, _ in steps), f"the batch never shrank to 2: {steps}"
    assert all(n == 0 and h == 0 for b, n, h in steps if b >= 3), \
        f"(batch size, drafts, head calls) per step: the schedule says 0 drafts from 3 requests on, where the " \
        f"head must not run at all: {steps}"
    assert not seen, (f"requests computed in steps without the head drafted afterwards ({len(seen)} proposals): "
                      "their head KV has holes there")
    hit_prompt = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
    n_seen = len(seen)
    hit = llm.generate([{"prompt_token_ids": hit_prompt}], greedy[1], use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 8, f"no prefix hit ({hit.num_cached_tokens} cached tokens)"
    assert len(seen) == n_seen, "a prefix hit on blocks written without the head drafted from their holes"
    fresh_prompt = list(range(100, 130))
    fresh = llm.generate([{"prompt_token_ids": fresh_prompt}], greedy[3], use_tqdm=False)[0]
    final = {fresh.request_id: fresh_prompt + fresh.outputs[0].token_ids}
    checked, accepted = assert_drafts_match_reference(seen, final)
    assert checked >= 20 and accepted >= 8, (f"too few drafts of a fresh request compared ({checked}, {accepted} "
                                             "matching): a block freed by a request with gaps stayed marked?")
    plain = run_greedy(make_llm(), prompts + [hit_prompt, fresh_prompt], [12, 20, 60, 70, 20, 70])
    got = [o.outputs[0].token_ids for o in outs + [hit, fresh]]
    assert got == plain, "speculative tokens differ from the engine without speculation"
    assert_pool_full(llm)


def test_head_kv_tracker_marks_blocks_and_clears_them_for_a_new_owner():
    """spec_decode/engine/head_kv.py on its own: block size 4, two rows with tables [3, 5] and [7, 2]."""
    from mini_vllm.spec_decode.engine.head_kv import HeadKvTracker

    t = HeadKvTracker(num_blocks=8, block_size=4)
    tables = np.array([[3, 5], [7, 2]])
    assert t.complete(tables, np.array([6, 6])).all(), "a fresh pool has no stale block"
    t.skipped(np.array([20, 21]))                                     # row 0's positions 4, 5: block 5's slots 0, 1
    assert t.stale.tolist() == [False] * 5 + [True] + [False] * 2, f"row 0's block 5 not marked: {t.stale}"
    assert t.complete(tables, np.array([4, 6])).tolist() == [True, True], "positions 4, 5 are not before 4"
    assert t.complete(tables, np.array([6, 6])).tolist() == [False, True], \
        "row 0's positions before 6 sit in stale block 5, so its history is not complete"
    t.written(np.array([21, 22]))                                     # a new owner writes slots 1, 2 of block 5
    assert t.stale[5], "only a write of slot 0 starts a block clean: slots 1 and 2 leave slot 0 stale"
    t.written(np.array([-1, 20, 21]))                                 # ... and from slot 0 (-1: padding)
    assert not t.stale.any(), "block 5 was rewritten from slot 0 by its new owner, but stays marked"
    t.skipped(np.array([-1, 9, 10]))                                  # a whole step without the head
    assert t.stale.tolist() == [False, False, True] + [False] * 5, \
        f"slots 9 and 10 are in block 2 (-1 is padding, nothing written): {t.stale}"
    t.moved(swap_out=[(2, 0), (3, 1)], swap_in=[(0, 6), (1, 2)], copies=[(6, 7)])  # the cache engine's order
    assert t.stale.tolist() == [False] * 6 + [True, True], (
        f"block 2's mark must travel to CPU block 0 and back into block 6, then be copied to 7, while clean "
        f"block 3's contents land in block 2: {t.stale}")


def test_a_prefix_hit_finds_the_heads_kv(monkeypatch, chapter):
    """A second request whose prompt is the first one's whole output hits its cached
    blocks; its drafts still equal the reference, which needs the head's KV of every
    cached position (written by the first request's steps, in the same blocks)."""
    llm = eagle_llm(chapter, 3, block_size=8, enable_prefix_caching=True)
    seen = _record_drafts(llm, monkeypatch)
    first = llm.generate([{"prompt_token_ids": code_prompts()[0]}],
                         SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    n_first = len(seen)
    prompt2 = first.prompt_token_ids + first.outputs[0].token_ids
    second = llm.generate([{"prompt_token_ids": prompt2}],
                          SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert second.num_cached_tokens >= 32, f"no prefix hit ({second.num_cached_tokens} cached tokens)"
    final = {second.request_id: prompt2 + second.outputs[0].token_ids}
    checked, accepted = assert_drafts_match_reference(seen[n_first:], final)
    assert checked >= 10 and accepted >= 3, f"too few drafts compared ({checked}, {accepted} matching)"


def test_n_and_abort_leave_other_requests_exact(chapter):
    """n = 2 fans out in the front end (two independent requests, both drafting; top-1
    sampling, since n > 1 at temperature 0 is refused as in vLLM), and an abort mid-flight
    frees the request without disturbing the one beside it."""
    prompts = code_prompts()
    base = run_greedy(make_llm(block_size=8), prompts[:2], 30)
    llm = eagle_llm(chapter, 3, block_size=8)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}],
                        SamplingParams(n=2, max_tokens=30, temperature=1.0, top_k=1, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [base[0]] * 2, "n = 2 with EAGLE changed greedy tokens"
    eng = llm.llm_engine
    for rid, p in (("keep", prompts[1]), ("drop", prompts[0])):
        eng.add_request(rid, {"prompt_token_ids": p}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    got: list[int] = []
    for step in range(200):
        if step == 3:
            eng.abort_request(["drop"])
        for o in eng.step():
            if o.request_id == "keep" and o.finished:
                got = o.outputs[0].token_ids
        if not eng.has_unfinished_requests():
            break
    assert got == base[1], "aborting one request changed the tokens of the other"
    assert_pool_full(llm)


def _eagle_draft_of(prompt: list[int]):
    """The head's first draft after prompt + [t1], from the reference (HF target + plain head)."""
    target, ref = load_tiny_model("tiny-py-target"), load_head(EAGLE)
    embed = target.model.embed_tokens.weight

    @torch.no_grad()
    def draft(t1: int) -> int:
        ids = torch.tensor([prompt + [t1, 0]])
        feats = target.model(input_ids=ids).last_hidden_state
        g = unroll(ref, embed, ids, feats, len(prompt), 1)[0]
        return int((g[0, -1] @ embed.T).argmax())
    return draft


def test_sampling_with_eagle_is_lossless_and_the_test_has_power(monkeypatch, chapter):
    from test_ch5_spec_decode import assert_lossless_with_power

    prompt = code_prompts()[1]
    assert_lossless_with_power(lambda: eagle_llm(chapter, 1, max_num_seqs=256), prompt, _eagle_draft_of(prompt),
                               monkeypatch, "EAGLE")
