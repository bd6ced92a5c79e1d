"""The limits an engine is built with: one type for the plan's build steps, built engines' config.json, the
repository (EngineInfo) and the reference engine (EngineConfig), and the KV cache block size, defined once."""

from __future__ import annotations

from dataclasses import dataclass

# KV cache block size of every engine: trtllm-build --tokens_per_block, the reference engine's paged KV cache
# (partial-block reuse makes each verify call compute only its new tokens at this block size).
TOKENS_PER_BLOCK = 32
# Plain decoding through the BLS streams from target calls of at most this many tokens: Triton 2.51 cannot cancel a
# BLS sub-request, so a cancelled request stops within one call (measured: docs/reliability.md). It also bounds
# serving.stream_interval, the tokens of such a call answered at once.
PLAIN_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class EngineLimits:
    """Build limits of one engine (trtllm-build flags; `build_config` of an engine's config.json)."""

    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    max_draft_len: int = 0
    tokens_per_block: int = TOKENS_PER_BLOCK
    gather_generation_logits: bool = False

    @staticmethod
    def build_config_values(build: dict) -> dict:
        """The limits present in an engine config.json's `build_config` (keys of absent ones are left out)."""
        values = {k: build[k] for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")
                  if build.get(k) is not None}
        values["max_draft_len"] = build.get("max_draft_len") or 0
        values["tokens_per_block"] = build.get("plugin_config", {}).get("tokens_per_block", TOKENS_PER_BLOCK)
        values["gather_generation_logits"] = bool(build.get("gather_generation_logits"))
        return values
