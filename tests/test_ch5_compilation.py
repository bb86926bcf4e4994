"""Chapter 5 compilation: `compile_forward` (VLLM_COMPILE split at attention, and
STOCK_TORCH_COMPILE) against the eager model, on the CPU with inductor.

Every architecture the engine serves (Llama, Qwen2, Qwen3) as a random tiny
checkpoint. One scenario of mixed steps (a 64-token prefill batch, a 7-token
chunk + decode step, 3- and 1-token decode steps) runs twice over identical
NaN-filled paged caches: eagerly and compiled. The compiled forward is built
once per (architecture, mode) in module fixtures: compiling is the slow part.
Inductor's cache (`compilation/backends.py`) makes a second run much faster.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from hf_configs import tiny_config
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.compilation.backends import _op_name, compile_forward
from mini_vllm.compilation.config import CompilationConfig, CompilationMode
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models import load_model
from mini_vllm.paged_attention import allocate_kv_cache

ATOL = 1e-4
CONFIGS = {  # 2 or 3 layers: the piece counts must follow the layer count
    "llama": lambda: tiny_config(LlamaConfig, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": lambda: tiny_config(Qwen2Config, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3),
    "qwen3": lambda: tiny_config(Qwen3Config, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 num_hidden_layers=3),
}
VLLM, STOCK = CompilationMode.VLLM_COMPILE, CompilationMode.STOCK_TORCH_COMPILE
MODES = [VLLM, STOCK]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model, config), from a random checkpoint written with save_pretrained."""
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(2000 + i)
        hf = AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # random norm weights, so a norm left out shows
            for pname, p in hf.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = load_model(path, dtype=torch.float32)
    return out


class PagedCaches:
    """NaN-filled paged caches with shuffled block ids; `step` binds them to the
    model's layers, builds the step's metadata and runs `forward` on it."""

    def __init__(self, config, block_size=8, num_blocks=40, seed=0):
        self.bs = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.caches = [tuple(t.fill_(float("nan")) for t in allocate_kv_cache(
            num_blocks, block_size, config.num_key_value_heads, config.head_dim))
            for _ in range(config.num_hidden_layers)]

    def step(self, model, forward, chunks):
        """chunks: [(seq, token_ids, start_pos)] -> logits [T, vocab]."""
        for layer, kv in zip(model.attention_layers(), self.caches):
            layer.kv_cache = kv  # read by the op at run time: never part of a compiled graph
        ids, pos, slots, q_lens, s_lens = [], [], [], [], []
        for seq, toks, start in chunks:
            table = self.tables.setdefault(seq, [])
            while len(table) * self.bs < start + len(toks):
                table.append(self.free.pop())
            ids += toks
            pos += range(start, start + len(toks))
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + len(toks))]
            q_lens.append(len(toks))
            s_lens.append(start + len(toks))
        width = max(len(self.tables[s]) for s, _, _ in chunks)
        rows = [self.tables[s] + [-1] * (width - len(self.tables[s])) for s, _, _ in chunks]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(rows, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(s_lens, dtype=torch.int32),
            max_query_len=max(q_lens), max_seq_len=max(s_lens), query_lens_cpu=q_lens, seq_lens_cpu=s_lens)
        with torch.inference_mode(), set_forward_context(md):
            return model.compute_logits(forward(torch.tensor(ids), torch.tensor(pos)))


def run_scenario(model, config, forward):
    """Token counts 64, 7, 3, 1, 1 in one cache; greedy decodes. -> (logits per step, tokens, caches)."""
    g = torch.Generator().manual_seed(7)
    a, b, c = (torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (40, 24, 6))
    paged, logits, seqs = PagedCaches(config), [], {"a": a, "b": b, "c": c}

    def decode(chunks):
        out = paged.step(model, forward, chunks)
        logits.append(out)
        row = 0
        for seq, toks, start in chunks:
            row += len(toks)
            if start + len(toks) == len(seqs[seq]):  # the chunk ends the sequence: sample
                seqs[seq].append(int(out[row - 1].argmax()))
    decode([("a", a[:40], 0), ("b", b[:24], 0)])                      # 64 tokens
    decode([("c", c[:6], 0), ("a", seqs["a"][40:41], 40)])             # 7: a prefill and a decode
    decode([(s, seqs[s][-1:], len(seqs[s]) - 1) for s in ("a", "b", "c")])  # 3 decodes
    for _ in range(2):                                                  # 1 token, twice
        decode([("b", seqs["b"][-1:], len(seqs["b"]) - 1)])
    return logits, seqs, paged.caches


