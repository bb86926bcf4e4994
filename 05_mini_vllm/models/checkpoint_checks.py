"""What the front end checks of a checkpoint before any engine process starts.

vLLM counterparts: `vllm/transformers_utils/config.py` (`get_config`: a folder
without a config file is "Invalid repository ID or local directory specified"),
`vllm/model_executor/models/registry.py` (`_raise_for_unsupported`: "Model
architectures [...] are not supported for now"), both run by
`EngineArgs.create_engine_config` in the calling process, and
`vllm/model_executor/model_loader/default_loader.py` ("Cannot find any model
weights with ..."), which vLLM finds only in its worker. Here all three run in
`EngineConfig.__post_init__`, so `LLM(...)`, `AsyncLLM` and `mini_vllm serve`
raise them in the caller's process at once, with vLLM's types and wording,
instead of an engine-core process failing to start. What only the core can find
(out of memory, a kernel that fails to build, a tensor of the wrong shape) still
fails its start-up.

Invariant: reads config.json and lists the weight files; loads no tensor.
"""
from __future__ import annotations

from pathlib import Path

from mini_vllm.models.config import ModelConfig
from mini_vllm.models.loader import MODEL_REGISTRY, safetensors_files
from mini_vllm.models.quantization import quant_config_for_model

SUPPORTED_ARCHITECTURES = tuple(sorted(cls.__name__ for cls in MODEL_REGISTRY.values()))

# vLLM 0.32's message for a path that is neither a repository id it can resolve nor a folder
# with a config file (this engine reads local folders only: no Hub).
_INVALID_MODEL = ("Invalid repository ID or local directory specified: '{model}'.\n"
                  "Please verify the following requirements:\n"
                  "1. Provide a valid Hugging Face repository ID.\n"
                  "2. Specify a local directory that contains a recognized configuration file.\n"
                  "   - For Hugging Face models: ensure the presence of a 'config.json'.\n")


def check_checkpoint(model: str, quantization: str | None = None, dtype=None) -> ModelConfig:
    """The checkpoint's ModelConfig, or the error vLLM raises for it:
    ValueError (no folder, or no config.json in it; an architecture or model type
    this engine does not run; a malformed config; a `quantization` that contradicts the
    checkpoint's quantization_config or cannot run `dtype`), RuntimeError (no weights)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(_INVALID_MODEL.format(model=model))
    cfg = ModelConfig.from_json(path / "config.json")  # ValueError naming the field
    if cfg.architectures and not set(cfg.architectures) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"Model architectures {cfg.architectures} are not supported for now. "
                         f"Supported architectures: {list(SUPPORTED_ARCHITECTURES)}")
    if dtype is not None:  # the device only picks activation scales: any will do for the check
        quant_config_for_model(quantization, cfg.raw, dtype, "cpu", str(path / "config.json"))
    try:
        safetensors_files(path)
    except FileNotFoundError:
        raise RuntimeError(f"Cannot find any model weights with `{model}`") from None
    return cfg
