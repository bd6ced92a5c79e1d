"""The BLS's per-request draft length and switch-off (pipeline.serving.bls.RoundPolicy) and the chain evidence it
shares with the engine's policy (pipeline.acceptance)."""

import math

import pytest

from pipeline.acceptance import EARLY_STOP_RISK, ChainEvidence, acceptance_upper_bound
from pipeline.serving.bls import BACK_OFF_TOKENS, ROUNDS_BEFORE_ACCEPTANCE_CHECK, RoundPolicy


def test_chain_evidence_counts_the_positions_a_chain_checked_and_what_each_step_stands_for():
    evidence = ChainEvidence()
    evidence.add(2, 4)  # accepted 2 of 4: positions 1-3 checked, the third rejected
    evidence.add(4, 4)  # all accepted: 4 checked
    evidence.add(0, 1, stands_for=4)  # a probe cut from 4, rejected: 1 checked, stands for a draft of 4
    assert (evidence.checked, evidence.accepted, evidence.steps, evidence.draft_tokens) == (8, 6, 3, 12)
    pool = ChainEvidence.pooled([evidence, evidence])
    assert (pool.checked, pool.accepted, pool.lengths[4]) == (16, 12, 6)
    assert ChainEvidence().optimistic_accepted() == math.inf  # nothing checked: nothing ruled out


def test_the_upper_bound_of_nothing_accepted_is_chernoffs():
    """With none of n positions accepted, n * KL(0 || p) = -n ln(1 - p) <= ln(1 / risk) gives p = 1 - risk^(1/n)."""
    for n in (1, 2, 5, 40):
        assert acceptance_upper_bound(0, n, EARLY_STOP_RISK) == pytest.approx(1 - EARLY_STOP_RISK ** (1 / n), abs=1e-8)
    assert acceptance_upper_bound(10, 10, EARLY_STOP_RISK) == pytest.approx(1.0)
    assert 0.5 < acceptance_upper_bound(5, 10, EARLY_STOP_RISK) < acceptance_upper_bound(5, 10, 0.001) < 1


def test_the_upper_bound_takes_faded_evidence_an_ulp_off():
    """Evidence faded by multiplications can read accepted / checked an ulp below 1 (or above, or below 0). The
    bisection's midpoint then rounds to 1, where KL divides by zero: that raised ZeroDivisionError inside an engine
    step of the served lookup (2026-12-06: every request of the step failed). The observed rate is clamped and the
    bound is 1 (or the zero-acceptance bound) there."""
    assert acceptance_upper_bound(1 - 2**-53, 1.0, EARLY_STOP_RISK) == 1.0
    assert acceptance_upper_bound(1 + 2**-52, 1.0, EARLY_STOP_RISK) == 1.0
    assert acceptance_upper_bound(-2**-60, 1.0, EARLY_STOP_RISK) == acceptance_upper_bound(0, 1.0, EARLY_STOP_RISK)
    accepted, checked = 0.0, 0.0
    for _ in range(2000):  # the engine's class evidence: one position a step, all accepted, faded each step
        accepted, checked = accepted * 0.99 + 1, checked * 0.99 + 1
        for observed in (accepted, checked - accepted):
            assert 0 <= acceptance_upper_bound(observed, checked, EARLY_STOP_RISK) <= 1


def test_a_costly_draft_starts_from_one_token_probes_and_a_hopeless_one_backs_off_early():
    """A draft token costs 0.6 of a plain step. Each rejected probe of one token stands for the draft of 4 it cut:
    after one, a position's acceptance may still be 0.95 (3.5 tokens from a draft of 4, above the 2.4 it costs); after
    two it is at most 0.78 (2.2 tokens each, below 2.4): the request backs off 6 rounds before the window would have,
    then probes again on fresh evidence and backs off twice as long."""
    policy = RoundPolicy(k=4, bar=0.6, slow_start=True)
    assert policy.draft_len == 1
    assert [policy.record(1, 0), policy.record(1, 0)] == [0, BACK_OFF_TOKENS]
    assert policy.draft_len == 1 and policy.rounds == 0  # fresh evidence, one-token drafts again
    assert [policy.record(1, 0), policy.record(1, 0)] == [0, 2 * BACK_OFF_TOKENS]
    decent = RoundPolicy(k=4, bar=0.6, slow_start=True)
    assert decent.record(1, 1) == 0 and decent.draft_len == 3 and not decent.probing  # an accepted probe ends it
    assert RoundPolicy(k=4, bar=0.6).draft_len == 4  # no measured cost: drafts of K from the start
    assert RoundPolicy(k=4, bar=0.0, slow_start=True).draft_len == 4  # no switch-off: nothing to probe for


