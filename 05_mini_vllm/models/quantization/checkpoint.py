"""Writing an 8-bit checkpoint from a full-precision one, in the formats `load_model` reads:
vLLM's "fp8" format and compressed-tensors (FP8 W8A8, FP8 or int8 weight-only).

vLLM counterpart: none in vLLM itself (it reads such checkpoints); the files are shaped as
llm-compressor writes compressed-tensors checkpoints (`weight` 8-bit, `weight_scale` fp32
[N, 1] per channel or [1] per tensor, `quantization_config` in config.json) and as vLLM's
"fp8" format stores per-tensor scales (one per checkpoint linear: q, k and v each their own).

Used by the tests and the notebook to make FP8 / int8 checkpoints of the course's models; the
quantize functions are the ones the online schemes use, so a checkpoint written here and
loaded equals the online scheme wherever both compute the same scales (per channel: always;
per tensor: not for merged layers, whose parts here keep their own scales).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant_utils as qu

# The checkpoint linears a scheme quantizes (lm_head and embeddings stay as they are).
LINEAR_SUFFIXES = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"))
SCHEMES = ("fp8", "fp8_per_channel", "fp8_per_channel_weight_only", "int8_per_channel_weight_only")


def quantization_config_for(scheme: str) -> dict:
    """The `quantization_config` a checkpoint of `scheme` declares."""
    if scheme == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    int8 = scheme.startswith("int8")
    weights = {"num_bits": 8, "type": "int" if int8 else "float", "symmetric": True, "dynamic": False,
               "strategy": "channel"}
    acts = None if scheme.endswith("weight_only") else {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized" if int8 else "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}


def quantize_tensor(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, its scale as the checkpoint stores it: [1] per tensor, [N, 1] per channel)."""
    if scheme.startswith("int8"):
        scale = qu.int8_weight_scale(w)
        return qu.quantize_int8(w, scale), scale.reshape(-1, 1)
    scale = qu.fp8_weight_scale(w, per_channel=scheme != "fp8")
    q = qu.quantize_fp8(w, scale)
    return q, (scale if scheme == "fp8" else scale.reshape(-1, 1))


def write_quantized_checkpoint(src, dst, scheme: str) -> Path:
    """Copies the checkpoint folder `src` to `dst` with every linear weight quantized by `scheme`
    (one of SCHEMES) and `quantization_config` added to config.json."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if not files or (src / "model.safetensors.index.json").exists():
        raise ValueError(f"{src}: expected one or more unsharded *.safetensors files and no index")
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith(LINEAR_SUFFIXES):
                    q, scale = quantize_tensor(t, scheme)
                    out[name] = q.contiguous()
                    out[name[: -len("weight")] + "weight_scale"] = scale.contiguous()
                else:
                    out[name] = t.contiguous()
        save_file(out, str(dst / file.name))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config_for(scheme)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copy(extra, dst / extra.name)
    return dst
