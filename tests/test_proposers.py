"""Proposers without an engine: n-gram lookup, tree building, the policy wrapper, metrics."""

import copy
import random

import pytest

from pipeline.spec_stats import SpecStats, aggregate
from pipeline.reference.policy import (PAST_EVIDENCE_DECAY, PAST_PROPOSED, POSITION_EVIDENCE, Fading,
                                       PolicyConfig, PolicyProposer)
from pipeline.reference.proposers import Draft, NgramProposer, ProposalInput
from pipeline.reference.tree import node_depths, path_to, tree_from_choices
from pipeline.sequences import MATCH_LENGTH_CAP


def test_ngram_proposes_the_continuation_of_the_longest_suffix_match():
    ngram = NgramProposer(min_ngram=1, max_ngram=3)
    #            0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (2, 6, 7) never occurred before; (6, 7) did at 1 and 6 -> latest at 6, followed by 2, 6, 7
    assert ngram.lookup(context, 3).token_ids == [2, 6, 7]
    assert ngram.lookup(context, 1).token_ids == [2]
    assert ngram.lookup(context, 3).match_length == 2  # 1 precedes that (6, 7), 2 the context's
    # the match length goes past max_ngram: all five tokens before the 9 match the context's last five
    assert ngram.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5], 2) == Draft(token_ids=[9, 1], match_length=5)


def test_ngram_prefers_a_longer_match_over_a_later_shorter_one():
    ngram = NgramProposer(min_ngram=1, max_ngram=2)
    context = [1, 2, 3, 4, 9, 2, 5, 1, 2]
    # (1, 2) occurs at 0 -> [3, 4]; the single token 2 also occurs later at 5 -> [5], but 2-grams win
    assert ngram.lookup(context, 2).token_ids == [3, 4]


def test_ngram_without_a_match_or_budget_proposes_nothing():
    ngram = NgramProposer(min_ngram=2, max_ngram=3)
    assert ngram.lookup([1, 2, 3, 4], 4).token_ids == []
    assert ngram.lookup([1, 2, 1, 2], 0).token_ids == []
    drafts = ngram.propose([ProposalInput("a", [1, 2, 3, 1, 2], 2), ProposalInput("b", [7], 2)])
    assert [d.token_ids for d in drafts] == [[3, 1], []]


def test_min_token_prob_cuts_the_draft_where_earlier_occurrences_disagree():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    context = [7, 1, 2, 3, 7, 1, 2, 4, 7, 1, 2, 4, 7]
    # 7 occurred at 0, 4 and 8; the latest continues 1 2 4 7. All three agree on 1 and 2; on the third token
    # 2 of 3 say 4 (the one at 0 says 3); the two left agree on 7: frequencies 1, 1, 2/3, 1
    assert NgramProposer(1, 1).lookup(context, 4).token_ids == [1, 2, 4, 7]  # no cut: the latest continuation
    assert NgramProposer(1, 1, min_token_prob=0.6).lookup(context, 4).token_ids == [1, 2, 4, 7]  # 2/3 >= 0.6
    assert NgramProposer(1, 1, min_token_prob=0.7).lookup(context, 4).token_ids == [1, 2]  # 2/3 < 0.7: cut before the 4
    # the first token is kept whatever its frequency: 7 was followed by 1 and then by 2 (latest)
    assert NgramProposer(1, 1, min_token_prob=0.9).lookup([7, 1, 7, 2, 7], 3).token_ids == [2]
    assert NgramProposer(1, 1).lookup([7, 1, 7, 2, 7], 3).token_ids == [2, 7]


def _lookup_by_definition(tokens, k, min_ngram, max_ngram, min_token_prob):
    """ngram_lookup's docstring, position by position: every earlier occurrence of the longest matching suffix,
    the latest one's continuation, cut where the share of agreeing occurrences' product falls below min_token_prob;
    the match length: the longest suffix (at most the cap) that also ends where that continuation starts."""
    if k <= 0:
        return [], 0
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        starts = [s + n for s in range(len(tokens) - n - 1, -1, -1) if tokens[s:s + n] == tokens[-n:]]
        if not starts:
            continue
        matched = max(m for m in range(n, min(MATCH_LENGTH_CAP, starts[0]) + 1)
                      if tokens[starts[0] - m:starts[0]] == tokens[-m:])
        draft, prob = tokens[starts[0]:starts[0] + k], 1.0
        for i, token in enumerate(draft):
            live = [s for s in starts if s + i < len(tokens)]
            starts = [s for s in live if tokens[s + i] == token]
            prob *= len(starts) / len(live)
            if i and prob < min_token_prob:
                return draft[:i], matched
        return draft, matched
    return [], 0


