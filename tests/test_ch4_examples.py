"""Chapter 4: hand-built verification examples, one per classic mistake, answers worked out by hand.

Vocabulary of 3 tokens throughout. The statistical tests beside this file prove
losslessness; these pin each rule to one case and say which mistake a failure
means. Every case is run through the per-request function, the per-request
batch loop and the batched sampler, which must all agree.
"""
import pytest
import torch

PH = -1
P = [0.5, 0.3, 0.2]  # target p at the rejected position
Q = [0.8, 0.1, 0.1]  # draft q: over-proposes token 0
# residual max(0, p - q) = [0, 0.2, 0.1]


def batch_of_one(drafts, draft_probs, target_probs, bonus, greedy, u, noise):
    """rejection_sample's tensor arguments for a single request."""
    t = lambda rows: None if rows is None else torch.tensor(rows, dtype=torch.float32).reshape(-1, 3)  # noqa: E731
    return (torch.tensor(drafts, dtype=torch.int64), torch.tensor([len(drafts)]), t(draft_probs), t(target_probs),
            torch.tensor([bonus]), torch.tensor([greedy]), torch.tensor(u, dtype=torch.float32), t([noise]))


def every_sampler(sd, drafts, draft_probs, target_probs, bonus, greedy, u, noise):
    """{name: emitted tokens} from each implementation, placeholders dropped."""
    args = batch_of_one(drafts, draft_probs, target_probs, bonus, greedy, u, noise)
    got = {"rejection_sample_request": list(sd.rejection_sample_request(
        list(drafts), args[2], args[3], bonus, greedy, args[6], args[7][0]))}
    for name in ("rejection_sample_reference", "rejection_sample"):
        row = getattr(sd, name)(*args)[0].tolist()
        got[name] = [x for x in row if x != PH]
    return got


def test_recover_token_samples_the_residual_not_p(chapter):
    """noise [1, 1, 0.6]: residual / noise = [0, 0.2, 0.167] -> token 1.
    p / noise = [0.5, 0.3, 0.33] -> token 0 (recovering from p: lossy, token 0 twice counted);
    p with the draft zeroed / noise = [0, 0.3, 0.33] -> token 2 (the n-gram rule used despite q)."""
    sd = chapter("spec_decode")
    got = sd.recover_token(torch.tensor(P), torch.tensor(Q), 0, torch.tensor([1.0, 1.0, 0.6]))
    assert got != 0, "recovered token drawn from p: at a rejection sample the residual max(0, p - q) instead"
    assert got != 2, "recovered from p with the draft zeroed: with draft probs the residual is max(0, p - q)"
    assert got == 1, f"argmax(max(0, p - q) / noise) is token 1, got {got}"


def test_recover_token_without_draft_probs_zeroes_the_draft(chapter):
    """n-gram draft x = 0 (q one-hot on x): residual = p with p[0] = 0 = [0, 0.3, 0.2]; noise all 1 -> token 1.
    Recovering from p itself would emit the rejected draft 0 again."""
    sd = chapter("spec_decode")
    p = torch.tensor(P)
    got = sd.recover_token(p, None, 0, torch.ones(3))
    assert got != 0, "n-gram recovery re-emitted the rejected draft: without draft probs zero p[draft] first"
    assert got == 1, f"argmax([0, 0.3, 0.2] / 1) is token 1, got {got}"
    assert p.tolist() == pytest.approx(P), "recover_token modified target_probs in place (zero a copy)"


def test_recover_token_all_zero_residual_falls_back_to_p(chapter):
    """q == p: the residual is all zero, every ratio is 0 and argmax would say token 0 for any noise.
    Fall back to p: p / noise = [0.5, 30, 0.2] -> token 1."""
    sd = chapter("spec_decode")
    got = sd.recover_token(torch.tensor(P), torch.tensor(P), 2, torch.tensor([1.0, 0.01, 1.0]))
    assert got == 1, f"all-zero residual must recover from p (token 1 here), got {got}"


