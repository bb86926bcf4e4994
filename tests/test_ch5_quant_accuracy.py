"""8-bit weights through the whole engine: a quantized checkpoint generates exactly what the
online scheme generates, and each mode stays within measured distance of the unquantized
engine on the course's own model and held-out corpus (`benchmarks/quant_accuracy.py`).

Thresholds: measured with this file's sample (tiny-py-target, 4 held-out windows of 256 tokens,
8 corpus prompts x 24 greedy tokens) on an AMD Zen 3 (AVX2 + FMA), then loosened by about a
third of the distance to the failure they guard against, so that another CPU's summation order
passes while a misapplied scale (agreement near 0, perplexity in the thousands) cannot:

| dtype | mode | measured: greedy / top-1 agreement / top-1 gap / ppl ratio | thresholds |
|---|---|---|---|
| bf16 | fp8_per_tensor | 0.740 / 0.956 / 0.377 / 1.011 | >= 0.45 / >= 0.93 / <= 0.6 / <= 1.03 |
| bf16 | fp8_per_channel | 0.656 / 0.959 / 0.309 / 1.008 | >= 0.45 / >= 0.93 / <= 0.6 / <= 1.03 |
| bf16 | int8_per_channel_weight_only | 0.776 / 0.988 / 0.138 / 1.0013 | >= 0.55 / >= 0.97 / <= 0.3 / <= 1.01 |
| fp32 | int8_per_channel_weight_only | 0.932 / 0.993 / 0.084 / 1.0012 | >= 0.7 / >= 0.98 / <= 0.2 / <= 1.01 |
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from quant_accuracy import measure  # noqa: E402
from accuracy_checks import check_thresholds, measure_table  # noqa: E402

from mini_vllm import LLM, SamplingParams  # noqa: E402
from mini_vllm.course.tiny_models import model_path  # noqa: E402
from mini_vllm.models.quantization.checkpoint import write_quantized_checkpoint  # noqa: E402

TARGET = str(model_path("tiny-py-target"))
COMMON = dict(block_size=32, kv_cache_memory_bytes=32 << 20)
# (greedy agreement >=, top-1 agreement >=, top-1 logprob gap <=, perplexity ratio <=), see the table above
THRESHOLDS = {
    ("bfloat16", "fp8_per_tensor"): (0.45, 0.93, 0.6, 1.03),
    ("bfloat16", "fp8_per_channel"): (0.45, 0.93, 0.6, 1.03),
    ("bfloat16", "int8_per_channel_weight_only"): (0.55, 0.97, 0.3, 1.01),
    ("float32", "int8_per_channel_weight_only"): (0.7, 0.98, 0.2, 1.01),
}


@pytest.fixture(scope="module")
def measured() -> dict:
    return measure_table(measure, TARGET, THRESHOLDS)


@pytest.mark.parametrize("dtype,mode", list(THRESHOLDS), ids=[f"{d}-{m}" for d, m in THRESHOLDS])
def test_accuracy_against_the_unquantized_engine(measured, dtype, mode):
    check_thresholds(measured[(dtype, mode)], mode, THRESHOLDS[(dtype, mode)])


def test_int8_weight_only_is_closer_than_fp8_w8a8(measured):
    """int8 rounds only the weights, to 1/254 of each row's range; FP8 W8A8 rounds weights and
    activations to 3 mantissa bits: int8 must stay nearer the unquantized model."""
    fp8 = measured[("bfloat16", "fp8_per_channel")]
    int8 = measured[("bfloat16", "int8_per_channel_weight_only")]
    assert int8["top1_logprob_gap"] < fp8["top1_logprob_gap"] and int8["top1_agreement"] > fp8["top1_agreement"]


def _generate(model: str, **kw):
    llm = LLM(model, dtype="bfloat16", **COMMON, **kw)
    prompts = [{"prompt_token_ids": [5, 17, 200, 33, 90, 12, 7, 8] * n} for n in (1, 3, 9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def test_int8_engine_core_in_its_own_process_equals_in_process():
    """The core forked from this process (which has used GNU OpenMP): the int8 kernel must run there
    too. A numba parallel region refuses to start in such a child and left the output unwritten
    (garbage logits, top-1 agreement 0)."""
    q = "int8_per_channel_weight_only"
    in_process = _generate(TARGET, quantization=q)  # first: this process runs its kernels before the fork
    assert _generate(TARGET, quantization=q, multiprocess_mode=True) == in_process, (
        "the int8 engine computes otherwise in a forked engine core than in process")


@pytest.mark.parametrize("scheme", ["fp8_per_channel", "int8_per_channel_weight_only"])
def test_engine_on_quantized_checkpoint_equals_online_quantization(tmp_path, scheme):
    """Through LLM: the checkpoint's quantization_config is read without any argument, and its
    tokens and logprobs are the online scheme's, bit for bit (per-channel scales are the same)."""
    ckpt = write_quantized_checkpoint(TARGET, tmp_path / scheme, scheme)
    assert _generate(str(ckpt)) == _generate(TARGET, quantization=scheme)


def test_engine_refuses_unknown_quantization():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM(TARGET, dtype="bfloat16", quantization="awq", **COMMON)


def test_engine_fp8_model_holds_fp8_weights():
    """quantization="fp8" on an unquantized checkpoint is vLLM 0.32's alias of fp8_per_tensor."""
    llm = LLM(TARGET, dtype="bfloat16", quantization="fp8", **COMMON)
    model = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn, "quantization='fp8' left the weights unquantized"
    assert bool((qkv.weight_scale == qkv.weight_scale[0]).all()), "fp8 (per tensor): one scale for the merged q|k|v"


def test_mismatch_is_refused_before_any_core_starts(tmp_path):
    """vLLM checks quantization against the checkpoint in the caller's process (ModelConfig): a
    multiprocess LLM raises the ValueError itself, not an engine core's start-up failure."""
    ckpt = write_quantized_checkpoint(TARGET, tmp_path / "int8", "int8_per_channel_weight_only")
    with pytest.raises(ValueError, match=r"quantization='fp8' does not match the checkpoint's "
                                         r"quantization_config.quant_method 'compressed-tensors'"):
        LLM(str(ckpt), dtype="bfloat16", quantization="fp8", multiprocess_mode=True, **COMMON)
    with pytest.raises(ValueError, match=r"dtype torch.float32 is not supported for quantization 'fp8_per_channel'"):
        LLM(TARGET, dtype="float32", quantization="fp8_per_channel", multiprocess_mode=True, **COMMON)
