"""A Llama-family decoder's eager CPU forward as one flat loop: outputs preallocated and the
C++ ops' parameter blocks filled once per batch shape, then one ctypes call per fused op.

vLLM counterpart: none as one file. vLLM's CPU worker removes the same host work by
compiling the model (`vllm/compilation/`, inductor's C++ wrapper calling the CPU build's
`torch.ops._C` ops), which costs start-up time; this module gets there without compiling.

Why: a decode step's arithmetic is small (one row per sequence), so the Python between the
kernels is a large part of it. Through the modules, each op of each layer pays
nn.Module.__call__, the layer's dtype / device / autograd checks, the kernel wrapper's shape
and stride checks, a new output tensor and a new parameter block. None of that changes from
one step to the next of the same shape, so it is done once per shape (`_ShapePlan`) and a
step only copies its inputs in, writes the attention plan of its batch and calls the kernels.
`benchmarks/bench_step_overhead.py` (MINI_VLLM_CPU_STEP=modules for the modules), 1 thread,
the 2-core AVX2 test machine: a Qwen3-0.6B-shaped bf16 decode step's forward spent 19.0 ms
outside its kernels at batch 1 and 23.5 ms at batch 8 through the modules, 1.0 and 1.6 ms
here (the step: 94 -> 77 ms and 224 -> 211 ms); tiny-py-target at batch 1: 2.7 -> 0.3 ms
(the step 4.8 -> 2.0 ms).

Same bits as the modules: the same C++ kernels read the same inputs (same packed weights,
same residual order, same thread split rule), and the KV cache is written as
`backends.write_kv_in_place` writes it. tests/test_ch5_cpu_step.py compares the two paths'
outputs exactly and pins that a step through here makes no module call and allocates
one tensor (the returned hidden state).

When (`usable`, then `_ShapePlan.valid`, once per step): MINI_VLLM_CPU_STEP=flat (the
default; `modules` turns it off), inference (no autograd), not traced by torch.compile
(a compiled model keeps the module code, which Dynamo traces), the fused ops on
(MINI_VLLM_CPU_OPS=compiled), a step of 1..MAX_TOKENS tokens whose every token keeps its
K/V, and a model this loop knows (`_supported`): one rank, Llama / Qwen3 attention with the
"cpu" backend on a cache the C++ kernel reads (the model's dtype, or fp8 with scales it takes:
K/V quantised as `backends.write_kv_in_place` does, each layer's k_scale / v_scale written into
the attention block every step), the dense MLP, unquantized linear layers that take the C++
matmul. Anything else runs the modules.

Invariant: a plan is keyed on everything its blocks baked in (the token count, the thread
count, the linear and attention kernel choices) and checked each step against what may
change under it: a weight written in place (its version: the packed copy is redone), a KV
cache bound anew, a layer switched to another backend or asked to calculate fp8 scales.
A parameter replaced by a new tensor object after the first step is not seen (none is).
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from mini_vllm.attention.backends import CpuAttentionBackend, CPUAttentionMetadata
from mini_vllm.kernels import cpu_layer_ops_native as native
from mini_vllm.kernels import cpu_native
from mini_vllm.kernels.cpu_paged_attention import batch_plan
from mini_vllm.kernels.cpu_runtime import use_torch_threads
from mini_vllm.kernels.kv_cache_dtype import as_bytes, is_fp8, quantize

from . import cpu_ops
from .layers import RMSNorm
from .quantization import UnquantizedLinearMethod
from .rotary import RotaryEmbedding

_CHOICES = ("flat", "modules")
CPU_STEP = os.environ.get("MINI_VLLM_CPU_STEP", "flat")
if CPU_STEP not in _CHOICES:
    raise ValueError(f"MINI_VLLM_CPU_STEP must be one of {_CHOICES}, got {CPU_STEP!r}")
MAX_TOKENS = 256  # decode batches and small mixed steps; a prefill's allocations are not its cost
MAX_PLANS = 8     # batch shapes kept (a decode batch shrinks by one as requests finish)
_OUT = native.PARAMS.index("out")


@dataclass
class _Op:
    """One C++ layer op, its block filled once: `inline` 1 runs it on the calling thread,
    0 checks it and splits its rows between threads (the rule `native._run` applies)."""
    params: np.ndarray
    address: int
    inline: int


@dataclass
class _Layer:
    ops_before: list[_Op]           # input norm, qkv_proj, q/k norm + rope (or the two ropes)
    ops_after: list[_Op]            # o_proj, post-attention norm, gate_up_proj, silu-and-mul, down_proj
    key_rows: torch.Tensor          # the key cache seen as [slots, kv heads, head dim] (an fp8 one as bytes)
    value_rows: torch.Tensor
    key_in: torch.Tensor            # this step's K and V as index_copy_ reads them (views of the buffers)
    value_in: torch.Tensor
    attn_slots: np.ndarray          # query, key cache, value cache, output pointers of the attention block
    attn: object                    # the Attention layer (its kv_cache and backend are checked each step)
    kv_cache: tuple
    fp8: torch.dtype | None         # the cache's fp8 dtype (K/V quantised with attn's scales), or None


@dataclass
class _ShapePlan:
    tokens: int
    nthreads: int
    embedded: torch.Tensor          # [T, hidden]: the embedding rows, then the first residual
    positions: torch.Tensor         # [T] int64, the address the rope blocks read
    query: torch.Tensor             # [T, heads, head dim] and the attention's output, as the kernel takes them
    attn_out: torch.Tensor
    layers: list[_Layer]
    final: _Op                      # the last add + norm; its output slot is set to a new tensor each step
    versions: list[tuple[torch.Tensor, int]]  # weights whose packed copies the blocks point into
    keep: list = field(default_factory=list)  # the other buffers, packed weights and fp32 biases pointed into

    def valid(self) -> bool:
        for t, v in self.versions:
            if t._version != v:
                return False
        for layer in self.layers:
            a = layer.attn
            if a.kv_cache is not layer.kv_cache or a.backend_name != "cpu" or a.calculate_kv_scales:
                return False
        return True


def _supported(model, attention_class: type, mlp_class: type) -> bool:
    """Is `model` (a LlamaModel) made only of the parts this loop runs (see the docstring)?
    The attention is `attention_class` or a subclass that changes only `qk_kernel`'s op (Qwen3)."""
    dtype = model.embed_tokens.weight.dtype
    if model.embed_tokens.tp.world_size != 1 or dtype not in native.DTYPES or not native.handles(dtype):
        return False
    probe = torch.empty(1, 2, dtype=dtype)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (not isinstance(attn, attention_class) or type(attn).forward is not attention_class.forward
                or attn.qk_kernel not in ("rope", "qk_norm_rope") or type(mlp) is not mlp_class):
            return False
        a = attn.attn
        cache = None if a.kv_cache is None else a.kv_cache[0].dtype
        fp8 = cache is not None and is_fp8(cache)
        # (every layer's cache of one dtype: the attention block's dtype slot is set once per step)
        if (a.backend_name != "cpu" or cache is None or a.calculate_kv_scales or (cache != dtype and not fp8)
                or cache != model.layers[0].self_attn.attn.kv_cache[0].dtype
                or not cpu_native.handles(cache, attn.head_dim, dtype) or (fp8 and not cpu_native.scales_ok(
                    a.k_scale, a.v_scale)) or a.scale != model.layers[0].self_attn.attn.scale
                or type(attn.rotary_emb) is not RotaryEmbedding or attn.head_dim > native.MAX_HEAD_SIZE):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if attn.qk_kernel == "qk_norm_rope" else []
        if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms):
            return False
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if (lin.tp_size != 1 or type(lin.quant_method) is not UnquantizedLinearMethod or lin.weight.dtype != dtype
                    or lin.weight.is_inference() or cpu_ops.linear_path(probe, lin.weight) != "native"):
                return False
    return type(model.norm) is RMSNorm


