"""Requests against the real Triton server (fixture `triton_server`: tiny draft/target pair, one server per session).

Greedy outputs are compared with plain Hugging Face greedy decoding of the target checkpoint.
"""

import json
import queue
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype
from transformers import AutoTokenizer, LlamaForCausalLM

from pipeline.corpus import local_text
from tests.triton_fixtures import DRAFT_MAX_SEQ_LEN

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plain(triton_server):
    """plain(prompt, max_tokens) -> the target's greedy continuation text, decoded like the server does."""
    tok = AutoTokenizer.from_pretrained(triton_server.target_dir)
    model = LlamaForCausalLM.from_pretrained(triton_server.target_dir, dtype=torch.float32).eval()
    cache = {}

    def run(prompt: str, max_tokens: int = MAX_TOKENS, ids: bool = False):
        if (prompt, max_tokens) not in cache:
            prompt_ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
            with torch.no_grad():
                out = model.generate(prompt_ids, max_new_tokens=max_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            new = out[0, prompt_ids.shape[1]:].tolist()
            if tok.eos_token_id in new:
                new = new[:new.index(tok.eos_token_id)]
            cache[prompt, max_tokens] = new
        new = cache[prompt, max_tokens]
        return new if ids else tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return run


def prompts(n: int) -> list[str]:
    """n different short prompts from local text."""
    words = local_text(20_000).split()
    return [" ".join(words[i * 7:i * 7 + 5 + i % 4]) for i in range(n)]


# Every test's gRPC stream has a deadline: a stream that the server never closes (docs/reliability.md, "Another hang,
# seen once") then ends with DEADLINE_EXCEEDED, and its test fails, where stop_stream() would wait forever.
STREAM_DEADLINE_S = 300


def open_stream(url: str, callback) -> grpcclient.InferenceServerClient:
    """A gRPC client with its stream started (callback(result, error) per response), the stream bounded by
    STREAM_DEADLINE_S."""
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback, stream_timeout=STREAM_DEADLINE_S)
    return client


