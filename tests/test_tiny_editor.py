"""`tiny-py-editor`: the tiny target fine-tuned to copy code (training/finetune_editor.py).

Prompt-lookup (n-gram) speculation pays only on a model that reproduces code
from its context, as code-editing models do; `benchmarks/bench_spec_decode.py`
measures it on this model. These tests check on held-out files that the editor
copies and the target does not, that fine-tuning left plain language modelling
intact, and that the card states what the files measure.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from engine_utils import ALWAYS_DRAFT
from mini_vllm.course import tiny_models

MARKER = "\n# unchanged copy:\n"
MIN_EDITOR_COPY_RUN = 8          # mean tokens copied before the first mistake (of 92); the target: about 2
MAX_PLAIN_LOSS_INCREASE = 0.25   # nats/token the fine-tune may cost on plain code


@pytest.fixture(scope="module")
def tok():
    return tiny_models.load_tiny_tokenizer()


@pytest.fixture(scope="module")
def heldout_ids(tok):
    ids = []
    for path in tiny_models.corpus_files("val"):
        ids += tok.encode(path.read_text(encoding="utf-8")) + [tok.eos_token_id]
    assert len(ids) > 20_000, "held-out files missing: models/corpus_files.txt does not match this Python"
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def models():
    return {n: tiny_models.load_tiny_model(n) for n in (tiny_models.TARGET_NAME, tiny_models.EDITOR_NAME)}


def copy_runs(model_name: str, tok, stream, n: int = 16, span_len: int = 96, seed: int = 0) -> list[int]:
    """Greedy, free-running: shown `span + marker + span[:4]`, how many of the
    span's next tokens does the model reproduce before its first mistake?"""
    from mini_vllm import LLM, SamplingParams
    gen = torch.Generator().manual_seed(seed)
    marker = tok.encode(MARKER)
    prompts, wants = [], []
    for _ in range(n):
        s = int(torch.randint(0, len(stream) - span_len, (1,), generator=gen))
        span = stream[s:s + span_len].tolist()
        prompts.append({"prompt_token_ids": span + marker + span[:4]})
        wants.append(span[4:])
    llm = LLM(str(tiny_models.model_path(model_name)), dtype="float32", kv_cache_memory_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=span_len - 4, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    runs = []
    for o, want in zip(outs, wants):
        got = o.outputs[0].token_ids
        runs.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)))
    return runs


def test_editor_copies_held_out_code_that_the_target_cannot(tok, heldout_ids):
    target = copy_runs(tiny_models.TARGET_NAME, tok, heldout_ids)
    editor = copy_runs(tiny_models.EDITOR_NAME, tok, heldout_ids)
    mean_t, mean_e = sum(target) / len(target), sum(editor) / len(editor)
    assert mean_e >= MIN_EDITOR_COPY_RUN, \
        f"the editor reproduces {mean_e:.1f} tokens of a span it was just shown: it did not learn to copy"
    assert mean_e >= 3 * mean_t, \
        f"editor {mean_e:.1f} vs target {mean_t:.1f} tokens: the fine-tune added no copying the target lacked"


@torch.no_grad()
def test_editor_still_models_plain_code(heldout_ids, models):
    x = heldout_ids[:8 * 256 + 1]
    inp, tgt = x[:-1].view(8, 256), x[1:].view(8, 256)
    loss = {n: float(torch.nn.functional.cross_entropy(m(input_ids=inp).logits.flatten(0, 1), tgt.flatten()))
            for n, m in models.items()}
    rise = loss[tiny_models.EDITOR_NAME] - loss[tiny_models.TARGET_NAME]
    assert rise <= MAX_PLAIN_LOSS_INCREASE, \
        f"fine-tuning raised the held-out loss by {rise:.3f} nats: the editor forgot how to model plain code"


def test_editor_card_states_its_metrics():
    d = tiny_models.models_dir() / tiny_models.EDITOR_NAME
    meta = json.loads((d / "finetune_metrics.json").read_text())
    card = (d / "README.md").read_text()
    row = re.search(r"\| teacher-forced top-1 accuracy [^|]*\| ([0-9.]+) \| ([0-9.]+) \|", card)
    assert row, "the card lost its copy-accuracy row"
    assert (float(row.group(1)), float(row.group(2))) == (round(meta["before"]["copy_accuracy"], 3),
                                                          round(meta["after"]["copy_accuracy"], 3)), \
        "card and finetune_metrics.json disagree"


def test_prompt_lookup_pays_on_the_editor(tok, heldout_ids):
    """End to end: on an editing prompt the n-gram proposer's drafts are mostly
    accepted, so a request needs a third as many engine steps as tokens, with
    the same greedy tokens as without speculation."""
    from mini_vllm import LLM, SamplingParams
    span = heldout_ids[1000:1100].tolist()
    prompt = span + tok.encode(MARKER) + span[:4]
    sp = SamplingParams(max_tokens=92, temperature=0)
    path = str(tiny_models.model_path(tiny_models.EDITOR_NAME))
    plain = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    want = plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, **ALWAYS_DRAFT,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    steps = 0
    step = spec.llm_engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()
    spec.llm_engine.step = counted_step
    got = spec.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want, "greedy speculation changed the output"
    rate = spec.llm_engine.engine_core.call_utility("spec_decoding_stats")["acceptance_rate"]
    # The target, whose greedy text loops, also gets some drafts accepted (about 2.4 tokens
    # per step here); a model that copies must do clearly better.
    assert rate >= 0.5 and len(got) >= 3 * steps, \
        f"acceptance {rate:.2f}, {len(got)} tokens in {steps} steps: prompt lookup does not pay on a copying model"


def test_finetune_copy_samples_repeat_their_span_after_the_marker(monkeypatch):
    """The fine-tune's data: every packed copy sample is span + marker + span + EOS,
    and plain rows are windows of the stream (what the card describes)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "training"))
    from finetune_editor import batch_rows, copy_sample
    stream = torch.arange(10_000) % 997 + 3
    marker, eos = [1, 2], 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = copy_sample(stream, marker, eos, gen)
        n = (len(ids) - len(marker) - 1) // 2
        assert 32 <= n <= 224 and ids[n:n + 2] == marker and ids[-1] == eos, "sample layout is not span+marker+span+EOS"
        assert ids[:n] == ids[n + 2:-1], "the copy half must repeat the span exactly"
    rows = batch_rows(stream, marker, eos, 512, 4, 2, gen)  # the fine-tune's row length
    assert rows.shape == (4, 513)
    for r in rows[:2]:  # a span is at most 224 tokens, so a row must reach a marker
        assert marker[0] in r.tolist(), "a copy row holds no marker: it packed no copy sample"
    for r in rows[2:]:
        assert bool(((r[1:] - r[:-1]) % 997 == 1).all()), "a plain row is not a contiguous window of the stream"