class PieceRecorder:
    """A piece_wrapper that records what it was given and counts the calls."""

    def __init__(self):
        self.given, self.calls = [], {}

    def __call__(self, runnable, index, num_pieces):
        self.given.append((index, num_pieces, runnable))

        def run(*args):
            self.calls[index] = self.calls.get(index, 0) + 1
            return runnable(*args)
        return run


@pytest.fixture(scope="module")
def runs(models):
    """(arch, mode) -> (compiled forward, its scenario, the eager scenario, the recorder)."""
    out, eager = {}, {}
    for arch, (model, config) in models.items():
        eager[arch] = run_scenario(model, config, model)
        for mode in MODES:
            rec = PieceRecorder() if mode == VLLM else None
            cf = compile_forward(model, CompilationConfig(mode=mode), piece_wrapper=rec)
            out[arch, mode] = (cf, run_scenario(model, config, cf), eager[arch], rec)
    return out


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_compiled_logits_and_greedy_tokens_match_eager(runs, arch, mode):
    _, (logits, tokens, _), (ref_logits, ref_tokens, _), _ = runs[arch, mode]
    for i, (got, ref) in enumerate(zip(logits, ref_logits)):
        err = (got - ref).abs().max().item()
        assert err <= ATOL, (f"{arch}/{mode.name}: step {i} ({got.shape[0]} tokens) logits differ from eager by "
                             f"{err:.2e}: a compiled piece computes something else, or the pieces were "
                             "glued in the wrong order")
    assert tokens == ref_tokens, f"{arch}/{mode.name}: greedy tokens differ from eager"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_one_compilation_serves_every_token_count(runs, arch, mode):
    cf = runs[arch, mode][0]
    assert cf.stats.dynamic_token_dim, (f"{arch}/{mode.name}: the traced graph has a fixed token count: the "
                                        "token dimension was not marked dynamic")
    assert cf.stats.num_compilations == 1, (
        f"{arch}/{mode.name}: {cf.stats.num_compilations} compilations for token counts 64, 7, 3 and 1: "
        "a recompile (token dim not dynamic, 1 specialised, or a guard on the batch layout)")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_kv_cache_after_compiled_forward_equals_eager(runs, arch, mode):
    _, (_, _, caches), (_, _, ref_caches), _ = runs[arch, mode]
    for layer, (kv, ref) in enumerate(zip(caches, ref_caches)):
        for name, got, want in (("key", kv[0], ref[0]), ("value", kv[1], ref[1])):
            assert torch.equal(got.isnan(), want.isnan()), (
                f"{arch}/{mode.name}: layer {layer}'s {name} cache has other slots written than eager's: "
                "the attention op (with its KV write) was dropped, duplicated or given stale metadata")
            torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=ATOL, rtol=0, msg=lambda m: (
                f"{arch}/{mode.name}: layer {layer}'s {name} cache differs from eager's: the op wrote "
                f"K/V computed from the wrong inputs (reordered or stale metadata). {m}"))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_split_has_one_attention_piece_per_layer(runs, models, arch):
    cf = runs[arch, VLLM][0]
    model, config = models[arch]
    n = config.num_hidden_layers
    pieces = cf.stats.pieces
    attn = [p for p in pieces if p.is_splitting_op]
    assert len(attn) == n and len(pieces) == 2 * n + 1, (
        f"{arch}: {len(pieces)} pieces of which {len(attn)} attention, want {2 * n + 1} and {n}: "
        "the graph was not split at every attention call (or split elsewhere)")
    assert [p.is_splitting_op for p in pieces] == [i % 2 == 1 for i in range(2 * n + 1)], \
        f"{arch}: pieces must alternate compiled / attention, starting and ending compiled:\n{cf.split_summary()}"
    assert [p.layer_name for p in attn] == [a.layer_name for a in model.attention_layers()], \
        f"{arch}: the attention pieces do not call the layers in model order:\n{cf.split_summary()}"
    assert all(p.num_nodes == 1 for p in attn), f"{arch}: an attention piece holds more than the op"
    assert f"{n} attention" in cf.split_summary(), (
        f"{arch}: split_summary must report the {n} attention pieces:\n{cf.split_summary()}")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_piece_wrapper_receives_every_compiled_piece(runs, models, arch):
    cf, _, _, rec = runs[arch, VLLM]
    n = models[arch][1].num_hidden_layers
    assert [(i, k) for i, k, _ in rec.given] == [(i, n + 1) for i in range(n + 1)], (
        f"{arch}: piece_wrapper got {[(i, k) for i, k, _ in rec.given]}, want (index, {n + 1}) for each of the "
        f"{n + 1} compiled pieces in order")
    assert not any(isinstance(r, torch.fx.GraphModule) for _, _, r in rec.given), \
        f"{arch}: piece_wrapper was handed the FX piece, not the inductor-compiled one"
    assert rec.calls == {i: 5 for i in range(n + 1)}, (
        f"{arch}: wrapped pieces were called {rec.calls} times over 5 steps: the wrapper was bypassed")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_compiled_pieces_keep_the_packed_linears(models, arch):
    """On the CPU every linear layer of the traced graph is `mini_vllm::packed_linear`
    (the weight packed once for oneDNN, as in eager mode), never a plain matmul that
    inductor would run on the unpacked weight: four per layer (qkv, o, gate_up, down).
    The FX backend traces the same graph as inductor's, without compiling it."""
    model, config = models[arch]
    n = config.num_hidden_layers
    cf = compile_forward(model, CompilationConfig(mode=VLLM, backend="eager"))
    logits, tokens, _ = run_scenario(model, config, cf)
    assert tokens == run_scenario(model, config, model)[1], f"{arch}: the traced graph's tokens differ from eager"
    calls = [node.target for p in cf.stats.pieces for node in p.graph.graph.nodes if node.op == "call_function"]
    packed = sum(_op_name(t) == "mini_vllm::packed_linear" for t in calls)
    plain = [str(t) for t in calls if t in (torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm,
                                           torch.addmm)]
    assert packed == 4 * n and not plain, (
        f"{arch}: the compiled graph has {packed} packed linears (want {4 * n}) and plain matmuls {plain}: "
        "the packed oneDNN matmul was traced through to torch's linear")


