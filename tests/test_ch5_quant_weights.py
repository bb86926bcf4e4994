"""8-bit weights (`mini_vllm.models.quantization`, `kernels/cpu_int8_linear.py`): the
quantize / dequantize pairs against their error bounds, the int8 kernel and the FP8 matmul
against plain-PyTorch oracles, every linear kind of a real model against the same
quantization computed by hand from the full-precision weights, checkpoints written and
loaded, and every refused configuration. The engine and accuracy tests are in
`test_ch5_quant_accuracy.py`.
"""
from __future__ import annotations

import pytest
import torch

from mini_vllm.config import EngineConfig
from mini_vllm.course.tiny_models import model_path
from mini_vllm.kernels.cpu_int8_linear import int8_linear, int8_linear_reference
from mini_vllm.models.loader import load_model
from mini_vllm.models.quantization import QUANTIZATION_METHODS, get_quantization_config
from mini_vllm.models.quantization import quant_utils as qu
from mini_vllm.models.quantization.checkpoint import quantization_config_for, write_quantized_checkpoint
from mini_vllm.models.quantization.fp8 import fp8_linear_reference, fp8_scaled_mm

TARGET = model_path("tiny-py-target")


def _weights(n=48, k=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)  # rows of very different size
    w[5] = 0.0  # an all-zero row: its scale must not divide by zero
    return w


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_fp8_round_trip_within_e4m3_error_bound(per_channel):
    w = _weights()
    s = qu.fp8_weight_scale(w, per_channel)
    q = qu.quantize_fp8(w, s)
    assert q.dtype == torch.float8_e4m3fn
    back = qu.dequantize_fp8(q, s)
    rows = s.reshape(-1, 1) if per_channel else s.reshape(1, 1)
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; below 2^-6 the subnormal spacing
    # 2^-9 (in units of the scale) gives an absolute 2^-10 * s.
    bound = 2.0 ** -4 * w.abs() + 2.0 ** -10 * rows + 1e-12
    assert bool(((back - w).abs() <= bound).all()), "fp8 round trip error above e4m3's half ulp: a scale is wrong"
    amax = w.abs().amax(dim=-1) if per_channel else w.abs().amax().reshape(1)
    torch.testing.assert_close(s, (amax / 448.0).clamp_min(qu.MIN_SCALE),
                               msg="the scale must map max|w| to 448 (e4m3's largest value)")
    assert bool(torch.isfinite(back).all()), "an all-zero row produced NaN: the scale divided by zero"


