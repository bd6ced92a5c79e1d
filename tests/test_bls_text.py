"""Text handling shared by preprocessing, postprocessing and the BLS (no server needed)."""

import numpy as np
import pytest

from pipeline.serving.errors import RequestError
from pipeline.serving.params import (BlsSettings, format_draft_token_costs, format_row_costs, parse_draft_token_costs,
                                     parse_row_costs, parse_text_request)
from pipeline.serving.text import (IncrementalDetokenizer, from_word_list_format, load_tokenizer, postprocess,
                                   preprocess, to_word_list_format)

MULTIBYTE = "héllo wörld: 日本語のテキスト 🙂 naïve café ∑"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(str(tiny_llama))


def test_streaming_detokenization_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # the tiny byte-level BPE splits multi-byte characters across tokens: the test is meaningful
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE
    for d in deltas:
        d.encode("utf-8")  # every streamed piece is valid UTF-8 on its own


def test_detokenizer_chunks_concatenate_to_full_decode(tokenizer):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 512, size=200).tolist()  # random tokens: invalid byte sequences included
    detok = IncrementalDetokenizer(tokenizer)
    pieces, i = [], 0
    while i < len(ids):
        n = int(rng.integers(1, 5))
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_word_list_format_round_trip():
    words = [[5, 6], [7], [8, 9, 10]]
    arr = to_word_list_format(words)
    assert arr.shape == (2, 6) and arr.dtype == np.int32
    assert arr[1].tolist()[:3] == [2, 3, 6]
    assert from_word_list_format(arr) == words
    assert to_word_list_format([]).tolist() == [[-1], [-1]]


def test_preprocess_and_postprocess_round_trip(tokenizer):
    out = preprocess({"QUERY": np.array([[b"hello world"], [MULTIBYTE.encode()]], dtype=object),
                      "REQUEST_OUTPUT_LEN": np.array([[8], [8]], dtype=np.int32),
                      "STOP_WORDS_DICT": np.array([[b"world"], [b""]], dtype=object)}, tokenizer, False)
    lengths = out["REQUEST_INPUT_LEN"]
    assert out["INPUT_ID"].shape == (2, int(lengths.max()))
    assert from_word_list_format(out["STOP_WORDS_IDS"][0]) == [tokenizer.encode("world", add_special_tokens=False)]
    text = postprocess(out["INPUT_ID"][:, None, :], lengths.reshape(2, 1), tokenizer, True)
    assert [t.decode() for t in text[:, 0]] == ["hello world", MULTIBYTE]


def test_text_request_validation(tokenizer):
    settings = BlsSettings(tokenizer_dir="", speculative_mode="draft_target", max_draft_len=4, max_input_len=64, max_seq_len=96)
    good = {"text_input": np.array([[b"hello"]], dtype=object), "max_tokens": np.array([[8]], dtype=np.int32)}
    req = parse_text_request(good, settings, tokenizer)
    assert req.max_tokens == 8 and req.num_draft_tokens == 0 and req.end_id == tokenizer.eos_token_id
    cases = {
        "max_tokens": {"max_tokens": np.array([[0]], dtype=np.int32)},
        "num_draft_tokens": {"num_draft_tokens": np.array([[5]], dtype=np.int32)},
        "text_input": {"text_input": np.array([[b"\xff\xfe"]], dtype=object)},
        "top_p": {"top_p": np.array([[1.5]], dtype=np.float32)},
        "lora_task_id": {"lora_task_id": np.array([[1]], dtype=np.uint64)},
    }
    for field, change in cases.items():
        with pytest.raises(RequestError, match=f"^{field}: .*; fix: "):
            parse_text_request({**good, **change}, settings, tokenizer)
    with pytest.raises(RequestError, match="exceed max_seq_len 96"):
        parse_text_request({**good, "max_tokens": np.array([[95]], dtype=np.int32)}, settings, tokenizer)


def test_a_requests_engine_calls_name_its_chain_but_a_call_that_can_finish_it(tokenizer):
    """The BLS's calls for one request name one chain (their request id: the engine's runner waits for a chain's next
    call after a step finished its last one), each request its own; a call that can reach max_tokens names none, as no
    call follows it."""
    settings = BlsSettings(tokenizer_dir="", speculative_mode="draft_target", max_draft_len=4, max_input_len=64,
                           max_seq_len=96)
    inputs = {"text_input": np.array([[b"hello"]], dtype=object), "max_tokens": np.array([[8]], dtype=np.int32)}
    req, other = parse_text_request(inputs, settings, tokenizer), parse_text_request(inputs, settings, tokenizer)
    assert req.chain and other.chain != req.chain and req == other  # a chain is no part of what was asked
    prompt = req.prompt_ids
    assert req.call_chain(prompt, 5) == req.chain  # 5 of 8 tokens
    assert req.call_chain(prompt + [7, 7, 7], 5) == ""  # 3 generated: this call can bring the 8th
    assert req.call_chain(prompt + [7, 7, 7], 4) == req.chain


def test_row_cost_parameter_holds_a_cost_per_draft_row_count_per_batch_size():
    costs = ((1, (1.0, 1.12, 1.17)), (4, (1.0, 1.0, 1.04, 1.33)))
    assert format_row_costs(costs) == "1:1.0,1.12,1.17 4:1.0,1.0,1.04,1.33"
    assert parse_row_costs(format_row_costs(costs)) == costs
    assert format_row_costs(()) == "0" and parse_row_costs("0") == () == parse_row_costs("")
    with pytest.raises(ValueError, match="parameter row_cost '1:1.0,x': give 'batch:cost,cost,...' per batch size"):
        parse_row_costs("1:1.0,x")
    # the policy divides by the costs: a zero, a negative, an infinite or a NaN cost is refused at load, by name
    for bad in ("1:1,0", "2:1,-1.2", "4:1,inf", "1:1,nan", "0:1,1.1"):
        with pytest.raises(ValueError, match=f"parameter row_cost '{bad}': .* with positive costs .* `pipeline repo`"):
            parse_row_costs(bad)


def test_draft_token_cost_parameter_holds_costs_per_batch_size():
    costs = ((1, 0.17), (2, 0.21), (4, 0.43))
    assert parse_draft_token_costs(format_draft_token_costs(costs)) == costs
    assert format_draft_token_costs(()) == "0" and parse_draft_token_costs("0") == () == parse_draft_token_costs("")
    assert parse_draft_token_costs("0.3") == ((1, 0.3),)  # one number: the cost at batch 1
    assert BlsSettings.from_parameters({"tokenizer_dir": "", "draft_token_cost": "1:0.17 4:0.43"}).draft_token_cost == 0.17
    with pytest.raises(ValueError, match="draft_token_cost '1:x': give 'batch:cost' pairs"):
        parse_draft_token_costs("1:x")
    with pytest.raises(ValueError, match="parameter one_token_cost '1:0.2 4': give 'batch:cost' pairs"):
        parse_draft_token_costs("1:0.2 4", "one_token_cost")  # the same form, named as the config names it
