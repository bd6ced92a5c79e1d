"""Greedy tokens from the project's argmax kernel (pipeline/reference/greedy_tokens.py): the index torch.argmax picks,
for any vocabulary length (whole 32-value blocks, 8-value tails, shorter rows), ties, infinities and NaNs."""

import pytest
import torch

from pipeline.reference import greedy_tokens as gt

pytestmark = pytest.mark.skipif(gt.kernel() is None, reason="the argmax kernel does not run on this CPU (no AVX2)")


@pytest.mark.parametrize("vocab", [1, 7, 8, 31, 32, 33, 100, 4096, 49152])
def test_the_index_torch_argmax_picks_on_random_logits(vocab):
    logits = torch.randn(13, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    assert gt.greedy_tokens(logits) == logits.argmax(dim=-1).tolist()


def test_ties_nans_and_infinities_as_torch_argmax():
    vocab = 70
    rows = torch.zeros(9, vocab)
    rows[0, [5, 40, 69]] = 3.0  # a tie: the first index
    rows[1, [3, 66]] = float("nan")  # a NaN counts as the largest: the first NaN, also past a larger value
    rows[1, 10] = float("inf")
    rows[2, 68] = float("nan")  # in the tail past the last whole block
    rows[3] = float("-inf")  # every value -inf: index 0
    rows[4, 50] = float("inf")
    rows[5, 0], rows[5, 1] = -0.0, 0.0  # signed zeros compare equal: the first
    rows[6] = -torch.arange(vocab, dtype=torch.float32)  # the first value is the largest
    rows[7] = torch.arange(vocab, dtype=torch.float32)  # the last one is
    rows[8, 64:] = 1.0  # the largest values only in the tail
    assert gt.greedy_tokens(rows) == rows.argmax(dim=-1).tolist() == [5, 3, 68, 0, 50, 0, 0, 69, 64]


def test_non_contiguous_rows_and_the_fallback_for_other_dtypes():
    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(1)).T  # [6, 40], not contiguous
    assert gt.greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert gt.greedy_tokens(logits.double()) == logits.argmax(dim=-1).tolist()  # torch.argmax runs
    assert gt.greedy_tokens(torch.empty(0, 5)) == []
