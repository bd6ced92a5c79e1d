"""Typed, validated requests for the Triton models (no Triton import: inputs arrive as numpy arrays).

Every problem raises `RequestError(field, problem, fix)`; the models turn it into an
INVALID_ARG error response and keep serving.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.modes import traits
from pipeline.serving.errors import RequestError
from pipeline.serving.text import decode_bytes_list, default_end_id, default_pad_id, words_to_ids


def scalar(inputs: dict[str, np.ndarray], name: str, default=None):
    """The single value of input `name` (any [1] / [1, 1] shape), or `default` when absent."""
    arr = inputs.get(name)
    if arr is None:
        return default
    if arr.size != 1:
        raise RequestError(name, f"expected one value, got shape {list(arr.shape)}", "send one value per request")
    value = arr.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


def _flag(value) -> bool:
    return bool(value) if value is not None else False


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters, shared by every model call of a request, regularized as NVIDIA's backend does.

    TensorRT-LLM's defaults are temperature 1, top_k 0 and top_p 0 (layers/defaultDecodingParams.h);
    the tensorrtllm backend drops a runtime_top_p <= 0 (inflight_batcher_llm/src/utils.cc), and the
    sampling kernels turn top_k 0 with top_p 0 into top_k 1, i.e. greedy, and top_k > 0 with top_p 0
    into top_p 1 (kernels/samplingTopKKernels.cu, setupTopKRuntimeArgs). So a request that sets no
    top_k and no top_p decodes greedily whatever its temperature; temperature 0 is greedy too.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k limit
    top_p: float = 0.0  # 0 = unset (any value <= 0 is stored as 0)
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        """True when every call picks the argmax."""
        return self.temperature == 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0)

    @property
    def nucleus(self) -> float:
        """The top_p the sampler applies: 1.0 (off) when top_p is unset."""
        return self.top_p if self.top_p > 0.0 else 1.0


def read_sampling(inputs: dict[str, np.ndarray], names: dict[str, str]) -> Sampling:
    """Sampling from request inputs; `names` maps Sampling fields to this model's input names."""
    s = Sampling(
        temperature=float(scalar(inputs, names["temperature"], 1.0)),
        top_k=int(scalar(inputs, names["top_k"], 0)),
        top_p=float(scalar(inputs, names["top_p"], 0.0)),
        seed=None if scalar(inputs, "seed") is None else int(scalar(inputs, "seed")),
        repetition_penalty=float(scalar(inputs, "repetition_penalty", 1.0)),
        presence_penalty=float(scalar(inputs, "presence_penalty", 0.0)),
        frequency_penalty=float(scalar(inputs, "frequency_penalty", 0.0)),
        min_tokens=int(scalar(inputs, "min_tokens", 0)),
    )
    floats = {names["temperature"]: s.temperature, names["top_p"]: s.top_p, "repetition_penalty": s.repetition_penalty,
              "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty}
    for name, value in floats.items():
        if not math.isfinite(value):  # NaN reaches the sampler as an error, inf as garbage text
            raise RequestError(name, f"{value} is not a finite number", "send a finite value")
    s = replace(s, top_p=max(0.0, s.top_p))  # top_p <= 0 is unset, as in NVIDIA's backend
    if s.temperature < 0:
        raise RequestError(names["temperature"], f"{s.temperature} is negative", "use 0 (greedy) or a positive value")
    if s.top_k < 0:
        raise RequestError(names["top_k"], f"{s.top_k} is negative", "use 0 (off) or a positive value")
    if s.top_p > 1.0:
        raise RequestError(names["top_p"], f"{s.top_p} is above 1", "use e.g. 0.9, or 1.0 to sample from all tokens")
    if s.repetition_penalty <= 0:
        raise RequestError("repetition_penalty", f"{s.repetition_penalty} is not positive", "use 1.0 to disable")
    if s.min_tokens < 0:
        raise RequestError("min_tokens", f"{s.min_tokens} is negative", "use 0 or more")
    return s


BLS_SAMPLING_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}
ENGINE_SAMPLING_NAMES = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p"}

