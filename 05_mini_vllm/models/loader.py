"""Load a Hugging Face checkpoint folder straight into a mini-vLLM model.

vLLM counterparts: `vllm/model_executor/model_loader/default_loader.py`
(`DefaultModelLoader`), `weight_utils.py` (`safetensors_weights_iterator`) and
each model's `load_weights` with its stacked-parameter mapping.

Invariants:
* only `config.json` and `*.safetensors` are read (single file, or the shards
  listed by `model.safetensors.index.json`); transformers is never imported;
* the model is built directly in the requested dtype and device, then every
  parameter is filled from exactly one checkpoint tensor (or one tensor per
  shard of a merged parameter); anything else is an error:
  - a checkpoint tensor of the wrong shape -> ValueError naming the file, the
    tensor and both shapes,
  - a tensor the model has no place for -> ValueError naming file and tensor,
  - a model parameter no file provides -> ValueError naming the tensor;
* a tied model (`tie_word_embeddings`) needs no `lm_head.weight`; a copy in
  the checkpoint is ignored;
* fp8 KV-cache scales (`...self_attn.k_scale` and the other names vLLM reads)
  go to their attention layer's `checkpoint_kv_scales` (`kv_scales.py`);
* a mixture of experts (`FusedMoE`) may be stored per expert or fused
  (`FusedMoE.checkpoint_layouts`); one of its layouts must be complete;
* weight loaders get lazy safetensors slices, never whole tensors: under
  tensor parallelism (the model built inside `use_tp_group`) each rank reads
  only its shard's bytes from the file, never the full model.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from mini_vllm.attention.backends import default_backend

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .kv_scales import parse_kv_scale_name, set_checkpoint_scales
from .fused_moe.layer import FusedMoE
from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .linear import LinearBase
from .quantization import quant_config_for_model, use_quant_config
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                  "qwen3_moe": Qwen3MoeForCausalLM}
LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Derived buffers some older checkpoints store; recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

assert set(MODEL_REGISTRY) == set(SUPPORTED_MODEL_TYPES)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: must be JSON with a 'weight_map' object ({e!r})") from None
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {index} does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight file in {path}")
    return files


def _expected_tensors(model) -> tuple[dict[str, tuple[str, object]], list[list[set[str]]]]:
    """(checkpoint tensor name -> (model parameter name, shard id or None),
    per FusedMoE its layouts' name sets, one of which the checkpoint must hold whole)."""
    expected, alternatives = {}, []
    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE):
            layouts = module.checkpoint_layouts(prefix)
            alternatives.append([set(layout) for layout in layouts])
            for layout in layouts:
                expected.update(layout)
    experts = {pname for pname, _ in expected.values()}
    for pname, _ in model.named_parameters():  # a tied lm_head is listed once, as the embedding
        if pname in experts:
            continue
        for packed, parts in model.packed_modules_mapping.items():
            if f".{packed}." in pname:
                for src, shard in parts:
                    expected[pname.replace(f".{packed}.", f".{src}.")] = (pname, shard)
                break
        else:
            expected[pname] = (pname, None)
    return expected, alternatives


def load_weights(model, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    expected, alternatives = _expected_tensors(model)
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    kv_scales = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected and parse_kv_scale_name(name) is not None:
                    kv_scales[name] = f.get_tensor(name)
                    continue
                if name not in expected:
                    if (tied and name == "lm_head.weight") or name.endswith(_IGNORED_SUFFIXES):
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    raise ValueError(f"{file}: unknown tensor {name!r} with shape {shape}: "
                                     f"{type(model).__name__} has no parameter for it")
                pname, shard = expected[name]
                param = params[pname]
                lazy = f.get_slice(name)  # a loader reads only its rank's rows/columns
                try:
                    if shard is None:
                        param.weight_loader(param, lazy)
                    else:
                        param.weight_loader(param, lazy, shard)
                except ValueError as e:
                    raise ValueError(f"{file}: tensor {name!r}: {e}") from None
                seen.add(name)
    set_checkpoint_scales(model, kv_scales)
    optional = set()
    for layouts in alternatives:  # the layouts this checkpoint does not use are not missing
        best = min(layouts, key=lambda names: len(names - seen))
        optional.update(*(names for names in layouts if names is not best))
    missing = sorted(set(expected) - seen - optional)
    if missing:
        pname, _ = expected[missing[0]]
        raise ValueError(f"{[str(f) for f in files]}: missing tensor {missing[0]!r} (for parameter "
                         f"{pname!r} of shape {tuple(params[pname].shape)}); {len(missing)} missing in all: "
                         f"{missing[:8]}")


def load_model(path, dtype: torch.dtype = torch.float32, device="cpu", attention_backend: str | None = None,
               enable_expert_parallel: bool = False, quantization: str | None = None):
    """Build the model named by `path/config.json` and load its weights.

    Returns (model in eval mode, ModelConfig). `attention_backend` defaults to
    `default_backend(device)`. `enable_expert_parallel` (vLLM's flag) splits a
    mixture of experts by whole experts over the tensor-parallel ranks; a dense
    model refuses it (it would have nothing to split). `quantization` (vLLM's engine
    argument) and the checkpoint's `quantization_config` choose 8-bit weights for the
    linear layers (`quantization/`); online schemes quantize once the weights are loaded.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if dtype not in LOAD_DTYPES:
        raise ValueError(f"dtype must be one of {LOAD_DTYPES}, got {dtype!r}")
    config = ModelConfig.from_json(path / "config.json")
    files = safetensors_files(path)
    backend = attention_backend or default_backend(device)
    extra = {}
    if enable_expert_parallel:
        if config.num_experts == 0:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model (model_type qwen3_moe), "
                             f"got model_type {config.model_type!r}")
        extra["enable_expert_parallel"] = True
    quant = quant_config_for_model(quantization, config.raw, dtype, device, str(path / "config.json"))
    with _default_dtype(dtype), torch.device(device), use_quant_config(quant):
        model = MODEL_REGISTRY[config.model_type](config, attention_backend=backend, **extra)
    load_weights(model, files)
    for module in model.modules():  # online schemes quantize the loaded weights here (vLLM: process_weights_after_loading)
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    return model.eval(), config
