"""What each speculative mode (spec.speculative.mode) means for every stage: one table, next to the spec.

Stages ask a trait (`traits(mode).has_draft_engine`) instead of comparing mode strings, so that a new
mode is one row here. Imports nothing beyond the standard library (the serving layer reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModeTraits:
    """One speculative mode, as the plan, the build, the repository, serving and deploy see it."""

    speculates: bool  # False only for mode none
    has_draft_engine: bool  # a second engine (tensorrt_llm_draft) built from models.draft proposes
    # the BLS runs propose/verify rounds, sending drafts to the target (draft_tokens_external); for prompt lookup
    # only where the toolchain's engine does not run it itself (pipeline.toolchains.lookup_in_engine)
    bls_drafts: bool
    prompt_lookup: bool  # the drafts come from prompt lookup in the request's context (speculative.ngram), no model
    engine_decoding_mode: str | None  # the target engine's speculative_decoding_mode (trtllm-build), None: plain
    heads_field: str | None  # the speculative.<field> section whose heads the target engine carries (medusa, eagle)
    requires: str | None  # the spec section the mode needs
    drafts_in_target: bool = False  # the target checkpoint carries the drafter (MTP modules after its decoder layers)
    toolchains: tuple[str, ...] | None = None  # the only toolchains that run the mode (None: every toolchain)


MODES: dict[str, ModeTraits] = {
    "none": ModeTraits(speculates=False, has_draft_engine=False, bls_drafts=False, prompt_lookup=False,
                       engine_decoding_mode=None, heads_field=None, requires=None),
    "draft_target": ModeTraits(speculates=True, has_draft_engine=True, bls_drafts=True, prompt_lookup=False,
                               engine_decoding_mode="draft_tokens_external", heads_field=None, requires="models.draft"),
    "ngram": ModeTraits(speculates=True, has_draft_engine=False, bls_drafts=True, prompt_lookup=True,
                        engine_decoding_mode="draft_tokens_external", heads_field=None, requires=None),
    "medusa": ModeTraits(speculates=True, has_draft_engine=False, bls_drafts=False, prompt_lookup=False,
                         engine_decoding_mode="medusa", heads_field="medusa", requires="speculative.medusa"),
    "eagle": ModeTraits(speculates=True, has_draft_engine=False, bls_drafts=False, prompt_lookup=False,
                        engine_decoding_mode="eagle", heads_field="eagle", requires="speculative.eagle"),
    # DeepSeek-V3-style multi-token prediction: the LLM API's MTPDecodingConfig, PyTorch backend only
    "mtp": ModeTraits(speculates=True, has_draft_engine=False, bls_drafts=False, prompt_lookup=False,
                      engine_decoding_mode=None, heads_field=None, requires=None, drafts_in_target=True,
                      toolchains=("trtllm-llmapi",)),
}


def traits(mode: str) -> ModeTraits:
    """The traits of a speculative mode (one of MODES)."""
    return MODES[mode]
