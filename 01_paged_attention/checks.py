"""Argument checks used by Chapter 1's reference functions.

They are the kernels' own checks (`mini_vllm.kernels.paged_checks`, built on
`mini_vllm.kernels.validation`), re-exported here, so a learner sees one error
message whichever implementation runs. Imports flow kernels <- chapters, so
the checks live on the kernels' side.

Every failure is a ValueError naming the argument and the allowed range.
"""
from __future__ import annotations

from mini_vllm.kernels.paged_checks import (  # noqa: F401  (re-exported)
    INDEX_DTYPES,
    check_cu_seqlens_q,
    check_paged_attention_args,
    check_reshape_and_cache_args,
)