# Inputs of NVIDIA's BLS/ensemble interface this implementation does not serve (multimodal, LoRA,
# prompt tuning, guided decoding, encoder-decoder); sending one is an error, not silently ignored.
UNSUPPORTED_BLS_INPUTS = (
    "decoder_text_input", "image_input", "image_bytes_input", "image_url_input", "image_sizes_input",
    "video_bytes_input", "prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id",
    "embedding_bias_words", "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config",
    "guided_decoding_guide_type", "guided_decoding_guide",
)


def format_draft_token_costs(costs: tuple[tuple[int, float], ...]) -> str:
    """The draft_token_cost parameter: "batch:cost" pairs, e.g. "1:0.17 4:0.43"; "0" when nothing was measured."""
    return " ".join(f"{batch}:{cost}" for batch, cost in costs) or "0"


def parse_draft_token_costs(text: str, name: str = "draft_token_cost") -> tuple[tuple[int, float], ...]:
    """((batch, cost), ...) from the draft_token_cost parameter (or another of its form, `name`): "batch:cost" pairs,
    or one number (the cost at batch 1; 0 or empty: free, ())."""
    text = text.strip()
    try:
        if ":" not in text:
            return ((1, float(text)),) if text and float(text) > 0 else ()
        pairs = [pair.split(":") for pair in text.split()]
        return tuple((int(batch), float(cost)) for batch, cost in pairs)
    except ValueError:
        raise ValueError(f"parameter {name} {text!r}: give 'batch:cost' pairs (e.g. '1:0.17 4:0.43') "
                         "or one cost for batch 1") from None


def format_row_costs(costs: tuple[tuple[int, tuple[float, ...]], ...]) -> str:
    """The row_cost parameter: per batch size "batch:cost,cost,..." (a step's cost with 0, 1, 2, ... draft rows, in
    plain steps of that batch), e.g. "1:1,1.12,1.17 4:1,1,1.04,1.33"; "0" when nothing was measured."""
    return " ".join(f"{batch}:{','.join(map(str, row))}" for batch, row in costs) or "0"


def parse_row_costs(text: str) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """((batch, (cost with 0, 1, 2, ... draft rows)), ...) from the row_cost parameter (`format_row_costs`; "0" or
    empty: not measured, ()). Every cost must be a positive finite number (the policy divides by them,
    PolicyProposer.fit_rows: a 0 made every drafting step raise), every batch size at least 1."""
    text = text.strip()
    if text in ("", "0"):
        return ()
    fix = "give 'batch:cost,cost,...' per batch size with positive costs (e.g. '1:1,1.12 4:1,1,1.04')"
    try:
        pairs = [pair.split(":") for pair in text.split()]
        costs = tuple((int(batch), tuple(float(c) for c in row.split(","))) for batch, row in pairs)
    except ValueError:
        raise ValueError(f"parameter row_cost {text!r}: {fix}") from None
    if any(batch < 1 or not all(0 < c < math.inf for c in row) for batch, row in costs):
        raise ValueError(f"parameter row_cost {text!r}: {fix}; `pipeline repo` measures them")
    return costs


def cost_at_batch_one(text: str) -> float:
    """The draft_token_cost parameter's cost at batch 1 (0: free or not measured)."""
    return dict(parse_draft_token_costs(text)).get(1, 0.0)


