"""The verifier: greedy paths on hand-made cases, and a chi-square test that sampled outputs follow p.

Statistical tests: synthetic Markov models over a small vocabulary, target P[prev] = p and draft
Q[prev] = q, a few thousand two-token generations, Pearson chi-square on the joint distribution of
the first two output tokens against the exact target law P[x0][a] * P[a][b]. Significance
alpha = 1e-3 with fixed seeds: a correct sampler fails with probability 1e-3 per seed, and these
seeds are fixed, so the test is deterministic. Deliberately broken samplers must fail the same check.
"""

import pytest
import torch

from pipeline.reference.rejection_sampler import DraftToVerify, Verdict, verify
from pipeline.reference.tree import tree_from_choices

ALPHA = 1e-3
VOCAB = 8


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed counts [C] against probabilities [C]; small cells are pooled."""
    expected = probs.double() * counts.sum()  # [C]
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """A random transition matrix [VOCAB, VOCAB]: row = previous token, column = next token."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)


P = markov(1, 1.5)  # target
Q = markov(2, 1.5) * 0.5 + P * 0.5  # draft: related to the target, not equal


def chain_draft(prev: int, k: int, g: torch.Generator) -> DraftToVerify:
    """k tokens sampled from the draft chain Q after token prev, with their q rows."""
    tokens, probs = [], []
    for _ in range(k):
        q = Q[prev]  # [VOCAB]
        prev = int(torch.multinomial(q, 1, generator=g))
        tokens.append(prev)
        probs.append(q)
    return DraftToVerify(token_ids=tokens, probs=torch.stack(probs), greedy=False, generator=g)


TREE = tree_from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def tree_draft(prev: int, k: int, g: torch.Generator) -> DraftToVerify:
    """A deterministic top-k tree (as Medusa / EAGLE build): node = the rank-th most likely q token after its parent."""
    tokens: list[int] = []
    for choice, parent in zip(TREE.choices, TREE.parents):
        after = prev if parent < 0 else tokens[parent]
        tokens.append(int(Q[after].argsort(descending=True)[choice[-1]]))
    return DraftToVerify(token_ids=tokens, parents=list(TREE.parents), greedy=False, generator=g)


def target_rows(prev: int, draft: DraftToVerify) -> torch.Tensor:
    """p at the root and after every node: [N + 1, VOCAB]."""
    parents = draft.node_parents()
    before = [prev] + [draft.token_ids[j] for j in range(len(parents))]
    return P[torch.tensor(before)]


def two_token_counts(verifier, make_draft, samples: int = 4000, seed: int = 0, prev: int = 0, k: int = 3) -> torch.Tensor:
    """Generate two tokens after `prev` by speculative steps, `samples` times; counts of (a, b) [VOCAB * VOCAB]."""
    g = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in range(samples)]
    contexts = [prev] * samples
    while True:
        todo = [i for i in range(samples) if len(outputs[i]) < 2]
        if not todo:
            break
        drafts = [make_draft(contexts[i], k, g) for i in todo]
        rows = torch.cat([target_rows(contexts[i], d) for i, d in zip(todo, drafts)])  # [sum(N + 1), VOCAB]
        for i, verdict in zip(todo, verifier(rows.log(), drafts, rows)):
            outputs[i] += verdict.token_ids
            contexts[i] = outputs[i][-1]
    pairs = torch.tensor([o[0] * VOCAB + o[1] for o in outputs])
    return torch.bincount(pairs, minlength=VOCAB * VOCAB)


EXACT_LAW = (P[0][:, None] * P).flatten()  # [VOCAB * VOCAB]: P(a | 0) * P(b | a)


def chain_draft_without_q(prev: int, k: int, g: torch.Generator) -> DraftToVerify:
    """Sampled draft tokens verified as if deterministic (accept with p(x), residual = p without x): also exact."""
    draft = chain_draft(prev, k, g)
    draft.probs = None
    return draft


@pytest.mark.parametrize("make_draft", [chain_draft, tree_draft, chain_draft_without_q],
                         ids=["chain-with-q", "deterministic-tree", "chain-without-q"])
def test_sampled_outputs_follow_the_target_distribution(make_draft):
    counts = two_token_counts(verify, make_draft)
    assert chi_square_pvalue(counts, EXACT_LAW) > ALPHA


def test_chi_square_check_detects_a_wrong_distribution():
    counts = two_token_counts(verify, chain_draft)
    wrong_law = (Q[0][:, None] * Q).flatten()
    assert chi_square_pvalue(counts, wrong_law) < ALPHA


def accept_always(target_logits, drafts, target_probs):
    """Broken: keeps every draft token, then samples a bonus from p (no rejection at all)."""
    verdicts, start = [], 0
    for d in drafts:
        end = start + len(d.token_ids) + 1
        bonus = int(torch.multinomial(target_probs[end - 1], 1, generator=d.generator))
        verdicts.append(Verdict(token_ids=d.token_ids + [bonus], accepted_nodes=list(range(len(d.token_ids))), bonus=True))
        start = end
    return verdicts


