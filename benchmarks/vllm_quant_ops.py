"""Runs in `.venv-vllm`: vLLM 0.32's own FP8 functions on tensors the course hands it, for
`tests/test_vs_vllm_quant.py` (the course never imports vLLM).

    python vllm_quant_ops.py IN.pt OUT.pt

IN.pt holds {"cases": [{"w": [N, K], "x": [M, K]}, ...]} (bf16 or fp16). For each case, OUT.pt
gets what vLLM's `quantization="fp8_per_channel"` computes on this CPU:
* the weight's per-channel scale and fp8 codes (`online/fp8.py`: `weight_amax`,
  `_fp8_channel_scale`, `_fp8_quant_per_channel`, as `Fp8PtpcOnlineLinearMethod` calls them);
* the activation's dynamic per-token quantization (`QuantFP8.forward_native`, per token);
* the product of the torch kernel vLLM picks on a CPU without AMX
  (`ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm`).
"""
from __future__ import annotations

import sys

import torch


def main(src: str, dst: str) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    out = []
    with set_current_vllm_config(VllmConfig()):
        quant_x = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        for case in torch.load(src)["cases"]:
            w, x = case["w"], case["x"]
            w_scale = online._fp8_channel_scale(online.weight_amax(w, dim=-1, keepdim=True))
            w_q = online._fp8_quant_per_channel(w, w_scale)
            x_q, x_scale = quant_x.forward_native(x)
            y = ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm(
                None, A=x_q, B=w_q.t(), out_dtype=x.dtype, As=x_scale, Bs=w_scale, bias=None,
                output_shape=[x.shape[0], w.shape[0]])
            out.append({"w_scale": w_scale.reshape(-1), "w_q": w_q, "x_scale": x_scale, "x_q": x_q[: x.shape[0]],
                        "y": y})
    torch.save({"cases": out}, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