class FlatCpuForward:
    """The flat loop of one LlamaModel (held weakly: the model holds this), its plans by shape;
    the classes of the layers it can replace come from `llama.py` (this module imports no model)."""

    def __init__(self, model, attention_class: type, mlp_class: type) -> None:
        self._model = weakref.ref(model)
        self._classes = (attention_class, mlp_class)
        self._plans: dict[tuple, _ShapePlan] = {}

    def usable(self, input_ids: torch.Tensor) -> bool:
        """The per-step conditions that need no plan (see the module docstring)."""
        return (CPU_STEP == "flat" and cpu_ops.CPU_OPS == "compiled" and not torch.compiler.is_compiling()
                and not torch.is_grad_enabled() and input_ids.device.type == "cpu"
                and 0 < input_ids.shape[0] <= MAX_TOKENS)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md) -> torch.Tensor | None:
        """The final hidden states [T, hidden], or None: this step takes the modules."""
        model = self._model()
        tokens = input_ids.shape[0]
        if md.num_tokens != tokens or not native.handles(model.embed_tokens.weight.dtype):
            return None
        nthreads = torch.get_num_threads()
        key = (tokens, nthreads, cpu_ops.CPU_LINEAR, cpu_native.isa())
        plan = self._plans.get(key)
        if plan is None or not plan.valid():
            if not _supported(model, *self._classes):
                return None
            if len(self._plans) >= MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = _build(model, tokens, nthreads)
        # The step's attention metadata, once for every layer (as the backend's first layer does).
        layer0 = plan.layers[0]
        cpu_md = md.backend_metadata
        if not isinstance(cpu_md, CPUAttentionMetadata):
            cpu_md = md.backend_metadata = CpuAttentionBackend.builder.build(
                md, layer0.kv_cache[0].shape[0], layer0.kv_cache[0].shape[1])
        if cpu_md.real is not None:  # some token keeps no K/V: the backend's masked write
            return None
        return _run(model, plan, input_ids, positions, md, cpu_md)