def test_ngram_lookup_finds_what_its_definition_finds():
    # token ids whose 4-byte encodings share bytes (256 = 0x100, 65536, 1): a match across two tokens' bytes
    # must not count; long contexts of two tokens reach the match length's cap
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([[1, 2], [1, 2, 3, 256], [0, 1, 256, 65536, 257], list(range(6)), [7]])
        tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
        k, lo = rng.randint(0, 6), rng.randint(1, 3)
        hi, cut = rng.randint(lo, 4), rng.choice([0.0, 0.4, 0.7])
        draft = NgramProposer(lo, hi, cut).lookup(tokens, k)
        assert (draft.token_ids, draft.match_length) == _lookup_by_definition(tokens, k, lo, hi, cut), tokens


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(min_ngram=3, max_ngram=2)


def test_tree_from_choices_orders_breadth_first_and_links_parents():
    tree = tree_from_choices([[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, -1, 0, 0, 1, 2)
    assert tree.depths == [1, 1, 2, 2, 2, 3] == node_depths(tree.parents)
    assert tree.ranks == [0, 1, 0, 1, 0, 0]
    assert path_to(tree.parents, 5) == [0, 2, 5]


def test_tree_missing_prefix_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[0, 1\] has no parent path \[0\]"):
        tree_from_choices([[1], [0, 1]])


class FixedProposer:
    """Proposes 0, 1, 2, ... up to K and records what it was asked."""

    needs_hidden_states = False

    def __init__(self):
        self.asked: list[int] = []
        self.released: list[str] = []

    def propose(self, inputs):
        self.asked = [inp.num_tokens for inp in inputs]
        return [Draft(token_ids=list(range(inp.num_tokens))) for inp in inputs]

    def update(self, request_id, num_accepted, num_proposed):
        pass

    def release(self, request_id):
        self.released.append(request_id)


def ask(policy, n=1, max_new_tokens=128, num_generated=1, k=8):  # 1: the answer has begun (0: a prompt's last step)
    inputs = [ProposalInput(f"r{i}", [1, 2, 3], k, max_new_tokens=max_new_tokens, num_generated=num_generated)
              for i in range(n)]
    return [len(d.token_ids) for d in policy.propose(inputs)]


def run_chains(policy, accept, steps, n=1):
    """`steps` steps of n requests whose drafts are accepted through their first accept[i] tokens (an int: all the
    same); returns the draft lengths the policy asks for next."""
    accept = [accept] * n if isinstance(accept, int) else accept
    for _ in range(steps):
        for i, k in enumerate(ask(policy, n=n)):
            if k:
                policy.update(f"r{i}", min(accept[i], k), k)
    return ask(policy, n=n)


def test_policy_adapts_draft_length_like_transformers_heuristic():
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=4, max_draft_tokens=8, adaptive=True))
    assert ask(policy) == [4]
    policy.update("r0", 4, 4)  # all accepted: +2
    assert ask(policy) == [6]
    policy.update("r0", 6, 6)
    assert ask(policy) == [8]  # capped at max_draft_tokens
    policy.update("r0", 2, 8)  # a rejection: -1
    assert ask(policy) == [7]


def test_policy_switches_a_request_off_when_acceptance_stays_low():
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.3, window=3)
    for accepted, k in ((0, 0), (3, 4)):  # alone: nothing accepted stops, 75 % keeps going
        policy = PolicyProposer(FixedProposer(), config)
        for _ in range(3):
            ask(policy)
            policy.update("r0", accepted, 4)
        assert ask(policy) == [k]
    policy = PolicyProposer(FixedProposer(), config)  # together: the pool (37.5 %) pays, both go on
    ask(policy, n=2)
    for _ in range(3):
        policy.update("r0", 0, 4)
        policy.update("r1", 3, 4)
    assert ask(policy, n=2) == [4, 4]
    for _ in range(3):
        policy.update("r0", 0, 4)  # r1's luck runs out: 9 of 48 together (19 %) stops both
        policy.update("r1", 0, 4)
    assert ask(policy, n=2) == [0, 0]


def test_policy_switch_off_uses_the_draft_token_cost_when_it_is_the_higher_bar():
    """Drafts whose first token is always accepted and the rest never: after the slow start's probe, 4 of the window's
    13 draft tokens (31 %), which do not pay where a draft token costs 0.4 of a step and pay where it costs 0.2; free
    draft tokens draft 4 from the start, and their 25 % clears the 10 % floor."""
    for cost, k in ((0.4, 0), (0.2, 4)):
        config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=3, draft_token_costs=((1, cost),))
        assert run_chains(PolicyProposer(FixedProposer(), config), accept=1, steps=8) == [k]
    free = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=3))
    assert run_chains(free, accept=1, steps=8) == [4]