@dataclass(frozen=True)
class BlsSettings:
    """tensorrt_llm_bls parameters from its config.pbtxt."""

    tokenizer_dir: str
    target_model: str = "tensorrt_llm"
    draft_model: str = ""
    speculative_mode: str = "none"  # draft_target | ngram | medusa | eagle | none
    num_draft_tokens: int = 0  # default K
    max_draft_len: int = 0  # the target engine's capacity
    use_draft_logits: bool = False
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_min_token_prob: float = 0.0
    # the target engine runs prompt lookup itself (pipeline.toolchains.lookup_in_engine): requests stream from it,
    # and each call carries the request's K as num_draft_tokens (0: plain)
    engine_lookup: bool = False
    max_input_len: int = 1024
    max_seq_len: int = 2048
    verify_input_len: int = 2047  # longest input_ids the target accepts (a verify call re-sends the sequence)
    min_new_tokens_for_speculation: int = 0
    min_acceptance_rate: float = 0.0
    # break-even acceptance: what one draft token costs a round, as a fraction of a plain step, measured on the
    # engines when the repository is assembled (pipeline.reference.step_cost); 0 = free (not measured, a GPU).
    # The parameter may hold costs per running batch size (`parse_draft_token_costs`); a BLS round is one
    # request's, so the BLS takes the cost at batch 1.
    draft_token_cost: float = field(default=0.0, metadata={"parse": cost_at_batch_one})
    max_batch_for_speculation: int = 1 << 30  # more requests in flight in this model instance: plain chunks
    skip_special_tokens: bool = True
    stall_timeout_s: float = 60.0  # a model call with no response for this long fails
    stream_interval: int = 1  # plain tokens a streamed response carries after the first (serving.stream_interval)

    @property
    def switch_off_below(self) -> float:
        """The acceptance a speculating request must keep: min_acceptance_rate, or the break-even when higher
        (min_acceptance_rate 0: none, the switch-off is off)."""
        return max(self.min_acceptance_rate, self.draft_token_cost) if self.min_acceptance_rate > 0 else 0.0

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "BlsSettings":
        """Parse Triton's string parameters (unknown or empty values keep the defaults)."""
        kwargs = {}
        for f in cls.__dataclass_fields__.values():
            key = {"target_model": "tensorrt_llm_model_name", "draft_model": "tensorrt_llm_draft_model_name"}.get(f.name, f.name)
            if key not in params:
                continue
            raw = params[key]
            if "parse" in f.metadata:
                kwargs[f.name] = f.metadata["parse"](raw)
            elif f.type in ("int",):
                kwargs[f.name] = int(raw)
            elif f.type in ("float",):
                kwargs[f.name] = float(raw)
            elif f.type in ("bool",):
                kwargs[f.name] = raw.lower() in ("1", "true", "yes")
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)


