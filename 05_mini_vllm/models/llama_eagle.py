"""The EAGLE-1 draft head on the engine's paged KV cache.

vLLM counterpart: `vllm/model_executor/models/llama_eagle.py`
(`EagleLlamaForCausalLM`), whose checkpoint format this loads: `fc.weight`
and `layers.0.*` of one Llama decoder layer, with no embedding and no LM
head (the target's are shared, as vLLM shares them when a head has none).

    h0 = fc([embed(ids); hidden])      hidden: the target's final hidden states, or this head's own
    g  = layer0(h0) + residual         layer0 has no input norm; there is no final norm
    logits = target.compute_logits(g)

Invariants:
* `forward(ids, positions, hidden)` returns g [T, hidden]; g is both what the
  LM head reads and the `hidden` of the next draft step (EAGLE-1 feeds its own
  output back);
* the layer's attention is one more `Attention` layer: the runner binds it to
  a KV tensor laid out like the target's, addressed by the same block tables;
* the plain-PyTorch reference of these equations is `training/eagle_head.py`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .linear import LinearBase
from .llama import LlamaAttention, LlamaDecoderLayer

ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")


class EagleLlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: ModelConfig, target, attention_backend: str = "torch"):
        super().__init__()
        if config.hidden_size != target.config.hidden_size:
            raise ValueError(f"speculative_config.model: the EAGLE head's hidden_size ({config.hidden_size}) "
                             f"must equal the target's ({target.config.hidden_size})")
        if config.vocab_size != target.config.vocab_size:
            raise ValueError(f"speculative_config.model: the EAGLE head's vocab_size ({config.vocab_size}) "
                             f"must equal the target's ({target.config.vocab_size})")
        self.config = config
        # Parameter names are the checkpoint's (vLLM's loader prefixes `model.`; this one needs not).
        self.fc = LinearBase(2 * config.hidden_size, config.hidden_size, bias=False)
        attn = LlamaAttention(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                              attention_backend=attention_backend)
        layer = LlamaDecoderLayer(config, attn)
        layer.input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output as it is
        self.layers = nn.ModuleList([layer])
        # The target, whose embedding and LM head the head uses: held in a tuple so that
        # nn.Module does not adopt its parameters as this module's own.
        self._target = (target,)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T] ids and positions, [T, H] hidden states -> g [T, H]; call inside `set_forward_context`."""
        embeds = self._target[0].model.embed_tokens(input_ids)
        h = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]


def load_eagle_head(path, target, dtype: torch.dtype, device, attention_backend: str) -> EagleLlamaForCausalLM:
    """Build the head named by `path/config.json` next to `target` and load its weights
    (the loader's checks: every tensor placed once, shapes equal)."""
    from .loader import _default_dtype, load_weights, safetensors_files

    path = Path(path)
    config = ModelConfig.from_json(path / "config.json")
    if not set(config.architectures) & set(ARCHITECTURES) or config.num_hidden_layers != 1:
        raise ValueError(f"speculative_config.model: {path} must be an EAGLE-1 head (architectures one of "
                         f"{list(ARCHITECTURES)}, num_hidden_layers 1), got {config.architectures} with "
                         f"{config.num_hidden_layers} layers")
    with _default_dtype(dtype), torch.device(device):
        head = EagleLlamaForCausalLM(config, target, attention_backend)
    load_weights(head, safetensors_files(path))
    return head.eval()