def test_policy_slow_start_drafts_only_as_far_as_the_probes_acceptance_pays():
    """A draft token costs 0.27 of a step in drafts of 4 and 0.38 in drafts of one (the weak trained-pair draft's
    measured costs: a step's fixed part 0.15 and 0.23 a token). One lucky probe of two (first-position acceptance 1/2)
    opens drafts of 3, the longest whose chain brings its cost under the chain model (0.875 tokens against 0.85; 4
    would bring 0.94 against 1.08); a rejection there (1/3) goes back to probes. A draft whose first probe is accepted
    drafts 4 at once."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8, draft_token_costs=((1, 0.27),),
                          one_token_costs=((1, 0.38),))
    policy, asked = PolicyProposer(FixedProposer(), config), []
    for accepted in (0, 1, 0):
        [k] = ask(policy)
        asked.append(k)
        policy.update("r0", min(accepted, k), k)
    assert asked + ask(policy) == [1, 1, 3, 1]
    assert run_chains(PolicyProposer(FixedProposer(), config), accept=4, steps=1) == [4]


def test_fading_counts_fade_as_counts_multiplied_every_step_across_rescales():
    """Fading's counts read what multiplying every count by the decay every step gives, also after 30000 steps, past
    the factor's rescale (0.99^22900 is below 1e-100), with counts added between fades, in every list it made."""
    fading = Fading()
    counts, other, eager = fading.counts(2), fading.counts(1), [0.0, 0.0]
    for step in range(30_000):
        if step % 7 == 0:
            counts.add(step % 2, 3.0)
            eager[step % 2] += 3.0
        if step == 0:
            other.add(0, 5.0)
        fading.fade()
        eager = [x * PAST_EVIDENCE_DECAY for x in eager]
        if step % 5_000 == 0 or step > 29_990:
            assert list(counts) == pytest.approx(eager, rel=1e-9)
            assert other[0] == pytest.approx(5.0 * PAST_EVIDENCE_DECAY ** (step + 1), rel=1e-9)
    assert fading.factor > 1e-100 and eager[0] > 1  # rescaled, and the counts still hold recent evidence


