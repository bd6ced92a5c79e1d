"""Client for the speculative-decoding Triton service: text in, text plus acceptance statistics out.

Talks to the `ensemble` or `tensorrt_llm_bls` model (NVIDIA inflight_batcher_llm tensor names), or to the
`tensorrt_llm` model of NVIDIA's LLM API repository (`text_input` + `sampling_param_*` tensors, draft length
fixed per server: per-request `num_draft_tokens` / `use_draft_logits` are refused, not ignored), over
- gRPC: Triton's bidirectional ModelStreamInfer RPC, built from tritonclient's protobuf stubs. The
  stream RPC serves decoupled and non-decoupled models alike, so non-streaming requests use it too
  (stream=false: the model sends one final response);
- HTTP: Triton's `/v2/models/<model>/generate` and `generate_stream` (server-sent events) endpoints.
  Triton's `/infer` endpoint answers 501 for decoupled models, which the speculative BLS is.

Both protocols come in a sync (`TritonClient`) and an async (`AsyncTritonClient`) flavour with the
same methods: `generate(request) -> Completion` and `stream(request)` yielding `Delta`s as tokens
arrive. Every failure a user can cause or meet (server down, unknown model, refused request,
timeout) raises `ClientError` whose message is one line naming the cause and the fix.

This module imports neither torch nor the reference engine: a client installs light.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Literal

import grpc
import grpc.aio
import httpx
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

Protocol = Literal["grpc", "http"]
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
STAT_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                "num_input_tokens", "num_output_tokens")


class ClientError(Exception):
    """A one-line, user-facing failure. `kind` is one of: unavailable, not_found, invalid_request,
    timeout, server_error."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class SamplingParams:
    """Sampling parameters (temperature 0 = greedy). None leaves the server's default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None


@dataclass
class GenerateRequest:
    """One text-generation request. `num_draft_tokens` is K, the draft length per speculation round
    (0 turns speculation off); `use_draft_logits` asks for lossless rejection sampling."""

    prompt: str
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int | None = None
    use_draft_logits: bool | None = None
    stop_words: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    end_id: int | None = None
    pad_id: int | None = None
    request_id: str = ""
    # The target model's log-probability of each generated token, its raw logits for each generated
    # token, and its raw logits for each prompt position (NVIDIA's return_* inputs).
    return_log_probs: bool = False
    return_generation_logits: bool = False
    return_context_logits: bool = False

    def wire_fields(self, stream: bool) -> dict[str, object]:
        """Ensemble input tensor name -> value, for the fields that are set."""
        fields = {"text_input": self.prompt, "max_tokens": self.max_tokens, "stream": stream,
                  "exclude_input_in_output": True, "return_num_input_tokens": True,
                  "return_num_output_tokens": True, "num_draft_tokens": self.num_draft_tokens,
                  "use_draft_logits": self.use_draft_logits, "end_id": self.end_id, "pad_id": self.pad_id,
                  "stop_words": self.stop_words or None, "bad_words": self.bad_words or None,
                  **{name: True for name in ("return_log_probs", "return_generation_logits", "return_context_logits")
                     if getattr(self, name)},
                  "return_perf_metrics": True}  # the LLM API model reports acceptance only when asked
        fields.update(vars(self.sampling))
        return {name: value for name, value in fields.items() if value is not None}


# Logits responses (vocab floats per token) outgrow gRPC's default 4 MB message limit.
GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# Inputs a model may lack without harm: the client then does without them.
OPTIONAL_EXTRAS = {"exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens", "stream",
                   "return_perf_metrics"}
# Our name -> the input names models use for it: older NVIDIA configs call the seed random_seed; NVIDIA's
# LLM API model (all_models/llmapi, the trtllm-llmapi toolchain) takes sampling_param_* tensors.
ALIASES = {"seed": ("seed", "random_seed", "sampling_param_seed"), "max_tokens": ("max_tokens", "sampling_param_max_tokens"),
           "stream": ("stream", "streaming"), "stop_words": ("stop_words", "sampling_param_stop"),
           "exclude_input_in_output": ("exclude_input_in_output", "sampling_param_exclude_input_from_output"),
           "return_perf_metrics": ("sampling_param_return_perf_metrics",),
           **{name: (name, f"sampling_param_{name}") for name in ("temperature", "top_k", "top_p", "presence_penalty",
                                                                  "frequency_penalty")}}
# Per-request speculation fields an LLM API model does not have: its draft length is fixed per server.
PER_REQUEST_SPECULATION = ("num_draft_tokens", "use_draft_logits")


@dataclass
class Delta:
    """One server response: newly generated text and the statistics it carries (acceptance counters on
    the final response; token counts so far on every response), plus the token ids behind the text and
    the target's log-probs / logits when the request asked for them."""

    text: str
    stats: dict[str, float]  # subset of STAT_OUTPUTS present in this response
    time_s: float  # seconds since the request was sent
    request_id: str = ""  # the id the server echoed
    token_ids: list[int] = field(default_factory=list)  # output_ids (empty when the server sends none)
    log_probs: list[float] | None = None  # output_log_probs: one per token id
    generation_logits: np.ndarray | None = None  # [len(token_ids), vocab]
    context_logits: np.ndarray | None = None  # [prompt tokens, vocab], on one response

    @property
    def carries_data(self) -> bool:
        """Whether the response holds anything (the empty final response does not)."""
        return bool(self.text or self.stats or self.token_ids or self.context_logits is not None)


