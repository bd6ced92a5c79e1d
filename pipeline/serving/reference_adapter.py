"""The reference engine behind the tensorrt_llm tensor interface (no Triton import here; torch).

`engine_request` turns a request's input arrays (NVIDIA's names: input_ids, request_output_len,
draft_input_ids, draft_logits, end_id, runtime_top_k, ...) into an engine `Request`;
`ResponseBuilder` turns the engine's `RequestOutput`s into the output arrays the tensorrtllm
backend returns (output_ids [1, beams, n], sequence_length, output_log_probs, cum_log_probs,
context_logits, generation_logits, acceptance counts). Log-probabilities are the raw model's
(log_softmax of the logits before temperature, penalties and top-k/top-p: TensorRT-LLM's PyTorch
backend default; its TensorRT engine backend reports them after temperature).
The other direction, the arrays a caller (the BLS) sends, is engine_io.py (numpy only).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline.reference import decode_threads
from pipeline.reference.engine import LLMEngine, Request, RequestOutput
from pipeline.reference.policy import PolicyConfig, PolicyProposer
from pipeline.reference.proposers import NgramProposer
from pipeline.reference.sampling import SamplingParams, probabilities, process_logits
from pipeline.serving.errors import RequestError
from pipeline.serving.params import (ENGINE_SAMPLING_NAMES, parse_draft_token_costs, parse_row_costs, read_sampling,
                                     scalar)
from pipeline.serving.text import from_word_list_format
from pipeline.spec_stats import SpecStats

# Inputs of the tensorrtllm backend the reference engine does not implement: sending one is an error.
# (decoder_input_ids / decoder_input_lengths are not among them: NVIDIA's backend reads them for encoder-decoder
# engines only and ignores them for decoder-only ones, and NVIDIA's preprocessing always sends them.)
UNSUPPORTED_ENGINE_INPUTS = (
    "encoder_input_features", "encoder_output_lengths",
    "embedding_bias", "prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size",
    "cross_attention_mask", "mrope_rotary_cos_sin", "mrope_position_deltas", "lora_task_id", "lora_weights",
    "lora_config", "context_phase_params", "skip_cross_attn_blocks", "guided_decoding_guide_type",
    "guided_decoding_guide", "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size",
)

# How long the engine waits after a step for the next call of each BLS chain (TextRequest.call_chain) whose call
# that step finished at its length (EngineRunner regathering): a BLS round trip (response out, prompt lookup, next
# request in) took about 6 ms of a 91 ms round in `make bench-serve`; waiting longer only delays the other running
# requests.
REGATHER_S = 0.010


@dataclass(frozen=True)
class ResponseOptions:
    """Per-request output choices."""

    streaming: bool
    exclude_input_in_output: bool
    return_generation_logits: bool
    return_log_probs: bool
    return_context_logits: bool
    return_perf_metrics: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool


def _flag(inputs, name, default=False) -> bool:
    value = scalar(inputs, name)
    return default if value is None else bool(value)


def _ids(inputs: dict[str, np.ndarray], name: str) -> list[int] | None:
    arr = inputs.get(name)
    if arr is None:
        return None
    if arr.ndim == 2 and arr.shape[0] != 1:
        raise RequestError(name, f"batch of {arr.shape[0]} rows", "send one sequence per request")
    return [int(t) for t in arr.reshape(-1)]


def _words(inputs: dict[str, np.ndarray], name: str) -> list[list[int]]:
    arr = inputs.get(name)
    if arr is None or arr.size == 0:
        return []
    return from_word_list_format(arr.reshape(-1, 2, arr.shape[-1])[0])


def _refuse_unsupported_sampling(inputs: dict[str, np.ndarray]) -> None:
    """Sampling inputs of the tensorrtllm backend that would change tokens and are not implemented here."""
    decay, reset = scalar(inputs, "runtime_top_p_decay"), scalar(inputs, "runtime_top_p_reset_ids")
    if decay is not None and float(decay) != 1.0:
        raise RequestError("runtime_top_p_decay", f"{decay}: top-p decay is not implemented by the reference engine",
                           "send 1.0 or leave it out")
    if reset is not None and int(reset) != -1:
        raise RequestError("runtime_top_p_reset_ids", f"{reset}: top-p decay is not implemented by the reference engine",
                           "send -1 or leave it out")
    if "draft_acceptance_threshold" in inputs:
        raise RequestError("draft_acceptance_threshold", "a constant acceptance threshold is not implemented (nor "
                           "lossless); draft logits are verified by rejection sampling", "leave it out")


def stop_requested(inputs: dict[str, np.ndarray]) -> bool:
    """True for NVIDIA's stop request (`stop` input true): it names a running request to stop, nothing to generate."""
    return _flag(inputs, "stop")


