"""The fp8 KV cache through the engine (vLLM's `kv_cache_dtype`, `calculate_kv_scales`, checkpoint
`k_scale` / `v_scale`): validation, capacity, every backend, and the features that move or share
cache blocks (prefix caching, chunked prefill, swap preemption, copy-on-write, speculative decoding).

Oracles: the CPU kernel (C++ where it runs, else numba) and the torch backend (SDPA over gathered,
dequantised blocks) are independent implementations of the same fp8 reads, so their tokens and
logprobs must agree; a feature that moves blocks (swap, prefix hit, chunking, speculation) must
give the tokens of the same fp8 engine without it; computed scales must map the first prefill's
largest |K| to 200 and |V| to 100, up to the fp32 rounding of x / scale: both are ties between
two e4m3 values (192 and 208, 96 and 104), so the cached maximum is one of them, whichever side
the rounding fell. The kernels themselves are tested against an fp8 oracle in
test_kernels_fp8_kv.py; accuracy against the unquantized engine in test_ch5_fp8_kv_accuracy.py.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine_utils import greedy, make_llm, model_runner, run_greedy, target_path
from mini_vllm import SamplingParams
from mini_vllm.config import EngineConfig
from mini_vllm.scheduler.swap import copy_blocks

PROMPTS = [[5, 17, 200, 33, 90, 12, 7, 8] * n for n in (1, 5, 12)]


def caches(llm):
    return model_runner(llm).cache_engine.gpu_cache


def tokens_and_logprobs(llm, prompts=PROMPTS, max_tokens=10, **kw):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens, logprobs=1, **kw),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="int8"), r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=1), "calculate_kv_scales must be a bool"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales=True needs an fp8 kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True,
          kv_transfer_config={"kv_connector": "GlobalCacheConnector", "kv_role": "kv_both"}),
     "calculate_kv_scales=True needs kv_transfer_config None"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", device="cpu", **kw)


def test_fp8_fits_twice_bf16_and_four_times_fp32():
    """The same KV bytes hold 2x the blocks of bf16 and 4x those of fp32 (vLLM's gain)."""
    fp32 = make_llm(kv_cache_memory_bytes=1 << 20)
    layers = len(caches(fp32))
    k, _ = caches(fp32)[0]
    budget = 40 * 2 * layers * k[0].numel() * 4  # exactly 40 fp32 blocks: no rounding down below
    n = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "fp8_e5m2")):
        llm = make_llm(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget)
        k, v = caches(llm)[0]
        want = {"auto": getattr(torch, dtype), "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
        assert k.dtype == v.dtype == want, f"{dtype}/{kv}: cache allocated as {k.dtype}, not {want}"
        n[(dtype, kv)] = model_runner(llm).cache_engine.num_gpu_blocks
    assert n[("float32", "auto")] == 40, f"the budget must hold exactly 40 fp32 blocks: {n}"
    assert n[("bfloat16", "fp8")] == 2 * n[("bfloat16", "auto")], f"fp8 must fit 2x bf16's blocks: {n}"
    assert n[("float32", "fp8_e5m2")] == 4 * n[("float32", "auto")], f"fp8 must fit 4x fp32's blocks: {n}"


@pytest.fixture(scope="module")
def fp8_cpu():
    return make_llm(kv_cache_dtype="fp8", attention_backend="cpu")


def test_cpu_kernel_and_torch_backend_agree(fp8_cpu):
    """numba's byte-table reads and the torch backend's dequantise-then-SDPA: same tokens,
    logprobs within fp32 summation-order noise."""
    a = tokens_and_logprobs(fp8_cpu)
    b = tokens_and_logprobs(make_llm(kv_cache_dtype="fp8", attention_backend="torch"))
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb, "cpu and torch backends disagree on an fp8 cache's greedy tokens"
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4, "cpu and torch backends' fp8 logprobs differ"


def test_triton_backend_agrees_on_a_short_run(fp8_cpu):
    """The Triton kernels (interpreter here): one prompt, a few tokens (the interpreter is slow)."""
    want = tokens_and_logprobs(fp8_cpu, PROMPTS[1:2], 4)
    got = tokens_and_logprobs(make_llm(kv_cache_dtype="fp8", attention_backend="triton"), PROMPTS[1:2], 4)
    for (ta, la), (tb, lb) in zip(want, got):
        assert ta == tb and max(abs(x - y) for x, y in zip(la, lb)) < 1e-4, "triton backend's fp8 run differs"


def test_prefix_hits_and_chunks_read_the_same_fp8_blocks(fp8_cpu):
    shared = list(range(3, 3 + 80))
    prompts = [shared + [200 + i] * (5 + i) for i in range(3)]
    want = run_greedy(make_llm(kv_cache_dtype="fp8", enable_prefix_caching=False, enable_chunked_prefill=False),
                      prompts, 8)
    llm = make_llm(kv_cache_dtype="fp8", max_num_batched_tokens=32)
    run_greedy(llm, prompts[:1], 8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want, "a prefix hit or 32-token chunks changed fp8 tokens"
    assert all(o.num_cached_tokens >= 64 for o in outs), "the shared fp8 prefix blocks were not reused"


def test_swap_preemption_round_trips_fp8_blocks():
    prompts = [[7 + i, 9, 11] * 10 for i in range(6)]
    want = run_greedy(make_llm(kv_cache_dtype="fp8"), prompts, 40)
    llm = make_llm(kv_cache_dtype="fp8", num_gpu_blocks_override=14, num_cpu_blocks=64, preemption_mode="swap",
                   enable_prefix_caching=False, block_size=8, max_model_len=128)
    got = run_greedy(llm, prompts, 40)
    preempted = llm.llm_engine.engine_core.call_utility("make_stats")["num_preemptions"]
    assert preempted > 0, "the workload did not preempt (swap): the test checks nothing"
    assert got == want, "fp8 blocks swapped out and back in changed the tokens"


def test_copy_blocks_moves_fp8_bits():
    """Copy-on-write and swaps go through copy_blocks: fp8 caches move bit for bit."""
    src = torch.randn(4, 8, 2, 16).to(torch.float8_e5m2)
    dst = torch.zeros(4, 8, 2, 16).to(torch.float8_e5m2)
    copy_blocks([(src, src)], [(dst, dst)], [(2, 0), (0, 3)])
    assert torch.equal(dst[0].view(torch.uint8), src[2].view(torch.uint8))
    assert torch.equal(dst[3].view(torch.uint8), src[0].view(torch.uint8)), "copy_blocks changed fp8 bytes"


def test_parallel_samples_share_fp8_prompt_blocks(fp8_cpu):
    """n=3 samples of one prompt share its blocks and fork at the partial one (copy-on-write)."""
    p = PROMPTS[1]
    seeded = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    got = fp8_cpu.generate([{"prompt_token_ids": p}], seeded, use_tqdm=False)[0].outputs
    alone = make_llm(kv_cache_dtype="fp8", enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p}], seeded, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in alone], "shared fp8 prompt blocks changed samples"


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
                                  {"method": "draft_model", "model": "tiny-py-draft", "num_speculative_tokens": 2},
                                  {"method": "eagle", "model": "tiny-py-eagle", "num_speculative_tokens": 3}],
                         ids=["ngram", "draft_model", "eagle"])