def test_int8_round_trip_within_half_a_step():
    w = _weights()
    s = qu.int8_weight_scale(w)
    q = qu.quantize_int8(w, s)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = qu.dequantize_int8(q, s)
    assert bool(((back - w).abs() <= s.reshape(-1, 1) / 2 * (1 + 1e-6) + 1e-12).all()), (
        "int8 round trip error above half a quantization step: rounding or the scale is wrong")
    nonzero = w.abs().amax(dim=-1) > 0
    assert bool((q.abs().amax(dim=-1)[nonzero] == 127).all()), "each row's max must quantize to +-127"


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "per-tensor"])
def test_dynamic_activation_scales(per_token):
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0]).unsqueeze(1)
    x_q, s = qu.quantize_activation_fp8(x, per_token)
    assert s.shape == ((5, 1) if per_token else (1, 1))
    want = (x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1)) / 448.0
    torch.testing.assert_close(s, want.clamp_min(qu.MIN_SCALE), msg="activation scale is not max|x| / 448")
    back = x_q.float() * s
    assert bool(((back - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s).all()), "activation round trip too far"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int8_kernel_matches_reference_and_is_batch_invariant(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 38, 96  # N not a multiple of the kernel's 4-row blocks
    w = torch.randn(n, k, generator=g)
    s = qu.int8_weight_scale(w)
    q = qu.quantize_int8(w, s)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    got = int8_linear(x, q, s, bias)
    want = int8_linear_reference(x, q, s, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol, msg="int8 kernel differs from (x @ q.T) * scale + bias")
    alone = torch.cat([int8_linear(x[i:i + 1], q, s, bias) for i in range(rows)])
    assert torch.equal(alone, got), "a row's int8 result depends on the rows it shares a call with"


def test_int8_kernel_refuses_bad_arguments():
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="x must be 2-D with K=16"):
        int8_linear(torch.zeros(2, 15), q, torch.ones(8))
    with pytest.raises(ValueError, match="scale must be fp32 of shape"):
        int8_linear(torch.zeros(2, 16), q, torch.ones(7))
    with pytest.raises(ValueError, match="q must be a 2-D int8"):
        int8_linear(torch.zeros(2, 16), q.float(), torch.ones(8))


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "per-tensor"])
def test_fp8_scaled_mm_matches_dequantized_reference(per_token):
    """torch._scaled_mm (CPU here, tensor cores on sm89+) against fp32 on the dequantized operands."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 96, generator=g), torch.randn(7, 96, generator=g)
    s_w = qu.fp8_weight_scale(w, per_channel=True)
    q = qu.quantize_fp8(w, s_w)
    x_q, s_x = qu.quantize_activation_fp8(x, per_token)
    bias = torch.randn(64, generator=g)
    want = (x_q.float() * s_x) @ (q.float() * s_w.reshape(-1, 1)).t() + bias
    torch.testing.assert_close(fp8_linear_reference(x_q, s_x, q, s_w, bias, torch.float32), want,
                               rtol=1e-5, atol=1e-5, msg="reference W8A8 matmul misapplies a scale")
    torch.testing.assert_close(fp8_scaled_mm(x_q, s_x, q, s_w, bias, torch.float32), want,
                               rtol=1e-5, atol=1e-5, msg="_scaled_mm path misapplies a scale")


# --- each linear kind of a real model against the quantization done by hand -----------------

def _layers(model):
    layer = model.model.layers[1]
    return {"qkv": layer.self_attn.qkv_proj, "o_proj (row-parallel)": layer.self_attn.o_proj,
            "gate_up (merged)": layer.mlp.gate_up_proj, "down (row-parallel)": layer.mlp.down_proj}


@pytest.fixture(scope="module")
def full_precision():
    return {dt: load_model(TARGET, dtype=dt, attention_backend="torch")[0] for dt in (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("quantization,dtype", [
    ("fp8_per_tensor", torch.bfloat16), ("fp8_per_channel", torch.bfloat16),
    ("int8_per_channel_weight_only", torch.bfloat16), ("int8_per_channel_weight_only", torch.float32)])
def test_every_linear_kind_equals_hand_quantization(full_precision, quantization, dtype):
    model, _ = load_model(TARGET, dtype=dtype, attention_backend="torch", quantization=quantization)
    ref_model = full_precision[dtype]
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(2)).to(dtype)
    for kind, layer in _layers(model).items():
        w = _layers(ref_model)[kind].weight.detach()
        xin = x[:, :w.shape[1]]
        if quantization.startswith("int8"):
            s = qu.int8_weight_scale(w)
            want = int8_linear_reference(xin, qu.quantize_int8(w, s), s)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        else:
            s = qu.fp8_weight_scale(w, per_channel=quantization == "fp8_per_channel").expand(w.shape[0])
            # vLLM's CPU choice: per-token activations with per-channel weights, per-tensor otherwise
            x_q, s_x = qu.quantize_activation_fp8(xin, per_token=quantization == "fp8_per_channel")
            want = fp8_linear_reference(x_q, s_x, qu.quantize_fp8(w, s), s, None, dtype)
            tol = dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(layer.weight_scale, s.float(), msg=f"{kind}: weight scales differ")
        torch.testing.assert_close(layer(xin), want, **tol, msg=f"{kind}: output differs from hand quantization")
    assert model.lm_head.weight.dtype == dtype and torch.equal(model.lm_head.weight, ref_model.lm_head.weight), (
        "lm_head must stay unquantized (vLLM quantizes no LM head)")


def test_online_quantization_is_refused_a_second_time():
    model, _ = load_model(TARGET, dtype=torch.bfloat16, attention_backend="torch", quantization="fp8_per_channel")
    layer = model.model.layers[0].mlp.down_proj
    with pytest.raises(RuntimeError, match="called twice"):
        layer.quant_method.process_weights_after_loading(layer)


# --- checkpoints ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {s: write_quantized_checkpoint(TARGET, root / s, s)
            for s in ("fp8", "fp8_per_channel", "fp8_per_channel_weight_only", "int8_per_channel_weight_only")}


def _mlp_out(model, dtype):
    ids = torch.tensor([5, 17, 200, 33, 90, 12, 7, 8])
    return model.model.layers[0].mlp(model.model.embed_tokens(ids).to(dtype))


@pytest.mark.parametrize("scheme,online", [("fp8_per_channel", "fp8_per_channel"),
                                           ("int8_per_channel_weight_only", "int8_per_channel_weight_only")])
def test_checkpoint_loads_to_the_online_result(checkpoints, scheme, online):
    """Per-channel scales do not depend on merging, so a written checkpoint loads to the bits the
    online scheme makes."""
    dtype = torch.bfloat16
    loaded, _ = load_model(checkpoints[scheme], dtype=dtype, attention_backend="torch")
    direct, _ = load_model(TARGET, dtype=dtype, attention_backend="torch", quantization=online)
    for (name, a), (_, b) in zip(loaded.named_parameters(), direct.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: checkpoint-loaded tensor differs from online"
    assert torch.equal(_mlp_out(loaded, dtype), _mlp_out(direct, dtype))


def test_fp8_checkpoint_keeps_each_parts_scale(checkpoints):
    """vLLM's fp8 format: q, k and v each have a per-tensor scale; the merged layer keeps each
    on its own rows (requantizing to one scale would round the weights again)."""
    from safetensors import safe_open
    model, _ = load_model(checkpoints["fp8"], dtype=torch.bfloat16, attention_backend="torch")
    qkv = model.model.layers[2].self_attn.qkv_proj
    with safe_open(str(checkpoints["fp8"] / "model.safetensors"), "pt") as f:
        for part in ("q", "k", "v"):
            start, size = qkv.shard_rows(part)
            scale = f.get_tensor(f"model.layers.2.self_attn.{part}_proj.weight_scale")
            assert bool((qkv.weight_scale[start:start + size] == scale).all()), f"{part}_proj's scale not on its rows"
            w = f.get_tensor(f"model.layers.2.self_attn.{part}_proj.weight")
            assert torch.equal(qkv.weight[start:start + size].view(torch.uint8), w.view(torch.uint8))


def test_weight_only_fp8_checkpoint_multiplies_in_model_dtype(checkpoints):
    model, _ = load_model(checkpoints["fp8_per_channel_weight_only"], dtype=torch.bfloat16, attention_backend="torch")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.quant_method.activation is None, "no input_activations in the config: weight-only"
    x = torch.randn(3, 768).bfloat16()
    want = torch.nn.functional.linear(x, qu.dequantize_fp8(layer.weight, layer.weight_scale).bfloat16())
    assert torch.equal(layer(x), want), "weight-only fp8 must quantize no activation"


# --- refused configurations -----------------------------------------------------------------

def test_unknown_quantization_is_refused_naming_allowed_values():
    with pytest.raises(ValueError, match=r"quantization must be None or one of .*'fp8_per_channel'.*got 'int4'"):
        EngineConfig(model=str(TARGET), quantization="int4")
    assert "int8_per_channel_weight_only" in QUANTIZATION_METHODS


def test_fp32_model_refused_for_fp8_as_in_vllm():
    with pytest.raises(ValueError, match=r"dtype torch.float32 is not supported for quantization 'fp8_per_channel'"):
        load_model(TARGET, dtype=torch.float32, quantization="fp8_per_channel")


def test_argument_must_match_the_checkpoint(checkpoints):
    with pytest.raises(ValueError, match=r"quantization='int8_per_channel_weight_only' does not match .*"
                                         r"quant_method 'compressed-tensors'"):
        load_model(checkpoints["fp8_per_channel"], dtype=torch.bfloat16, quantization="int8_per_channel_weight_only")
    with pytest.raises(ValueError, match="needs a checkpoint whose config.json has a quantization_config"):
        load_model(TARGET, dtype=torch.bfloat16, quantization="compressed-tensors")
    model, _ = load_model(checkpoints["fp8"], dtype=torch.bfloat16, quantization="fp8")  # the same method: fine
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


def _ct(**changes) -> dict:
    """The compressed-tensors config the writer makes for FP8 W8A8, with `where__key` changed."""
    cfg = quantization_config_for("fp8_per_channel")
    group = cfg["config_groups"]["group_0"]
    for path, value in changes.items():
        where, key = path.split("__")
        {"top": cfg, "group": group}.get(where, group.get(where))[key] = value
    return cfg


@pytest.mark.parametrize("changes,field", [
    (dict(weights__num_bits=4), "weights.num_bits"),
    (dict(weights__strategy="group"), "weights.strategy"),
    (dict(input_activations__dynamic=False), "input_activations.dynamic"),
    (dict(group__targets=["Attention"]), "targets"),
    (dict(top__ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore"),
    (dict(top__format="pack-quantized"), "format"),
])
def test_bad_compressed_tensors_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.(config_groups\.group_0\.)?{field}"):
        get_quantization_config(None, _ct(**changes), "cpu")


@pytest.mark.parametrize("cfg,field", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "gptq"}, "quant_method"),
])
def test_bad_fp8_config_names_the_field(cfg, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}"):
        get_quantization_config(None, cfg, "cpu")


def test_checkpoint_tensors_of_the_wrong_dtype_are_refused(tmp_path, checkpoints):
    """A config that promises fp8 over bf16 tensors (or e5m2 ones) would load garbage silently."""
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["fp8_per_channel"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.weight.*float8_e5m2.*expects torch.float8_e4m3fn"):
        load_model(bad, dtype=torch.bfloat16)
