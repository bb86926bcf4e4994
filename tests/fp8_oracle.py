"""An fp8 oracle that shares no code with torch's float8 conversions or the course's.

The value of every byte is decoded from its bits (sign, exponent, mantissa, bias), and
quantising x picks the nearest finite value of that table (ties: the even code, as
round-to-nearest-even does), after saturating to the largest finite value. Used by the
fp8 KV-cache tests as the meaning of "e4m3" and "e5m2".
"""
import math

import torch

FORMATS = {  # name -> (exponent bits, mantissa bits, bias, has inf/NaN codes like IEEE)
    "e4m3": (4, 3, 7, False),  # OCP E4M3 "fn": no inf, only S.1111.111 is NaN
    "e5m2": (5, 2, 15, True),
}
TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def decode(fmt: str, code: int) -> float:
    e_bits, m_bits, bias, ieee = FORMATS[fmt]
    sign = -1.0 if code >> 7 else 1.0
    exp = (code >> m_bits) & ((1 << e_bits) - 1)
    mant = code & ((1 << m_bits) - 1)
    if ieee and exp == (1 << e_bits) - 1:
        return sign * math.inf if mant == 0 else math.nan
    if not ieee and exp == (1 << e_bits) - 1 and mant == (1 << m_bits) - 1:
        return math.nan
    if exp == 0:
        return sign * mant / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mant / (1 << m_bits)) * 2.0 ** (exp - bias)


def table(fmt: str) -> torch.Tensor:
    """float64 [256]: the value of each byte."""
    return torch.tensor([decode(fmt, c) for c in range(256)], dtype=torch.float64)


def quantize_codes(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of the nearest finite value to each element of x, saturated: the magnitude
    is rounded among the non-negative values (float64 distances), the sign bit is x's."""
    values = table(fmt)[:128]  # codes 0..127: +0 and the positive values
    codes = torch.arange(128)[torch.isfinite(values)]
    vals = values[codes]
    big = float(vals.max())
    mag = x.double().flatten().abs().clamp(max=big)
    dist = (mag[:, None] - vals[None, :]).abs()
    tied = dist == dist.min(dim=1, keepdim=True).values
    # Among equally near values the even code (even last mantissa bit) wins: round half to even.
    rank = torch.where(tied, (codes[None, :] % 2) * 1000 + torch.arange(len(codes))[None, :], 10 ** 9)
    out = codes[rank.argmin(dim=1)] | (torch.signbit(x.flatten()).long() << 7)
    return out.to(torch.uint8).view(x.shape)


def dequantize_codes(fmt: str, codes: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 value of each byte times scale."""
    return table(fmt)[codes.long()] * scale