def test_the_window_decides_what_the_early_rounds_cannot_rule_out():
    """Drafts of 4 whose first token is accepted and second rejected bring 1 of 4 (25 %). Each checked 2 positions and
    accepted one, which leaves a position's acceptance high enough for the early stop never to fire: against a 30 %
    bar the window backs the request off after ROUNDS_BEFORE_ACCEPTANCE_CHECK rounds (lookup misses count), against
    20 % it keeps drafting."""
    policy = RoundPolicy(k=4, bar=0.3, adaptive=False)
    assert policy.record(0, 0) == 0  # a lookup miss is a round
    backs = [policy.record(4, 1) for _ in range(ROUNDS_BEFORE_ACCEPTANCE_CHECK - 1)]
    assert backs == [0] * (ROUNDS_BEFORE_ACCEPTANCE_CHECK - 2) + [BACK_OFF_TOKENS]
    assert policy.draft_len == 4  # not adaptive: back at K
    kept = RoundPolicy(k=4, bar=0.2, adaptive=False)
    rounds = 3 * ROUNDS_BEFORE_ACCEPTANCE_CHECK
    assert [kept.record(4, 1) for _ in range(rounds)] == [0] * rounds


def test_recent_requests_rounds_keep_a_request_backed_off_until_their_evidence_fades():
    """A request's rounds join the recent evidence. A new request whose recent evidence rules out the bar starts with a
    back-off, and at the end of a back-off asks again (backing off twice as long); once the evidence has faded (the
    decoder fades it with the tokens it generates) it drafts again: one rejected probe leaves a position's acceptance
    up to 0.95, which a draft of 4 would pay with at a bar of 0.6."""
    recent = ChainEvidence()
    first = RoundPolicy(k=4, bar=0.6, slow_start=True, recent=recent)
    assert first.opening_plain == 0  # nothing known yet
    assert [first.record(1, 0), first.record(1, 0)] == [0, BACK_OFF_TOKENS]
    assert (recent.checked, recent.lengths[4]) == (2, 2)  # its two probes, each standing for a draft of 4
    assert first.resume() == 2 * BACK_OFF_TOKENS  # its back-off is over, but the evidence still rules the bar out
    second = RoundPolicy(k=4, bar=0.6, slow_start=True, recent=recent)
    assert second.opening_plain == BACK_OFF_TOKENS and second.draft_len == 1
    recent.fade(0.5)  # one probe's worth left
    assert second.resume() == 0 and second.draft_len == 1  # drafts again, from a one-token probe
    decent = ChainEvidence()
    decent.add(3, 4)
    decent.add(1, 4)
    assert RoundPolicy(k=4, bar=0.6, slow_start=True, recent=decent).opening_plain == 0
    assert RoundPolicy(k=4, bar=0.6, slow_start=True).resume() == 0  # no recent evidence given: nothing to ask


def test_the_decoder_keeps_recent_evidence_only_where_requests_run_rounds_under_a_switch_off():
    """Nothing to keep (nor to fade per streamed chunk) where the BLS drafts nothing itself or no bar switches off."""
    from pipeline.serving.bls import SpeculativeDecoder
    from pipeline.serving.params import BlsSettings

    for mode, engine_lookup, rate, kept in (("draft_target", False, 0.1, True), ("ngram", False, 0.1, True),
                                            ("ngram", True, 0.1, False), ("draft_target", False, 0.0, False),
                                            ("medusa", False, 0.1, False)):
        settings = BlsSettings(tokenizer_dir="", speculative_mode=mode, engine_lookup=engine_lookup,
                               min_acceptance_rate=rate)
        assert (SpeculativeDecoder(settings, client=None, metrics=None).recent is not None) == kept, mode