def engine_request(inputs: dict[str, np.ndarray], request_id: str, exclude_input_default: bool,
                   vocab_size: int) -> tuple[Request, ResponseOptions]:
    """Validate tensorrt_llm inputs and build the engine request; raises RequestError."""
    # An empty optional tensor is an absent one, as in NVIDIA's backend (its preprocessing sends an empty
    # embedding_bias, and empty bad/stop word lists, when the request has none).
    inputs = {name: array for name, array in inputs.items() if array.size}
    for name in UNSUPPORTED_ENGINE_INPUTS:
        if name in inputs:
            raise RequestError(name, "is not supported by the reference engine", f"remove {name} from the request")
    for name in ("beam_width", "num_return_sequences"):
        n = scalar(inputs, name)
        if n is not None and int(n) != 1:
            raise RequestError(name, f"{n} is not supported", f"set {name} to 1")
    prompt = _ids(inputs, "input_ids")
    if not prompt:
        raise RequestError("input_ids", "is missing or empty", "send the prompt's token ids")
    length = scalar(inputs, "input_lengths")
    if length is not None:
        if not 0 < int(length) <= len(prompt):
            raise RequestError("input_lengths", f"{length} does not fit input_ids of length {len(prompt)}",
                               "send the prompt length")
        prompt = prompt[:int(length)]
    max_new = scalar(inputs, "request_output_len")
    if max_new is None or int(max_new) < 1:
        raise RequestError("request_output_len", f"{max_new} is not a positive count", "ask for at least 1 token")
    s = read_sampling(inputs, ENGINE_SAMPLING_NAMES)
    _refuse_unsupported_sampling(inputs)
    end_id = scalar(inputs, "end_id")
    if end_id is not None and int(end_id) == -1:  # TensorRT-LLM accepts end_id -1: no end token
        end_id = None
    sampling = SamplingParams(
        temperature=0.0 if s.greedy else s.temperature, top_k=s.top_k, top_p=s.nucleus, seed=s.seed,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, min_length=s.min_tokens,
        end_id=None if end_id is None else int(end_id),
        stop_words=_words(inputs, "stop_words_list"), bad_words=_words(inputs, "bad_words_list"))
    draft = _ids(inputs, "draft_input_ids")
    draft_probs = None
    if draft is not None and "draft_logits" in inputs:
        logits = torch.from_numpy(np.ascontiguousarray(inputs["draft_logits"], dtype=np.float32))
        logits = logits.reshape(-1, logits.shape[-1])  # [k, vocab] raw draft logits
        if logits.shape != (len(draft), vocab_size):
            raise RequestError("draft_logits", f"shape {list(logits.shape)} is not [len(draft_input_ids), vocab] = "
                               f"{[len(draft), vocab_size]}", "send one row of draft logits per draft token")
        # q: what the draft sampled from. The draft request's prompt was this request's input_ids,
        # so row r saw input_ids + draft[:r] and the same penalties and temperature/top-k/top-p.
        contexts = [prompt + draft[:r] for r in range(len(draft))]
        draft_probs = probabilities(process_logits(logits, contexts, len(prompt), sampling), sampling)  # [k, vocab]
    k = scalar(inputs, "num_draft_tokens")  # K for the engine's own prompt lookup (our extension; 0: plain)
    request = Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=int(max_new), sampling=sampling,
                      draft_tokens=draft or None, draft_probs=draft_probs if draft else None,
                      num_draft_tokens=None if k is None else int(k),
                      return_generation_logits=_flag(inputs, "return_generation_logits"),
                      return_log_probs=_flag(inputs, "return_log_probs"),
                      return_context_logits=_flag(inputs, "return_context_logits"))
    options = ResponseOptions(
        streaming=_flag(inputs, "streaming"),
        exclude_input_in_output=_flag(inputs, "exclude_input_in_output", exclude_input_default),
        return_generation_logits=request.return_generation_logits,
        return_log_probs=request.return_log_probs,
        return_context_logits=request.return_context_logits,
        return_perf_metrics=_flag(inputs, "return_perf_metrics"),
        return_num_input_tokens=_flag(inputs, "return_num_input_tokens"),
        return_num_output_tokens=_flag(inputs, "return_num_output_tokens"))
    return request, options


