"""clients/ against the real Triton server (fixture `triton_server`: tiny draft/target pair, K=3 by default).

Every client path (gRPC/HTTP x stream/non-stream x sync/async) must return the same greedy text
with the server's statistics; failures must be one clear line (ClientError / `error:` on stderr).
"""

import ast
import asyncio
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clients.chat import ChatTemplate, ChatTemplateError
from clients.client import AsyncTritonClient, ClientError, GenerateRequest, SamplingParams, TritonClient
from pipeline import names
from pipeline.server import free_ports

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The class statement creates"
MAX_TOKENS = 16  # >= min_new_tokens_for_speculation (8); prompt + output stay under the draft's 64-token limit


def url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def request(**kw) -> GenerateRequest:
    return GenerateRequest(prompt=kw.pop("prompt", PROMPT), max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                           sampling=SamplingParams(temperature=0.0), **kw)


@pytest.fixture(scope="module")
def reference_text(triton_server) -> str:
    """The greedy continuation with speculation off, over gRPC without streaming."""
    with TritonClient(triton_server.grpc_url, "grpc") as client:
        done = client.generate(request(num_draft_tokens=0))
    assert done.text and done.num_output_tokens == MAX_TOKENS
    return done.text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_sync_paths_match_plain_greedy_and_report_acceptance(triton_server, reference_text, protocol, stream):
    with TritonClient(url(triton_server, protocol), protocol) as client:
        req = request(num_draft_tokens=3)
        done = client.stream_completion(req) if stream else client.generate(req)
    assert done.text == reference_text  # greedy speculation is lossless
    assert done.num_output_tokens == MAX_TOKENS and done.finish_reason == "length"
    assert done.num_input_tokens > 0
    assert done.total_draft_tokens > 0
    assert 0 <= done.total_accepted_draft_tokens <= done.total_draft_tokens
    assert done.acceptance_rate == pytest.approx(done.total_accepted_draft_tokens / done.total_draft_tokens)
    assert 0 < done.ttft_s <= done.latency_s
    if stream:  # one response per speculation round: several, in time order
        assert len(done.response_times_s) > 1 and done.response_times_s == sorted(done.response_times_s)
    else:
        assert len(done.response_times_s) == 1


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_stream_yields_text_as_it_arrives(triton_server, reference_text, protocol):
    with TritonClient(url(triton_server, protocol), protocol) as client:
        deltas = list(client.stream(request(num_draft_tokens=0)))
    texts = [d.text for d in deltas if d.text]
    assert len(texts) > 1 and "".join(texts) == reference_text
    assert deltas[-1].stats["num_output_tokens"] == MAX_TOKENS  # stats ride on the final response


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_paths_run_concurrently(triton_server, reference_text, protocol):
    async def main():
        async with AsyncTritonClient(url(triton_server, protocol), protocol) as client:
            streamed = [client.stream_completion(request(num_draft_tokens=k)) for k in (0, 1, 2, 3)]
            single = [client.generate(request(num_draft_tokens=3))]
            done = await asyncio.gather(*streamed, *single)
            deltas = [d async for d in client.stream(request(num_draft_tokens=2))]
        return done, deltas

    done, deltas = asyncio.run(main())
    assert [d.text for d in done] == [reference_text] * 5
    assert done[0].total_draft_tokens == 0 and all(d.total_draft_tokens > 0 for d in done[1:])
    assert len({d.request_id for d in done}) == 5  # each request got its own id
    assert "".join(d.text for d in deltas) == reference_text


def test_server_default_k_applies_when_request_omits_it(triton_server):
    with TritonClient(triton_server.grpc_url) as client:
        done = client.generate(request())
    assert done.total_draft_tokens > 0  # the repository's default num_draft_tokens (3)


