"""Chapter 4: regression tests for bugs found by acceptance testing.

Oracle for the denormal residual: the residual max(0, p - q) is built with a
single positive entry, so the normalised residual is a point mass and the only
legal recovered token is that entry, whatever the noise. The three
implementations (per-request reference, batched PyTorch, Triton kernel) must
all return it.
"""
import pytest
import torch

from mini_vllm.kernels.rejection_sampler import rejection_sample_triton
from mini_vllm.spec_decode import rejection_sampler as rs
from mini_vllm.spec_decode.random_draws import generate_exponential_noise, generate_uniform_probs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALLEST_DENORMAL = 1e-45  # rounds to 2**-149 in float32
V = 8

IMPLS = {
    "reference": rs.rejection_sample_reference,
    "batched": rs.rejection_sample,
    "triton": rejection_sample_triton,
}


def denormal_residual_case(with_draft_probs: bool):
    """Draft 1 is rejected; the residual's only positive entry is token 7,
    a denormal, so residual / noise (noise 3) rounds to 0 everywhere."""
    p = torch.zeros(1, V)
    q = None
    if with_draft_probs:
        p[0, 0], p[0, 1] = 0.5, 0.4999
        q = torch.zeros(1, V)
        q[0, 0], q[0, 1] = 0.5, 0.5  # p - q: 0 at token 0, negative at 1
    else:
        p[0, 1] = 0.9999  # without draft probs the draft's own entry is zeroed
    p[0, 7] = SMALLEST_DENORMAL
    assert p[0, 7] > 0 and float(p[0, 7] / 3.0) == 0.0, "the test needs a residual whose ratio underflows"
    args = (torch.tensor([1]), torch.tensor([1]), q, p, torch.tensor([5]), torch.tensor([False]),
            torch.tensor([0.99995]), torch.full((1, V), 3.0))
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_denormal_residual_recovers_its_only_token(impl, with_draft_probs):
    out = IMPLS[impl](*denormal_residual_case(with_draft_probs))
    assert out.tolist() == [[7, -1]], (
        f"denormal residual bug ({impl}): the residual's only positive entry is token 7, "
        f"got {out.tolist()} (token 0 has probability 0; falling back to p ignores the residual)")


def test_scaled_race_matches_plain_race_on_normal_residuals():
    """The exact 2**64 scale must not change any pick where nothing underflows:
    same tokens as argmax(residual / noise) computed directly."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(64, 50, generator=g), -1)
    q = torch.softmax(2 * torch.randn(64, 50, generator=g), -1)
    noise = torch.empty(64, 50).exponential_(generator=g)
    for i in range(64):
        want = int((torch.clamp(p[i] - q[i], min=0) / noise[i]).argmax())
        assert rs.recover_token(p[i], q[i], 0, noise[i]) == want, "scaling moved the argmax of a normal residual"


def test_generator_keys_outside_batch_rejected_by_both_draw_functions():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="generator key 2 must be a request index in \\[0, 2\\)"):
        generate_uniform_probs([1, 3], {2: g})
    with pytest.raises(ValueError, match="generator key 2 must be a request index in \\[0, 2\\)"):
        generate_exponential_noise(2, 5, {2: g})
    for key in (-1, "0"):
        with pytest.raises(ValueError, match="generator key"):
            generate_uniform_probs([1, 3], {key: g})
    # A key inside the batch still seeds that request's draws.
    a = generate_uniform_probs([1, 3], {1: torch.Generator().manual_seed(7)})[1:]
    b = generate_uniform_probs([1, 3], {1: torch.Generator().manual_seed(7)})[1:]
    assert torch.equal(a, b), "a seeded request's uniforms must repeat with the same seed"
