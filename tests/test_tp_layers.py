"""Tensor-parallel layers and sharded loading, checked in one process.

Each rank's model is built under a one-rank-of-N `GroupCoordinator` (no
process group), so these tests need no workers. The oracle is the TP = 1
model loaded from the same checkpoint (itself checked against Hugging Face in
test_ch5_models.py): every rank's shard must be exactly its slice of the TP = 1
weights, and the collectives, replaced here by an explicit sum / concatenation
over the ranks, must rebuild the TP = 1 outputs.
"""
from __future__ import annotations

import pytest
import torch

import mini_vllm.models.layers as layers_mod
import mini_vllm.models.linear as linear_mod
import mini_vllm.models.loader as loader_mod
from mini_vllm import LLM
from mini_vllm.config import EngineConfig
from mini_vllm.distributed import GroupCoordinator, use_tp_group
from mini_vllm.models.config import ModelConfig
from mini_vllm.models.linear import QKVParallelLinear
from mini_vllm.distributed.parallel_state import verify_tensor_parallel_size
from mini_vllm.course.tiny_models import model_path
from tp_utils import TP_CONFIGS, load_rank, save_random_checkpoint, tp_children

CASES = [(name, tp) for name in list(TP_CONFIGS) + ["tiny-py-target"] for tp in (2, 4)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {"tiny-py-target": model_path("tiny-py-target")}
    for i, name in enumerate(TP_CONFIGS):
        out[name] = save_random_checkpoint(name, tmp_path_factory.mktemp(name), 4000 + i)
    return out


def _expected_qkv(full, rank: int, tp: int):
    """Rank's rows of the TP = 1 merged [q|k|v] (weight or bias): its q heads, its kv heads."""
    h, k, d = full.total_num_heads, full.total_num_kv_heads, full.head_size
    hq = h // tp
    out = {}
    for pname in ("weight", "bias"):
        t = getattr(full, pname)
        if t is None:
            continue
        q, kk, vv = t.split([h * d, k * d, k * d])
        kv_heads = max(1, k // tp)
        kv0 = (rank // max(1, tp // k)) * kv_heads  # replicated kv head when tp > k
        out[pname] = torch.cat([q[rank * hq * d:(rank + 1) * hq * d],
                                kk[kv0 * d:(kv0 + kv_heads) * d], vv[kv0 * d:(kv0 + kv_heads) * d]])
    return out


@pytest.mark.parametrize("name,tp", CASES)
def test_every_rank_holds_exactly_its_slice(ckpts, name, tp):
    full = load_rank(ckpts[name], 0, 1)
    vocab = full.config.vocab_size
    for rank in range(tp):
        m = load_rank(ckpts[name], rank, tp)
        for lf, lr in zip(full.model.layers, m.model.layers):
            a_f, a_r = lf.self_attn, lr.self_attn
            for pname, exp in _expected_qkv(a_f.qkv_proj, rank, tp).items():
                assert torch.equal(getattr(a_r.qkv_proj, pname), exp), (
                    f"rank {rank}/{tp} qkv_proj.{pname} is not its heads' rows: the QKV loader "
                    "splits by rows instead of heads, or replicates the wrong kv head")
            o = a_f.o_proj.weight.shape[1] // tp
            assert torch.equal(a_r.o_proj.weight, a_f.o_proj.weight[:, rank * o:(rank + 1) * o]), \
                f"rank {rank}: o_proj must hold input columns of its own heads (row-parallel)"
            i = lf.mlp.down_proj.weight.shape[1] // tp
            g, u = lf.mlp.gate_up_proj.weight.chunk(2)
            assert torch.equal(lr.mlp.gate_up_proj.weight,
                               torch.cat([g[rank * i:(rank + 1) * i], u[rank * i:(rank + 1) * i]])), \
                f"rank {rank}: gate_up must be [gate_r | up_r], each part split on its own"
            assert torch.equal(lr.mlp.down_proj.weight,
                               lf.mlp.down_proj.weight[:, rank * i:(rank + 1) * i]), \
                f"rank {rank}: down_proj must hold its intermediate columns"
            assert torch.equal(lr.input_layernorm.weight, lf.input_layernorm.weight), \
                "norms are replicated, not split"
            assert a_r.attn.num_heads == a_f.attn.num_heads // tp and \
                a_r.attn.num_kv_heads == max(1, a_f.attn.num_kv_heads // tp), \
                "the attention layer must see this rank's head counts"
        per = -(-vocab // tp)
        for emb_f, emb_r in ((full.model.embed_tokens, m.model.embed_tokens), (full.lm_head, m.lm_head)):
            n = min(per, vocab - rank * per)
            assert emb_r.weight.shape[0] == per, "vocab shards are ceil(V/tp) rows on every rank"
            assert torch.equal(emb_r.weight[:n], emb_f.weight[rank * per:rank * per + n]), \
                f"rank {rank}: vocab rows [{rank * per}, {rank * per + n}) expected"
            assert not emb_r.weight[n:].any(), "padding rows past the vocabulary must be zero"


def _collect(monkeypatch):
    """Replace the collectives with recorders; the test performs the sum / concat itself."""
    seen = []

    def record(x, group, *a, **k):
        seen.append(x.clone())
        return x

    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", record)
    monkeypatch.setattr(layers_mod, "tensor_model_parallel_all_reduce", record)
    monkeypatch.setattr(layers_mod, "tensor_model_parallel_all_gather", record)
    return seen


@pytest.mark.parametrize("name,tp", [("qwen3-mha-bias-untied", 2), ("qwen2-kv1-tied", 4)])
def test_collectives_rebuild_the_single_rank_outputs(ckpts, monkeypatch, name, tp):
    seen = _collect(monkeypatch)
    full = load_rank(ckpts[name], 0, 1)
    ranks = [load_rank(ckpts[name], r, tp) for r in range(tp)]
    torch.manual_seed(0)
    ids = torch.randint(0, full.config.vocab_size, (9,))
    emb = full.model.embed_tokens(ids)
    seen.clear()
    for m in ranks:
        m.model.embed_tokens(ids)
    assert torch.equal(sum(seen), emb), "vocab-parallel embedding: masked rows must sum to the full lookup"
    x = torch.randn(9, full.config.hidden_size)
    seen.clear()
    heads = [m.lm_head(x) for m in ranks]
    assert torch.allclose(torch.cat(seen, -1)[:, :full.config.vocab_size], full.lm_head(x), atol=1e-6), \
        "LM head: gathered logit columns (padding dropped) must equal the full projection"
    assert all(h.shape[-1] == -(-full.config.vocab_size // tp) for h in heads)
    for get in (lambda m: m.model.layers[0].mlp.down_proj, lambda m: m.model.layers[0].self_attn.o_proj):
        layer = get(full)
        xin = torch.randn(9, layer.weight.shape[1])
        k = xin.shape[1] // tp
        seen.clear()
        outs = [get(m)(xin[:, r * k:(r + 1) * k]) for r, m in enumerate(ranks)]
        bias = 0 if layer.bias is None else layer.bias
        assert torch.allclose(sum(seen) + bias, layer(xin), atol=1e-5), \
            "row-parallel: partial products must sum to the full matmul (bias added once)"
        assert all(torch.equal(o, p + bias) for o, p in zip(outs, seen)), \
            "row-parallel: the bias is added after the all-reduce, not before it"


def test_loader_reads_only_each_ranks_bytes(ckpts, monkeypatch):
    """A rank must never materialise a full tensor: it reads its shard's elements only."""
    real_open = loader_mod.safe_open
    read = []

    class Slice:
        def __init__(self, s):
            self.s = s

        def get_shape(self):
            return self.s.get_shape()

        def __getitem__(self, idx):
            t = self.s[idx]
            read.append(t.numel())
            return t

    class File:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return Slice(self.f.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError(f"loader read the whole tensor {name!r}")

    monkeypatch.setattr(loader_mod, "safe_open", File)
    path, tp = ckpts["tiny-py-target"], 2
    full_elems = sum(p.numel() for p in load_rank(path, 0, 1).parameters())
    for rank in range(tp):
        read.clear()
        m = load_rank(path, rank, tp)
        held = sum(p.numel() for p in m.parameters())
        assert sum(read) == held, f"rank {rank} read {sum(read)} elements for {held} parameters"
        assert held < 0.6 * full_elems, (
            f"rank {rank} holds {held} of {full_elems} parameters: a TP = 2 rank should hold about half")


def test_invalid_tensor_parallel_size_is_a_clear_value_error(ckpts):
    mc = ModelConfig.from_json(model_path("tiny-py-target") / "config.json")  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_attention_heads"):
        verify_tensor_parallel_size(mc, 3)
    with pytest.raises(ValueError, match="<= num_attention_heads"):
        verify_tensor_parallel_size(mc, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="x", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(model_path("tiny-py-target")), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(str(model_path("tiny-py-target")), device="cpu", tensor_parallel_size=2,
            kv_transfer_config={"kv_connector": "x"})
    assert not tp_children(), "a rejected tensor_parallel_size must not start any worker"
    with use_tp_group(GroupCoordinator(rank=0, world_size=2)), \
            pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(64, 16, total_num_heads=6, total_num_kv_heads=3)  # 3 kv heads over 2 ranks
    with use_tp_group(GroupCoordinator(rank=0, world_size=4)), \
            pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        QKVParallelLinear(64, 16, total_num_heads=12, total_num_kv_heads=3)  # 4 ranks, 3 kv heads


def test_cli_flag_reaches_the_engine_arguments():
    from mini_vllm.entrypoints.cli import _engine_kwargs, build_parser

    for argv in (["generate", "--model", "m", "--prompt", "p", "--tensor-parallel-size", "2"],
                 ["serve", "m", "-tp", "2"]):
        args = build_parser().parse_args(argv)
        assert _engine_kwargs(args)["tensor_parallel_size"] == 2, f"{argv[0]}: flag not passed on"
    assert _engine_kwargs(build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"])
                          )["tensor_parallel_size"] == 1