@dataclass(frozen=True)
class TextRequest:
    """One validated tensorrt_llm_bls / ensemble request."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    num_draft_tokens: int  # 0 = plain decoding
    use_draft_logits: bool
    sampling: Sampling
    end_id: int
    pad_id: int
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    exclude_input_in_output: bool = False
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_log_probs: bool = False  # the target's log-probability of each generated token
    return_generation_logits: bool = False  # the target's raw logits for each generated token
    return_context_logits: bool = False  # the target's raw logits for each prompt position
    # the chain its calls to the engine models form, one a client request (`call_chain`; a request parameter:
    # EngineRunner regathers a chain's calls)
    chain: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)

    def call_chain(self, prompt_ids: list[int], max_new: int) -> str:
        """The chain a call over prompt_ids (this request's prompt and what it generated so far) for up to max_new
        tokens names: `chain`, or "" for a call that can reach max_tokens. The request may end with such a call, and
        the engine waiting for a next call that never comes would hold every other request's next step."""
        return "" if len(prompt_ids) - len(self.prompt_ids) + max_new >= self.max_tokens else self.chain


def _strings(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    arr = inputs.get(name)
    if arr is None:
        return []
    try:
        return decode_bytes_list(arr.reshape(-1).tolist())
    except UnicodeDecodeError:
        raise RequestError(name, "is not valid UTF-8", "send UTF-8 encoded text") from None


def parse_text_request(inputs: dict[str, np.ndarray], settings: BlsSettings, tokenizer) -> TextRequest:
    """Validate and tokenize a text request (NVIDIA's BLS/ensemble input names)."""
    for name in UNSUPPORTED_BLS_INPUTS:
        if name in inputs:
            raise RequestError(name, "is not supported by this server", f"remove {name} from the request")
    texts = _strings(inputs, "text_input")
    if len(texts) != 1:
        raise RequestError("text_input", f"expected one string, got {len(texts)}", "send one prompt per request")
    prompt_ids = tokenizer.encode(texts[0], add_special_tokens=False)
    if not prompt_ids:
        raise RequestError("text_input", "is empty", "send a non-empty prompt")
    if len(prompt_ids) > settings.max_input_len:
        raise RequestError("text_input", f"{len(prompt_ids)} tokens exceed max_input_len {settings.max_input_len}",
                           "shorten the prompt")
    max_tokens = scalar(inputs, "max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens", "is required", "send max_tokens (INT32), e.g. 64")
    max_tokens = int(max_tokens)
    if max_tokens <= 0:
        raise RequestError("max_tokens", f"{max_tokens} is not positive", "ask for at least 1 token")
    room = settings.max_seq_len - len(prompt_ids)
    if max_tokens > room:
        raise RequestError("max_tokens", f"{max_tokens} plus the {len(prompt_ids)} prompt tokens exceed max_seq_len "
                           f"{settings.max_seq_len}", f"ask for at most {room} tokens")
    k = scalar(inputs, "num_draft_tokens")
    k = settings.num_draft_tokens if k is None else int(k)
    if k < 0:
        raise RequestError("num_draft_tokens", f"{k} is negative", "use 0 (no speculation) or more")
    mode = traits(settings.speculative_mode)
    if k > 0 and mode.bls_drafts and k > settings.max_draft_len:
        raise RequestError("num_draft_tokens", f"{k} exceeds the target engine's max_draft_len {settings.max_draft_len}",
                           f"use at most {settings.max_draft_len}")
    if k > 0 and not mode.speculates:
        raise RequestError("num_draft_tokens", f"{k} > 0 but this repository has no speculative decoding",
                           "send 0, or assemble the repository from a spec with speculative.mode set")
    use_logits = scalar(inputs, "use_draft_logits")
    use_logits = settings.use_draft_logits if use_logits is None else bool(use_logits)
    if use_logits and k > 0 and not mode.has_draft_engine:
        raise RequestError("use_draft_logits", "needs a draft model", "set it to false")
    for name in ("beam_width", "num_return_sequences"):
        n = scalar(inputs, name)
        if n is not None and int(n) != 1:
            raise RequestError(name, f"{n} is not supported", f"set {name} to 1")
    end_id = scalar(inputs, "end_id")
    pad_id = scalar(inputs, "pad_id")
    return TextRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, stream=_flag(scalar(inputs, "stream")),
        num_draft_tokens=k if mode.bls_drafts else 0,
        use_draft_logits=use_logits, sampling=read_sampling(inputs, BLS_SAMPLING_NAMES),
        end_id=default_end_id(tokenizer) if end_id is None else int(end_id),
        pad_id=default_pad_id(tokenizer) if pad_id is None else int(pad_id),
        stop_words=words_to_ids(tokenizer, _strings(inputs, "stop_words")),
        bad_words=words_to_ids(tokenizer, _strings(inputs, "bad_words")),
        # Unset: the engines' configured value, false as NVIDIA's recipe fills it, so a non-streaming response
        # starts with the prompt as NVIDIA's BLS and ensemble return it (their end_to_end_test.py compares them).
        exclude_input_in_output=_flag(scalar(inputs, "exclude_input_in_output")),
        return_perf_metrics=_flag(scalar(inputs, "return_perf_metrics")),
        return_num_input_tokens=_flag(scalar(inputs, "return_num_input_tokens")),
        return_num_output_tokens=_flag(scalar(inputs, "return_num_output_tokens")),
        return_log_probs=_flag(scalar(inputs, "return_log_probs")),
        return_generation_logits=_flag(scalar(inputs, "return_generation_logits")),
        return_context_logits=_flag(scalar(inputs, "return_context_logits")),
    )
