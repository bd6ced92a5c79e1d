"""OpenAI-compatible HTTP frontend (FastAPI) in front of Triton's gRPC endpoint.

    python -m clients.openai_server --triton-url localhost:8001 --port 9000

Serves `/v1/models`, `/v1/completions` and `/v1/chat/completions` (server-sent events when
`stream` is true, `usage` counts from the server's token counts). Speculation is set per request
with extra body fields `num_draft_tokens` (K; 0 turns it off) and `use_draft_logits`; `top_k`,
`repetition_penalty` and `min_tokens` are accepted too. Responses carry a `speculation` object
(acceptance_rate, total_draft_tokens, total_accepted_draft_tokens). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from clients.chat import ChatTemplate, ChatTemplateError
from clients.client import (AsyncTritonClient, ClientError, Completion, Delta, GenerateRequest, SamplingParams,
                            tokenizer_dir_of)

ERROR_STATUS = {"invalid_request": 400, "not_found": 404, "unavailable": 503, "timeout": 504, "server_error": 500}


class ApiError(Exception):
    """An error returned in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_client_error(cls, error: ClientError) -> "ApiError":
        status = ERROR_STATUS.get(error.kind, 500)
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return cls(status, str(error), type_, code="model_not_found" if error.kind == "not_found" else error.kind)


class GenerationFields(BaseModel):
    """Request fields shared by completions and chat completions (OpenAI's plus the speculation extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Extra body fields (the openai package sends them with extra_body=...).
    num_draft_tokens: int | None = Field(default=None, ge=0)
    use_draft_logits: bool | None = None
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)

    def generate_request(self, prompt: str, default_max_tokens: int, extra_stops: list[str]) -> GenerateRequest:
        """The Triton request for one prompt."""
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported; use n=1", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                  repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens)
        return GenerateRequest(prompt=prompt, max_tokens=self.max_tokens or default_max_tokens, sampling=sampling,
                               num_draft_tokens=self.num_draft_tokens, use_draft_logits=self.use_draft_logits,
                               stop_words=stops + [w for w in extra_stops if w not in stops])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(GenerationFields):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message text (text parts of a multi-part content joined)."""
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return "".join(parts)
        return self.content or ""


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None


