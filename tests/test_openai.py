"""The OpenAI-compatible frontend, driven by the official `openai` package, in front of the real Triton server."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

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


# ------------------------------------------------------------------ stop strings (text, across token boundaries)

def mid_token_stop(text: str, target_dir) -> str:
    """A 3-character piece of `text` that starts inside a token (a token-id stop list cannot express it)."""
    encoding = Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(text, add_special_tokens=False)
    start, end = next((s, e) for s, e in encoding.offsets[1:] if e - s >= 2 and text[s + 1:s + 4].strip())
    return text[start + 1:start + 4]


def test_stop_string_matches_text_across_tokens_and_is_cut(api, greedy, triton_server):
    stop = mid_token_stop(greedy, triton_server.target_dir)
    want = greedy[:greedy.index(stop)]
    counts = []
    for k in (0, 3):
        r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                   stop=[stop, "never appears"], extra_body={"num_draft_tokens": k})
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        counts.append(r.usage.completion_tokens)
        chunks = list(api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             stop=stop, stream=True, stream_options={"include_usage": True},
                                             extra_body={"num_draft_tokens": k}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        counts.append(chunks[-1].usage.completion_tokens)
    # the tokens up to the one completing the stop string, however many a speculative round returned at once
    assert len(set(counts)) == 1 and 0 < counts[0] < MAX_TOKENS


def test_chat_stop_string_is_cut(api):
    full = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=12, temperature=0).choices[0]
    stop = full.message.content[3:6]
    got = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=12, temperature=0, stop=stop)
    assert got.choices[0].message.content == full.message.content[:full.message.content.index(stop)]
    assert got.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ logprobs and echo

@pytest.fixture(scope="module")
def hf_target(triton_server):
    return AutoModelForCausalLM.from_pretrained(triton_server.target_dir, dtype=torch.float32).eval()


def hf_log_probs(hf, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_are_the_targets(api, greedy, triton_server, hf_target, k):
    r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                               extra_body={"num_draft_tokens": k})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == greedy and "".join(lp.tokens) == greedy
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and value == max(top.values())  # greedy: the chosen token is the most likely
    prompt_ids = tokenizer_of(triton_server).encode(PROMPT, add_special_tokens=False).ids
    out = hf_target.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)[0].tolist()
    ref = hf_log_probs(hf_target, out)
    want = [ref[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(out[len(prompt_ids):])]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-3)


def tokenizer_of(triton_server) -> Tokenizer:
    return Tokenizer.from_file(str(triton_server.target_dir / "tokenizer.json"))


def test_logprobs_without_alternatives_and_with_a_stop_string(api, greedy, triton_server):
    stop = mid_token_stop(greedy, triton_server.target_dir)
    r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                               stop=stop)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert text == greedy[:greedy.index(stop)] and all(v is not None and v <= 0 for v in lp.token_logprobs)
    # the tokens behind the returned text: they cover it, and the last one is needed to cover it
    assert "".join(lp.tokens).startswith(text) and len("".join(lp.tokens[:-1])) < len(text)
    assert len(lp.tokens) <= r.usage.completion_tokens <= len(lp.tokens) + len(stop)
    assert all(top == {} for top in lp.top_logprobs)


@pytest.mark.parametrize("k", [0, 3])
def test_streamed_logprobs_equal_the_non_streamed(api, triton_server, k):
    stop = mid_token_stop(api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0).choices[0].text, triton_server.target_dir)
    for top in (0, 2):
        full = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=top,
                                      stop=stop, extra_body={"num_draft_tokens": k}).choices[0]
        chunks = [c.choices[0] for c in api.completions.create(
            model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=top, stop=stop, stream=True,
            extra_body={"num_draft_tokens": k}) if c.choices[0].logprobs]
        assert "".join(c.text for c in chunks) == full.text
        streamed = {name: [v for c in chunks for v in getattr(c.logprobs, name)]
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert streamed["tokens"] == full.logprobs.tokens and streamed["text_offset"] == full.logprobs.text_offset
        assert streamed["token_logprobs"] == pytest.approx(full.logprobs.token_logprobs, abs=1e-4)
        for got, want in zip(streamed["top_logprobs"], full.logprobs.top_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-4)  # same tokens, same values
    full = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2).choices[0]
    streamed = [e for c in api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=8, temperature=0,
                                                       logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in full.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full.logprobs.content], abs=1e-4)


def test_echo_with_prompt_logprobs_from_token_ids(api, triton_server, hf_target):
    """What lm-eval's local-completions sends for log-likelihood: token ids, echo, logprobs=1, max_tokens=1."""
    ids = tokenizer_of(triton_server).encode(PROMPT + " the", add_special_tokens=False).ids
    for k in (0, 3):
        r = api.completions.create(model="ensemble", prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True,
                                   extra_body={"num_draft_tokens": k})
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(PROMPT + " the") and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_log_probs(hf_target, ids)
        want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-3)
        greedy_flags = [ref[i - 1].argmax().item() == t for i, t in enumerate(ids) if i]
        assert [v == max(top.values()) for v, top in zip(lp.token_logprobs[1:len(ids)], lp.top_logprobs[1:])] == greedy_flags
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_echo_without_logprobs_prepends_the_prompt(api, greedy):
    r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + greedy and r.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(api):
    r = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                    top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content and len(content) == r.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob == c.top_logprobs[0].logprob
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    plain = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=8, temperature=0, logprobs=True)
    assert [c.logprob for c in plain.choices[0].logprobs.content] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_token_prompt_that_does_not_round_trip_is_refused(api, triton_server):
    tok = tokenizer_of(triton_server)
    whole = tok.encode(PROMPT, add_special_tokens=False).ids
    # the same text cut into two pieces tokenized apart: the server would re-tokenize it differently
    split = next(ids for ids in (tok.encode(PROMPT[:i], add_special_tokens=False).ids
                                 + tok.encode(PROMPT[i:], add_special_tokens=False).ids for i in range(1, len(PROMPT)))
                 if ids != whole)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="ensemble", prompt=split, max_tokens=1)
    assert error_of(info.value)["param"] == "prompt" and "send the prompt as text" in error_of(info.value)["message"]