def test_rejection_emits_residual_sample(chapter):
    """Draft 0 with u = 0.9: u * q(0) = 0.72 >= p(0) = 0.5 -> rejected; recovered token 1 (the residual)."""
    sd = chapter("spec_decode")
    for name, got in every_sampler(sd, [0], [Q], [P], 2, False, [0.9], [1.0, 1.0, 0.6]).items():
        assert got != [0, 2], f"{name}: draft 0 accepted although u * q(x) = 0.72 >= p(x) = 0.5"
        assert got[0] != 0, f"{name}: recovered token drawn from p instead of the residual max(0, p - q)"
        assert len(got) == 1, (f"{name}: emitted {got}: nothing follows the recovered token (no bonus token "
                               "after a rejection, no verification of later drafts)")
        assert got == [1], f"{name}: rejected draft 0 must emit only the residual sample 1, got {got}"


def test_accept_uses_u_times_q_below_p(chapter):
    """p(1) = 0.3, q(1) = 0.6: accept iff u < p/q = 0.5. u = 0.45 accepts, u = 0.55 rejects.
    (Comparing u with p alone rejects 0.45; comparing with q / p accepts 0.55.)"""
    sd = chapter("spec_decode")
    p, q, noise = [0.2, 0.3, 0.5], [0.2, 0.6, 0.2], [1.0, 1.0, 1.0]
    for name, got in every_sampler(sd, [1], [q], [p], 0, False, [0.45], noise).items():
        assert got == [1, 0], f"{name}: u = 0.45 < p/q = 0.5 must accept draft 1 then add bonus 0, got {got}"
    for name, got in every_sampler(sd, [1], [q], [p], 0, False, [0.55], noise).items():
        assert got == [2], f"{name}: u = 0.55 >= p/q = 0.5 must reject draft 1 (residual [0, 0, 0.3] -> 2), got {got}"


def test_zero_target_mass_is_never_accepted(chapter):
    """p(1) = 0, q(1) = 1, u = 0: the test must be strict, u * q(x) < p(x) (0 < 0 is false).
    With u <= p / q the target would emit a token it gives probability 0."""
    sd = chapter("spec_decode")
    for name, got in every_sampler(sd, [1], [[0.0, 1.0, 0.0]], [[0.5, 0.0, 0.5]], 1, False, [0.0],
                                   [1.0, 1.0, 0.5]).items():
        assert got[0] != 1, (f"{name}: accepted draft 1 with p(1) = 0 at u = 0: use the strict test u * q(x) < p(x) "
                             "(u <= p/q accepts zero-mass tokens)")
        assert got == [2], f"{name}: residual [0.5, 0, 0.5] / noise [1, 1, 0.5] -> token 2, got {got}"


def test_rejected_drafts_are_discarded_and_no_bonus_follows(chapter):
    """Drafts [1, 0, 2], u = [0.1, 0.9, 0.1]: draft 1 accepted (0.1 * 0.1 < 0.3), draft 0 rejected
    (0.9 * 0.8 >= 0.5) -> emit [1, residual sample 1] and stop: draft 2 and the bonus are dropped."""
    sd = chapter("spec_decode")
    probs = [P, P, P]
    for name, got in every_sampler(sd, [1, 0, 2], [Q, Q, Q], probs, 0, False, [0.1, 0.9, 0.1],
                                   [1.0, 1.0, 0.6]).items():
        assert len(got) <= 2, (f"{name}: emitted {got}: tokens after the first rejection must be discarded "
                               "(no rollback of rejected drafts, or a bonus token after a rejection)")
        assert got == [1, 1], f"{name}: want accepted draft 1 then the recovered token 1, got {got}"