class MeteredEngine(LLMEngine):
    """An LLMEngine that reports how long each step() took (engine busy time, for metrics and benchmarks), the
    speculation of each request that finished having drafted, and each step after which it has no work left, on the
    thread that steps it.

    Before its first step it times its decode threads again (`decode_threads.choose(again=True)`; no request has
    blocks yet, so the cache's first blocks are free scratch) and reports the count (`on_decode_threads`): at load,
    the server's other model processes start beside it and take a core, so the default engine timed one thread at
    28 ms and two at 29 in 3 of 3 server starts and served every step on one (10.9 ms a plain step of `make bench`'s
    code prompts, against 8.4 on two threads; docs/benchmarks.md). By the first request the server has loaded."""

    on_step: Callable[[float], None] = staticmethod(lambda seconds: None)
    on_speculated: Callable[[SpecStats], None] = staticmethod(lambda stats: None)
    on_idle: Callable[[], None] = staticmethod(lambda: None)  # after a step that left no request unfinished
    on_decode_threads: Callable[[int | None], None] = staticmethod(lambda threads: None)
    _threads_timed: bool = False  # the decode threads were timed again before the first step

    def step(self) -> list[RequestOutput]:
        """One scheduler step, timed."""
        if not self._threads_timed:
            self._threads_timed = True
            self.on_decode_threads(decode_threads.choose(self.model, self.kv, again=True))
        start = time.perf_counter()
        try:
            outputs = super().step()
        finally:
            self.on_step(time.perf_counter() - start)
        for out in outputs:
            if out.finished and out.stats.draft_tokens:
                self.on_speculated(out.stats)
        if not self.has_unfinished():
            self.on_idle()
        return outputs


def parse_choices(text: str) -> list[tuple[int, ...]]:
    """TensorRT-LLM's brace format for medusa_choices / eagle_choices: "{0}, {0, 0}, {1}" -> [(0,), (0, 0), (1,)]."""
    choices = [tuple(int(i) for i in body.replace(" ", "").split(",") if i) for body in re.findall(r"\{([^{}]*)\}", text)]
    if not choices or any(not c for c in choices):
        raise ValueError(f"tree choices {text!r}: write them as brace lists, e.g. \"{{0}}, {{0, 0}}, {{1}}\"")
    return choices


def load_serving_engine(engine_dir, parameters: dict[str, str] | None = None) -> MeteredEngine:
    """The engine as tensorrt_llm serves it: inputs up to max_seq_len - 1 (a verify call re-sends the whole
    sequence as input_ids) and the engine's built tokens_per_block (32 by default): partial-block KV reuse
    makes each such call compute only its new tokens at any block size (measured on SmolLM2 verify rounds
    with K = 4: 5.0 tokens per round with 32-token blocks, against 24.1 with whole-block reuse only).

    parameters: the model's config.pbtxt parameters. A Medusa / EAGLE engine speculates inside itself on
    the tree of `medusa_choices` / `eagle_choices`, or EAGLE-2's dynamic tree of width
    `eagle_dynamic_tree_top_k` when that is set; a target with `speculative_mode` ngram drafts by prompt lookup
    in its own step loop (`lookup_proposer`). `batch_invariant` ("true" unless set to "false"): every
    token's result is independent of the batch, so greedy speculative output equals plain greedy output
    and a request's answer does not depend on the others in flight (docs/engine.md, "Batch invariance":
    what it costs per engine format). `engine_role` ("target" unless set): "draft" for tensorrt_llm_draft, whose
    logits only propose, so a float32 output layer runs in 16 bits where a kernel for them runs
    (LLMEngine.from_engine_dir)."""
    parameters = parameters or {}
    exact = _choice(parameters, "batch_invariant", ("true", "false"))
    role = _choice(parameters, "engine_role", ("target", "draft"))
    build = json.loads((Path(engine_dir) / "config.json").read_text())["build_config"]
    tree = parameters.get("medusa_choices") or parameters.get("eagle_choices")
    top_k = parameters.get("eagle_dynamic_tree_top_k")
    ngram = parameters.get("speculative_mode") == "ngram"
    lookup = lookup_proposer(parameters, build.get("max_draft_len", 0)) if ngram else None
    return MeteredEngine.from_engine_dir(engine_dir, proposer=lookup, max_input_len=build["max_seq_len"] - 1,
                                         choices=parse_choices(tree) if tree and not top_k else None,
                                         dynamic_top_k=int(top_k) if top_k else None, draft=role == "draft",
                                         batch_invariant=exact == "true")


