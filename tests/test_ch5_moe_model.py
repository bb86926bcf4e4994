"""Chapter 5, mixture of experts: Qwen3-MoE against Hugging Face transformers (float32).

Random checkpoints written by transformers' `save_pretrained` (tests/moe_utils.py):
8 experts top-2 and 64 narrow experts top-8, norm_topk_prob on and off, dense
layers from decoder_sparse_step and from mlp_only_layers. The model runs on a
NaN-filled paged cache (test_ch5_models.PagedBatcher) and its logits must equal
transformers' within the dense models' tolerance; through the engine (`LLM`)
greedy tokens must equal transformers' `generate`. The fused expert layout
(transformers 5's in-memory tensors) must load to the same model.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine_utils import hf_greedy, make_llm, run_greedy
from moe_utils import MOE_CONFIGS, save_random_moe
from mini_vllm.models import load_model, set_attention_backend
from mini_vllm.models.config import ModelConfig
from mini_vllm.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from test_ch5_models import ATOL, PagedBatcher

_HF: dict = {}


class _Checkpoints(dict):
    """name -> checkpoint folder, each written on first use (a test of one config writes one)."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, name):
        self[name] = save_random_moe(name, self.factory.mktemp(name), 5800 + list(MOE_CONFIGS).index(name))
        return self[name]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return _Checkpoints(tmp_path_factory)


def hf_model(path):
    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_logits(path, ids):
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]


def _model(path):
    model, config = load_model(path, dtype=torch.float32)
    set_attention_backend(model, "torch")
    return model, config


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_ragged_prefill_matches_hf(ckpts, name):
    model, config = _model(ckpts[name])
    hf_cfg = hf_model(ckpts[name]).config
    sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
    want = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf_model(ckpts[name]).model.layers]
    assert sparse == want, f"{name}: sparse layers {sparse}, transformers has {want} (decoder_sparse_step / mlp_only_layers)"
    assert config.num_experts == hf_cfg.num_experts and config.norm_topk_prob == hf_cfg.norm_topk_prob
    prompts = _prompts([7, 19, 33], seed=1)
    logits = PagedBatcher(model, config, "cpu").step([(f"s{i}", p, 0) for i, p in enumerate(prompts)])
    row = 0
    for i, p in enumerate(prompts):
        err = (logits[row:row + len(p)] - hf_logits(ckpts[name], p)).abs().max().item()
        row += len(p)
        assert err <= ATOL, (f"{name}: prompt {i} logits differ from transformers by {err:.2e}: wrong routing "
                             "(top-k, norm_topk_prob), expert weights or dense/sparse layer choice")


def test_chunked_prefill_and_decodes_match_hf(ckpts):
    name = "e8-k2-step2"
    model, config = _model(ckpts[name])
    a, b = _prompts([24, 14], seed=2)
    batcher = PagedBatcher(model, config, "cpu", seed=3)
    steps = [[("a", a[:13], 0)], [("b", b[:9], 0), ("a", a[13:21], 13)],
             [("a", a[21:22], 21), ("b", b[9:10], 9)], [("b", b[10:14], 10), ("a", a[22:24], 22)]]
    got = {"a": [], "b": []}
    for chunks in steps:
        logits, row = batcher.step(chunks), 0
        for seq, toks, _ in chunks:
            got[seq].append(logits[row:row + len(toks)])
            row += len(toks)
    for seq, toks in (("a", a), ("b", b)):
        err = (torch.cat(got[seq]) - hf_logits(ckpts[name], toks)).abs().max().item()
        assert err <= ATOL, f"{name}: sequence {seq} over chunks and decodes differs from transformers by {err:.2e}"


def test_fused_expert_tensors_load_to_the_same_model(ckpts, tmp_path):
    """transformers 5 holds experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); save_pretrained writes them per expert. Both must give the same model."""
    name = "e8-k2-norm"
    src = ckpts[name]
    state = {k: v.contiguous() for k, v in hf_model(src).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), "transformers' experts are fused in memory"
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    fused, _ = load_model(tmp_path)
    per_expert, _ = load_model(src)
    for (n, p), (_, q) in zip(fused.named_parameters(), per_expert.named_parameters()):
        assert torch.equal(p, q), f"{n}: the fused checkpoint loads other values than the per-expert one"


def test_missing_expert_tensor_is_named(ckpts, tmp_path):
    from safetensors.torch import load_file

    src = ckpts["e8-k2-norm"]
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        load_model(tmp_path)


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_tok", 9, r"'num_experts_per_tok' must be an int \[1, 8\]"),
    ("num_experts_per_tok", 0, r"'num_experts_per_tok' must be an int \[1, 8\]"),
    ("mlp_only_layers", [2], r"'mlp_only_layers' must list distinct layer indices in \[0, num_hidden_layers=2\)"),
    ("decoder_sparse_step", 0, r"'decoder_sparse_step' must be an int >= 1"),
    ("moe_intermediate_size", None, r"'moe_intermediate_size' is missing"),
    ("num_local_experts", None, r"'num_experts' \(or 'num_local_experts'\) is missing"),
    ("norm_topk_prob", "yes", r"'norm_topk_prob' must be a bool"),
    ("use_sliding_window", True, r"use_sliding_window must be false"),
])
def test_bad_moe_config_is_a_clear_error(ckpts, field, value, match):
    raw = json.loads((ckpts["e8-k2-norm"] / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_engine_greedy_equals_hf_generate(ckpts):
    path = str(ckpts["e64-k8-narrow-norm"])
    prompts = _prompts([5, 23, 41], seed=3)
    llm = make_llm(path, block_size=8, max_num_batched_tokens=32)  # the 41-token prompt prefills in chunks
    got = run_greedy(llm, prompts, 10)
    for p, toks in zip(prompts, got):
        assert toks == hf_greedy(hf_model(ckpts["e64-k8-narrow-norm"]), p, 10), \
            "engine greedy tokens on Qwen3-MoE differ from transformers' generate"


def test_expert_parallel_needs_a_moe_model(tmp_path):
    from mini_vllm.course.tiny_models import model_path

    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
        load_model(model_path("tiny-py-draft"), enable_expert_parallel=True)