def test_policy_gate_does_a_step_as_propose_would_and_says_whether_anyone_drafts():
    """The engine asks `skips_step` before it builds a step's proposal inputs: True where nobody drafts (the step done
    there), else False and the next propose() finishes the step. A draft token costs 0.6 of a step: two probes
    rejected, then the early stop. Stepped through the gate or through propose() alone, the policy asks the same
    drafts and its evidence fades by the same steps (a step the gate begins fades it once, not twice)."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8, draft_token_costs=((1, 0.6),))
    gated, plain = PolicyProposer(FixedProposer(), config), PolicyProposer(FixedProposer(), config)

    def step(policy, gate):
        if gate and policy.skips_step(["r0"], [1]):
            return None  # nobody drafts: no inputs built, no propose()
        [k] = ask(policy)
        if k:
            policy.update("r0", 0, k)
        return k

    asked = [step(gated, True) for _ in range(6)]
    assert asked == [1, 1, None, None, None, None]
    assert [step(plain, False) for _ in range(6)] == [1, 1, 0, 0, 0, 0]
    assert list(gated.position_proposed) == list(plain.position_proposed)
    assert gated.position_proposed[0] < 2  # faded 4 times
    assert gated.requests.keys() == plain.requests.keys() == {"r0"}


@pytest.mark.parametrize("seed", range(4))
def test_policy_gate_skips_working_out_an_unchanged_switched_off_step_and_decides_as_it_would(seed):
    """A step `skips_step` switched off where that holds until the running requests or their evidence change (the
    batch gate, or a switch-off the finished requests' fading evidence does not decide) is not worked out again while
    neither changes. Requests join, leave, are requeued and come back or are cancelled at random, drafts are accepted
    at random; at every step the gate decides as a copy of the policy working the step out from scratch does, and the
    evidence fades alike; some steps ask propose() alone."""
    rng = random.Random(seed)
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=4, max_batch_for_speculation=3,
                          draft_token_costs=((1, 0.3), (4, 0.6)), one_token_costs=((1, 0.45), (4, 0.8)))
    policy = PolicyProposer(FixedProposer(), config)
    running, preempted, next_id, skipped, worked_out = [], [], 0, 0, 0
    for _ in range(600):
        if rng.random() < 0.05 and running:
            policy.release(running.pop(rng.randrange(len(running))))
        if rng.random() < 0.03 and running:  # requeued: the policy still follows it
            preempted.append(running.pop(rng.randrange(len(running))))
        if rng.random() < 0.03 and preempted:  # cancelled while requeued, or back
            request_id = preempted.pop(0)
            policy.release(request_id) if rng.random() < 0.5 else running.append(request_id)
        if rng.random() < 0.06 and len(running) < 5:
            running.append(f"r{next_id}")
            next_id += 1
        if not running:
            continue
        asks_gate = rng.random() < 0.8  # else propose() alone (it begins the step itself)
        if asks_gate:
            fresh = copy.deepcopy(policy)
            fresh._off_requests = None  # the same policy with nothing to skip: it works the step out
            expected = fresh.skips_step(list(running), [1] * len(running))
            memoized = policy._off_requests == running and policy._off_version == policy.evidence_version
            assert policy.skips_step(list(running), [1] * len(running)) == expected
            assert policy.fading.factor == pytest.approx(fresh.fading.factor, rel=1e-12)
            skipped += memoized
            worked_out += not memoized
        if not asks_gate or not expected:
            inputs = [ProposalInput(r, [1, 2, 3], 4, max_new_tokens=128, num_generated=1) for r in running]
            for inp, draft in zip(inputs, policy.propose(inputs)):
                if draft.token_ids:
                    accepted = rng.choice([0, 0, 0, len(draft.token_ids)]) if seed % 2 else 0
                    policy.update(inp.request_id, accepted, len(draft.token_ids))
    assert skipped > 100 and worked_out > 50  # both paths ran


def test_policy_stops_a_hopeless_draft_before_its_window_is_full():
    """A draft token costs 0.6 of a step. The slow start probes with one draft token, and each probe stands for the
    draft of 4 it cut: after 2 probes rejected (2 positions checked, none accepted), a position's acceptance is at most
    1 - 20^(-1/2) = 0.78 at 95%, which brings at most 0.55 of a token per draft token at K=4: below the bar, so it stops
    6 steps before the window of 8. The first accepted token ends the slow start; free draft tokens draft 4 from the
    start and wait for the window."""
    for accept, cost, asks in ((0, 0.6, [[1], [1], [0]]), (2, 0.6, [[1], [4], [4]]), (0, 0.0, [[4], [4], [4]])):
        policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8,
                                                              draft_token_costs=((1, cost),) if cost else ()))
        assert [run_chains(policy, accept, steps) for steps in (0, 1, 1)] == asks


@pytest.mark.parametrize("k, bar", [(4, 0.5), (8, 0.3)])
def test_policy_early_stop_stops_a_draft_at_the_break_even_in_about_5_percent_of_windows(k, bar):
    """Simulated chain drafts whose positions are each accepted with probability alpha, alpha set so that the expected
    acceptance (sum(alpha^i, i <= K) / K) is the bar: the early stop may end such a draft before its window in about
    5% of windows (EARLY_STOP_RISK), not more (counting draft tokens as independent samples stopped 15-17% here),
    with the slow start's short drafts standing for the drafts of K they cut; a draft that accepts nothing still stops
    within 4 steps, each a probe of one draft token."""
    alpha = 0.0
    for step in (0.5 ** i for i in range(1, 40)):  # bisection on alpha
        if sum((alpha + step) ** i for i in range(1, k + 1)) / k <= bar:
            alpha += step
    rng, windows, stopped = random.Random(0), 1000, 0
    config = PolicyConfig(num_draft_tokens=k, max_draft_tokens=k, min_acceptance_rate=0.05, window=8,
                          draft_token_costs=((1, bar),))
    for _ in range(windows):
        policy, proposed = PolicyProposer(FixedProposer(), config), 0
        while proposed < config.window * k:  # then the window decides
            [asked] = ask(policy)
            if asked == 0:
                stopped += 1
                break
            accepted = 0
            while accepted < asked and rng.random() < alpha:
                accepted += 1
            policy.update("r0", accepted, asked)
            proposed += asked
    assert stopped / windows <= 0.07
    useless = PolicyProposer(FixedProposer(), config)
    steps = 0
    while ask(useless) == [1]:
        useless.update("r0", 0, 1)
        steps += 1
    assert 2 <= steps <= 4 and ask(useless) == [0]


def test_policy_keeps_a_decent_request_through_a_run_of_rejections():
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.3, window=3))
    ask(policy)
    for accepted in (4, 4, 0, 0, 0):  # 8 of 20 so far: 40 % >= 30 %
        policy.update("r0", accepted, 4)
    assert ask(policy) == [4]


def test_policy_batch_gate_and_short_outputs():
    inner = FixedProposer()
    policy = PolicyProposer(inner, PolicyConfig(num_draft_tokens=4, max_batch_for_speculation=2,
                                                min_new_tokens_for_speculation=8))
    assert ask(policy, n=3) == [0, 0, 0]  # three running > 2: nobody speculates
    assert inner.asked == []  # a proposer of committed tokens alone is not asked when nobody drafts
    follower = FixedProposer()
    follower.needs_hidden_states = True  # it follows the target's features (EAGLE): it sees every request
    gated = PolicyProposer(follower, PolicyConfig(num_draft_tokens=4, max_batch_for_speculation=2))
    assert ask(gated, n=3) == [0, 0, 0] and follower.asked == [0, 0, 0]
    assert ask(policy, n=2) == [0, 0]  # the batch is the requests it follows: r2 still runs (it was not released)
    policy.release("r2")
    assert ask(policy, n=2) == [4, 4]
    assert ask(policy, n=1, max_new_tokens=4) == [0]  # short output
    assert ask(policy, n=1, max_new_tokens=10, num_generated=7) == [2]  # K <= tokens still needed - 1
    policy.release("r0")
    assert inner.released == ["r2", "r0"] and "r0" not in policy.requests


def test_metrics_count_positions_and_derive_rates():
    a, b = SpecStats(), SpecStats()
    a.record_step(draft_depth=0, num_draft_tokens=0, num_accepted=0, num_new_tokens=1)  # prefill
    a.record_step(draft_depth=4, num_draft_tokens=4, num_accepted=2, num_new_tokens=3)
    a.record_step(draft_depth=4, num_draft_tokens=4, num_accepted=4, num_new_tokens=5)
    b.record_step(draft_depth=2, num_draft_tokens=3, num_accepted=0, num_new_tokens=1)  # a 3-node tree of depth 2
    assert a.acceptance_rate == 6 / 8 and a.mean_accepted_length == 3.0 and a.tokens_per_forward == 3.0
    assert a.acceptance_by_position == [1.0, 1.0, 0.5, 0.5]
    total = aggregate([a, b])
    assert total.draft_tokens == 11 and total.accepted_tokens == 6 and total.spec_steps == 3
    assert total.proposed_by_position == [3, 3, 2, 2] and total.accepted_by_position == [2, 2, 1, 1]
    assert total.summary()["tokens_per_forward"] == round(10 / 4, 4)


def test_medusa_heads_from_an_engine_match_the_folder_format(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from pipeline.reference.medusa import load_medusa_dir, medusa_heads_from_engine

    g = torch.Generator().manual_seed(0)
    folder, engine = {}, {}
    for h in range(2):
        w, b, lm = torch.randn(16, 16, generator=g), torch.randn(16, generator=g), torch.randn(32, 16, generator=g)
        folder.update({f"{h}.0.linear.weight": w, f"{h}.0.linear.bias": b, f"{h}.1.weight": lm})
        engine.update({f"medusa_heads.{h}.0.linear.weight": w, f"medusa_heads.{h}.0.linear.bias": b,
                       f"medusa_heads.{h}.lm_head.weight": lm})
    save_file(folder, tmp_path / "medusa_lm_head.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))  # 5: the known lie
    target_lm_head = torch.zeros(32, 16)
    from_folder = load_medusa_dir(tmp_path, target_lm_head)
    from_engine = medusa_heads_from_engine(engine, {"num_medusa_heads": 2, "num_medusa_layers": 1}, target_lm_head)
    x = torch.randn(3, 16, generator=g)
    assert len(from_folder) == 2  # counted from the file, not the config
    for a, b in zip(from_folder, from_engine):
        assert torch.equal(a.logits(x), b.logits(x))


def test_medusa_pickle_weights_need_permission(tmp_path):
    import torch

    from pipeline.reference.medusa import load_medusa_dir

    (tmp_path / "config.json").write_text("{}")
    torch.save({"0.0.linear.weight": torch.zeros(2, 2)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="allow_pickle_weights"):
        load_medusa_dir(tmp_path, torch.zeros(4, 2))


def test_medusa_tree_deeper_than_its_heads_is_refused():
    from pipeline.reference.medusa import MedusaProposer

    with pytest.raises(ValueError, match="only 1 heads"):
        MedusaProposer([object()], [[0], [0, 0]])



def test_policy_break_even_follows_the_running_batch_size():
    config = PolicyConfig(draft_token_costs=((8, 0.6), (1, 0.2)))  # measured points, in any order
    assert [round(config.break_even(b), 3) for b in (1, 2, 8, 16)] == [0.2, round(0.2 + 0.4 / 7, 3), 0.6, 0.6]
    assert PolicyConfig().break_even(8) == 0.0  # unmeasured: free
    linear = PolicyConfig(min_acceptance_rate=0.1, draft_token_costs=((1, 0.3),))
    assert linear.step_costs(1) == (0.0, 0.3)  # no one-token costs: K times a draft token's
    assert linear.tokens_needed(1, steps=10, draft_tokens=40) == pytest.approx(12)  # 0.3 of each draft token
    assert PolicyConfig(min_acceptance_rate=0.5, draft_token_costs=((1, 0.3),)).tokens_needed(1, 10, 40) == 20
    assert PolicyConfig(min_acceptance_rate=0.0, draft_token_costs=((1, 0.3),)).tokens_needed(1, 10, 40) == 0  # off


def test_policy_step_costs_are_affine_through_the_costs_at_k_and_at_one():
    """Drafts of 4 cost 0.4 of a step a token (1.6 a step), drafts of 1 cost 0.85: a step costs 0.6 plus 0.25 a token,
    per batch size; where a token of K costs as much as a draft of 1 (or more) the model stays linear."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, draft_token_costs=((1, 0.4), (8, 0.7)),
                          one_token_costs=((8, 1.0), (1, 0.85)))
    fixed, per_token = config.step_costs(1)
    assert (round(fixed, 6), round(per_token, 6)) == (0.6, 0.25)
    assert fixed + 4 * per_token == pytest.approx(4 * 0.4) and fixed + per_token == pytest.approx(0.85)
    assert config.tokens_needed(1, steps=10, draft_tokens=20) == pytest.approx(10 * 0.6 + 20 * 0.25)
    fixed, per_token = config.step_costs(8)  # 2.8 a step at K=4, 1.0 at 1
    assert (round(fixed, 6), round(per_token, 6)) == (0.4, 0.6)
    for k, at_one in ((4, 0.3), (1, 0.9)):  # a draft of one cheaper than a token of 4; K=1 has no second point
        linear = PolicyConfig(num_draft_tokens=k, draft_token_costs=((1, 0.4),), one_token_costs=((1, at_one),))
        assert linear.step_costs(1) == (0.0, 0.4)


