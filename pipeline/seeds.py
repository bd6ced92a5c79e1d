"""Random streams derived from one request seed with a counter-based hash (no torch, no Triton).

A seeded request must give the same text whatever else runs (batching), however the BLS splits it
into calls (plain chunks, speculative rounds) and whether it speculates. So no stream is ever a
sequential generator shared across calls, and no stream is `seed + offset` (seeds s and s + 1 would
then share all but one of their streams):
- each model role (the target, the draft model) gets its own seed, `derive_seed(seed, role)`;
- inside an engine, the token at sequence position i is drawn from `derive_seed(role_seed, "pos", i)`
  only, so a plain call and a verify call that sample position i use the same random numbers, and a
  draft token accepted by token matching is exactly the token plain decoding would have drawn.
The hash is BLAKE2b over the decimal path, keyed by nothing: a counter-based generator in the sense of
Salmon et al. 2011 ("Parallel random numbers: as easy as 1, 2, 3"), with a cryptographic mixer.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # torch.Generator.manual_seed and numpy accept it; UINT64 seed tensors carry it

ROLE_TARGET = "target"  # the tensorrt_llm model: the seed the client sent, unchanged
ROLE_DRAFT = "draft"  # the tensorrt_llm_draft model's calls from the BLS
ROLE_PROPOSER = "proposer"  # in-engine proposers (draft model, Medusa / EAGLE heads) of a sampled request


def derive_seed(seed: int, *path: int | str) -> int:
    """A 63-bit seed for the stream named by `path` under `seed`; independent of every other path and seed."""
    text = ":".join(str(part) for part in (int(seed), *path))
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def role_seed(seed: int | None, role: str) -> int | None:
    """The seed a model call of `role` gets from the request's seed (None stays None: unseeded)."""
    if seed is None:
        return None
    return int(seed) if role == ROLE_TARGET else derive_seed(seed, role)
