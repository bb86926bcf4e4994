"""The eager CPU step's flat loop (mini_vllm/models/cpu_step.py): the same bits as the
modules, and its mechanism pinned without timing anything: a decode step of a shape seen
before calls no layer module and allocates nothing per layer (only the step's metadata and
the hidden states it returns); a weight written in place after the plans were made is read
anew (the packed copies they point into are redone)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mini_vllm import LLM, SamplingParams
from mini_vllm.course.tiny_models import model_path
from mini_vllm.models import cpu_step

SETTINGS = dict(block_size=16, kv_cache_memory_bytes=1 << 26, max_num_seqs=8, max_num_batched_tokens=256,
                enable_prefix_caching=False, multiprocess_mode=False)
PROMPTS = [[5, 9, 200, 31, 7], [100, 101, 102], [3000, 12, 77, 950, 4, 4, 61, 2, 8]]


def _engine(dtype: str, path=None, **kw) -> LLM:
    return LLM(str(path or model_path("tiny-py-target")), dtype=dtype, **SETTINGS, **kw)


def _random_checkpoint(name: str, folder) -> str:
    """A random Hugging Face checkpoint of tests/hf_configs.py's `name`, written to `folder`."""
    from transformers import AutoModelForCausalLM

    from hf_configs import RANDOM_CONFIGS

    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(RANDOM_CONFIGS[name]()).save_pretrained(folder)
    return str(folder)


def _generate(llm: LLM, vocab: int = 6144) -> list[tuple]:
    sps = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, detokenize=False)
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


# tiny-py-target (Qwen3: the q/k norm + rope op) in both dtypes, and with fp8 caches of both
# formats (scales calculated from the first step's K/V, a pair per layer, none 1.0: a layer's
# scales written into the attention block, or the quantisation, must match the modules');
# random Llama 3 (llama3 rope scaling: the two rope ops, untied) and Qwen2 (qkv bias: the
# linear's fp32 bias) checkpoints.
@pytest.mark.parametrize("model,dtype,kv_cache_dtype", [
    ("tiny-py-target", "float32", "auto"), ("tiny-py-target", "bfloat16", "auto"),
    ("tiny-py-target", "float32", "fp8"), ("tiny-py-target", "bfloat16", "fp8_e5m2"),
    ("llama3-rope-gqa2-tied", "float32", "auto"), ("qwen2-gqa4-tied", "float32", "auto")])
def test_the_flat_step_gives_the_modules_bits(monkeypatch, tmp_path, model, dtype, kv_cache_dtype):
    flat_steps = []
    real = cpu_step._run
    monkeypatch.setattr(cpu_step, "_run", lambda *a: flat_steps.append(1) or real(*a))
    path, vocab = (None, 6144) if model == "tiny-py-target" else (_random_checkpoint(model, tmp_path), 97)
    fp8 = {} if kv_cache_dtype == "auto" else dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=True)
    llm = _engine(dtype, path, **fp8)
    try:
        flat = _generate(llm, vocab)
        assert flat_steps, f"no step took the flat loop: the CPU default must use it for {model}"
        monkeypatch.setattr(cpu_step, "CPU_STEP", "modules")
        flat_steps.clear()
        modules = _generate(llm, vocab)
        assert not flat_steps, "MINI_VLLM_CPU_STEP=modules must keep every step on the modules"
        layers = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model.model.layers
        scales = {(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in layers}
    finally:
        llm.shutdown()
    if fp8:
        assert len(scales) == len(layers) and 1.0 not in {x for pair in scales for x in pair}, \
            f"the case needs a distinct scale pair per layer, none 1.0: got {scales}"
    for i, (a, b) in enumerate(zip(flat, modules)):
        assert a[0] == b[0], (f"{model} {dtype} {kv_cache_dtype} request {i}: the flat loop's tokens differ from the "
                              "modules' (a wrong buffer, residual or block, fp8 scales or quantisation)")
        assert a[1] == b[1], \
            f"{model} {dtype} {kv_cache_dtype} request {i}: the flat loop's logprobs differ from the modules' bits"


class _Allocations(TorchDispatchMode):
    """The aten ops that return a new tensor: not views, not in-place, not out= (which write
    a tensor that exists)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not func._schema.is_mutable:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_decode_step_calls_no_module_and_allocates_only_its_result():
    llm = _engine("float32")
    try:
        engine = llm.llm_engine
        runner = engine.engine_core.engine_core.executor.driver_worker.model_runner
        sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, detokenize=False)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        for _ in range(3):  # the prefill, then decode steps of 3 sequences: the shape's plan exists
            engine.step()
        called, alloc = [], _Allocations()
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: called.append(type(module).__name__))
        forward = runner.model_forward

        def watched(*args):
            with alloc:
                return forward(*args)

        runner.model_forward = watched
        try:
            engine.step()
        finally:
            hook.remove()
            runner.model_forward = forward
    finally:
        llm.shutdown()
    in_forward = called[:called.index("ParallelLMHead")] if "ParallelLMHead" in called else called
    assert in_forward == ["Qwen3ForCausalLM", "LlamaModel"], \
        f"a decode step went through layer modules (nn.Module.__call__ per op is the cost removed): {in_forward}"
    # The step's attention metadata (CPUAttentionMetadataBuilder: does every token keep its K/V?),
    # once a step, then the returned hidden states; nothing per layer or per op.
    assert alloc.ops == ["aten.ge.Scalar", "aten.all.default", "aten.is_nonzero.default", "aten.empty_like.default"], \
        f"a decode step of a known shape allocated more than its metadata and its returned hidden states: {alloc.ops}"


def test_a_weight_written_in_place_is_read_anew(monkeypatch):
    """The plans point into packed copies of the weights: a weight written after the first
    steps (a test zeroing a projection, a reload) must be packed again, as the modules do."""
    llm = _engine("float32")
    try:
        model = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model
        before = _generate(llm)  # plans and packed copies made for these shapes
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.weight.mul_(-1.5)
        flat = _generate(llm)
        monkeypatch.setattr(cpu_step, "CPU_STEP", "modules")
        modules = _generate(llm)
    finally:
        llm.shutdown()
    assert modules != before, "the written weights changed nothing: the test cannot see a stale plan"
    assert flat == modules, "the flat loop read a stale packed weight after the weight was written in place"