def test_policy_switches_off_short_drafts_that_pay_per_token_but_not_per_step():
    """A proposer that finds one token a step (prompt lookup often finds fewer than K), accepted 60% of the time, at K=4
    where a draft token of 4 costs 0.4 of a step: priced at 0.4 a token it pays and goes on; where a draft of one token
    was measured at 0.85 of a step it does not, and the policy stops it."""
    def run(one_token_costs):
        config = PolicyConfig(num_draft_tokens=4, max_draft_tokens=4, min_acceptance_rate=0.1, window=4,
                              draft_token_costs=((1, 0.4),), one_token_costs=one_token_costs)
        policy = PolicyProposer(FixedProposer(), config)
        for step in range(40):
            if ask(policy) == [0]:
                return step
            policy.update("r0", int(step % 5 < 3), 1)  # 3 of every 5 accepted
        return None

    assert run(()) is None
    assert run(((1, 0.85),)) is not None


def test_policy_pools_the_running_requests_evidence_with_many_in_flight():
    """With 8 in flight the costlier batch bar applies, and the slow start's probe (one draft token each) and one step
    of the batch (8 x 4 draft tokens) are enough evidence: the requests stop together after them, long before their
    own window of 8 steps, the lucky ones included. When the batch shrinks to the two requests that did well, they
    speculate again; drafts accepted through their first token alone (28 %) keep speculating at batch 1 (bar 20 %)."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8, draft_token_costs=((1, 0.2), (8, 0.5)))
    policy = PolicyProposer(FixedProposer(), config)
    accept = [4, 2, 1, 1, 1, 1, 1, 0]  # 7 of 8 probes accepted: at 7/8 per position a chain of 4 pays at 0.5 a token
    assert run_chains(policy, accept, steps=1, n=8) == [4] * 8
    assert run_chains(policy, accept, steps=1, n=8) == [0] * 8  # pooled 18 of 40 (45 %) < 50 %
    for i in range(2, 8):
        policy.release(f"r{i}")  # r0 (5 of 5) and r1 (3 of 5) run on alone: bar 24 % at batch 2
    assert ask(policy, n=2) == [4, 4]
    alone = PolicyProposer(FixedProposer(), config)
    assert run_chains(alone, accept=1, steps=8) == [4]


def test_policy_takes_no_evidence_from_drafts_for_a_prompts_last_step():
    """Prompt lookup drafts for the step that completes a prompt, from the prompt alone; an answer's opening rarely
    copies it. With 8 in flight those 32 misses filled the window and switched lookup off for good; they no longer
    count (nor shrink K): the first drafts of the answer decide, and a batch that misses there too stops."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8, adaptive=True)
    policy = PolicyProposer(FixedProposer(), config)
    assert ask(policy, n=8, num_generated=0) == [4] * 8  # the prompts' last step
    for i in range(8):
        policy.update(f"r{i}", 0, 4)
    assert ask(policy, n=8) == [4] * 8  # still on, K unchanged
    for i in range(8):
        policy.update(f"r{i}", 0, 4)  # the answer's first drafts miss too: 0 of 32
    assert ask(policy, n=8) == [0] * 8


