"""Chapter 5 models vs Hugging Face transformers (the oracle), in float32.

Every test runs our model over a real paged KV cache (NaN-filled, so a read of
a slot nobody wrote poisons the logits) with shuffled, non-contiguous block
ids, and compares per-position logits with transformers' forward on each
whole sequence. Covered: ragged prefills in one batch, chunked prefill plus
decodes mixed in the same steps, and a prefix hit on blocks that the same
forward pass writes.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_configs import RANDOM_CONFIGS
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models import load_model, set_attention_backend
from mini_vllm.paged_attention import allocate_kv_cache
from mini_vllm.course.tiny_models import model_path

ATOL = 1e-4
# "triton" runs compiled on CUDA, and in Triton's interpreter (tests/conftest.py
# sets TRITON_INTERPRET=1; outside the tests, kernels.prepare_triton) on the CPU, so both backends are checked everywhere.
BACKENDS = ["torch", "triton"]


MODELS = list(RANDOM_CONFIGS) + ["tiny-py-target", "tiny-py-draft"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> folder with config.json + model.safetensors (random or trained)."""
    out = {"tiny-py-target": model_path("tiny-py-target"), "tiny-py-draft": model_path("tiny-py-draft")}
    for i, (name, make) in enumerate(RANDOM_CONFIGS.items()):
        torch.manual_seed(1000 + i)
        hf = AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # norm weights start at 1; random ones make their use visible
            for pname, p in hf.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = path
    return out


_HF_CACHE: dict = {}


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF_CACHE[path](torch.tensor([ids])).logits[0].float()


class PagedBatcher:
    """A hand-made runner: one NaN-filled paged cache per layer, shuffled
    block ids, and `step()` that builds AttentionMetadata for a varlen batch."""

    def __init__(self, model, config, device, block_size=8, num_blocks=48, seed=0):
        self.model, self.bs, self.device = model, block_size, device
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        for layer in model.attention_layers():
            k, v = allocate_kv_cache(num_blocks, block_size, config.num_key_value_heads, config.head_dim,
                                     device=device)
            layer.kv_cache = (k.fill_(float("nan")), v.fill_(float("nan")))

    def ensure(self, seq: str, length: int, shared: list[int] = ()) -> None:
        table = self.tables.setdefault(seq, list(shared))
        while len(table) * self.bs < length:
            table.append(self.free.pop())

    def step(self, chunks):
        """chunks: [(seq, token_ids, start_pos)] -> logits [T, vocab] on CPU."""
        ids, pos, slots, q_lens, s_lens = [], [], [], [], []
        for seq, toks, start in chunks:
            end = start + len(toks)
            self.ensure(seq, end)
            table = self.tables[seq]
            ids += toks
            pos += range(start, end)
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
            q_lens.append(len(toks))
            s_lens.append(end)
        width = max(len(self.tables[s]) for s, _, _ in chunks) + 1  # +1: a -1 pad in every row
        rows = [self.tables[s] + [-1] * (width - len(self.tables[s])) for s, _, _ in chunks]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        d = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=d),
            block_tables=torch.tensor(rows, dtype=torch.int32, device=d),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=d),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=d),
            max_query_len=max(q_lens), max_seq_len=max(s_lens),
            query_lens_cpu=q_lens, seq_lens_cpu=s_lens)
        with torch.no_grad(), set_forward_context(md):
            hidden = self.model(torch.tensor(ids, device=d), torch.tensor(pos, device=d))
            return self.model.compute_logits(hidden).cpu()


def _setup(checkpoints, name, backend):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model, config = load_model(checkpoints[name], dtype=torch.float32, device=device)
    set_attention_backend(model, backend)
    return model, config, device