def resample_from_p(target_logits, drafts, target_probs):
    """Broken: on rejection samples from p instead of the residual norm(max(p - q, 0)) (chains only)."""
    verdicts, start = [], 0
    for d in drafts:
        p_rows = target_probs[start:start + len(d.token_ids) + 1]  # [K + 1, VOCAB]
        tokens = []
        for j, x in enumerate(d.token_ids):
            if float(torch.rand((), generator=d.generator)) * float(d.probs[j, x]) >= float(p_rows[j, x]):
                break
            tokens.append(x)
        last = int(torch.multinomial(p_rows[len(tokens)], 1, generator=d.generator))
        verdicts.append(Verdict(token_ids=tokens + [last], accepted_nodes=list(range(len(tokens)))))
        start += len(d.token_ids) + 1
    return verdicts


@pytest.mark.parametrize("broken", [accept_always, resample_from_p])
def test_broken_samplers_fail_the_same_check(broken):
    counts = two_token_counts(broken, chain_draft)
    assert chi_square_pvalue(counts, EXACT_LAW) < ALPHA


def test_first_token_marginal_matches_with_a_weak_draft():
    """A draft unrelated to the target (mostly rejections): recovered tokens carry the law."""
    weak = markov(7, 3.0)
    g = torch.Generator().manual_seed(3)
    drafts, rows = [], []
    for _ in range(3000):
        q = weak[0]
        x = int(torch.multinomial(q, 1, generator=g))
        drafts.append(DraftToVerify(token_ids=[x], probs=q[None], greedy=False, generator=g))
        rows.append(torch.stack([P[0], P[x]]))
    rows = torch.cat(rows)
    first = torch.tensor([v.token_ids[0] for v in verify(rows.log(), drafts, rows)])
    assert chi_square_pvalue(torch.bincount(first, minlength=VOCAB), P[0]) > ALPHA


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """Target logits whose argmax at row r is tokens[r]: [len(tokens), VOCAB]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_chain_all_accepted_gives_a_bonus_token():
    (v,) = verify(one_hot_logits([3, 4, 5, 6]), [DraftToVerify(token_ids=[3, 4, 5])])
    assert v.token_ids == [3, 4, 5, 6] and v.num_accepted == 3 and v.bonus and v.last_row == 3


def test_greedy_chain_partial_then_recovered_token():
    (v,) = verify(one_hot_logits([3, 4, 5, 6]), [DraftToVerify(token_ids=[3, 7, 5])])
    assert v.token_ids == [3, 4] and v.accepted_nodes == [0] and not v.bonus


def test_greedy_chain_all_rejected_and_empty_draft():
    first, empty = verify(one_hot_logits([3, 4, 5, 6, 2]), [DraftToVerify(token_ids=[1, 4, 5]), DraftToVerify(token_ids=[])])
    assert first.token_ids == [3] and first.num_accepted == 0 and not first.bonus
    assert empty.token_ids == [2] and empty.num_accepted == 0


def test_ragged_batch_rows_are_split_per_request():
    drafts = [DraftToVerify(token_ids=[1]), DraftToVerify(token_ids=[2, 3, 4]), DraftToVerify(token_ids=[5, 6])]
    logits = one_hot_logits([1, 7] + [2, 3, 0, 0] + [5, 6, 1])
    assert [v.token_ids for v in verify(logits, drafts)] == [[1, 7], [2, 3, 0], [5, 6, 1]]


def test_greedy_tree_takes_the_longest_accepted_path():
    # nodes: 0:(0) 1:(1) 2:(0,0) 3:(1,0) 4:(1,0,0); parents -1,-1,0,1,3
    tree = tree_from_choices([[0], [1], [0, 0], [1, 0], [1, 0, 0]])
    tokens = [3, 3, 4, 5, 6]  # node 0 and node 1 both carry the target's first token 3
    # argmax after: root 3, n0 -> 4, n1 -> 5, n2 -> 1, n3 -> 6, n4 -> 2
    logits = one_hot_logits([3, 4, 5, 1, 6, 2])
    (v,) = verify(logits, [DraftToVerify(token_ids=tokens, parents=list(tree.parents))])
    assert v.accepted_nodes == [1, 3, 4] and v.token_ids == [3, 5, 6, 2] and v.bonus


def test_sampling_is_reproducible_with_a_seeded_generator():
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        drafts = [chain_draft(0, 4, g) for _ in range(50)]
        for d in drafts:
            d.generator = torch.Generator().manual_seed(seed)
        rows = torch.cat([target_rows(0, d) for d in drafts])
        return [v.token_ids for v in verify(rows.log(), drafts, rows)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_row_count_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="N_i \\+ 1"):
        verify(torch.zeros(3, VOCAB), [DraftToVerify(token_ids=[1, 2, 3])])