def test_policy_ends_drafts_at_the_first_position_that_does_not_pay_at_the_running_batch():
    """A draft token costs 0.3 of a step with 4 in flight and nothing alone. Drafts of 4 whose first two tokens are
    always accepted and the last two never: with 4 in flight, after the slow start's probe and once positions 2 and 3
    have 16 draft tokens of evidence, drafts stop after 2 tokens (the pool's 52 % still pays, so speculation stays on);
    a request alone drafts 4 again; the evidence fades, so with 4 in flight position 2 is tried again after some
    steps."""
    config = PolicyConfig(num_draft_tokens=4, max_draft_tokens=4, min_acceptance_rate=0.1, window=2,
                          draft_token_costs=((1, 0.0), (4, 0.3)))
    policy = PolicyProposer(FixedProposer(), config)
    assert run_chains(policy, accept=2, steps=1, n=4) == [4] * 4
    assert run_chains(policy, accept=2, steps=4, n=4) == [4] * 4  # 16 draft tokens at positions 2, 3, a little less
    assert run_chains(policy, accept=2, steps=1, n=4) == [2] * 4
    assert policy.useful_positions(1) == 4  # free draft tokens: every position pays
    steps = 1
    while ask(policy, n=4) == [2] * 4:  # nothing new is verified: only the fading changes the evidence
        steps += 1
    assert steps >= 10 and ask(policy, n=4) == [4] * 4
    for i in range(1, 4):
        policy.release(f"r{i}")
    assert ask(policy, n=1) == [4]