def _run(model, plan: _ShapePlan, input_ids, positions, md, cpu_md) -> torch.Tensor:
    torch.index_select(model.embed_tokens.weight, 0, input_ids, out=plan.embedded)
    plan.positions.copy_(positions)
    a0 = plan.layers[0].attn
    tile_tokens, attn_threads, (cu, seq_lens, tables, item_seq, item_t0, item_h0, decode_heads) = batch_plan(
        a0.num_heads, a0.num_kv_heads, md.block_tables, md.cu_seqlens_q, md.seq_lens, cpu_md.plans)
    attn_params, arrays = cpu_native.attention_params(
        plan.query, plan.layers[0].kv_cache[0], plan.layers[0].kv_cache[1], plan.attn_out, tables, cu, seq_lens,
        item_seq, item_t0, item_h0, tile_tokens, decode_heads, a0.scale, attn_threads)
    counter, attn_address = arrays[-1], attn_params.ctypes.data
    worker = cpu_native.library().worker
    layer_op = cpu_native.layer_ops_library(len(native.PARAMS)).layer_op
    # the thread count a split op fans out to (native._run's rule), set once for the step
    nthreads, slots = use_torch_threads() if plan.nthreads > 1 else 1, cpu_md.slots
    for layer in plan.layers:
        for op in layer.ops_before:
            _call(layer_op, op, nthreads)
        attn_params[cpu_native.LAYER_SLOTS] = layer.attn_slots
        if layer.fp8 is None:
            write_kv(layer.key_rows, layer.value_rows, slots, layer.key_in, layer.value_in)
        else:
            k_scale, v_scale = layer.attn.k_scale, layer.attn.v_scale
            write_kv(layer.key_rows, layer.value_rows, slots, layer.key_in, layer.value_in, layer.fp8, k_scale,
                     v_scale)
            attn_params[cpu_native.SCALE_SLOTS] = cpu_native.scale_slots(k_scale, v_scale)
        counter[0] = 0
        if attn_threads == 1:
            worker(attn_address, 0)
        else:
            cpu_native.run_params(attn_params, attn_threads)
        for op in layer.ops_after:
            _call(layer_op, op, nthreads)
    # A new tensor for the result: the runner, a deferred output or prompt logprobs may hold
    # it past the next step, which reuses every buffer of this plan.
    hidden = torch.empty_like(plan.embedded)
    plan.final.params[_OUT] = hidden.data_ptr()
    _call(layer_op, plan.final, nthreads)
    return hidden