def _prompts(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_ragged_prefill_batch_matches_hf(checkpoints, name, backend):
    model, config, device = _setup(checkpoints, name, backend)
    prompts = _prompts(config.vocab_size, [7, 19, 33], seed=1)
    batcher = PagedBatcher(model, config, device)
    logits = batcher.step([(f"s{i}", p, 0) for i, p in enumerate(prompts)])
    assert logits.dtype == torch.float32, "compute_logits must return float32"
    row = 0
    for i, p in enumerate(prompts):
        ref = hf_logits(checkpoints[name], p)
        got = logits[row:row + len(p)]
        row += len(p)
        err = (got - ref).abs().max().item()
        assert err <= ATOL, (f"{name}/{backend}: prompt {i} (len {len(p)}) logits differ from HF by {err:.2e}: "
                             "wrong layer math, rope, GQA mapping or varlen row bookkeeping")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama3-rope-gqa2-tied", "qwen2-gqa4-tied", "tiny-py-target"])
def test_chunked_prefill_and_decode_mixed_in_steps_match_hf(checkpoints, name, backend):
    """Sequence a: 21-token prompt in chunks of 13 and 8, then 3 decodes;
    sequence b: 9-token prompt, then decodes, sharing every step with a."""
    model, config, device = _setup(checkpoints, name, backend)
    a, b = _prompts(config.vocab_size, [24, 14], seed=2)  # a[21:], b[9:] are the "decoded" tokens
    batcher = PagedBatcher(model, config, device, seed=3)
    steps = [
        [("a", a[:13], 0)],
        [("b", b[:9], 0), ("a", a[13:21], 13)],           # whole prefill + second chunk
        [("a", a[21:22], 21), ("b", b[9:10], 9)],          # two decodes
        [("b", b[10:11], 10), ("a", a[22:23], 22)],
        [("a", a[23:24], 23), ("b", b[11:14], 11)],        # decode + a 3-token chunk (spec-decode shape)
    ]
    got = {"a": [], "b": []}
    for chunks in steps:
        logits, row = batcher.step(chunks), 0
        for seq, toks, _ in chunks:
            got[seq].append(logits[row:row + len(toks)])
            row += len(toks)
    for seq, toks in (("a", a), ("b", b)):
        err = (torch.cat(got[seq]) - hf_logits(checkpoints[name], toks)).abs().max().item()
        assert err <= ATOL, (f"{name}/{backend}: sequence {seq} differs from HF's full-sequence logits by "
                             f"{err:.2e}: a later chunk or decode misreads the cache (positions, slots, "
                             "block tables or the causal offset seq_len - q_len)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama-mha-untied", "qwen3-gqa2-untied-bias", "tiny-py-draft"])
def test_prefix_hit_on_blocks_written_in_the_same_step(checkpoints, name, backend):
    """b's table starts with a's first two blocks, which a writes in this very
    forward pass; b comes FIRST in the batch and computes only its suffix.
    Matches HF only if every layer writes the whole batch's K/V before any
    sequence attends (the blocks start NaN)."""
    model, config, device = _setup(checkpoints, name, backend)
    batcher = PagedBatcher(model, config, device, seed=4)
    bs = batcher.bs
    a, tail = _prompts(config.vocab_size, [2 * bs + 5, 7], seed=5)
    b = a[:2 * bs] + tail
    batcher.ensure("a", len(a))
    batcher.ensure("b", len(b), shared=batcher.tables["a"][:2])
    logits = batcher.step([("b", b[2 * bs:], 2 * bs), ("a", a, 0)])
    err_b = (logits[:len(tail)] - hf_logits(checkpoints[name], b)[2 * bs:]).abs().max().item()
    err_a = (logits[len(tail):] - hf_logits(checkpoints[name], a)).abs().max().item()
    assert err_a <= ATOL, f"{name}/{backend}: the sequence that owns the blocks differs from HF by {err_a:.2e}"
    assert err_b <= ATOL, (f"{name}/{backend}: the prefix-hit sequence differs from HF by {err_b:.2e}: its shared "
                           "blocks were read before this step's K/V of the whole batch was written")


def test_model_api_for_the_runner(checkpoints):
    model, config = load_model(checkpoints["tiny-py-target"])
    layers = model.attention_layers()
    assert len(layers) == config.num_hidden_layers, "the runner binds one KV cache per decoder layer"
    assert [l is m.self_attn.attn for l, m in zip(layers, model.model.layers)] == [True] * len(layers), \
        "attention_layers() must follow layer order, or caches get bound to the wrong layers"
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied checkpoints must share the embedding"
    with pytest.raises(RuntimeError, match="set_forward_context"):
        with torch.no_grad():
            model(torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="attention_backend"):
        set_attention_backend(model, "flash")