def test_eager_backend_split_matches_eager(models):
    """backend="eager": the same split, the pieces run as FX code (no inductor)."""
    model, config = models["qwen3"]
    cf = compile_forward(model, CompilationConfig(mode=VLLM, backend="eager"))
    logits, tokens, _ = run_scenario(model, config, cf)
    ref_logits, ref_tokens, _ = run_scenario(model, config, model)
    assert tokens == ref_tokens and all((a - b).abs().max() <= ATOL for a, b in zip(logits, ref_logits)), \
        "the split graph run as FX code differs from eager"
    assert len(cf.stats.pieces) == 2 * config.num_hidden_layers + 1, (
        f"backend='eager' split the graph differently: {len(cf.stats.pieces)} pieces, want "
        f"{2 * config.num_hidden_layers + 1}")


def test_mode_none_is_refused(models):
    with pytest.raises(ValueError, match="STOCK_TORCH_COMPILE or VLLM_COMPILE"):
        compile_forward(models["llama"][0], CompilationConfig(mode=CompilationMode.NONE))


def test_attention_op_schema_declares_what_it_writes(models):
    """torch.library.opcheck runs the op eagerly and under fake tensors and checks
    that it writes exactly the arguments its schema marks mutable (`output`): an
    undeclared write would let the compiler move reads of `output` before the op."""
    model, config = models["llama"]
    layer = model.attention_layers()[0]
    paged = PagedCaches(config)
    layer.kv_cache = paged.caches[0]
    t, kv = 5, layer.num_kv_heads * layer.head_size
    q = torch.randn(t, layer.num_heads * layer.head_size)
    k, v = torch.randn(t, kv), torch.randn(t, kv)
    md = AttentionMetadata(
        slot_mapping=torch.arange(t), block_tables=torch.tensor([[0]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
        max_query_len=t, max_seq_len=t, query_lens_cpu=[t], seq_lens_cpu=[t])
    with set_forward_context(md):
        torch.library.opcheck(torch.ops.mini_vllm.unified_attention_with_output.default,
                              (q, k, v, torch.empty_like(q), layer.layer_name))
