"""The stop rules (counterpart of `check_stop` in `vllm/v1/core/sched/utils.py`)."""
from __future__ import annotations

from .request import Request, RequestStatus


def check_stop(req: Request, tok: int, max_model_len: int) -> RequestStatus | None:
    """The finished status that `tok`, the token just appended to `req`, gives
    it, or None if it goes on. The stop token itself stays in the output."""
    sp = req.sampling_params
    if req.num_output_tokens < sp.min_tokens:
        # min_tokens: EOS and stop ids do not count yet (the sampler masks them too).
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
    if not sp.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if tok in sp.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