def test_policy_cuts_a_steps_drafts_to_the_row_count_that_pays_best():
    """A step's measured cost per draft row count at 4 in flight: two draft rows nearly free, a third 1.6 plain steps
    (where the AVX2 int8 GEMM's next 6-row block begins). Four 2-token drafts at the prior chance, 0.5 a token, are cut
    to the two tokens the block holds ((4 + 1) / 1.02 tokens per unit of step time against 8 / 1.70 for all eight),
    the first requests' first tokens; once the evidence says every token is accepted, all eight pay (11.8 / 1.70)
    and stay. Without costs at the running batch size (a request alone here) nothing is cut."""
    costs = (1.0, 1.0, 1.02, 1.6, 1.62, 1.64, 1.66, 1.68, 1.70)
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=2, max_draft_tokens=2,
                                                          row_costs=((4, costs),)))
    assert ask(policy, n=4, k=2) == [1, 1, 0, 0]
    for _ in range(4):
        for i in range(4):
            policy.update(f"r{i}", 2, 2)  # every draft token accepted
    assert ask(policy, n=4, k=2) == [2] * 4
    for i in range(1, 4):
        policy.release(f"r{i}")
    assert ask(policy, n=1, k=2) == [2]


def test_the_row_cut_prices_a_position_without_evidence_as_the_one_before():
    """The cut would keep a position it never drafts at the prior (0.5) for good: with the first position's evidence
    at 0.97 and none for the second, 2-token drafts at 4 in flight (0.1 of a step a row) were cut to one token. A
    later position with less than POSITION_EVIDENCE draft tokens is priced as the one before, so the drafts stay
    whole ((4 + 8 x 0.97) / 1.8 against (4 + 4 x 0.97) / 1.4); once the second position's evidence says it is never
    accepted, the cut takes it off."""
    costs = tuple(1.0 + 0.1 * rows for rows in range(9))
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=2, max_draft_tokens=2,
                                                          row_costs=((4, costs),)))
    for _ in range(8):
        assert ask(policy, n=4, k=1) == [1] * 4
        for i in range(4):
            policy.update(f"r{i}", 1, 1)  # one-token drafts, every one accepted: evidence for the first position only
    assert policy.position_proposed[0] > 16 and policy.position_proposed[1] == 0
    assert ask(policy, n=4, k=2) == [2] * 4
    for _ in range(5):
        for i in range(4):
            policy.update(f"r{i}", 1, 2)  # the second token never accepted
        ask(policy, n=4, k=2)
    assert policy.position_proposed[1] >= POSITION_EVIDENCE
    assert ask(policy, n=4, k=2) == [1] * 4