def grpc_inputs(fields: dict, client_module=grpcclient) -> list:
    """InferInputs of tritonclient.grpc (or of the client module given, e.g. tritonclient.http)."""
    out = []
    for name, value in fields.items():
        arr = np.asarray(value)
        t = client_module.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def text_request(prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """ensemble / tensorrt_llm_bls inputs; generated text only unless `exclude_input_in_output` says otherwise."""
    fields = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    for name, value in {"exclude_input_in_output": True, **extra}.items():
        dtype = {bool: bool, int: np.int32, float: np.float32}[type(value)]
        fields[name] = np.array([[value]], dtype=dtype)
    return fields


def stream_requests(url: str, model: str, requests: list[dict], timeout: float = 120) -> list[list]:
    """Send every request on one gRPC stream; returns each request's results (texts, last result). timeout: seconds
    to wait for the next request to end (the tiny models' streams end within seconds; a stream stuck in Triton's
    python backend fails its test in two minutes, and the next test's check stops the session)."""
    results: dict[str, list] = {str(i): [] for i in range(len(requests))}
    done: queue.Queue = queue.Queue()

    def callback(result, error):
        if error is not None:
            done.put(("error", error))
            return
        rid = result.get_response().id
        results[rid].append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.put(("final", rid))

    client = open_stream(url, callback)
    for i, fields in enumerate(requests):
        client.async_stream_infer(model, grpc_inputs(fields), request_id=str(i), enable_empty_final_response=True)
    finished = 0
    errors = []
    while finished < len(requests):
        kind, value = done.get(timeout=timeout)
        finished += 1
        if kind == "error":
            errors.append(value)
    client.stop_stream()
    client.close()
    if errors:
        raise errors[0]
    return [results[str(i)] for i in range(len(requests))]


def joined_text(results: list) -> str:
    parts = [r.as_numpy("text_output") for r in results]
    return "".join(p[0].decode("utf-8") for p in parts if p is not None)  # text_output[0], as NVIDIA's clients read it


def final_value(results: list, name: str):
    for r in reversed(results):
        v = r.as_numpy(name)
        if v is not None:
            return v.reshape(-1)[0]
    return None


def http_json(url: str, body: dict | bytes) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# ----------------------------------------------------------------------------- protocols


def _http_inputs(fields: dict) -> list:
    out = []
    for name, arr in fields.items():
        t = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_http_infer_preprocessing_postprocessing_round_trip(triton_server):
    """HTTP /infer serves the non-decoupled models (decoupled ones answer on /generate and gRPC streams)."""
    client = httpclient.InferenceServerClient(triton_server.http_url)
    text = "héllo wörld, 日本語 🙂"
    pre = client.infer("preprocessing", _http_inputs({
        "QUERY": np.array([[text.encode()]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[8]], dtype=np.int32),
        "STOP_WORDS_DICT": np.array([[b"world"]], dtype=object)}))
    ids, lengths = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
    tok = AutoTokenizer.from_pretrained(triton_server.target_dir)
    assert ids[0, :lengths[0, 0]].tolist() == tok.encode(text, add_special_tokens=False)
    assert pre.as_numpy("STOP_WORDS_IDS").shape[:2] == (1, 2)
    post = client.infer("postprocessing", _http_inputs({"TOKENS_BATCH": ids[:, None, :].astype(np.int32),
                                                         "SEQUENCE_LENGTH": lengths.astype(np.int32)}))
    assert post.as_numpy("OUTPUT").reshape(-1)[0].decode() == text


def test_generate_and_generate_stream(triton_server, plain):
    prompt = prompts(2)[1]
    base = f"http://{triton_server.http_url}/v2/models"
    status, body = http_json(f"{base}/ensemble/generate", {"text_input": prompt, "max_tokens": MAX_TOKENS, "num_draft_tokens": 0})
    assert status == 200, body
    # exclude_input_in_output unset: a non-streaming response starts with the prompt, as NVIDIA's ensemble's
    assert json.loads(body)["text_output"] == prompt + plain(prompt)
    status, body = http_json(f"{base}/ensemble/generate", {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                           "num_draft_tokens": 3, "exclude_input_in_output": True})
    assert status == 200 and json.loads(body)["text_output"] == plain(prompt), body
    status, body = http_json(f"{base}/tensorrt_llm_bls/generate_stream",
                             {"text_input": prompt, "max_tokens": MAX_TOKENS, "num_draft_tokens": 3, "stream": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 2  # streamed: several rounds, then the final response with the counters
    assert "".join(e["text_output"] for e in events) == plain(prompt)
    assert events[-1]["total_draft_tokens"] > 0
    assert 0 <= events[-1]["acceptance_rate"] <= 1


def test_grpc_streaming_speculative(triton_server, plain):
    prompt = prompts(3)[2]
    (results,) = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls", [text_request(prompt, stream=True, num_draft_tokens=3)])
    assert len(results) > 2
    assert joined_text(results) == plain(prompt)
    proposed, accepted = final_value(results, "total_draft_tokens"), final_value(results, "total_accepted_draft_tokens")
    assert 0 < proposed and 0 <= accepted <= proposed
    assert final_value(results, "acceptance_rate") == pytest.approx(accepted / proposed)


def test_sixteen_concurrent_streams_match_plain_greedy(triton_server, plain):
    texts = prompts(16)
    requests = [text_request(p, stream=True, num_draft_tokens=(i % 4)) for i, p in enumerate(texts)]  # K = 0..3 mixed
    all_results = stream_requests(triton_server.grpc_url, "ensemble", requests)
    for prompt, results in zip(texts, all_results):
        assert joined_text(results) == plain(prompt), prompt


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_nvidia_end_to_end_grpc_client_request(triton_server, model):
    """The inputs NVIDIA's inflight_batcher_llm/client/end_to_end_grpc_client.py sends (prepare_inputs)."""
    prompt = "What is machine learning?"
    fields = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * 16,
        "stream": np.array([[True]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "num_draft_tokens": np.array([[3]], dtype=np.int32),
        "use_draft_logits": np.array([[False]], dtype=bool),
        "bad_words": np.array([["foo"]], dtype=object),
        "stop_words": np.array([["bar", "baz"]], dtype=object),
        "repetition_penalty": np.array([[1.0]], dtype=np.float32),
        "presence_penalty": np.array([[0.0]], dtype=np.float32),
        "frequency_penalty": np.array([[0.0]], dtype=np.float32),
        "end_id": np.array([[0]], dtype=np.int32),
        "pad_id": np.array([[0]], dtype=np.int32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }
    texts = []
    for _ in range(2):
        got: queue.Queue = queue.Queue()
        client = open_stream(triton_server.grpc_url, lambda result, error: got.put(error or result))
        client.async_stream_infer(model, grpc_inputs(fields), outputs=[grpcclient.InferRequestedOutput("text_output")],
                                  request_id="1")
        client.stop_stream()  # waits for the server to close the stream, as NVIDIA's client does
        results = []
        while not got.empty():
            results.append(got.get())
        assert results and not any(isinstance(r, InferenceServerException) for r in results), results
        texts.append("".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results
                             if r.as_numpy("text_output") is not None))
    # streamed: no prompt, whatever exclude_input_in_output says (as NVIDIA's backend; its client's --check-outputs
    # expects that); temperature 1 with no top_k / top_p is greedy in NVIDIA's backend: the same text twice
    assert texts[0] and not texts[0].startswith(prompt) and texts[0] == texts[1]


# ----------------------------------------------------------------------------- errors


# case -> (gRPC inputs, the generate endpoint's JSON or None, text the error must contain)
BAD_REQUESTS = {
    "missing text_input": ({"max_tokens": np.array([[8]], dtype=np.int32)}, {"max_tokens": 8}, "text_input"),
    "max_tokens zero": (text_request("hello", 0), {"text_input": "hello", "max_tokens": 0}, "max_tokens"),
    "max_tokens beyond max_seq_len": (text_request("hello", 10_000), {"text_input": "hello", "max_tokens": 10_000},
                                      "max_seq_len"),
    "num_draft_tokens beyond max_draft_len": (text_request("hello", 8, num_draft_tokens=9),
                                              {"text_input": "hello", "max_tokens": 8, "num_draft_tokens": 9},
                                              "num_draft_tokens"),
    "wrong dtype": ({"text_input": np.array([[b"hello"]], dtype=object), "max_tokens": np.array([[8.0]], dtype=np.float32)},
                    None, "max_tokens"),  # JSON has no dtype to get wrong
    "invalid utf-8": ({"text_input": np.array([[b"\xff\xfe\xfd"]], dtype=object), "max_tokens": np.array([[8]], dtype=np.int32)},
                      None, "UTF-8"),
}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_invalid_argument(triton_server, model, case):
    grpc_fields, generate_body, mentions = BAD_REQUESTS[case]
    got: queue.Queue = queue.Queue()
    client = open_stream(triton_server.grpc_url, lambda result, error: got.put(error or result))
    client.async_stream_infer(model, grpc_inputs(grpc_fields), request_id="bad")
    reply = got.get(timeout=60)  # an error arrives: the stream never hangs
    client.stop_stream()
    assert isinstance(reply, InferenceServerException), reply
    assert mentions in reply.message()
    if generate_body is not None:  # the HTTP status carries the error code: 400 = invalid argument
        status, body = http_json(f"http://{triton_server.http_url}/v2/models/{model}/generate", generate_body)
        assert status == 400, (status, body)


def test_bad_http_generate_is_400_and_server_keeps_serving(triton_server, plain):
    base = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    status, body = http_json(base, {"max_tokens": 8})
    assert status == 400, body
    status, body = http_json(base, {"text_input": "hi", "max_tokens": 8, "num_draft_tokens": 99})
    assert status == 400 and "num_draft_tokens" in body and "fix" in body
    prompt = prompts(1)[0]
    status, body = http_json(base, {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})
    assert status == 200 and json.loads(body)["text_output"] == plain(prompt)


# ----------------------------------------------------------------------------- speculation details


def test_draft_failure_falls_back_to_target(triton_server, plain):
    """The draft engine's max_seq_len is DRAFT_MAX_SEQ_LEN: longer sequences make its calls fail mid-request."""
    prompt = " ".join(local_text(5000).split()[:10])
    n = 60
    before = _metric(triton_server, "spec_decode_draft_fallbacks_total")
    (results,) = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls", [text_request(prompt, n, stream=True, num_draft_tokens=3)])
    assert joined_text(results) == plain(prompt, n)
    assert _metric(triton_server, "spec_decode_draft_fallbacks_total") == before + 1
    assert "draft model failed" in triton_server.server.log_file.read_text()
    assert final_value(results, "total_draft_tokens") > 0  # it did speculate before the sequence outgrew the draft
    prompt_len = len(AutoTokenizer.from_pretrained(triton_server.target_dir).encode(prompt))
    assert prompt_len + 8 < DRAFT_MAX_SEQ_LEN < prompt_len + n


def test_sampled_lossless_request_completes(triton_server):
    (results,) = stream_requests(triton_server.grpc_url, "tensorrt_llm_bls", [
        text_request(prompts(1)[0], stream=False, num_draft_tokens=3, use_draft_logits=True, temperature=0.8,
                     top_k=20)])
    assert len(results) == 1  # not streamed: one final response
    assert joined_text(results)
    assert final_value(results, "total_draft_tokens") > 0


def test_target_model_verifies_external_draft_tokens(triton_server, plain):
    """tensorrt_llm with draft_input_ids returns the accepted prefix plus one target token."""
    tok = AutoTokenizer.from_pretrained(triton_server.target_dir)
    prompt = prompts(1)[0]
    ids = tok.encode(prompt, add_special_tokens=False)
    greedy = plain(prompt, 6, ids=True)
    draft = greedy[:2] + [(greedy[2] + 1) % 512]  # two right, one wrong
    fields = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[len(draft) + 1]], dtype=np.int32),
              "draft_input_ids": np.array([draft], dtype=np.int32)}
    (results,) = stream_requests(triton_server.grpc_url, "tensorrt_llm", [fields])
    out = [r.as_numpy("output_ids") for r in results if r.as_numpy("output_ids") is not None]
    # exclude_input_in_output is false in the config (NVIDIA's recipe): the prompt comes back first
    assert np.concatenate([o.reshape(-1) for o in out]).tolist() == ids + greedy[:3]
    assert final_value(results, "total_accepted_draft_tokens") == 2


def test_metrics_endpoint_shows_speculative_metrics(triton_server):
    stream_requests(triton_server.grpc_url, "tensorrt_llm_bls", [text_request(prompts(1)[0], num_draft_tokens=3)])
    with urllib.request.urlopen(triton_server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    label = 'model="tensorrt_llm_bls"'
    assert _metric(triton_server, "spec_decode_draft_tokens_total") > 0
    assert _metric(triton_server, "spec_decode_accepted_tokens_total") >= 0
    buckets = [l for l in text.splitlines() if l.startswith("spec_decode_acceptance_length_bucket{") and label in l]
    assert len(buckets) >= 2 and any('le="+Inf"' in l for l in buckets)
    assert any(l.startswith("spec_decode_acceptance_length_count{") and label in l for l in text.splitlines())
    assert "spec_decode_accepted_tokens_per_position_total{" in text
    busy = [l for l in text.splitlines() if l.startswith('reference_engine_step_seconds_total{model="tensorrt_llm"}')]
    assert busy and float(busy[0].rsplit(" ", 1)[1]) > 0  # engine busy time, for utilization and bench-serve


def test_each_served_engine_chooses_its_decode_threads_once_before_its_first_step(triton_server):
    """The target's engine chose its small forwards' thread count before its first step (the session's guard has sent
    a request), not at load alone, where the other model processes starting beside it skew the timing
    (pipeline.serving.reference_adapter.MeteredEngine), and said so in the server log, once."""
    log = triton_server.server.log_file.read_text(errors="replace")
    chosen = re.findall(r"tensorrt_llm: small forwards on ([0-9]+) thread\(s\), chosen before the first step", log)
    assert len(chosen) == 1 and int(chosen[0]) >= 1, chosen


def _metric(triton_server, name: str) -> float:
    with urllib.request.urlopen(triton_server.metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") and 'model="tensorrt_llm_bls"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cancelled_stream_stops_its_work(triton_server):
    """A client that cancels its stream: the BLS stops generating (it logs how far it got) and keeps serving."""
    got: queue.Queue = queue.Queue()
    client = open_stream(triton_server.grpc_url, lambda result, error: got.put(error or result))
    max_tokens = 200
    client.async_stream_infer("tensorrt_llm_bls", grpc_inputs(text_request(prompts(5)[4], max_tokens, stream=True,
                                                                            num_draft_tokens=0)), request_id="c")
    log = triton_server.server.log_file
    marker = "tensorrt_llm_bls: request cancelled by its client, stopped after "
    earlier = log.read_text().count(marker)  # the session's server: earlier tests cancelled streams too
    first = got.get(timeout=60)
    assert not isinstance(first, InferenceServerException), first
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 60
    while log.read_text().count(marker) == earlier and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [l for l in log.read_text().splitlines() if marker in l]
    assert len(lines) > earlier, f"the BLS logged no cancellation within 60 s (server log: {log})"
    line = lines[earlier]  # this test's
    stopped_at = int(line.split(marker)[1].split(" of ")[0])
    assert stopped_at < max_tokens
    (results,) = stream_requests(triton_server.grpc_url, "ensemble", [text_request(prompts(1)[0], 4)])
    assert joined_text(results)


def test_log_probs_and_context_logits_under_nvidia_names(triton_server, plain):
    """tensorrt_llm and the ensemble return output_log_probs / cum_log_probs / context_logits as NVIDIA's
    backend names them; with speculation they are the target's (equal to plain decoding)."""
    tok = AutoTokenizer.from_pretrained(triton_server.target_dir)
    model = LlamaForCausalLM.from_pretrained(triton_server.target_dir, dtype=torch.float32).eval()
    prompt = prompts(2)[1]
    ids = tok.encode(prompt, add_special_tokens=False)
    greedy = plain(prompt, 8, ids=True)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + greedy])).logits[0], -1)
    want = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(greedy)]
    fields = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[8]], dtype=np.int32), "return_log_probs": np.array([[True]]),
              "return_context_logits": np.array([[True]])}
    (target,) = stream_requests(triton_server.grpc_url, "tensorrt_llm", [fields])
    log_probs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in target])
    assert target[-1].as_numpy("output_log_probs").ndim == 3  # [batch, beams, n]
    np.testing.assert_allclose(log_probs, want, atol=1e-4)
    assert final_value(target, "cum_log_probs") == pytest.approx(sum(want), abs=1e-3)
    (context,) = [r.as_numpy("context_logits") for r in target if r.as_numpy("context_logits") is not None]
    assert context.shape == (1, len(ids), ref.shape[1])
    np.testing.assert_allclose(torch.log_softmax(torch.from_numpy(context[0].copy()), -1).numpy(), ref[:len(ids)].numpy(), atol=1e-4)
    for k in (0, 3):
        (results,) = stream_requests(triton_server.grpc_url, "ensemble", [text_request(
            prompt, 8, num_draft_tokens=k, return_log_probs=True, stream=True)])
        got = [v for r in results if r.as_numpy("output_log_probs") is not None for v in r.as_numpy("output_log_probs").reshape(-1)]
        ids_out = [t for r in results if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids").reshape(-1)]
        assert ids_out == greedy and joined_text(results) == plain(prompt, 8)
        np.testing.assert_allclose(got, want, atol=1e-4)
