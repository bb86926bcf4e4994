"""The EAGLE-1 draft head in plain PyTorch: what `train_eagle.py` trains, and the
reference the engine's paged implementation (`05_mini_vllm/spec_decode/engine/eagle.py`)
is checked against.

vLLM counterpart: `vllm/model_executor/models/llama_eagle.py`
(`EagleLlamaForCausalLM`), whose checkpoint format `save_head` writes.

The head predicts the token after next from what the target already knows:

    h0  = fc([embed(x[t+1]); f[t]])          # f[t]: the target's final hidden state at t
    r   = h0 + attention(h0)                  # one Llama layer; no input norm (EAGLE drops it)
    g   = r + mlp(rmsnorm(r))                 # no final norm either
    logits = g @ embed.T                      # the target's (tied) LM head

`g` stands in for f[t+1] at the next draft step. The embedding and LM head are
the target's and are not stored with the head (vLLM shares them when the
checkpoint has none).

Attention takes an explicit boolean mask (True = may attend), so the same
module runs causal attention over one sequence (the reference) and the
training-time-test layout of `ttt_mask` (training).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale (Hugging Face's order)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half convention; x [B, T, heads, d], positions [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = positions.float()[..., None] * inv                    # [B, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class EagleHead(nn.Module):
    """One EAGLE-1 layer. Parameter names are the checkpoint's (vLLM's loader adds `model.`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0):
        super().__init__()
        self.h, self.nh, self.nkv, self.hd = hidden_size, num_heads, num_kv_heads, head_dim
        self.eps, self.theta = rms_norm_eps, rope_theta
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden_size))
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The layer input h0 and its rotated q, k and v, each [B, T, heads, d]."""
        h0 = self.fc(torch.cat([embeds, hidden], -1))
        B, T, _ = h0.shape
        q = rotate(self.q_proj(h0).view(B, T, self.nh, self.hd), positions, self.theta)
        k = rotate(self.k_proj(h0).view(B, T, self.nkv, self.hd), positions, self.theta)
        v = self.v_proj(h0).view(B, T, self.nkv, self.hd)
        return h0, q, k, v

    def finish(self, h0: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention of q over (keys, values) under `mask` [Tq, Tk], then o_proj, MLP, residuals."""
        rep = self.nh // self.nkv
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.repeat_interleave(rep, 2).transpose(1, 2),
            values.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask)
        r = h0 + self.o_proj(att.transpose(1, 2).flatten(2))
        x = rms_norm(r, self.post_attention_layernorm, self.eps)
        return r + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal pass over whole sequences: embeds/hidden [B, T, H] -> g [B, T, H]."""
        h0, q, k, v = self.qkv(embeds, hidden, positions)
        T = h0.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=h0.device).tril()
        return self.finish(h0, q, k, v, causal)

    def config(self) -> dict:
        return dict(hidden_size=self.h, num_attention_heads=self.nh, num_key_value_heads=self.nkv,
                    head_dim=self.hd, intermediate_size=self.gate_proj.out_features,
                    rms_norm_eps=self.eps, rope_theta=self.theta)


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time test: the mask of draft step `step` (1-based) over the keys of steps 1..step.

    Row t is the chain that starts after position t. Its step-j query sits at
    position t + j - 1 and may see what it would see at inference: the step-1
    keys at positions <= t (written from the target's features) and its own
    chain's keys of steps 2..j (one per step, on the diagonal)."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * (step - 1), dim=1)


# --- the checkpoint: vLLM's `EagleLlamaForCausalLM` format -------------------------------
_NAMES = {  # this module's parameter -> the checkpoint's tensor name
    "fc.weight": "fc.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
}


def save_head(head: EagleHead, out: Path, target_config: dict, dtype=torch.float32) -> None:
    """config.json + model.safetensors that vLLM 0.32 loads as an EAGLE-1 draft for the target."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = head.state_dict()
    save_file({_NAMES[k]: v.detach().to(dtype).contiguous() for k, v in sd.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    c = head.config()
    cfg = dict(architectures=["EagleLlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
               vocab_size=target_config["vocab_size"],
               max_position_embeddings=target_config["max_position_embeddings"],
               bos_token_id=target_config.get("bos_token_id"), eos_token_id=target_config.get("eos_token_id"),
               rope_parameters={"rope_theta": c.pop("rope_theta"), "rope_type": "default"},
               dtype=str(dtype).removeprefix("torch."), **c)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_head(path: Path) -> EagleHead:
    from safetensors.torch import load_file
    cfg = json.loads((Path(path) / "config.json").read_text())
    head = EagleHead(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                     cfg["head_dim"], cfg["intermediate_size"], cfg["rms_norm_eps"],
                     cfg["rope_parameters"]["rope_theta"])
    tensors = load_file(str(Path(path) / "model.safetensors"))
    head.load_state_dict({k: tensors[v].float() for k, v in _NAMES.items()})
    return head
