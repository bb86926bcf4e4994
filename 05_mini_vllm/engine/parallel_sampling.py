"""Parallel sampling (n > 1) in the front end: one request, n independent core requests.

vLLM counterpart: `vllm/v1/engine/parallel_sampling.py` (`ParentRequest`,
`get_child_info`, `_get_child_sampling_params`).

The engine core never hears of n: `ParentRequest` turns a validated request
with n samples into n `EngineCoreRequest`s, each with n = 1, and the output
processor (`output_processor.py`) joins their outputs back into one
`RequestOutput` with n `CompletionOutput`s. The children share the prompt's
KV blocks through prefix caching (a child admitted in the same step as its
siblings hits the blocks they are writing in that very step), as in vLLM; with
prefix caching off each child computes the prompt on its own.

Ids: sample 0 keeps the request's own id, sample i >= 1 is "{i}_{request_id}"
(`child_request_id`), so a request with n = 1 is sent exactly as it came.
Seeds: child i draws with seed + i (vLLM's rule), wrapped into int64, so
seeded siblings differ and every sample is reproducible on its own.
"""
from __future__ import annotations

import dataclasses

from mini_vllm.engine import EngineCoreRequest


def child_request_id(parent_request_id: str, index: int) -> str:
    """The core id of sample `index` (>= 1) of a parallel-sampling request (vLLM's format)."""
    return f"{index}_{parent_request_id}"


def child_sampling_params(sp, index: int):
    """Sample `index`'s params: n = 1, and seed + index so seeded siblings differ.

    The sum wraps around within int64 (a seed's range): a parent seeded with
    2**63 - 1 must not give a child a seed its own params reject. torch seeds
    a generator with the value modulo 2**64, so the wrapped seed draws what
    vLLM's unwrapped seed + index draws."""
    changes = {"n": 1}
    if sp.seed is not None:
        changes["seed"] = (sp.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63
    return dataclasses.replace(sp, **changes)


class ParentRequest:
    """The n samples of one request, as the core will see them."""

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        self.n = request.sampling_params.n

    def core_request_ids(self) -> list[str]:
        rid = self.request.request_id
        return [rid] + [child_request_id(rid, i) for i in range(1, self.n)]

    def child_requests(self) -> list[EngineCoreRequest]:
        """One core request per sample (the request itself when n = 1)."""
        if self.n == 1:
            return [self.request]
        return [dataclasses.replace(self.request, request_id=cid,
                                    sampling_params=child_sampling_params(self.request.sampling_params, i))
                for i, cid in enumerate(self.core_request_ids())]
