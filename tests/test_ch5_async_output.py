"""The pieces of deferred step outputs (`worker/async_output.py`) that can be
checked without a GPU: the one-transfer packing of a step's uploads, where the
next step's input takes the pending tokens, and the output built from them.
The engine-level behaviour (tokens equal synchronous scheduling's, the next step
prepared while the tokens are pending) is in test_ch5_async_scheduling.py."""
import numpy as np
import torch

from mini_vllm.sample.sampler import LogprobsTensors
from mini_vllm.worker.async_output import (DeferredStepOutput, HostStaging, feedback_indices, pack_into,
                                           packed_layout, unpack)


def test_packed_uploads_come_back_with_their_dtypes_shapes_and_values():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 10**9, size=7, dtype=np.int64),        # input ids
              rng.integers(-1, 500, size=(3, 5), dtype=np.int32),     # a block table: odd byte length
              np.array([0, 4, 9, 12], dtype=np.int32),                # query start locations
              np.zeros(0, dtype=np.int64),                            # no feedback this step
              rng.integers(0, 50, size=3, dtype=np.int64)]            # after an empty one
    layout = packed_layout(arrays)
    buf = torch.zeros(layout[0][-1], dtype=torch.uint8)
    pack_into(buf, arrays, layout)
    out = unpack(buf.clone(), arrays, layout)  # the device copy stands in for the packed buffer
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape, \
            "an upload came back with another dtype or shape: its bytes were cut at the wrong offsets"
        assert np.array_equal(t.numpy(), a), "an upload came back with other values: arrays overlap in the buffer"


def test_cpu_uploads_are_the_arrays_themselves():
    staging = HostStaging(torch.device("cpu"), 8)
    ids = np.arange(5, dtype=np.int64)
    (t,) = staging.upload(ids)
    t[0] = 42
    assert ids[0] == 42, "on a CPU the upload must wrap the array (no copy): the step's input is written in place"


def _pending(tokens, req_ids=("a", "b", "c"), sample=("a", "b"), logprobs=None, counts=None):
    return DeferredStepOutput(list(req_ids), list(sample), torch.tensor(tokens), HostStaging(torch.device("cpu"), 8),
                              logprobs, counts)


def test_feedback_takes_each_pending_token_at_its_own_position():
    pending = _pending([7, 9])  # "a" and "b" sampled; "c" was mid-prefill
    req_ids = ["b", "c", "a", "d"]
    num_tokens = np.array([10, 40, 20, 6])     # tokens the host knows, per request of this step
    computed = np.array([10, 30, 16, 6])       # b: a decode at the unknown position; a: recomputes 16..20
    num_sched = np.array([1, 8, 5, 1])
    qsl = np.array([0, 1, 9, 14, 15])
    dst, src = feedback_indices(pending, req_ids, num_tokens, computed, num_sched, qsl)
    assert (dst, src) == ([0, 13], [1, 0]), \
        "a pending token must land on its own request's row, at the first position the host lacks"
    # A request whose unknown position is not computed in this step takes nothing.
    dst, src = feedback_indices(pending, ["a"], np.array([20]), np.array([12]), np.array([4]), np.array([0, 4]))
    assert (dst, src) == ([], []), "a pending token was written over a position this step does not compute"


def test_deferred_output_lists_every_scheduled_request():
    lp = LogprobsTensors(torch.tensor([[5, 1, 2], [9, 3, 4]]), torch.tensor([[-0.5, -2.0, -3.0], [-0.25, -1.0, -4.0]]),
                         torch.tensor([1, 2]))
    out = _pending([5, 9], logprobs=lp, counts={"b": 1}).get_output()
    assert out.req_ids == ["a", "b", "c"]
    assert out.sampled_token_ids == [[5], [9], []], "a sampling request lost its token or a mid-prefill one got one"
    assert out.logprobs == {"b": [([9, 3], [-0.25, -1.0], 2)]}, \
        "logprobs must be those of the request that asked, cut to its count + the sampled token"
