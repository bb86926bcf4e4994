"""Triton rejection sampler == per-request reference on identical draws (interpreter on CPU)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.kernels.rejection_sampler import rejection_sample_triton
from mini_vllm.spec_decode import rejection_sample_reference
from mini_vllm.spec_decode.random_draws import random_verify_batch
from strategies import verify_batch_specs

# Compiled on a GPU when there is one; otherwise the interpreter runs on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(args):
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


@settings(max_examples=20)
@given(verify_batch_specs(max_vocab=40), st.sampled_from([4, 16, 64]))
def test_kernel_equals_reference(spec, block_v):
    """block_v below the vocabulary forces the multi-block argmax/recovery loops."""
    args = random_verify_batch(spec.num_draft_tokens, spec.vocab_size, spec.is_greedy, spec.with_draft_probs,
                               torch.Generator().manual_seed(spec.seed))
    want = rejection_sample_reference(*args)
    got = rejection_sample_triton(*on_device(args), block_v=block_v).cpu()
    assert torch.equal(got, want), f"kernel disagrees with the reference on identical draws:\n{got}\n{want}"


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_kernel_ties_go_to_lowest_index(with_draft_probs):
    """Flat target rows make every argmax (greedy) and every recovery score (random) a tie
    across blocks; torch picks the lowest index."""
    vocab, k = 12, 2
    target = torch.full((k, vocab), 1.0 / vocab)
    draft = torch.zeros(k, vocab)
    draft[:, 0] = 1.0
    args = (torch.tensor([0, 0, 0, 0]), torch.tensor([2, 2]), draft.repeat(2, 1) if with_draft_probs else None,
            target.repeat(2, 1), torch.tensor([1, 2]), torch.tensor([True, False]),
            torch.full((4,), 0.99), torch.ones(2, vocab))
    want = rejection_sample_reference(*args)
    for block_v in (4, 16):
        assert torch.equal(rejection_sample_triton(*on_device(args), block_v=block_v).cpu(), want), "tie-breaking differs from torch.argmax"


def test_kernel_bad_shapes_raise():
    args = list(random_verify_batch([2, 1], 5, [False, True], True, torch.Generator().manual_seed(0)))
    args[7] = torch.ones(3, 5)
    with pytest.raises(ValueError, match="recovery_noise"):
        rejection_sample_triton(*args)


def test_rejection_sampler_triton_backend_matches_reference():
    """End to end through RejectionSampler: seeded generators give every backend the same draws."""
    from mini_vllm.spec_decode import RejectionSampler, SpecDecodeMetadata, TemperatureTopKTopP

    g = torch.Generator().manual_seed(11)
    drafts = [[1, 2, 3], [], [4, 5]]
    meta = SpecDecodeMetadata.make(drafts, device=DEVICE)
    logits = torch.randn((3 + 1) + (0 + 1) + (2 + 1), 9, generator=g).to(DEVICE)
    draft_logits = torch.randn(5, 9, generator=g).to(DEVICE)
    sampling = TemperatureTopKTopP.make([0.0, 0.9, 1.2], [0, 3, 0], [1.0, 1.0, 0.8])
    outs = []
    for backend in ("reference", "triton"):
        gens = {i: torch.Generator(device=DEVICE).manual_seed(100 + i) for i in range(3)}
        outs.append(RejectionSampler(backend)(meta, None, logits, sampling, gens, draft_logits=draft_logits))
    assert torch.equal(outs[0], outs[1]), f"triton backend differs from reference:\n{outs[1]}\n{outs[0]}"


def test_kernel_all_zero_residual_recovers_from_target():
    """q >= p everywhere up to rounding: the residual is all zero, so recovery
    must fall back to p (p / noise peaks at token 1), as the reference does."""
    args = (torch.tensor([0]), torch.tensor([1]), torch.tensor([[0.5002, 0.25, 0.25]]),
            torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([2]), torch.tensor([False]),
            torch.tensor([0.99999]), torch.tensor([[1.0, 0.01, 1.0]]))
    want = rejection_sample_reference(*args)
    got = rejection_sample_triton(*on_device(args)).cpu()
    assert want[0].tolist() == [1, -1], "reference must recover from p when the residual is empty"
    assert torch.equal(got, want), f"kernel mishandles an all-zero residual: {got} vs {want}"