@dataclass
class Completion:
    """A finished request: the text, token counts, acceptance statistics and timing.

    acceptance_rate = total_accepted_draft_tokens / total_draft_tokens (0 when nothing was drafted).
    num_output_tokens is the server's count of generated tokens (None when it does not report one).
    `response_times_s` lists when each non-empty response arrived: with stream=true the BLS sends
    one response per speculation round (or per token when not speculating).
    """

    request_id: str
    text: str
    num_input_tokens: int | None
    num_output_tokens: int | None
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    acceptance_rate: float
    finish_reason: str  # "length" when max_tokens were generated, else "stop"
    ttft_s: float  # time to the first non-empty response
    latency_s: float
    response_times_s: list[float]

    @classmethod
    def from_deltas(cls, request: GenerateRequest, deltas: list[Delta], latency_s: float) -> "Completion":
        """Fold a stream's deltas (or the single response of a non-streaming call) into a Completion."""
        stats: dict[str, float] = {}
        for delta in deltas:
            stats.update(delta.stats)
        counts = {name: int(stats[name]) if name in stats else None for name in ("num_input_tokens", "num_output_tokens")}
        drafted = int(stats.get("total_draft_tokens", 0))
        accepted = int(stats.get("total_accepted_draft_tokens", 0))
        times = [d.time_s for d in deltas if d.text]
        length_hit = counts["num_output_tokens"] is not None and counts["num_output_tokens"] >= request.max_tokens
        return cls(request_id=request.request_id, text="".join(d.text for d in deltas), **counts,
                   total_draft_tokens=drafted, total_accepted_draft_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   finish_reason="length" if length_hit else "stop", ttft_s=times[0] if times else latency_s,
                   latency_s=latency_s, response_times_s=times)


@dataclass
class ModelInputs:
    """What a served model accepts: input name -> (Triton datatype, shape; a leading -1 = batched)."""

    name: str
    inputs: dict[str, tuple[str, list[int]]]

    @property
    def is_llmapi(self) -> bool:
        """NVIDIA's LLM API model (text_input + sampling_param_* tensors), not the inflight_batcher_llm ones."""
        return "sampling_param_max_tokens" in self.inputs

    def encode(self, fields: dict[str, object]) -> dict[str, object]:
        """Keep the fields the model accepts (under its own names); refuse ones it cannot honour."""
        encoded = {}
        for name, value in fields.items():
            wire = next((alias for alias in ALIASES.get(name, (name,)) if alias in self.inputs), None)
            if wire is None and name in PER_REQUEST_SPECULATION and self.is_llmapi:
                raise ClientError("invalid_request", f"model '{self.name}' is TensorRT-LLM's LLM API model: its draft "
                                  f"length is fixed per server (speculative_config in model.yaml), there is no per-request "
                                  f"'{name}'; drop it (CLI --num-draft-tokens / --use-draft-logits, OpenAI extra_body, bench --k)")
            if wire is None:
                if name in OPTIONAL_EXTRAS:
                    continue
                raise ClientError("invalid_request", f"model '{self.name}' has no input '{name}'; "
                                  f"drop it or send the request to tensorrt_llm_bls, which accepts it")
            _check_range(wire, value, self.inputs[wire][0])
            encoded[wire] = value
        return encoded