def test_stop_word_ends_the_text(triton_server, reference_text):
    # A plain ASCII word from the second half of the greedy text; the server keeps the stop word.
    words = [w for w in reference_text.split() if w.isascii() and w.isalpha()]
    stop = " " + words[len(words) // 2]
    with TritonClient(triton_server.grpc_url) as client:
        done = client.generate(request(stop_words=[stop], num_draft_tokens=3))
    assert done.num_output_tokens < MAX_TOKENS and done.finish_reason == "stop"
    assert done.text.endswith(stop) and reference_text.startswith(done.text)


def test_tensorrt_llm_bls_model(triton_server, reference_text):
    with TritonClient(triton_server.grpc_url, model="tensorrt_llm_bls") as client:
        done = client.generate(request(num_draft_tokens=2))
    assert done.text == reference_text and done.total_draft_tokens > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_request_id_reaches_the_server(triton_server, protocol):
    with TritonClient(url(triton_server, protocol), protocol) as client:
        deltas = list(client.stream(request(request_id=f"my-request-{protocol}")))
    assert deltas and all(d.request_id == f"my-request-{protocol}" for d in deltas)  # echoed by Triton


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_down_server_is_one_clear_line(protocol):
    (port,) = free_ports(1)
    with TritonClient(f"127.0.0.1:{port}", protocol, timeout_s=5) as client, pytest.raises(ClientError) as info:
        client.generate(request())
    assert info.value.kind == "unavailable"
    message = str(info.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "make serve" in message


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_wrong_model_name(triton_server, protocol):
    with TritonClient(url(triton_server, protocol), protocol, model="no_such_model") as client:
        with pytest.raises(ClientError) as info:
            client.generate(request())
    assert info.value.kind == "not_found" and "no_such_model" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_refused_request_names_the_field_and_server_keeps_serving(triton_server, reference_text, protocol, stream):
    with TritonClient(url(triton_server, protocol), protocol) as client:
        with pytest.raises(ClientError) as info:
            req = request(num_draft_tokens=99)  # the engine's max_draft_len is 4
            list(client.stream(req)) if stream else client.generate(req)
        assert info.value.kind == "invalid_request"
        assert "num_draft_tokens" in str(info.value) and "\n" not in str(info.value)
        assert client.generate(request(num_draft_tokens=0)).text == reference_text


def test_client_side_checks():
    client = TritonClient("127.0.0.1:1")
    for bad, field in ((request(prompt=""), "prompt"), (request(max_tokens=0), "max_tokens"),
                       (request(num_draft_tokens=-1), "num_draft_tokens")):
        with pytest.raises(ClientError, match=field):
            client.generate(bad)


def test_timeout_is_a_clear_error_and_server_keeps_serving(triton_server, reference_text):
    with TritonClient(triton_server.grpc_url) as client:
        client.model_inputs()  # metadata fetched with the normal timeout
        client.timeout_s = 0.02
        with pytest.raises(ClientError) as info:
            client.generate(request(max_tokens=40, num_draft_tokens=0))
        assert info.value.kind == "timeout" and "timed out" in str(info.value)
        client.timeout_s = 60
        assert client.generate(request(num_draft_tokens=0)).text == reference_text


def test_chat_template_from_tokenizer_dir(tmp_path, triton_server):
    default = ChatTemplate.from_tokenizer_dir(triton_server.target_dir)  # the tiny tokenizer has no template
    assert default.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}[assistant]{% endif %}", "bos_token": "<s>", "eos_token": {"content": "</s>"}}')
    custom = ChatTemplate.from_tokenizer_dir(tmp_path)
    assert custom.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi\n[assistant]"
    assert custom.stop_words == ["</s>"]
    with pytest.raises(ChatTemplateError, match="messages\\[0\\]"):
        custom.render([{"role": "user"}])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clients", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_streams_and_prints_stats(triton_server, reference_text):
    out = run_cli(PROMPT, "--url", triton_server.grpc_url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                  "--num-draft-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference_text + "\n"
    assert f"[{MAX_TOKENS} tokens" in out.stderr and "acceptance" in out.stderr


def test_cli_chat_over_http(triton_server):
    out = run_cli("hello", "--chat", "--url", triton_server.http_url, "--protocol", "http", "--no-stream",
                  "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert "[8 tokens" in out.stderr or "stop" in out.stderr


def test_cli_errors_are_one_line(triton_server):
    (port,) = free_ports(1)
    for args, expected in (((PROMPT, "--url", f"127.0.0.1:{port}"), "cannot reach Triton"),
                           ((PROMPT, "--url", triton_server.grpc_url, "--model", "nope"), "'nope' is not served"),
                           ((PROMPT, "--url", triton_server.grpc_url, "--num-draft-tokens", "99"), "num_draft_tokens")):
        out = run_cli(*args)
        assert out.returncode == 1
        assert out.stderr.startswith("error: ") and expected in out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_clients_import_neither_torch_nor_the_pipeline():
    """clients/ is standalone: it installs with the light `clients` extra and imports nothing from pipeline/."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name in ("torch", "pipeline", "transformers") or name.startswith(("torch.", "pipeline.")):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import clients, clients.cli, clients.chat, clients.openai_server, clients.bench, clients.bench_args
        print("ok", "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok False"


def test_clients_speak_the_servers_names():
    """clients/ spells the wire names as literals (it cannot import pipeline.names): each metric it reads and
    each model it asks for or defaults to must be one the model repository has."""
    metrics, models = set(), set()
    for path in (ROOT / "clients").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(("spec_decode_",
                                                                                                   "reference_engine_")):
                if re.fullmatch(r"(spec_decode|reference_engine)_[a-z_]+", node.value):
                    metrics.add(node.value)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id.endswith("_MODEL") for t in node.targets):
                models.add(node.value.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "model_config":
                models.add(node.args[0].value)
            elif isinstance(node, ast.keyword) and node.arg == "model" and isinstance(node.value, ast.Constant):
                models.add(node.value.value)
            elif isinstance(node, ast.arguments):  # defaults of parameters named model
                params = node.args + node.kwonlyargs
                defaults = [None] * (len(node.args) - len(node.defaults)) + list(node.defaults) + list(node.kw_defaults)
                models.update(d.value for a, d in zip(params, defaults) if a.arg == "model" and isinstance(d, ast.Constant))
    assert metrics and metrics <= {*names.SPEC_DECODE_METRICS, names.ENGINE_STEPS_METRIC, names.ENGINE_STEP_SECONDS_METRIC}
    assert names.ENGINE_STEPS_METRIC in metrics and names.TARGET_MODEL in models
    assert {names.ENSEMBLE_MODEL, names.PREPROCESSING_MODEL, names.BLS_MODEL} <= models <= set(names.MODEL_NAMES)
