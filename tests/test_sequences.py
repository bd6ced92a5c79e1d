"""Token-sequence helpers (pipeline/sequences.py) against their definitions."""

import random

from pipeline.sequences import common_prefix_len


def test_common_prefix_len_is_the_index_of_the_first_difference():
    rng = random.Random(0)
    for _ in range(5000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
        b = a[:rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(tuple(b), a) == first_difference, (a, b)
