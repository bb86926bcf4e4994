"""Chapter 4 mutants: classic rejection-sampling mistakes planted in the reference.

Most rules live twice in the reference, in the readable per-request sampler and
in the vectorised batch one, so most mistakes are planted in each. The
hand-built examples run first so the first failure names the mistake.
"""
from mutants.core import Mutant

TESTS = [
    "tests/test_ch4_examples.py",
    "tests/test_ch4_rejection_sampler.py",
    "tests/test_ch4_proposers.py",
    "tests/test_ch4_lossless.py",
]
RS = "04_spec_decode/rejection_sampler.py"
META = "04_spec_decode/metadata.py"

MUTANTS: list[Mutant] = [
    Mutant(
        name="recover_from_p",
        path=RS,
        old="residual = torch.clamp(target_probs - draft_probs, min=0.0)",
        new="residual = target_probs.clone()",
        tests=TESTS,
        why="recovered token drawn from p instead of the residual max(p - q, 0)",
    ),
    Mutant(
        name="recover_from_p_batched",
        path=RS,
        old="residual = (p - draft_probs[t_r]).clamp_(min=0.0)",
        new="residual = p.clone()",
        tests=TESTS,
        why="batched sampler: recovered token drawn from p instead of the residual",
    ),
    Mutant(
        name="ngram_recovery_keeps_draft",
        path=RS,
        old="residual = target_probs.clone()\n        residual[draft_token_id] = 0.0",
        new="residual = target_probs.clone()",
        tests=TESTS,
        why="n-gram draft (no q): recovery from p may re-emit the rejected draft",
    ),
    Mutant(
        name="no_zero_residual_fallback",
        path=RS,
        old="if float(residual.max()) <= 0.0:\n        residual = target_probs",
        new="if False:\n        residual = target_probs",
        tests=TESTS,
        why="an all-zero residual (p == q up to rounding) emits token 0 instead of sampling p",
    ),
    Mutant(
        name="accept_le",
        path=RS,
        old="if not bool(uniform_probs[i] * q_x < p[x]):",
        new="if not bool(uniform_probs[i] * q_x <= p[x]):",
        tests=TESTS,
        why="accept with u <= p/q instead of u < min(1, p/q): p(x) = 0 accepted at u = 0",
    ),
    Mutant(
        name="accept_le_batched",
        path=RS,
        old="uniform_probs.to(device) * q_x < p_x)",
        new="uniform_probs.to(device) * q_x <= p_x)",
        tests=TESTS,
        why="batched sampler: accept with u <= p/q",
    ),
    Mutant(
        name="accept_ignores_q",
        path=RS,
        old="q_x = 1.0 if draft_probs is None else draft_probs[i, x]",
        new="q_x = 1.0",
        tests=TESTS,
        why="accept with probability p(x) even when the draft has probabilities (u < p, not u < p/q)",
    ),
    Mutant(
        name="no_stop_at_rejection",
        path=RS,
        old="return out + [recover_token(p, q, x, recovery_noise)]",
        new="out.append(recover_token(p, q, x, recovery_noise))\n                continue",
        tests=TESTS,
        why="rejected drafts not rolled back: verification goes on after the first rejection",
    ),
    Mutant(
        name="bonus_after_rejection_batched",
        path=RS,
        old="full = torch.nonzero(~has_rej).squeeze(1)",
        new="full = torch.arange(batch, device=device)",
        tests=TESTS,
        why="bonus token emitted even when a draft was rejected",
    ),
    Mutant(
        name="greedy_mismatch_emits_draft",
        path=RS,
        old="return out + [best]",
        new="return out + [int(x)]",
        tests=TESTS,
        why="greedy mismatch emits the draft instead of the target's argmax",
    ),
    Mutant(
        name="greedy_uses_random_rule",
        path=RS,
        old="accepted = torch.where(greedy_tok, drafts == target_argmax,",
        new="accepted = torch.where(greedy_tok & False, drafts == target_argmax,",
        tests=TESTS,
        why="batched sampler verifies greedy requests with the random accept test",
    ),
    Mutant(
        name="no_rollback_of_rejected_kv",
        path=META,
        old="return num_computed_tokens + delta - rejected,",
        new="return num_computed_tokens + delta,",
        tests=TESTS,
        why="num_computed_tokens keeps the rejected drafts' KV (Table 4.1's - L_rejected forgotten)",
    ),
]
