"""OpenAI-compatible HTTP frontend (FastAPI) in front of Triton's gRPC endpoint.

    python -m clients.openai_server --triton-url localhost:8001 --port 9000

Serves `/v1/models`, `/v1/completions` and `/v1/chat/completions` (server-sent events when
`stream` is true). Speculation is set per request with extra body fields `num_draft_tokens` (K; 0
turns it off) and `use_draft_logits`; `top_k`, `repetition_penalty` and `min_tokens` are accepted
too. Responses carry a `speculation` object (acceptance_rate, total_draft_tokens,
total_accepted_draft_tokens). Request bodies are validated by clients.openai_params (every OpenAI
parameter is served or refused with a 400; docs/parameters.md). `stop` strings match the generated
text and are cut from it (clients.text_stops); `logprobs` / `top_logprobs` / `echo` come from the
target model's log-probs and logits (clients.openai_logprobs). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.

`usage.prompt_tokens` is the number of tokens the server's tokenizer gives the prompt it receives:
for chat, the prompt after the chat template (role markers included), so it is larger than a count
of the message text alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from clients.chat import ChatTemplate, ChatTemplateError
from clients.client import AsyncTritonClient, ClientError, Delta, GenerateRequest, SamplingParams, tokenizer_dir_of
from clients.openai_logprobs import TokenLogprobs, TokenText, chat_logprobs, completion_logprobs
from clients.openai_params import ApiError, ChatRequest, CompletionRequest, GenerationFields, parse_body
from clients.text_stops import TextStops


@dataclass
class Outcome:
    """One finished choice: its text, why it ended, token counts and (when asked) per-token log-probs."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, float]
    logprobs: TokenLogprobs | None = None

    def usage(self) -> dict:
        """OpenAI usage counts."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def speculation(self) -> dict:
        """The speculative-decoding statistics of this choice."""
        drafted = int(self.stats.get("total_draft_tokens", 0))
        accepted = int(self.stats.get("total_accepted_draft_tokens", 0))
        return {"acceptance_rate": accepted / drafted if drafted else 0.0, "total_draft_tokens": drafted,
                "total_accepted_draft_tokens": accepted}


@dataclass
class Choice:
    """One choice in progress: text released so far (stop strings held back and cut), tokens and stats,
    and each token's log-prob (with `top` alternatives) when `top` is not None."""

    request: GenerateRequest
    stops: TextStops
    tokens: TokenText | None  # the tokenizer, when it is on this machine: exact token counts at a stop string
    top: int | None = None  # alternatives per token when logprobs are asked for
    text: str = ""
    deltas: list[Delta] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    tokens_at_stop: int | None = None  # token ids received when a stop string matched
    data: TokenLogprobs = field(default_factory=lambda: TokenLogprobs([], [], []))
    reported: int = 0  # tokens whose log-probs went out in stream chunks

    def add(self, delta: Delta) -> str:
        """Take one server response; return the text that can be sent now."""
        self.deltas.append(delta)
        self.stats.update(delta.stats)
        if self.top is not None:
            self.data = self.data + _delta_logprobs(delta, self.top)
        out = self.stops.feed(delta.text)
        if self.stops.matched is not None and self.tokens_at_stop is None:
            self.tokens_at_stop = sum(len(d.token_ids) for d in self.deltas)
        self.text += out
        return out

    def finish(self) -> str:
        """The held-back text once the server has finished (empty after a stop string)."""
        out = "" if self.stops.matched is not None else self.stops.flush()
        self.text += out
        return out

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text."""
        return self.stops.matched is not None

    def logprobs(self) -> TokenLogprobs:
        """The log-probs of the tokens behind the text so far: not those of a held-back or stop string, nor a
        trailing special token (such as a kept end-of-turn)."""
        return self.data.head(self.tokens.tokens_for(self.data.ids, len(self.text)))

    def new_logprobs(self) -> TokenLogprobs:
        """logprobs() not reported yet (for the next stream chunk)."""
        data = self.logprobs()
        new, self.reported = data.tail(self.reported), len(data.ids)
        return new

    def outcome(self, logprobs: TokenLogprobs | None = None) -> Outcome:
        """The finished choice. After a stop string, completion_tokens counts the tokens up to the one that
        completed it (without the tokenizer: every token received by then, which may be a few more)."""
        generated = int(self.stats.get("num_output_tokens", 0))
        if self.stopped:
            reason, completion = "stop", self.tokens_at_stop or 0
            if self.tokens is not None:
                ids = [t for d in self.deltas for t in d.token_ids]
                completion = self.tokens.tokens_for(ids, len(self.text) + len(self.stops.matched))
        else:
            reason, completion = ("length" if generated >= self.request.max_tokens else "stop"), generated
        return Outcome(self.text, reason, int(self.stats.get("num_input_tokens", 0)), completion, self.stats, logprobs)


def _delta_logprobs(delta: Delta, top: int) -> TokenLogprobs:
    """One server response's tokens with their log-probs: from the target's logits when alternatives are asked
    for (token and alternatives then come from the same numbers), else from output_log_probs."""
    if not delta.token_ids:
        return TokenLogprobs([], [], [], delta.context_logits)
    if top:
        rows = 0 if delta.generation_logits is None else len(delta.generation_logits)
        if rows != len(delta.token_ids):
            raise ApiError(500, f"the server returned logits for {rows} of {len(delta.token_ids)} tokens",
                           type_="server_error")
        data = TokenLogprobs.from_logits(delta.token_ids, delta.generation_logits, top, False)
    else:
        values = delta.log_probs or []
        if len(values) != len(delta.token_ids):
            raise ApiError(500, f"the server returned {len(values)} log-probs for {len(delta.token_ids)} tokens",
                           type_="server_error")
        data = TokenLogprobs(list(delta.token_ids), list(values), [[] for _ in values])
    data.context_logits = delta.context_logits
    return data


def _sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Frontend:
    """Request handling, independent of the web framework's routing."""

    def __init__(self, client: AsyncTritonClient, served_model_name: str, chat_template: ChatTemplate | None,
                 default_max_tokens: int, tokenizer_dir: str | None = None):
        self.client = client
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        self.default_max_tokens = default_max_tokens
        self.tokenizer_dir = tokenizer_dir
        self._tokens: TokenText | bool | None = None  # False: looked for, not on this machine

    async def _local_tokenizer_dir(self) -> str | None:
        """--tokenizer, else the server's tokenizer directory when it is on this machine."""
        if self.tokenizer_dir is None:
            try:
                directory = tokenizer_dir_of(await self.client.model_config("preprocessing"))
            except ClientError as error:
                raise ApiError.from_client_error(error) from None
            self.tokenizer_dir = directory if directory and Path(directory).is_dir() else ""
        return self.tokenizer_dir or None

    async def template(self) -> ChatTemplate:
        """The chat template: given, else the server's tokenizer's when it is on this machine, else ChatML."""
        if self.chat_template is None:
            directory = await self._local_tokenizer_dir()
            self.chat_template = ChatTemplate.from_tokenizer_dir(directory) if directory else ChatTemplate()
        return self.chat_template

    async def local_token_text(self, needed: bool = True) -> TokenText | None:
        """The tokenizer (tokenizer.json) when it is on this machine (and `needed`)."""
        if not needed:
            return None
        if self._tokens is None:
            directory = await self._local_tokenizer_dir()
            found = directory is not None and (Path(directory) / "tokenizer.json").is_file()
            self._tokens = TokenText.from_dir(directory) if found else False
        return self._tokens or None

    async def token_text(self, param: str) -> TokenText:
        """The tokenizer (for logprobs and token-id prompts); a 400 naming `param` when it is not on this machine."""
        tokens = await self.local_token_text()
        if tokens is None:
            raise ApiError(400, f"{param} needs the model's tokenizer.json on the frontend's machine; start the "
                           "frontend with --tokenizer DIR", param=param, code="unsupported_parameter")
        return tokens

    def check_model(self, model: str) -> None:
        """404 unless `model` is the served model's id."""
        if model != self.served_model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                           param="model", code="model_not_found")

    def models(self) -> dict:
        """GET /v1/models."""
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "specdeploy"}]}

    def triton_request(self, body: GenerationFields, prompt: str, max_tokens: int | None, template_stops: list[str],
                       prompt_logprobs: bool = False) -> GenerateRequest:
        """The Triton request for one prompt. User stop strings stay here (matched on text); the chat template's
        end-of-turn markers go to the server as stop words."""
        greedy_top_p = body.top_p == 0  # OpenAI's top_p 0 keeps only the most likely token
        # NVIDIA's backend decodes greedily when neither top_k nor top_p is set, whatever the temperature;
        # OpenAI's top_p defaults to 1, so a temperature > 0 alone samples from the whole distribution.
        top_p = body.top_p
        if top_p is None and body.top_k is None and body.temperature:
            top_p = 1.0
        sampling = SamplingParams(temperature=0.0 if greedy_top_p else body.temperature, top_k=body.top_k,
                                  top_p=None if greedy_top_p else top_p, seed=body.seed,
                                  repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty, min_tokens=body.min_tokens)
        top = body.num_top_logprobs
        return GenerateRequest(prompt=prompt, max_tokens=max_tokens or self.default_max_tokens, sampling=sampling,
                               num_draft_tokens=body.num_draft_tokens, use_draft_logits=body.use_draft_logits,
                               stop_words=template_stops, return_log_probs=body.wants_logprobs and not top,
                               return_generation_logits=body.wants_logprobs and top > 0,
                               return_context_logits=prompt_logprobs)

    async def completions(self, body: CompletionRequest):
        """POST /v1/completions."""
        self.check_model(body.model)
        prompts = [await self.prompt_text(p) for p in body.prompts()]
        if not prompts or (body.stream and len(prompts) != 1):
            raise ApiError(400, "send one prompt (a list of prompts is allowed only without stream)", param="prompt")
        echo_logprobs = bool(body.echo) and body.wants_logprobs
        requests = [self.triton_request(body, p, body.max_tokens, [], echo_logprobs) for p in prompts]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            def chunk(text: str, finish: str | None, logprobs: dict | None) -> dict:
                return {**base, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
            offset = [len(prompts[0]) if body.echo else 0]  # text_offset of the next chunk's first token

            def render(data: TokenLogprobs, tokens: TokenText) -> dict:
                out = completion_logprobs(data, tokens, with_top=True, offset0=offset[0])
                offset[0] += sum(len(t) for t in out["tokens"])
                return out
            opening = chunk(prompts[0], None, None) if body.echo else None
            return await self.stream(requests[0], body, base, chunk, opening, render if body.wants_logprobs else None)
        tokens = await self.token_text("logprobs") if body.wants_logprobs else await self.local_token_text(bool(body.stop))
        done = await asyncio.gather(*(self.run(r, body, tokens) for r in requests))
        choices = []
        for i, (prompt, d) in enumerate(zip(prompts, done)):
            text, logprobs = d.text, None
            if body.wants_logprobs:
                data = d.logprobs
                if body.echo:
                    data = self.prompt_logprobs(tokens, prompt, d, body.num_top_logprobs) + data
                logprobs = completion_logprobs(data, tokens, with_top=True)
            if body.echo:
                text = prompt + text
            choices.append({"index": i, "text": text, "finish_reason": d.finish_reason, "logprobs": logprobs})
        total = {k: sum(d.usage()[k] for d in done) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {**base, "choices": choices, "usage": total,
                "speculation": done[0].speculation() if len(done) == 1 else [d.speculation() for d in done]}

    async def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text; token ids must come back unchanged from the server's tokenization of their text."""
        if isinstance(prompt, str):
            return prompt
        tokens = await self.token_text("prompt")
        text = tokens.decode(prompt)
        if tokens.encode(text) != prompt:
            raise ApiError(400, "this token-id prompt does not survive decoding and re-encoding (the server takes "
                           "text); send the prompt as text", param="prompt")
        return text

    def prompt_logprobs(self, tokens: TokenText, prompt: str, done: Outcome, top: int) -> TokenLogprobs:
        """The echoed prompt's log-probs from the target's context logits (the first token has none)."""
        ids = tokens.encode(prompt)
        context = done.logprobs.context_logits if done.logprobs else None
        if context is None or len(context) != len(ids):
            raise ApiError(500, f"the server returned context logits for {0 if context is None else len(context)} "
                           f"prompt tokens, the frontend's tokenizer gives {len(ids)}; start the frontend with the "
                           "server's tokenizer (--tokenizer)", type_="server_error")
        return TokenLogprobs.from_logits(ids, context, top, first_is_prompt_start=True)

    async def chat(self, body: ChatRequest):
        """POST /v1/chat/completions."""
        self.check_model(body.model)
        template = await self.template()
        try:
            prompt = template.render([{"role": m.role, "content": _message_text(m.content)} for m in body.messages])
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        request = self.triton_request(body, prompt, body.max_completion_tokens or body.max_tokens, template.stop_words)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "chat.completion", "created": created, "model": body.model}
        if body.stream:
            base["object"] = "chat.completion.chunk"

            def chunk(text: str | None, finish: str | None, logprobs: dict | None) -> dict:
                delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
                return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
            return await self.stream(request, body, base, chunk, opening=chunk(None, None, None),
                                     render=chat_logprobs if body.wants_logprobs else None)
        tokens = await self.token_text("logprobs") if body.wants_logprobs else await self.local_token_text(bool(body.stop))
        done = await self.run(request, body, tokens)
        logprobs = chat_logprobs(done.logprobs, tokens) if body.wants_logprobs else None
        return {**base, "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                                     "finish_reason": done.finish_reason, "logprobs": logprobs}],
                "usage": done.usage(), "speculation": done.speculation()}

    async def run(self, request: GenerateRequest, body: GenerationFields, tokens: TokenText | None) -> Outcome:
        """Run one request to its end (streamed from Triton, so a stop string ends it at once)."""
        gen = Choice(request, TextStops(body.stop_strings), tokens, body.num_top_logprobs if body.wants_logprobs else None)
        deltas = self.client.stream(request)
        try:
            async for delta in deltas:
                gen.add(delta)
                if gen.stopped:
                    break
        except ClientError as error:
            raise ApiError.from_client_error(error) from None
        finally:
            await deltas.aclose()  # after a stop string: cancels the rest of the Triton request
        gen.finish()
        return gen.outcome(gen.logprobs() if body.wants_logprobs else None)

    async def stream(self, request: GenerateRequest, body: GenerationFields, base: dict, chunk,
                     opening: dict | None = None, render=None) -> StreamingResponse:
        """An SSE response. The first response is awaited here, so a refused request gets a real error status.
        With logprobs, `render(TokenLogprobs, tokens)` gives each chunk's logprobs object for its tokens."""
        tokens = await self.token_text("logprobs") if body.wants_logprobs else await self.local_token_text(bool(body.stop))
        gen = Choice(request, TextStops(body.stop_strings), tokens, body.num_top_logprobs if body.wants_logprobs else None)

        def event(text: str, finish: str | None = None) -> str:
            return _sse(chunk(text, finish, render(gen.new_logprobs(), tokens) if render else None))
        deltas = self.client.stream(request)
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        except ClientError as error:
            await deltas.aclose()
            raise ApiError.from_client_error(error) from None

        async def events() -> AsyncIterator[str]:
            if opening:
                yield _sse(opening)
            try:
                if first is not None and (text := gen.add(first)):
                    yield event(text)
                if not gen.stopped:
                    async for delta in deltas:
                        if text := gen.add(delta):
                            yield event(text)
                        if gen.stopped:
                            break
            except ClientError as error:
                yield _sse(ApiError.from_client_error(error).body())
                yield _sse("[DONE]")
                return
            finally:
                await deltas.aclose()  # a client that disconnects (or a stop string) cancels its Triton request
            if text := gen.finish():
                yield event(text)
            done = gen.outcome()
            yield _sse({**chunk("", done.finish_reason, None), "speculation": done.speculation()})
            if body.stream_options and body.stream_options.get("include_usage"):
                yield _sse({**base, "choices": [], "usage": done.usage()})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def _message_text(content: str | list[dict] | None) -> str:
    """A chat message's text (text parts of a multi-part content joined)."""
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if p.get("type") == "text"]
        if len(parts) != len(content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        return "".join(parts)
    return content or ""


def create_app(triton_url: str = "localhost:8001", model: str = "ensemble", served_model_name: str | None = None,
               chat_template: ChatTemplate | None = None, default_max_tokens: int = 16,
               timeout_s: float = 120.0, tokenizer_dir: str | None = None) -> FastAPI:
    """The FastAPI application; `model` is the Triton model requests go to (ensemble or tensorrt_llm_bls)."""
    client = AsyncTritonClient(triton_url, "grpc", model, timeout_s=timeout_s)
    frontend = Frontend(client, served_model_name or model, chat_template, default_max_tokens, tokenizer_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.close()

    app = FastAPI(title="specdeploy OpenAI-compatible frontend", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown paths, wrong methods
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(error.body(), status_code=exc.status_code)

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
    async def completions(request: Request):
        body = parse_body(await request.body(), request.headers.get("content-type"), CompletionRequest)
        return await frontend.completions(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await request.body(), request.headers.get("content-type"), ChatRequest)
        return await frontend.chat(body)

    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m clients.openai_server`: serve the OpenAI-compatible API until Ctrl-C."""
    p = argparse.ArgumentParser(prog="python -m clients.openai_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC host:port")
    p.add_argument("--model", default="ensemble", help="Triton model to call (ensemble or tensorrt_llm_bls)")
    p.add_argument("--served-model-name", help="model id clients use (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory: chat template, logprobs, token-id prompts "
                   "(default: the server's, when it is on this machine)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a Triton request is abandoned (504)")
    args = p.parse_args(argv)
    template = ChatTemplate.from_tokenizer_dir(args.tokenizer) if args.tokenizer else None
    app = create_app(args.triton_url, args.model, args.served_model_name, template, args.default_max_tokens,
                     args.timeout, args.tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
