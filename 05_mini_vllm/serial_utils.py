"""msgpack encoding of the messages between the front end and the engine core.

vLLM counterpart: `vllm/v1/serial_utils.py` (`MsgpackEncoder`,
`MsgpackDecoder`). msgspec encodes dataclasses, lists, dicts and scalars
natively and decodes them back into the declared types, so a message is
typed at both ends and nothing is pickled: a pickle from a socket can run
code, and it is slower.

Tensors (none cross today, but a runner output may grow one) travel as a
msgpack extension: dtype, shape and the raw bytes, copied once into the
message and viewed back without a copy.
"""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

_TENSOR_EXT = 1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # bfloat16 has no numpy dtype: its bytes travel as int16 and are viewed back.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        header = msgspec.msgpack.encode((str(t.dtype).removeprefix("torch."), list(t.shape)))
        return msgspec.msgpack.Ext(_TENSOR_EXT, len(header).to_bytes(4, "little") + header
                                   + raw.numpy().tobytes())
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from the engine core")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code} in an engine-core message")
    n = int.from_bytes(data[:4], "little")
    dtype_name, shape = msgspec.msgpack.decode(data[4:4 + n])
    dtype = getattr(torch, dtype_name)
    wire = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(data[4 + n:]), dtype=wire) if len(data) > 4 + n \
        else torch.empty(0, dtype=wire)
    return flat.view(dtype).reshape(shape)


class MsgpackEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Decodes one message type (`t`), or plain msgpack values when `t` is Any."""

    def __init__(self, t: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)
