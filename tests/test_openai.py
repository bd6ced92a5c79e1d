"""The OpenAI-compatible frontend, driven by the official `openai` package, in front of the real Triton server."""

import asyncio
import threading
import time

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from clients.client import GenerateRequest, SamplingParams, TritonClient
from clients.openai_server import create_app
from pipeline.server import free_ports

PROMPT = "The class statement creates"
MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def frontend(triton_server):
    """The frontend on a free localhost port (uvicorn in a thread); yields its base URL."""
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(create_app(triton_server.grpc_url), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def api(frontend):
    return openai.OpenAI(base_url=frontend, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(triton_server) -> str:
    """The greedy continuation of PROMPT straight from Triton (speculation off)."""
    with TritonClient(triton_server.grpc_url) as client:
        return client.generate(GenerateRequest(PROMPT, MAX_TOKENS, SamplingParams(temperature=0.0),
                                               num_draft_tokens=0)).text


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == ["ensemble"]


@pytest.mark.parametrize("k", [0, 3])
def test_completion_text_usage_and_speculation(api, greedy, k):
    r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                               extra_body={"num_draft_tokens": k})
    assert r.object == "text_completion" and r.choices[0].text == greedy
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculation"]
    assert (spec["total_draft_tokens"] > 0) == (k > 0)
    assert 0 <= spec["total_accepted_draft_tokens"] <= spec["total_draft_tokens"]


def test_completion_prompt_list_runs_each_prompt(api, greedy):
    r = api.completions.create(model="ensemble", prompt=[PROMPT, PROMPT + " a"], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == greedy
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    assert len(r.model_extra["speculation"]) == 2


def test_completion_stream_is_server_sent_events_with_usage(api, greedy):
    chunks = list(api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"num_draft_tokens": 3}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1 and "".join(texts) == greedy
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_matches_non_stream(api):
    full = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"num_draft_tokens": 2, "use_draft_logits": False})
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > len("hello")
    chunks = list(api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_async_openai_client_concurrent_requests(frontend, greedy):
    async def main():
        client = openai.AsyncOpenAI(base_url=frontend, api_key="unused", max_retries=0)
        out = await asyncio.gather(*(client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                               temperature=0, extra_body={"num_draft_tokens": k})
                                     for k in (0, 1, 2, 3)))
        await client.close()
        return out

    assert [r.choices[0].text for r in asyncio.run(main())] == [greedy] * 4


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_errors_follow_openai_shape(api):
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert error_of(info.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=0)
    assert error_of(info.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=4, n=2)
    assert error_of(info.value)["param"] == "n"


@pytest.mark.parametrize("stream", [False, True])
def test_refused_request_is_a_400_before_streaming(api, stream):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=12, stream=stream,
                                    extra_body={"num_draft_tokens": 99})
    err = error_of(info.value)
    assert err["type"] == "invalid_request_error" and "num_draft_tokens" in err["message"]
    assert api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_triton_down_is_a_503():
    (port,) = free_ports(1)
    with TestClient(create_app(f"127.0.0.1:{port}", timeout_s=5)) as client:
        response = client.post("/v1/completions", json={"model": "ensemble", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "server_error" and "cannot reach Triton" in error["message"]


def test_triton_timeout_is_a_504_and_health_reports_the_server(triton_server):
    with TestClient(create_app(triton_server.grpc_url, timeout_s=30)) as client:
        assert client.get("/health").json() == {"status": "ok"}
    with TestClient(create_app(triton_server.grpc_url, timeout_s=0.01)) as client:
        response = client.post("/v1/completions", json={"model": "ensemble", "prompt": PROMPT, "max_tokens": 40,
                                                         "num_draft_tokens": 0})
    assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]
