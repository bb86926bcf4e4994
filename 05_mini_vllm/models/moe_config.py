"""The mixture-of-experts fields of a Hugging Face `config.json` (Qwen3-MoE).

vLLM counterpart: the fields `vllm/model_executor/models/qwen3_moe.py` reads
from the transformers `Qwen3MoeConfig` (`num_experts`, `num_experts_per_tok`,
`norm_topk_prob`, `moe_intermediate_size`, `decoder_sparse_step`,
`mlp_only_layers`).

Invariants (each violation a ValueError naming the field and its range):
* num_experts >= 1; transformers 5 writes it as `num_local_experts` (its
  config maps one name to the other), older files as `num_experts`; both
  present must agree;
* 1 <= num_experts_per_tok <= num_experts (top-k picks distinct experts);
* moe_intermediate_size >= 1, decoder_sparse_step >= 1;
* mlp_only_layers lists distinct layer indices in [0, num_hidden_layers).
Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step
== 0 (Hugging Face's and vLLM's rule), see `is_sparse_layer`.
"""
from __future__ import annotations


def _int(raw: dict, key: str, source: str, low: int, high: int | None = None, default=None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{source}: config field {key!r} is missing (needed by model_type qwen3_moe)")
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{source}: config field {key!r} must be an int {bound}, got {value!r}")
    return value


def moe_fields(raw: dict, source: str) -> dict:
    """The ModelConfig keyword arguments of a qwen3_moe config, validated."""
    names = [k for k in ("num_experts", "num_local_experts") if raw.get(k) is not None]
    if len(names) == 2 and raw["num_experts"] != raw["num_local_experts"]:
        raise ValueError(f"{source}: config fields 'num_experts' ({raw['num_experts']!r}) and "
                         f"'num_local_experts' ({raw['num_local_experts']!r}) must agree")
    if not names:
        raise ValueError(f"{source}: config field 'num_experts' (or 'num_local_experts') is missing "
                         "(needed by model_type qwen3_moe)")
    num_experts = _int(raw, names[0], source, 1)
    top_k = _int(raw, "num_experts_per_tok", source, 1, num_experts)
    layers = _int(raw, "num_hidden_layers", source, 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in only) or len(set(only)) != len(only):
        raise ValueError(f"{source}: config field 'mlp_only_layers' must list distinct layer indices in "
                         f"[0, num_hidden_layers={layers}), got {only!r}")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"{source}: config field 'norm_topk_prob' must be a bool, got {norm!r}")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
                moe_intermediate_size=_int(raw, "moe_intermediate_size", source, 1),
                decoder_sparse_step=_int(raw, "decoder_sparse_step", source, 1, default=1),
                mlp_only_layers=tuple(only))


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has a mixture of experts (else a dense MLP)."""
    return (config.num_experts > 0 and layer_idx not in config.mlp_only_layers
            and (layer_idx + 1) % config.decoder_sparse_step == 0)