def test_bonus_token_only_when_every_draft_is_accepted(chapter):
    """q == p accepts every draft for any u < 1: drafts [0, 1] then the bonus 2."""
    sd = chapter("spec_decode")
    for name, got in every_sampler(sd, [0, 1], [P, P], [P, P], 2, False, [0.99, 0.5], [1.0, 1.0, 1.0]).items():
        assert got != [0, 1], f"{name}: all drafts accepted but no bonus token: a verify step then emits k + 1"
        assert got == [0, 1, 2], f"{name}: want drafts [0, 1] then bonus 2, got {got}"
    for name, got in every_sampler(sd, [], None, [], 2, False, [], [1.0, 1.0, 1.0]).items():
        assert got == [2], f"{name}: k = 0 must emit exactly the bonus token, got {got}"


def test_greedy_accepts_while_draft_is_the_argmax(chapter):
    """Greedy, target argmaxes [0, 1, 0] (P, P reversed, P), drafts [0, 1, 1]: accept 0 and 1,
    mismatch at position 2 -> emit its argmax 0. u = 0 would accept everything under the random rule."""
    sd = chapter("spec_decode")
    rev = [0.2, 0.5, 0.3]
    for name, got in every_sampler(sd, [0, 1, 1], [Q, Q, Q], [P, rev, P], 2, True, [0.0, 0.0, 0.0],
                                   [1.0, 0.01, 1.0]).items():
        assert got != [0, 1, 1, 2], f"{name}: greedy request verified with the random rule (u = 0 accepts all)"
        assert got[-1] != 1, f"{name}: greedy mismatch emitted the draft or a noisy sample, not argmax(p) = 0"
        assert got == [0, 1, 0], f"{name}: want accepted [0, 1] then the target argmax 0, got {got}"
    for name, got in every_sampler(sd, [0, 1], None, [P, rev], 2, True, [0.9, 0.9], [1.0, 1.0, 1.0]).items():
        assert got == [0, 1, 2], f"{name}: greedy drafts equal to the argmax are all accepted, plus bonus 2; got {got}"


def test_greedy_request_beside_a_random_one(chapter):
    """The greedy case above, batched with a random request (batched samplers take another
    path when not every request is greedy): the greedy row must still be [0, 1, 0]."""
    sd = chapter("spec_decode")
    rev = [0.2, 0.5, 0.3]
    f = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    args = (torch.tensor([0, 1, 1, 0]), torch.tensor([3, 1]), f([Q, Q, Q, P]), f([P, rev, P, P]),
            torch.tensor([2, 2]), torch.tensor([True, False]), f([0.0, 0.0, 0.0, 0.5]), f([[1.0, 0.01, 1.0]] * 2))
    for name in ("rejection_sample_reference", "rejection_sample"):
        out = getattr(sd, name)(*args)
        assert out[0].tolist() != [0, 1, 1, 2], f"{name}: greedy request verified with the random rule (u = 0 accepts all)"
        assert out[0].tolist() == [0, 1, 0, PH], f"{name}: greedy row must be [0, 1, 0, -1], got {out[0].tolist()}"
        assert out[1].tolist() == [0, 2, PH, PH], f"{name}: random row (q == p accepts) must be [0, 2], got {out[1].tolist()}"


def test_verify_step_rolls_back_rejected_drafts(chapter):
    """10 tokens cached, 1 pending, 3 drafts of which 1 accepted (2 rejected): the step computed
    1 + 3 KV entries, but the 2 rejected drafts' entries are invalid -> 10 + 4 - 2 = 12 cached;
    tokens: 11 + the accepted draft + the recovered token = 13 (seed 001 Table 4.1)."""
    sd = chapter("spec_decode")
    got = sd.apply_verify_step(10, 11, 3, 1)
    assert got[0] != 14, "num_computed_tokens kept the rejected drafts' KV: subtract L_rejected (no rollback)"
    assert got == (12, 13), f"(num_computed_tokens, num_tokens) must be (12, 13), got {got}"
