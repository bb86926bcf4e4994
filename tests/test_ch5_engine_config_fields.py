"""EngineConfig's fields under vLLM's names: one name per setting, holding the resolved object.

vLLM's `VllmConfig.speculative_config` is a `SpeculativeConfig`, `compilation_config` a
`CompilationConfig` and `ModelConfig.dtype` a torch.dtype once resolved; the engine's config
resolves each in place, and the names of the resolved copies it once kept beside them are no
engine arguments.
"""
import pytest
import torch

from mini_vllm.compilation.config import CompilationConfig, CUDAGraphMode
from mini_vllm.config import EngineConfig
from mini_vllm.spec_decode.engine.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("old, new", [("speculative", "speculative_config"), ("compilation", "compilation_config"),
                                      ("torch_dtype", "dtype"), ("max_num_reqs", "max_num_seqs")])
def test_a_former_or_runner_side_name_is_an_unknown_engine_argument(old, new):
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['" + old + r"'\]") as e:
        EngineConfig.from_kwargs("", **{old: None})
    assert f"'{new}'" in str(e.value), f"the refusal of {old!r} must list the field to use, {new!r}"


def test_each_field_holds_its_resolved_object():
    cfg = EngineConfig(dtype="bf16", speculative_config=NGRAM, device="cpu",
                       compilation_config={"cudagraph_mode": "NONE"})
    assert cfg.dtype is torch.bfloat16, f"dtype must be resolved to a torch.dtype, got {cfg.dtype!r}"
    assert isinstance(cfg.speculative_config, SpeculativeConfig), (
        f"speculative_config must hold the resolved SpeculativeConfig, got {cfg.speculative_config!r}")
    assert cfg.speculative_config.num_speculative_tokens == 2, "the dict's fields were lost in resolving"
    assert isinstance(cfg.compilation_config, CompilationConfig), (
        f"compilation_config must hold the resolved CompilationConfig, got {cfg.compilation_config!r}")
    assert cfg.compilation_config.cudagraph_capture_sizes, "the resolved compilation_config lacks its defaults"
    assert cfg.cudagraph_mode_asked, "a cudagraph_mode named in the dict must still count as asked for"
    assert EngineConfig(dtype="bf16", speculative_config=NGRAM, device="cpu").speculative_config \
        is not cfg.speculative_config, "each config must resolve its own SpeculativeConfig"


def test_a_resolved_config_builds_again():
    """The resolved values are legal inputs (a config handed on is rebuilt from its fields)."""
    cfg = EngineConfig(dtype="float32", speculative_config=NGRAM, device="cpu")
    again = EngineConfig(dtype=cfg.dtype, speculative_config=cfg.speculative_config, device="cpu",
                         compilation_config=cfg.compilation_config)
    assert again.dtype is torch.float32 and again.speculative_config == cfg.speculative_config
    assert again.speculative_config is not cfg.speculative_config, (
        "a SpeculativeConfig given in must be copied: the engine adjusts its schedule in place")
    assert again.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
