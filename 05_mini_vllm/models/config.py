"""`ModelConfig`: the fields of a Hugging Face `config.json` the engine needs.

vLLM counterpart: `vllm/config/model.py` (`ModelConfig`), which wraps the
transformers config; here the JSON is read directly so the engine never
imports transformers.

Invariants (checked by `from_json`):
* every size is an int >= 1, num_attention_heads % num_key_value_heads == 0;
* `rope_theta` is a float and `rope_scaling` is None (plain RoPE) or a dict
  with a "rope_type" key, whether the file uses transformers 5's
  `rope_parameters` or the legacy `rope_theta` / `rope_scaling` pair;
* `eos_token_ids` is a tuple (config files store an int or a list);
* mixture of experts (model_type "qwen3_moe", `moe_config.py`): `num_experts` >= 1
  (transformers 5 writes it as `num_local_experts`), 1 <= num_experts_per_tok
  <= num_experts, decoder_sparse_step >= 1, every `mlp_only_layers` entry a
  layer index; dense models keep num_experts = 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .moe_config import moe_fields

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    model_type: str
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    # mixture of experts (qwen3_moe only; see moe_config.py): 0 experts = dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config.json not found at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "ModelConfig":
        def need(key):
            if key not in raw or raw[key] is None:
                raise ValueError(f"{source}: config field {key!r} is missing")
            return raw[key]

        def pos_int(key, value=None):
            value = need(key) if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: config field {key!r} must be an int >= 1, got {value!r}")
            return value

        model_type = need("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                             f"supported model types: {SUPPORTED_MODEL_TYPES}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act must be 'silu', got {raw['hidden_act']!r}")
        if model_type in ("qwen2", "qwen3_moe") and raw.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window must be false (sliding-window attention "
                             "is not implemented)")
        hidden, heads = pos_int("hidden_size"), pos_int("num_attention_heads")
        kv_heads = pos_int("num_key_value_heads", raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        head_dim = pos_int("head_dim", raw.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = _rope(raw, source)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"{source}: dtype must be one of {tuple(_DTYPES)}, got {dtype_name!r}")
        return cls(
            model_type=model_type,
            architectures=list(raw.get("architectures") or []),
            vocab_size=pos_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=pos_int("intermediate_size"),
            num_hidden_layers=pos_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=pos_int("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config has no attention_bias key.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_id=raw.get("eos_token_id"),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            dtype=_DTYPES[dtype_name],
            **(moe_fields(raw, source) if model_type == "qwen3_moe" else {}),
            raw=raw,
        )


def _rope(raw: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config style."""
    params = raw.get("rope_parameters")
    if params is not None:  # transformers 5: one dict holds theta and scaling
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:  # legacy: top-level rope_theta, optional rope_scaling dict
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{source}: rope_type must be 'default' or 'llama3', got {rope_type!r}")
    return float(theta), (scaling if rope_type != "default" else None)