def usage(done: Completion) -> dict:
    """OpenAI usage counts from the server's token counts."""
    prompt, completion = done.num_input_tokens or 0, done.num_output_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(done: Completion) -> dict:
    """The speculative-decoding statistics of one request."""
    return {"acceptance_rate": done.acceptance_rate, "total_draft_tokens": done.total_draft_tokens,
            "total_accepted_draft_tokens": done.total_accepted_draft_tokens}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Frontend:
    """Request handling, independent of the web framework's routing."""

    def __init__(self, client: AsyncTritonClient, served_model_name: str, chat_template: ChatTemplate | None,
                 default_max_tokens: int):
        self.client = client
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        self.default_max_tokens = default_max_tokens

    async def template(self) -> ChatTemplate:
        """The chat template: given, else the server's tokenizer's when it is on this machine, else ChatML."""
        if self.chat_template is None:
            directory = tokenizer_dir_of(await self.client.model_config("preprocessing"))
            use = directory is not None and Path(directory).is_dir()
            self.chat_template = ChatTemplate.from_tokenizer_dir(directory) if use else ChatTemplate()
        return self.chat_template

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                           param="model", code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "specdeploy"}]}

    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        if body.echo or body.logprobs:
            raise ApiError(400, "echo and logprobs are not supported", param="echo" if body.echo else "logprobs")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or (body.stream and len(prompts) != 1):
            raise ApiError(400, "send one prompt string (a list is allowed only without stream)", param="prompt")
        requests = [body.generate_request(p, self.default_max_tokens, []) for p in prompts]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            def chunk(text: str, finish: str | None) -> dict:
                return {**base, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
            return await self.stream(requests[0], base, chunk, body.include_usage)
        done = await self.run_all(requests)
        choices = [{"index": i, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}
                   for i, d in enumerate(done)]
        total = {k: sum(usage(d)[k] for d in done) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {**base, "choices": choices, "usage": total,
                "speculation": speculation(done[0]) if len(done) == 1 else [speculation(d) for d in done]}

    async def chat(self, body: ChatRequest):
        self.check_model(body.model)
        if body.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        template = await self.template()
        try:
            prompt = template.render([{"role": m.role, "content": m.text()} for m in body.messages])
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        request = body.generate_request(prompt, self.default_max_tokens, template.stop_words)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "chat.completion", "created": created, "model": body.model}
        if body.stream:
            base["object"] = "chat.completion.chunk"

            def chunk(text: str | None, finish: str | None) -> dict:
                delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
                return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            return await self.stream(request, base, chunk, body.include_usage, opening=chunk(None, None))
        (done,) = await self.run_all([request])
        return {**base, "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                                     "finish_reason": done.finish_reason, "logprobs": None}],
                "usage": usage(done), "speculation": speculation(done)}

    async def run_all(self, requests: list[GenerateRequest]) -> list[Completion]:
        try:
            return await asyncio.gather(*(self.client.generate(r) for r in requests))
        except ClientError as error:
            raise ApiError.from_client_error(error) from None

    async def stream(self, request: GenerateRequest, base: dict, chunk, include_usage: bool,
                     opening: dict | None = None) -> StreamingResponse:
        """An SSE response. The first response is awaited here, so a refused request gets a real error status."""
        start = time.perf_counter()
        deltas_iter = self.client.stream(request)
        try:
            first = await deltas_iter.__anext__()
        except StopAsyncIteration:
            first = None
        except ClientError as error:
            raise ApiError.from_client_error(error) from None

        async def events() -> AsyncIterator[str]:
            deltas: list[Delta] = [first] if first else []
            if opening:
                yield sse(opening)
            try:
                if first and first.text:
                    yield sse(chunk(first.text, None))
                async for delta in deltas_iter:
                    deltas.append(delta)
                    if delta.text:
                        yield sse(chunk(delta.text, None))
            except ClientError as error:
                yield sse(ApiError.from_client_error(error).body())
                yield sse("[DONE]")
                return
            finally:
                await deltas_iter.aclose()  # a client that disconnects cancels its Triton request
            done = Completion.from_deltas(request, deltas, time.perf_counter() - start)
            yield sse({**chunk("", done.finish_reason), "speculation": speculation(done)})
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(done)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def create_app(triton_url: str = "localhost:8001", model: str = "ensemble", served_model_name: str | None = None,
               chat_template: ChatTemplate | None = None, default_max_tokens: int = 16,
               timeout_s: float = 120.0) -> FastAPI:
    """The FastAPI application; `model` is the Triton model requests go to (ensemble or tensorrt_llm_bls)."""
    client = AsyncTritonClient(triton_url, "grpc", model, timeout_s=timeout_s)
    frontend = Frontend(client, served_model_name or model, chat_template, default_max_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.close()

    app = FastAPI(title="specdeploy OpenAI-compatible frontend", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse(ApiError(400, f"{param}: {first['msg']}", param=param).body(), status_code=400)

    @app.get("/v1/models")
    async def list_models():
        return frontend.models()

    @app.get("/health")
    async def health():
        try:
            await client.model_inputs()
        except ClientError as error:
            raise ApiError.from_client_error(error) from None
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await frontend.completions(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await frontend.chat(body)

    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m clients.openai_server`: serve the OpenAI-compatible API until Ctrl-C."""
    p = argparse.ArgumentParser(prog="python -m clients.openai_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC host:port")
    p.add_argument("--model", default="ensemble", help="Triton model to call (ensemble or tensorrt_llm_bls)")
    p.add_argument("--served-model-name", help="model id clients use (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory with the chat template (default: the server's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a Triton request is abandoned (504)")
    args = p.parse_args(argv)
    template = ChatTemplate.from_tokenizer_dir(args.tokenizer) if args.tokenizer else None
    app = create_app(args.triton_url, args.model, args.served_model_name, template, args.default_max_tokens,
                     args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