# ------------------------------------------------------------------ no parameter silently ignored

REFUSED = [
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"n": 2}, "n"),
    ("completions", {"ignore_eos": True}, "ignore_eos"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": 1, "echo": True, "stream": True}, "echo"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"temperature": 2.5}, "temperature"),
    ("completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": 2.01}, "frequency_penalty"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"max_tokens": 2**32 + 5}, "max_tokens"),
    ("completions", {"max_tokens": 2**40}, "max_tokens"),
    ("completions", {"max_tokens": 5.0}, "max_tokens"),
    ("completions", {"top_k": 2**32 + 1}, "top_k"),
    ("completions", {"num_draft_tokens": 2**32 + 3}, "num_draft_tokens"),
    ("completions", {"min_tokens": 2**31}, "min_tokens"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"max_token": 5}, "max_token"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"store": True}, "store"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
]


def post(frontend: str, path: str, content: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{frontend}/{path}", content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("endpoint, fields, param", REFUSED, ids=[f"{p}={list(f.values())[0]}"[:40] for _, f, p in REFUSED])
def test_unsupported_or_out_of_range_parameters_are_a_400(frontend, endpoint, fields, param):
    body = {"model": "ensemble", "max_tokens": 4,
            **({"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT}), **fields}
    response = post(frontend, "completions" if endpoint == "completions" else "chat/completions", json.dumps(body).encode())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split(".")[0] in error["message"]


def test_the_openai_client_gets_the_refusals(api):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=4, response_format={"type": "json_object"})
    assert error_of(info.value)["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=2**32 + 5)
    assert "2147483647" in error_of(info.value)["message"]


@pytest.mark.parametrize("content, content_type, words", [
    (b'{"model": "ensemble", "prompt": "x", "temperature": NaN}', "application/json", "NaN"),
    (b'{"model": "ensemble", "prompt": "x", "temperature": Infinity}', "application/json", "Infinity"),
    (b'{"model": "ensemble", "prompt": "x", "temperature": 1e999}', "application/json", "finite"),
    (b'{"model": "ensemble", "prompt": "x",', "application/json", "not valid JSON"),
    (b'{"model": "ensemble", "prompt": "x"}', "text/plain", "Content-Type"),
    (b'{"model": "ensemble", "prompt": "\xff\xfe"}', "application/json", "UTF-8"),
    (b'["ensemble"]', "application/json", "JSON object"),
])
def test_bad_bodies_get_openai_errors_with_a_useful_message(frontend, content, content_type, words):
    response = post(frontend, "completions", content, content_type)
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert words in body["error"]["message"]


def test_unknown_path_is_an_openai_error(frontend):
    response = httpx.get(f"{frontend}/nothing-here", timeout=30)
    assert response.status_code == 404 and "error" in response.json()


def test_parameters_without_effect_on_output_are_accepted(api, greedy):
    r = api.chat.completions.create(model="ensemble", messages=CHAT, max_tokens=4, temperature=0, user="u1",
                                    response_format={"type": "text"}, metadata={"a": "b"}, parallel_tool_calls=True,
                                    store=False, service_tier="auto")
    assert r.choices[0].message.content
    r = api.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, top_p=0, temperature=1.5, seed=3)
    assert r.choices[0].text == greedy  # top_p 0 keeps only the most likely token
