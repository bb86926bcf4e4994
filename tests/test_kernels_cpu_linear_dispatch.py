"""Which matmul a CPU linear runs (`mini_vllm.models.cpu_ops.linear_path`,
`MINI_VLLM_CPU_LINEAR`): every path forced on this CPU gives x @ W.T + b with a row's
bits independent of its batch, and the AMX rule (bf16 weights to oneDNN's AMX-packed
matmul, vLLM's choice there) is checked on any CPU by pretending the CPU has AMX."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_layer_ops_native as native
from mini_vllm.models import cpu_ops
from mini_vllm.models.linear import ColumnParallelLinear


def _layer(n_in: int, n_out: int, dtype: torch.dtype) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(n_in, n_out, bias=True)
    g = torch.Generator().manual_seed(n_in * 7 + n_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g))
        layer.bias.copy_(torch.randn(n_out, generator=g))
    return layer.to(dtype)


def _runnable(path: str, x, w) -> bool:
    if path == "onednn":
        return cpu_ops._AVAILABLE and x.dtype in cpu_ops.PACKABLE
    if path == "native":
        return native.handles_linear(x, w)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["native", "onednn", "torch"])
def test_each_forced_path_computes_the_linear(monkeypatch, path, dtype):
    layer = _layer(64, 96, dtype)
    x = torch.randn(130, 64).to(dtype)
    if not _runnable(path, x, layer.weight):
        pytest.skip(f"this CPU cannot run the {path} matmul for {dtype} (its AVX2 build, or oneDNN's bf16, is absent)")
    monkeypatch.setattr(cpu_ops, "CPU_LINEAR", path)
    assert cpu_ops.linear_path(x, layer.weight) == path, f"MINI_VLLM_CPU_LINEAR={path} was not honoured"
    with torch.inference_mode():
        got = layer(x)
        alone = layer(x[:1])
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * 8,
                               msg=f"the {path} matmul does not compute x @ W.T + b")
    if path != "torch":
        assert layer._packed is not None and layer._packed[0][-1] == (path == "native"), (
            f"the {path} matmul ran without its own packed weight (a copy packed for the other kernel was used)")
        assert torch.equal(got[:1], alone), (
            f"{path}: row 0's product changed with 130 rows in the call: a request's tokens would depend on its batch")


def test_amx_sends_bf16_weights_to_onednn(monkeypatch):
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_ops, "CPU_LINEAR", "auto")
    monkeypatch.setattr(cpu_ops, "_AVAILABLE", True)
    monkeypatch.setattr(cpu_ops, "PACKABLE", (torch.float32, torch.bfloat16))
    monkeypatch.setitem(cpu_ops._state, "amx", True)
    assert cpu_ops.linear_path(x, w) == "onednn", \
        "a bf16 weight on an AMX CPU must take oneDNN's AMX-packed matmul (vLLM's onednn_mm)"
    assert cpu_ops.linear_path(x.float(), w.float()) != "onednn" or not native.handles_linear(x.float(), w.float()), \
        "AMX has no fp32 tiles: an fp32 weight the C++ kernel takes must stay with it"
    monkeypatch.setitem(cpu_ops._state, "amx", False)
    want = "native" if native.handles_linear(x, w) else "onednn"
    assert cpu_ops.linear_path(x, w) == want, "without AMX the C++ kernel comes first for the shapes it takes"


def test_forcing_onednn_where_it_cannot_pack_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_ops, "CPU_LINEAR", "onednn")
    monkeypatch.setattr(cpu_ops, "PACKABLE", (torch.float32,))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="MINI_VLLM_CPU_LINEAR=onednn: oneDNN cannot pack a torch.bfloat16"):
        cpu_ops.linear_path(x, torch.zeros(64, 64, dtype=torch.bfloat16))


def test_linear_switch_is_validated_at_import():
    code = "import mini_vllm.models.cpu_ops as c; print(c.CPU_LINEAR)"
    bad = subprocess.run([sys.executable, "-c", code], env={"MINI_VLLM_CPU_LINEAR": "amx", "PATH": ""},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and ("MINI_VLLM_CPU_LINEAR must be one of ('auto', 'native', 'onednn', 'torch'), "
                                    "got 'amx'") in bad.stderr, bad.stderr[-500:]