def test_policy_row_costs_past_the_measured_rows_grow_by_their_mean_cost_a_row():
    """More draft tokens than row counts measured: the cost goes on at the measured rows' mean cost a row, so a long
    tail of likely tokens stays (8 at chance 0.5 over 2 measured rows of 0.05 each)."""
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=8, max_draft_tokens=8,
                                                          row_costs=((1, (1.0, 1.05, 1.1)),)))
    assert ask(policy, n=1, k=8) == [8]


def test_policy_keeps_a_losing_batch_off_while_requests_come_and_go():
    """At 4 in flight the bar is high (a draft token costs 0.8 of a step); the requests stop after one step of
    evidence. When one finishes and a new one joins, the finished one's evidence fills the newcomer's share of
    the window, so the batch stays off (it used to start again with every newcomer). The finished evidence
    fades: after some plain steps new requests are tried again."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=2, draft_token_costs=((1, 0.2), (4, 0.8)))
    policy = PolicyProposer(FixedProposer(), config)

    def step(ids):
        return [len(d.token_ids) for d in policy.propose([ProposalInput(i, [1, 2, 3], 8, num_generated=1) for i in ids])]

    for k in (1, 4):  # the slow start's probe, then drafts of 4 accepted through their first token
        assert step(["a", "b", "c", "d"]) == [k] * 4
        for i in "abcd":
            policy.update(i, 1, k)
    assert step(["a", "b", "c", "d"]) == [0] * 4  # 8 of 20 (40 %): pays at batch 1, not at 4
    policy.release("a")
    assert step(["b", "c", "d", "e"]) == [0] * 4  # e has no evidence of its own: a's fills it in
    policy.release("b")
    assert step(["c", "d", "e", "f"]) == [0] * 4
    policy.release("c")
    policy.release("d")
    assert step(["e", "f", "g", "h"]) == [0] * 4  # none of the four has evidence of its own
    steps = 1
    while step(["e", "f", "g", "h"]) == [0] * 4:  # nothing new is proposed: only the fading changes the pool
        steps += 1
    assert steps > 50 and policy.past[PAST_PROPOSED] < config.window * config.num_draft_tokens  # tried again


def test_policy_batch_gate_from_the_measured_cost():
    """A batch size at which one draft token costs a whole step (break-even >= 1) never speculates."""
    policy = PolicyProposer(FixedProposer(), PolicyConfig(num_draft_tokens=4, draft_token_costs=((1, 0.3), (8, 1.2))))
    assert ask(policy, n=8) == [0] * 8
    for i in range(1, 8):  # seven of them finish
        policy.release(f"r{i}")
    assert ask(policy, n=1) == [1]  # the slow start's probe


class MatchProposer(FixedProposer):
    """FixedProposer whose drafts carry a match length per request, as prompt lookup's do."""

    reports_match_length = True

    def __init__(self, match_lengths):
        super().__init__()
        self.match_lengths = match_lengths

    def propose(self, inputs):
        return [Draft(token_ids=d.token_ids, match_length=self.match_lengths[inp.request_id])
                for d, inp in zip(super().propose(inputs), inputs)]


def test_policy_lets_long_matches_draft_where_the_pool_is_off():
    """Prompt lookup with 8 in flight, where a draft token costs 0.5 of a step: two requests' drafts follow 16-token
    matches and are always accepted, six follow 1-token matches and are rarely (1 of 6). The pool's probes (3 of 8 a
    step) switch it off; then both classes probe with one token until the short matches' class is surely below the bar
    (it drafts nothing) and the long matches' surely above it (it drafts K). Those drafts do not turn the pool on
    again. A proposer without match lengths stays off."""
    config = PolicyConfig(num_draft_tokens=4, min_acceptance_rate=0.1, window=8,
                          draft_token_costs=((1, 0.2), (8, 0.5)))
    lengths = {f"r{i}": 16 if i < 2 else 1 for i in range(8)}
    accept = [4, 4, 1, 0, 0, 0, 0, 0]
    policy = PolicyProposer(MatchProposer(lengths), config)
    assert run_chains(policy, accept, steps=1, n=8) == [1] * 8  # the slow start's probes
    assert run_chains(policy, accept, steps=1, n=8) == [1] * 8  # pool off (3 of 16); neither class is sure yet
    assert run_chains(policy, accept, steps=1, n=8) == [4, 4] + [0] * 6  # 6 of 6, and 3 of 18
    assert run_chains(policy, accept, steps=5, n=8) == [4, 4] + [0] * 6
    assert not policy.pays(8)
    pooled = PolicyProposer(FixedProposer(), config)
    assert run_chains(pooled, accept, steps=8, n=8) == [0] * 8
