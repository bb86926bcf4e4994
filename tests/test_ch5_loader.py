"""Chapter 5 loader: config parsing, checkpoint layouts, dtypes and bad inputs.

Checkpoints are tiny random models saved by transformers' `save_pretrained`
(the format the loader must read), then broken on purpose with `safetensors`.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models import ModelConfig, cpu_ops, load_model
from mini_vllm.paged_attention import allocate_kv_cache
from mini_vllm.course.tiny_models import load_tiny_model, model_path


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """An untied Llama checkpoint folder (config.json + model.safetensors)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      initializer_range=0.1)
    path = tmp_path_factory.mktemp("untied")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _variant(src, dst, edit):
    """Copy checkpoint `src` to `dst` with its tensors changed by `edit(dict)`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_folder_config_or_weights(tmp_path, untied):
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    shutil.copy(untied / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight file in .*" + tmp_path.name):
        load_model(tmp_path)


def test_unknown_model_type_names_it_the_file_and_the_supported_list(tmp_path, untied):
    raw = json.loads((untied / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json: model_type 'gpt2' is not supported.*'llama', 'qwen2', 'qwen3'"):
        load_model(tmp_path)


def test_wrong_shape_tensor_names_file_tensor_and_both_shapes(tmp_path, untied):
    name = "model.layers.1.self_attn.k_proj.weight"  # [2 heads * 8, 32]

    def edit(t):
        t[name] = torch.zeros(24, 32)
    path = _variant(untied, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}'.*\(24, 32\).*\(16, 32\)"):
        load_model(path)


def test_missing_and_unknown_tensors(tmp_path, untied):
    missing = _variant(untied, tmp_path / "missing", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'.*gate_up_proj"):
        load_model(missing)
    no_head = _variant(untied, tmp_path / "no_head", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_model(no_head)  # untied: the head is a separate tensor and must be present
    extra = _variant(untied, tmp_path / "extra",
                     lambda t: t.__setitem__("model.layers.0.self_attn.rel_bias", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"model\.safetensors: unknown tensor 'model\.layers\.0\.self_attn\.rel_bias'"):
        load_model(extra)


def test_sharded_checkpoint_with_index_loads_every_shard(tmp_path, untied):
    tensors = load_file(untied / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in shards.items() for n in part}}))
    shutil.copy(untied / "config.json", tmp_path / "config.json")
    model, _ = load_model(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    ours = dict(model.named_parameters())
    assert torch.equal(ours["model.layers.1.self_attn.qkv_proj.weight"][32:48],
                       hf.model.layers[1].self_attn.k_proj.weight), "k rows of the merged QKV must hold k_proj"
    assert torch.equal(ours["model.layers.0.mlp.gate_up_proj.weight"][48:], hf.model.layers[0].mlp.up_proj.weight), \
        "second half of gate_up must hold up_proj"
    assert torch.equal(ours["lm_head.weight"], hf.lm_head.weight), "untied head must come from lm_head.weight"
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path)


def _logits(model, config, ids, dtype):
    n, bs = len(ids), 8
    table = [5, 2, 7, 0, 1][: -(-n // bs)]
    for layer in model.attention_layers():
        layer.kv_cache = allocate_kv_cache(8, bs, config.num_key_value_heads, config.head_dim, dtype=dtype)
    md = AttentionMetadata(
        slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]),
        block_tables=torch.tensor([table], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n, max_seq_len=n,
        query_lens_cpu=[n], seq_lens_cpu=[n])
    with torch.no_grad(), set_forward_context(md):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_matches_hf_in_the_same_dtype(dtype, monkeypatch):
    # The loader's cast points are under test, so attention runs on the "torch" backend,
    # which rounds where HF's SDPA does. The "cpu" kernel (the CPU default) keeps scores
    # and softmax in fp32, as vLLM's CPU kernel does; it is checked against the dense
    # oracle in tests/test_kernels_cpu_attention.py instead. Likewise the layers run
    # their torch code: the fused bf16 ops round at the same points, but RMSNorm sums
    # its squares in another order, which can move a logit by one bf16 step; they are
    # held to the same rounding points op by op in tests/test_kernels_cpu_layer_ops.py,
    # and to bf16's own noise below.
    fused_model, _ = load_model(model_path("tiny-py-target"), dtype=dtype, attention_backend="torch")
    monkeypatch.setattr(cpu_ops, "CPU_OPS", "torch")
    model, config = load_model(model_path("tiny-py-target"), dtype=dtype, attention_backend="torch")
    assert {p.dtype for p in model.parameters()} == {dtype}, "every parameter must be in the requested dtype"
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.dtype == torch.float32, "the RoPE table must stay float32 (angles lose digits in 16 bits)"
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = _logits(model, config, ids, dtype)
    with torch.no_grad():
        ref = load_tiny_model("tiny-py-target", dtype=dtype)(torch.tensor([ids])).logits[0].float()
        ref32 = load_tiny_model("tiny-py-target")(torch.tensor([ids])).logits[0].float()
    err, err32 = (ours - ref).abs().max().item(), (ref - ref32).abs().max().item()
    # HF in the same dtype rounds at the same points (RMSNorm cast before the
    # weight, RoPE table cast to the query dtype), so the two agree to far
    # below the 16-bit rounding noise err32 that separates them from float32.
    assert err <= 0.05 * err32, (f"{dtype}: {err:.3e} from HF in the same dtype (16-bit noise vs float32 is "
                                 f"{err32:.3e}): a cast happens at a different point than in HF")
    monkeypatch.setattr(cpu_ops, "CPU_OPS", "compiled")
    fused_err = (_logits(fused_model, config, ids, dtype) - ref).abs().max().item()
    assert fused_err <= err32, (f"{dtype} with the fused CPU ops: {fused_err:.3e} from HF in the same dtype, more "
                                f"than 16-bit noise itself ({err32:.3e}): a fused op rounds at other points")


def test_config_styles_and_defaults(tmp_path):
    base = dict(model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=64, eos_token_id=[2, 7])
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    assert (new.rope_theta, new.rope_scaling) == (old.rope_theta, old.rope_scaling) \
        == (5e5, {"rope_type": "llama3", **scaling}), (
        "rope_parameters (new style) and rope_theta + rope_scaling (old style) must give the same llama3 RoPE, got "
        f"{(new.rope_theta, new.rope_scaling)} and {(old.rope_theta, old.rope_scaling)}")
    assert new.head_dim == 8 and new.num_key_value_heads == 4, "head_dim defaults to hidden/heads, KV heads to heads"
    assert new.eos_token_ids == (2, 7) and new.dtype == torch.float32, (
        f"a list eos_token_id must become the tuple of EOS ids and dtype default to float32, got {new.eos_token_ids} "
        f"{new.dtype}")
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="'vocab_size' is missing"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(model_path("tiny-py-draft"), dtype=torch.float64)