def _choice(parameters: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    """The parameter `name`, one of `choices` (case and spaces aside; unset: the first), or a ValueError naming it."""
    value = parameters.get(name, choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"parameter {name} {parameters[name]!r}: write {' or '.join(choices)}")
    return value


def lookup_proposer(parameters: dict[str, str], max_draft_len: int) -> PolicyProposer:
    """Prompt lookup inside the engine (the tensorrt_llm parameters of pipeline.repo.assemble.engine_model where
    toolchains.lookup_in_engine), under the BLS's rules: drafts cut at ngram_min_token_prob, a draft length
    that adapts per request up to the request's num_draft_tokens, the switch-off bar (min_acceptance_rate, or
    what the steps cost at the running batch size when higher: draft_token_cost, and one_token_cost for a step's
    fixed part) and the batch gate (max_batch_for_speculation running requests, or a batch size where a draft token
    costs a whole step); row_cost: a step's drafts cut to the row count that pays best (PolicyProposer.fit_rows).
    Short requests are the BLS's call (it sends num_draft_tokens 0), so the engine applies no length floor."""
    if max_draft_len < 1:
        raise ValueError("speculative_mode ngram needs an engine built with max_draft_len >= 1; "
                         "rebuild it (make engines)")
    ngram = NgramProposer(int(parameters.get("ngram_min", 1)), int(parameters.get("ngram_max", 3)),
                          float(parameters.get("ngram_min_token_prob", 0.0)))
    return PolicyProposer(ngram, PolicyConfig(
        num_draft_tokens=min(int(parameters.get("num_draft_tokens", max_draft_len)), max_draft_len),
        max_draft_tokens=max_draft_len, adaptive=True,
        min_acceptance_rate=float(parameters.get("min_acceptance_rate", 0.0)),
        draft_token_costs=parse_draft_token_costs(parameters.get("draft_token_cost") or ""),
        one_token_costs=parse_draft_token_costs(parameters.get("one_token_cost") or "", "one_token_cost"),
        row_costs=parse_row_costs(parameters.get("row_cost") or ""),
        max_batch_for_speculation=int(parameters.get("max_batch_for_speculation", 1 << 30)),
        min_new_tokens_for_speculation=0))


class ResponseBuilder:
    """Accumulates one request's engine outputs and renders tensorrtllm-backend response arrays."""

    def __init__(self, prompt_ids: list[int], options: ResponseOptions):
        self.prompt_ids = prompt_ids
        self.options = options
        self.num_tokens = 0
        self.cum_log_prob = 0.0
        self.unsent: list[RequestOutput] = []  # outputs not rendered yet (non-streaming: all of them)

    def add(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Arrays to send for this output, or None (non-streaming and not finished yet, or nothing new)."""
        self.num_tokens += len(out.new_token_ids)
        self.cum_log_prob += sum(out.log_probs or [])
        self.unsent.append(out)
        if not out.finished and (not self.options.streaming or not out.new_token_ids):
            return None
        outs, self.unsent = self.unsent, []
        return self._arrays(outs, out)

    def _arrays(self, outs: list[RequestOutput], last: RequestOutput) -> dict[str, np.ndarray]:
        ids = [t for o in outs for t in o.new_token_ids]
        # As TensorRT-LLM (batch_manager/llmRequest.cpp, createResult): a streamed response carries only
        # new tokens, so exclude_input_in_output matters for the one non-streaming response alone.
        if not self.options.exclude_input_in_output and not self.options.streaming:
            ids = self.prompt_ids + ids
        arrays = {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),  # [batch, beams, n]
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),  # [batch, beams]
        }
        logits = [o.generation_logits for o in outs if o.generation_logits is not None]
        if self.options.return_generation_logits and logits:
            gen = torch.cat(logits).to(torch.float32).numpy()  # [n, vocab]
            arrays["generation_logits"] = gen.reshape(1, 1, *gen.shape)  # [batch, beams, n, vocab]
        if self.options.return_log_probs:
            log_probs = [v for o in outs for v in o.log_probs or []]  # the generated tokens' only
            arrays["output_log_probs"] = np.array(log_probs, dtype=np.float32).reshape(1, 1, -1)  # [batch, beams, n]
            arrays["cum_log_probs"] = np.array([[self.cum_log_prob]], dtype=np.float32)  # [batch, beams]
        context = [o.context_logits for o in outs if o.context_logits is not None]
        if self.options.return_context_logits and context:
            arrays["context_logits"] = context[0].to(torch.float32).numpy()[None]  # [batch, prompt_len, vocab]
        if self.options.return_perf_metrics or last.stats.draft_tokens:
            st = last.stats
            arrays["acceptance_rate"] = np.array([[st.acceptance_rate]], dtype=np.float32)
            arrays["total_accepted_draft_tokens"] = np.array([[st.accepted_tokens]], dtype=np.int32)
            arrays["total_draft_tokens"] = np.array([[st.draft_tokens]], dtype=np.int32)
        if self.options.return_num_input_tokens:
            arrays["num_input_tokens"] = np.array([[len(self.prompt_ids)]], dtype=np.int32)
        if self.options.return_num_output_tokens:
            arrays["num_output_tokens"] = np.array([[self.num_tokens]], dtype=np.int32)
        return arrays