def _check_range(name: str, value: object, datatype: str) -> None:
    """Refuse an integer that the input's Triton datatype cannot hold (numpy would wrap it silently)."""
    if datatype == "BOOL" or datatype == "BYTES" or not datatype.startswith(("INT", "UINT")):
        return
    info = np.iinfo(triton_to_np_dtype(datatype))
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ClientError("invalid_request", f"{name}={v!r} is not an integer; send a whole number")
        if not info.min <= v <= info.max:
            raise ClientError("invalid_request", f"{name}={v} does not fit the model's {datatype} input "
                              f"[{info.min}, {info.max}]; send a smaller value")


def _check_request(request: GenerateRequest) -> None:
    """Reject obviously bad requests before they reach the server."""
    if not request.prompt:
        raise ClientError("invalid_request", "prompt is empty; pass some text")
    if request.max_tokens <= 0:
        raise ClientError("invalid_request", f"max_tokens={request.max_tokens} must be >= 1")
    if request.num_draft_tokens is not None and request.num_draft_tokens < 0:
        raise ClientError("invalid_request", f"num_draft_tokens={request.num_draft_tokens} must be >= 0")


def _with_request_id(request: GenerateRequest) -> GenerateRequest:
    if not request.request_id:
        request.request_id = uuid.uuid4().hex[:16]
    return request


# ---------------------------------------------------------------- gRPC encoding