def test_speculative_decoding_keeps_fp8_tokens(fp8_cpu, spec):
    """The draft model's and the EAGLE head's own layers write fp8 caches too (with their own scales)."""
    from mini_vllm.course.tiny_models import model_path
    if "model" in spec:
        spec = spec | {"model": str(model_path(spec["model"])), "num_speculative_tokens_per_batch_size": None}
    want = run_greedy(fp8_cpu, PROMPTS, 16)
    llm = make_llm(kv_cache_dtype="fp8", speculative_config=spec)
    assert run_greedy(llm, PROMPTS, 16) == want, f"{spec['method']} speculation changed fp8 greedy tokens"


def test_calculated_scales_map_the_first_prefill_to_200_and_100():
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True, enable_prefix_caching=False)
    layers = model_runner(llm).model.attention_layers()
    assert all(layer.calculate_kv_scales for layer in layers), "scales must wait for the first real step"
    run_greedy(llm, PROMPTS[2:], 1)  # one prefill (and nothing else) writes the cache
    for i, (layer, (k, v)) in enumerate(zip(layers, caches(llm))):
        assert not layer.calculate_kv_scales and layer.k_scale != 1.0, f"layer {i}: scales never computed"
        # max|K| / k_scale is 200 up to the fp32 rounding of the quotient (an ulp either way, as
        # the attention kernel's last bits set max|K|); 200 is the tie between e4m3's 192 and 208,
        # so either is right, and 100 between 96 and 104.
        assert float(k.float().abs().max()) in (192, 208) and float(v.float().abs().max()) in (96, 104), (
            f"layer {i}: the largest cached |K|, |V| are {k.float().abs().max()}, {v.float().abs().max()}, "
            "not e4m3(200), e4m3(100): the scale is not max|x| / 200 (K) and / 100 (V)")


def test_checkpoint_scales_are_read_and_used(tmp_path):
    ckpt = tmp_path / "model"
    shutil.copytree(target_path(), ckpt)
    n = 5  # tiny-py-target's layers
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.05 * (i + 1)) for i in range(n)}
    scales |= {f"model.layers.{i}.self_attn.v_scale": torch.tensor(0.02) for i in range(n - 1)}
    scales[f"model.layers.{n - 1}.self_attn.v_proj.v_scale"] = torch.tensor([0.03])  # ModelOpt's name
    save_file(scales, str(ckpt / "kv_scales.safetensors"))
    llm = make_llm(str(ckpt), kv_cache_dtype="fp8_e5m2")
    got = [(layer.k_scale, layer.v_scale) for layer in model_runner(llm).model.attention_layers()]
    want = [(pytest.approx(0.05 * (i + 1)), pytest.approx(0.02 if i < n - 1 else 0.03)) for i in range(n)]
    assert got == want, f"checkpoint scales not applied per layer: {got}"
    auto = make_llm(str(ckpt))
    assert all((layer.k_scale, layer.v_scale) == (1.0, 1.0) for layer in model_runner(auto).model.attention_layers()), \
        "an unquantized cache must use scale 1.0 whatever the checkpoint holds (vLLM's rule)"
    run_greedy(llm, PROMPTS[:1], 2)
    k, _ = caches(llm)[0]
    assert k.float().abs().max() > 40, "keys were not divided by k_scale 0.05 before caching"


def test_bad_checkpoint_scale_is_refused(tmp_path):
    ckpt = tmp_path / "model"
    shutil.copytree(target_path(), ckpt)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2)}, str(ckpt / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="must hold one value"):
        make_llm(str(ckpt), kv_cache_dtype="fp8")


def test_cli_passes_kv_cache_dtype_and_refuses_others():
    from mini_vllm.entrypoints.cli import _engine_kwargs, build_parser
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--kv-cache-dtype", "fp8_e5m2",
                                      "--calculate-kv-scales"])
    kw = _engine_kwargs(args)
    assert (kw["kv_cache_dtype"], kw["calculate_kv_scales"]) == ("fp8_e5m2", True), "the CLI dropped the KV options"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--kv-cache-dtype", "int8"])