def write_kv(key_rows, value_rows, slots, key, value, fp8: torch.dtype | None = None, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """backends.write_kv_in_place with every token kept, for a cache of the model's dtype or
    of the fp8 dtype `fp8` (rows seen as bytes; the same `quantize` bytes); a function of its
    own so that a benchmark can time it as the kernel it is."""
    if fp8 is not None:
        key, value = as_bytes(quantize(key, k_scale, fp8)), as_bytes(quantize(value, v_scale, fp8))
    key_rows.index_copy_(0, slots, key)
    value_rows.index_copy_(0, slots, value)


def _call(layer_op, op: _Op, nthreads: int) -> None:
    status = layer_op(op.address, op.inline)
    if status:
        native.raise_status(status)
    if not op.inline:
        native.fan_out(op.params, nthreads)


def _op(nthreads: int, work: int, split_at: int = native.SPLIT_ELEMENTS, **slots) -> _Op:
    params = native.op_block(**slots)
    return _Op(params, params.ctypes.data, 0 if work >= split_at and nthreads > 1 else 1)


def _build(model, tokens: int, nthreads: int) -> _ShapePlan:
    """The buffers and blocks of one batch shape (the model passed `_supported`)."""
    w = model.embed_tokens.weight
    dtype, hidden_size, code = w.dtype, w.shape[1], native.DTYPES[w.dtype]
    first = model.layers[0].self_attn
    new = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt)  # noqa: E731
    embedded, residual = new(tokens, hidden_size), [new(tokens, hidden_size), new(tokens, hidden_size)]
    normed, mlp_out = new(tokens, hidden_size), new(tokens, hidden_size)
    q_size, kv_size = first.q_size, first.kv_size
    qkv, query, key = new(tokens, q_size + 2 * kv_size), new(tokens, q_size), new(tokens, kv_size)
    attn_out, o_out = new(tokens, q_size), new(tokens, hidden_size)
    inter = model.layers[0].mlp.gate_up_proj.weight.shape[0] // 2
    gate_up, act = new(tokens, 2 * inter), new(tokens, inter)
    pos = torch.zeros(tokens, dtype=torch.int64)
    # The blocks hold raw addresses: every buffer they point into lives as long as the plan.
    keep = [*residual, normed, mlp_out, qkv, key, o_out, gate_up, act]
    versions, layers = [], []

    def linear(lin, x, out):
        packed = cpu_ops._packed_weight(lin, lin.weight, True)
        bias = None if lin.bias is None else lin.bias.detach().float()
        keep.extend([packed, bias])
        versions.append((lin.weight, lin.weight._version))
        if lin.bias is not None:
            versions.append((lin.bias, lin.bias._version))
        n, k = lin.weight.shape
        return _op(nthreads, tokens * n * k, native.SPLIT_MACS, op=native.LINEAR, dtype=code, rows=tokens, width=n,
                   x=x.data_ptr(), x_stride=x.stride(0), weight=packed.data_ptr(), out=out.data_ptr(),
                   in_features=k, bias=0 if bias is None else bias.data_ptr())

    def add_norm(norm, x, res_in, out, res_out):
        return _op(nthreads, tokens * hidden_size, op=native.ADD_RMS_NORM, dtype=code, rows=tokens,
                   width=hidden_size, x=x.data_ptr(), x_stride=x.stride(0), residual=res_in.data_ptr(),
                   residual_stride=res_in.stride(0), weight=norm.weight.data_ptr(),
                   eps_bits=native.eps_slot(norm.eps), out=out.data_ptr(), residual_out=res_out.data_ptr())

    res = embedded  # the residual stream: the embedding, then the two buffers in turn

    def other(current):  # an add + norm never writes the residual it reads
        return residual[1] if current is residual[0] else residual[0]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        rope = attn.rotary_emb
        table = dict(positions=pos.data_ptr(), cos=rope.cos_cache.data_ptr(), sin=rope.sin_cache.data_ptr(),
                     cos_stride=rope.cos_cache.stride(0), sin_stride=rope.sin_cache.stride(0),
                     table_rows=rope.cos_cache.shape[0], head_size=attn.head_dim)
        if i == 0:  # no residual yet: the norm alone (LlamaDecoderLayer's first branch)
            before = [_op(nthreads, tokens * hidden_size, op=native.RMS_NORM, dtype=code, rows=tokens,
                          width=hidden_size, x=embedded.data_ptr(), x_stride=hidden_size,
                          weight=layer.input_layernorm.weight.data_ptr(),
                          eps_bits=native.eps_slot(layer.input_layernorm.eps), out=normed.data_ptr())]
        else:
            before = [add_norm(layer.input_layernorm, mlp_out, res, normed, other(res))]
            res = other(res)
        before.append(linear(attn.qkv_proj, normed, qkv))
        if attn.qk_kernel == "qk_norm_rope":
            before.append(_op(nthreads, tokens * (attn.num_heads + attn.num_kv_heads) * attn.head_dim,
                              op=native.QK_NORM_ROPE, dtype=code, rows=tokens, x=qkv.data_ptr(),
                              x_stride=qkv.stride(0), weight=attn.q_norm.weight.data_ptr(),
                              eps_bits=native.eps_slot(attn.q_norm.eps), out=query.data_ptr(),
                              q_heads=attn.num_heads, k_heads=attn.num_kv_heads,
                              k_weight=attn.k_norm.weight.data_ptr(), k_out=key.data_ptr(), **table))
        else:  # Llama / Qwen2: the two rotations, read from qkv's column slices
            for src, out, width in ((qkv[:, :q_size], query, q_size), (qkv[:, q_size:q_size + kv_size], key, kv_size)):
                before.append(_op(nthreads, tokens * width, op=native.ROPE, dtype=code, rows=tokens, width=width,
                                  x=src.data_ptr(), x_stride=src.stride(0), out=out.data_ptr(), **table))
        after = [linear(attn.o_proj, attn_out, o_out),
                 add_norm(layer.post_attention_layernorm, o_out, res, normed, other(res)),
                 linear(mlp.gate_up_proj, normed, gate_up),
                 _op(nthreads, tokens * inter, op=native.SILU_AND_MUL, dtype=code, rows=tokens, width=inter,
                     x=gate_up.data_ptr(), x_stride=gate_up.stride(0), out=act.data_ptr()),
                 linear(mlp.down_proj, act, mlp_out)]
        res = other(res)
        kc, vc = attn.attn.kv_cache
        kvh, hd = attn.num_kv_heads, attn.head_dim
        layers.append(_Layer(
            before, after, as_bytes(kc).view(-1, kvh, hd), as_bytes(vc).view(-1, kvh, hd), key.view(tokens, kvh, hd),
            qkv[:, q_size + kv_size:].view(tokens, kvh, hd),
            np.array((query.data_ptr(), kc.data_ptr(), vc.data_ptr(), attn_out.data_ptr()), np.int64),
            attn.attn, attn.attn.kv_cache, kc.dtype if is_fp8(kc.dtype) else None))
    final = add_norm(model.norm, mlp_out, res, normed, other(res))
    heads = first.num_heads
    return _ShapePlan(tokens, nthreads, embedded, pos, query.view(tokens, heads, first.head_dim),
                      attn_out.view(tokens, heads, first.head_dim), layers, final, versions, keep)