def _grpc_request(model: ModelInputs, request: GenerateRequest, stream: bool) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with one tensor per field, shaped [1, n] for batched models."""
    message = service_pb2.ModelInferRequest(model_name=model.name, id=request.request_id)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in model.encode(request.wire_fields(stream)).items():
        datatype, shape = model.inputs[name]
        values = value if isinstance(value, list) else [value]
        if datatype == "BYTES":
            array = np.array([v.encode() for v in values], dtype=np.object_)
            raw = serialize_byte_tensor(array).item()
        else:
            array = np.array(values, dtype=triton_to_np_dtype(datatype))
            raw = array.tobytes()
        dims = [1, len(values)] if shape and shape[0] == -1 and len(shape) >= 2 else [len(values)]
        message.inputs.add(name=name, datatype=datatype, shape=dims)
        message.raw_input_contents.append(raw)
    return message


def _grpc_delta(response: service_pb2.ModelInferResponse, start: float) -> tuple[Delta, bool]:
    """Decode one stream response into a Delta and its final flag."""
    result = InferResult(response)
    final = response.parameters["triton_final_response"].bool_param
    if not response.outputs:  # the empty final response
        return Delta("", {}, time.perf_counter() - start, response.id), final
    text_array = result.as_numpy("text_output")
    text = b"".join(np.asarray(text_array).reshape(-1)).decode("utf-8", "replace") if text_array is not None else ""
    stats = {}
    for name in STAT_OUTPUTS:
        array = result.as_numpy(name)
        if array is not None:
            stats[name] = float(np.asarray(array).reshape(-1)[0])
    return _with_tokens(Delta(text, stats, time.perf_counter() - start, response.id), result.as_numpy), final


def _with_tokens(delta: Delta, get) -> Delta:
    """Fill a Delta's token ids, log-probs and logits from a response's arrays (`get(name)` -> array or None)."""
    ids, log_probs, gen, context = (get(n) for n in ("output_ids", "output_log_probs", "generation_logits", "context_logits"))
    if ids is not None:
        delta.token_ids = np.asarray(ids).reshape(-1).astype(int).tolist()
    if log_probs is not None:
        delta.log_probs = np.asarray(log_probs, dtype=np.float64).reshape(-1).tolist()
    if gen is not None:
        gen = np.asarray(gen, dtype=np.float32)
        delta.generation_logits = gen.reshape(-1, gen.shape[-1])  # [n, vocab]
    if context is not None:
        context = np.asarray(context, dtype=np.float32)
        delta.context_logits = context.reshape(-1, context.shape[-1])  # [prompt tokens, vocab]
    return delta


def _grpc_error(error: grpc.RpcError, url: str, model: str) -> ClientError:
    """Map a gRPC status to a one-line ClientError."""
    code, details = error.code(), (error.details() or "").split("\n")[0]
    if code == grpc.StatusCode.UNAVAILABLE:
        reason = "connection refused" if "refused" in details.lower() else details or "unavailable"
        return ClientError("unavailable", f"cannot reach Triton at {url} (gRPC): {reason}; "
                           "is the server running (make serve) and is the port right?")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ClientError("timeout", f"request to '{model}' at {url} timed out; raise --timeout or lower max_tokens")
    if code == grpc.StatusCode.NOT_FOUND or "unknown model" in details:
        return ClientError("not_found", f"model '{model}' is not served by {url}: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return ClientError("server_error", f"request to '{model}' was cancelled: {details}")
    return ClientError("invalid_request" if code == grpc.StatusCode.INVALID_ARGUMENT else "server_error",
                       f"'{model}' refused the request: {details}")


def _stream_error(message: str, model: str) -> ClientError:
    """An error carried inside a stream response (the request reached Triton and was refused)."""
    line = message.splitlines()[0] if message else "unknown error"
    if "unknown model" in line or "is not found" in line:
        return ClientError("not_found", f"model '{model}' is not served: {line}")
    return ClientError("invalid_request", f"'{model}' refused the request: {line}")


def tokenizer_dir_of(config: dict) -> str | None:
    """The `tokenizer_dir` parameter of a model config (preprocessing and the BLS carry one)."""
    value = config.get("parameters", {}).get("tokenizer_dir", {}).get("string_value")
    return value or None


def _parse_metadata(model: str, metadata: dict) -> ModelInputs:
    return ModelInputs(model, {i["name"]: (i["datatype"], [int(d) for d in i["shape"]]) for i in metadata["inputs"]})


# ---------------------------------------------------------------- HTTP encoding

def _http_delta(payload: dict, start: float) -> Delta:
    stats = {name: float(np.asarray(payload[name]).reshape(-1)[0]) for name in STAT_OUTPUTS if name in payload}
    text = payload.get("text_output", "")
    text = "".join(text) if isinstance(text, list) else text
    delta = Delta(text, stats, time.perf_counter() - start, payload.get("id", ""))
    return _with_tokens(delta, lambda name: None if name not in payload else np.asarray(payload[name]))


def _http_error(response: httpx.Response, url: str, model: str) -> ClientError:
    try:
        message = response.json().get("error", response.text)
    except (json.JSONDecodeError, AttributeError):
        message = response.text
    message = (message or f"HTTP {response.status_code}").splitlines()[0]
    if response.status_code == 404 or "unknown model" in message:
        return ClientError("not_found", f"model '{model}' is not served by {url}: {message}")
    return ClientError("invalid_request" if response.status_code == 400 else "server_error",
                       f"'{model}' refused the request: {message}")


def _http_transport_error(error: httpx.HTTPError, url: str, model: str) -> ClientError:
    if isinstance(error, httpx.TimeoutException):
        return ClientError("timeout", f"request to '{model}' at {url} timed out; raise --timeout or lower max_tokens")
    return ClientError("unavailable", f"cannot reach Triton at {url} (HTTP): {error or type(error).__name__}; "
                       "is the server running (make serve) and is the port right?")


def _sse_delta(line: str, model: str, start: float) -> Delta | None:
    """The Delta of one generate_stream line (None for lines that carry no event)."""
    if not line.startswith("data:"):
        return None
    payload = json.loads(line[5:])
    if "error" in payload:
        raise _stream_error(payload["error"], model)
    return _http_delta(payload, start)


def _generate_path(model: str, stream: bool) -> str:
    return f"/v2/models/{model}/{'generate_stream' if stream else 'generate'}"


def _stream_response(message: service_pb2.ModelStreamInferResponse, model: str, start: float) -> tuple[Delta | None, bool]:
    """(the Delta of one gRPC stream message, or None when it carries nothing; whether it is the last)."""
    if message.error_message:
        raise _stream_error(message.error_message, model)
    delta, final = _grpc_delta(message.infer_response, start)
    return (delta if delta.carries_data else None), final


# ---------------------------------------------------------------- clients

class TritonClient:
    """Synchronous client. `url` is host:port of Triton's gRPC (default 8001) or HTTP (8000) endpoint."""

    def __init__(self, url: str | None = None, protocol: Protocol = "grpc", model: str = "ensemble",
                 timeout_s: float = 60.0):
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self.url = url or DEFAULT_URLS[protocol]
        self._inputs: ModelInputs | None = None
        if protocol == "grpc":
            self._channel = grpc.insecure_channel(self.url, options=GRPC_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        elif protocol == "http":
            self._http = httpx.Client(base_url=f"http://{self.url}", timeout=timeout_s)
        else:
            raise ClientError("invalid_request", f"protocol '{protocol}' is not one of grpc, http")

    def close(self) -> None:
        """Release the connection."""
        if self.protocol == "grpc":
            self._channel.close()
        else:
            self._http.close()

    def __enter__(self) -> "TritonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_inputs(self) -> ModelInputs:
        """The served model's inputs (fetched once); raises ClientError if the server or model is missing."""
        if self._inputs is None:
            if self.protocol == "grpc":
                try:
                    reply = self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=self.model),
                                                     timeout=self.timeout_s)
                except grpc.RpcError as error:
                    raise _grpc_error(error, self.url, self.model) from None
                self._inputs = _parse_metadata(self.model, json_format.MessageToDict(reply))
            else:
                try:
                    response = self._http.get(f"/v2/models/{self.model}")
                except httpx.HTTPError as error:
                    raise _http_transport_error(error, self.url, self.model) from None
                if response.status_code != 200:
                    raise _http_error(response, self.url, self.model)
                self._inputs = _parse_metadata(self.model, response.json())
        return self._inputs

    def model_config(self, model: str) -> dict:
        """A served model's configuration (Triton's JSON form)."""
        try:
            if self.protocol == "grpc":
                reply = self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=self.timeout_s)
                return json_format.MessageToDict(reply.config, preserving_proto_field_name=True)
            response = self._http.get(f"/v2/models/{model}/config")
        except grpc.RpcError as error:
            raise _grpc_error(error, self.url, model) from None
        except httpx.HTTPError as error:
            raise _http_transport_error(error, self.url, model) from None
        if response.status_code != 200:
            raise _http_error(response, self.url, model)
        return response.json()

    def generate(self, request: GenerateRequest) -> Completion:
        """Run one request without streaming (one final response) and return the Completion."""
        return self._collect(request, stream=False)

    def stream(self, request: GenerateRequest) -> Iterator[Delta]:
        """Stream a request: yields a Delta per server response as it arrives."""
        yield from self._responses(request, stream=True)

    def stream_completion(self, request: GenerateRequest) -> Completion:
        """Stream a request and return the Completion (per-response timing included)."""
        return self._collect(request, stream=True)

    def _collect(self, request: GenerateRequest, stream: bool) -> Completion:
        start = time.perf_counter()
        deltas = list(self._responses(request, stream))
        return Completion.from_deltas(request, deltas, time.perf_counter() - start)

    def _responses(self, request: GenerateRequest, stream: bool) -> Iterator[Delta]:
        _check_request(_with_request_id(request))
        model = self.model_inputs()
        start = time.perf_counter()
        if self.protocol == "grpc":
            yield from self._grpc_responses(model, request, stream, start)
        else:
            yield from self._http_responses(model, request, stream, start)

    def _grpc_responses(self, model, request, stream, start) -> Iterator[Delta]:
        call = self._stub.ModelStreamInfer(iter([_grpc_request(model, request, stream)]), timeout=self.timeout_s)
        try:
            for message in call:
                delta, final = _stream_response(message, self.model, start)
                if delta:
                    yield delta
                if final:
                    break
            # After the final response the server ends the stream itself (this client sent its one request and
            # closed its side): wait for that rather than cancel a call Triton is still closing. A cancel at that
            # moment left Triton 2.51 holding the model, and the server's next stop waited its whole exit timeout
            # (docs/reliability.md).
            call.code()
        except grpc.RpcError as error:
            raise _grpc_error(error, self.url, self.model) from None
        finally:
            call.cancel()  # no-op when finished; else the server stops within one round or 16-token chunk

    def _http_responses(self, model, request, stream, start) -> Iterator[Delta]:
        body = {**model.encode(request.wire_fields(stream)), "id": request.request_id}
        try:
            with self._http.stream("POST", _generate_path(self.model, stream), json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise _http_error(response, self.url, self.model)
                if not stream:
                    yield _http_delta(json.loads(response.read()), start)
                    return
                for line in response.iter_lines():
                    if delta := _sse_delta(line, self.model, start):
                        yield delta
        except httpx.HTTPError as error:
            raise _http_transport_error(error, self.url, self.model) from None


class AsyncTritonClient:
    """Asynchronous client (asyncio) with the same methods as TritonClient; many requests may run at once."""

    def __init__(self, url: str | None = None, protocol: Protocol = "grpc", model: str = "ensemble",
                 timeout_s: float = 60.0):
        self.protocol, self.model, self.timeout_s = protocol, model, timeout_s
        self.url = url or DEFAULT_URLS[protocol]
        self._inputs: ModelInputs | None = None
        self._channel: grpc.aio.Channel | None = None  # created in the event loop that first uses it
        if protocol == "http":
            self._http = httpx.AsyncClient(base_url=f"http://{self.url}", timeout=timeout_s,
                                           limits=httpx.Limits(max_connections=256))
        elif protocol != "grpc":
            raise ClientError("invalid_request", f"protocol '{protocol}' is not one of grpc, http")

    @property
    def _stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=GRPC_OPTIONS)
            self._grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._grpc_stub

    async def close(self) -> None:
        """Release the connection."""
        if self.protocol == "http":
            await self._http.aclose()
        elif self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "AsyncTritonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def model_inputs(self) -> ModelInputs:
        """The served model's inputs (fetched once); raises ClientError if the server or model is missing."""
        if self._inputs is None:
            if self.protocol == "grpc":
                try:
                    reply = await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=self.model),
                                                           timeout=self.timeout_s)
                except grpc.RpcError as error:
                    raise _grpc_error(error, self.url, self.model) from None
                self._inputs = _parse_metadata(self.model, json_format.MessageToDict(reply))
            else:
                try:
                    response = await self._http.get(f"/v2/models/{self.model}")
                except httpx.HTTPError as error:
                    raise _http_transport_error(error, self.url, self.model) from None
                if response.status_code != 200:
                    raise _http_error(response, self.url, self.model)
                self._inputs = _parse_metadata(self.model, response.json())
        return self._inputs

    async def model_config(self, model: str) -> dict:
        """A served model's configuration (Triton's JSON form)."""
        try:
            if self.protocol == "grpc":
                reply = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=self.timeout_s)
                return json_format.MessageToDict(reply.config, preserving_proto_field_name=True)
            response = await self._http.get(f"/v2/models/{model}/config")
        except grpc.RpcError as error:
            raise _grpc_error(error, self.url, model) from None
        except httpx.HTTPError as error:
            raise _http_transport_error(error, self.url, model) from None
        if response.status_code != 200:
            raise _http_error(response, self.url, model)
        return response.json()

    async def generate(self, request: GenerateRequest) -> Completion:
        """Run one request without streaming and return the Completion."""
        return await self._collect(request, stream=False)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request: yields a Delta per server response as it arrives."""
        async for delta in self._responses(request, stream=True):
            yield delta

    async def stream_completion(self, request: GenerateRequest) -> Completion:
        """Stream a request and return the Completion (per-response timing included)."""
        return await self._collect(request, stream=True)

    async def _collect(self, request: GenerateRequest, stream: bool) -> Completion:
        start = time.perf_counter()
        deltas = [delta async for delta in self._responses(request, stream)]
        return Completion.from_deltas(request, deltas, time.perf_counter() - start)

    async def _responses(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Delta]:
        _check_request(_with_request_id(request))
        model = await self.model_inputs()
        start = time.perf_counter()
        responses = (self._grpc_responses if self.protocol == "grpc" else self._http_responses)(
            model, request, stream, start)
        async for delta in responses:
            yield delta

    async def _grpc_responses(self, model, request, stream, start) -> AsyncIterator[Delta]:
        call = self._stub.ModelStreamInfer(iter([_grpc_request(model, request, stream)]), timeout=self.timeout_s)
        try:
            async for message in call:
                delta, final = _stream_response(message, self.model, start)
                if delta:
                    yield delta
                if final:
                    break
            await call.code()  # the server ends the stream after the final response (see the sync client)
        except grpc.RpcError as error:
            raise _grpc_error(error, self.url, self.model) from None
        finally:
            call.cancel()  # no-op when finished; else the server stops within one round or 16-token chunk

    async def _http_responses(self, model, request, stream, start) -> AsyncIterator[Delta]:
        body = {**model.encode(request.wire_fields(stream)), "id": request.request_id}
        try:
            async with self._http.stream("POST", _generate_path(self.model, stream), json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _http_error(response, self.url, self.model)
                if not stream:
                    yield _http_delta(json.loads(await response.aread()), start)
                    return
                async for line in response.aiter_lines():
                    if delta := _sse_delta(line, self.model, start):
                        yield delta
        except httpx.HTTPError as error:
            raise _http_transport_error(error, self.url, self.model) from None
