"""The `Attention` layer every model calls: paged KV cache + a chosen backend,
reached through one custom op, `mini_vllm::unified_attention_with_output`.

vLLM counterpart: `vllm/attention/layer.py` (`Attention`, which binds the
layer's slice of the KV cache and forwards to the backend picked by
`vllm/attention/selector.py`, and the custom op `unified_attention_with_output`
with its fake implementation).

Why a custom op: `torch.compile` must not look inside attention. Its inputs
change shape every step (the block tables, the varlen layout), it writes the
KV cache in place, and the piecewise backend (`compilation/backends.py`) cuts
the traced graph at exactly this op. To the compiler the op is a black box
that reads q/k/v and writes `output`; the layer, its cache and the step's
metadata are found at run time from `layer_name` and the forward context, so
none of them is ever baked into a compiled graph as a constant.

Invariants:
* the runner binds `self.kv_cache = (key_cache, value_cache)`, each
  [num_blocks, block_size, num_kv_heads, head_size], before the first forward;
* the batch layout comes from `get_forward_context()`, never from arguments,
  so model code keeps Hugging Face's shape;
* `forward` takes and returns flat [T, heads*head_size] rows and always goes
  through the op (eager too: one code path); `output` is allocated by the
  caller, so under piecewise CUDA graphs it belongs to the piece before attention;
* the op's schema declares `output` mutated: it is then never dead code, and it stays
  after what produces q/k/v and before what reads `output`. The KV cache it
  also writes is invisible to the compiler, which is safe because nothing in a
  graph reads a cache: only this op, for its own layer, in layer order;
* an fp8 cache (`kv_cache_dtype`) is written and read with this layer's
  per-tensor `k_scale` / `v_scale` (vLLM's `Attention._k_scale_float`): 1.0,
  the checkpoint's (`kv_scales.py`), or computed from the first step that
  writes K/V when `calculate_kv_scales` is set (vLLM's former
  `calc_kv_scales`: max|K| / 200, max|V| / 100), then fixed for the run;
* every layer's `layer_name` is unique in the process (a draft and a target
  model, or a test's many models, never share one), and the registry holds
  layers weakly, so a dropped model is freed.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from mini_vllm.kernels.kv_cache_dtype import is_fp8

# vLLM's former K_SCALE_CONSTANT / V_SCALE_CONSTANT (`calc_kv_scales`): a computed scale
# maps the step's largest |K| to 200 and |V| to 100, inside e4m3's 448 with headroom for
# later tokens that exceed the first prefill's range.
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0

from mini_vllm.attention.backends import get_attn_backend
from mini_vllm.forward_context import get_forward_context

# layer_name -> Attention (vLLM keeps this in the forward context as `no_compile_layers`).
_LAYERS: weakref.WeakValueDictionary[str, "Attention"] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def unified_attention_with_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  output: torch.Tensor, layer_name: str) -> None:
    """Write this step's K/V into the layer's cache, attend, put the result in `output`."""
    layer = _LAYERS.get(layer_name)
    if layer is None:
        raise RuntimeError(f"no live Attention layer is named {layer_name!r}")
    layer.run(query, key, value, output)


# Registered through `torch.library.Library`, as vLLM's `direct_register_custom_op`
# does: `torch.library.custom_op` adds about 20 us of Python dispatch per call
# (2 us this way), paid by every layer of every eager step. `Tensor(a!)` is the
# schema's word for "written in place".
_LIB = torch.library.Library("mini_vllm", "FRAGMENT")
_LIB.define("unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a!) output, "
            "str layer_name) -> ()")
_LIB.impl("unified_attention_with_output", unified_attention_with_output, "CompositeExplicitAutograd")


@torch.library.register_fake("mini_vllm::unified_attention_with_output", lib=_LIB)
def _(query, key, value, output, layer_name) -> None:
    return None  # shapes are the caller's: the op only fills `output`


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 attention_backend: str = "torch", prefix: str = "attn"):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per-tensor scales of an fp8 cache (1.0 for any other): stored = fp8(x / scale).
        self.k_scale, self.v_scale = 1.0, 1.0
        # (k_scale, v_scale) found in the checkpoint, if any (`kv_scales.py`); used only by an fp8 cache.
        self.checkpoint_kv_scales: tuple[float, float] | None = None
        # True: the next step that writes K/V sets k_scale / v_scale from its values, then clears this.
        self.calculate_kv_scales = False
        # vLLM names a layer by its module path; two models built from the same
        # config would share those, so a process-wide number makes the name unique.
        self.layer_name = f"{prefix}.{next(_NEXT_ID)}"
        _LAYERS[self.layer_name] = self
        self.set_backend(attention_backend)

    def set_backend(self, name: str) -> None:
        self.backend = get_attn_backend(name)
        self.backend_name = name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output = torch.empty(q.shape[0], self.num_heads * self.head_size, dtype=q.dtype, device=q.device)
        torch.ops.mini_vllm.unified_attention_with_output(q, k, v, output, self.layer_name)
        return output

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor) -> None:
        """The op's body, eager always: the backend writes K/V, attends, and we fill `output`."""
        md = get_forward_context()
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound: the runner must set "
                               "layer.kv_cache = (key_cache, value_cache) before the first forward")
        # A PIECEWISE CUDA-graph step pads the rows to a capture size; attention runs on
        # the step's real tokens only (vLLM's num_actual_tokens): padded rows have no
        # slot and no sequence, and their output rows are never read.
        num_tokens = md.num_tokens
        if q.shape[0] < num_tokens:
            raise RuntimeError(f"attention got {q.shape[0]} rows for a step of {num_tokens} tokens")
        key = k[:num_tokens].reshape(num_tokens, self.num_kv_heads, self.head_size)
        value = v[:num_tokens].reshape(num_tokens, self.num_kv_heads, self.head_size)
        if self.calculate_kv_scales and num_tokens:
            self.calc_kv_scales(key, value)
        out = self.backend.forward(
            q[:num_tokens].reshape(num_tokens, self.num_heads, self.head_size), key, value,
            self.kv_cache[0], self.kv_cache[1], md, self.scale, self.k_scale, self.v_scale)
        output[:num_tokens].copy_(out.reshape(num_tokens, -1))

    def calc_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Per-tensor scales from this step's K/V (vLLM's former `Attention.calc_kv_scales`), once.
        An all-zero K or V keeps scale 1.0 (a zero scale would divide by zero)."""
        if not is_fp8(self.kv_cache[0].dtype):
            raise RuntimeError("calculate_kv_scales is set on a layer whose KV cache is not fp8")
        k_max, v_max = float(key.abs().max()), float(value.abs().max())
        self.k_scale = k_max / K_SCALE_CONSTANT if k_max > 0 else 1.0
        self.v_scale = v_max / V_SCALE_CONSTANT if v_max > 0 else 1.0
        self.calculate_kv_scales = False


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Switch every `Attention` layer of `model` to the backend `name`."""
    get_attn_backend(name)  # validates the name once, before touching any layer
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_backend(name)
