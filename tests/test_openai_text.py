"""The OpenAI frontend's text pieces without a server: stop strings on streamed text, tokens behind a text."""

import numpy as np
import pytest

from clients.openai_logprobs import TokenText, log_softmax
from clients.text_stops import TextStops
from specfixtures.toymodels import make_tokenizer

TEXT = "The answer is 42. Paris is the capital."


def feed_all(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    s = TextStops(stops)
    out = "".join(s.feed(p) for p in pieces)
    return (out if s.matched else out + s.flush()), s.matched


@pytest.mark.parametrize("stops, want, matched", [
    (["answer is"], "The ", "answer is"),
    (["Paris", "42"], "The answer is ", "42"),  # the earliest match wins, whatever the list order
    ([". P"], "The answer is 42", ". P"),
    (["nowhere"], TEXT, None),
    (["capital.x"], TEXT, None),  # a held-back tail that never completes comes out at the end
])
def test_stop_strings_match_whatever_the_pieces(stops, want, matched):
    for pieces in ([TEXT], list(TEXT), [TEXT[i:i + 3] for i in range(0, len(TEXT), 3)]):
        assert feed_all(stops, pieces) == (want, matched)


def test_text_that_may_start_a_stop_string_is_held_back_only_while_it_may():
    s = TextStops(["answer is"])
    assert s.feed("The ans") == "The "  # "ans" may begin the stop string
    assert s.feed("wer was") == "answer was"  # it did not
    assert s.matched is None


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(directory)
    return TokenText.from_dir(directory)


def test_tokens_behind_a_text_skip_a_trailing_special_token(tokens):
    ids = tokens.encode(TEXT)
    end = tokens.tokenizer.token_to_id("<|endoftext|>")
    assert tokens.tokens_for(ids + [end], len(TEXT)) == len(ids)
    cut = TEXT.index("Paris")
    n = tokens.tokens_for(ids, cut)
    assert len(tokens.decode(ids[:n])) >= cut > len(tokens.decode(ids[:n - 1]))


def test_token_bytes_join_to_the_text(tokens):
    ids = tokens.encode("naïve café ☕")
    assert b"".join(tokens.bytes_of(i) for i in ids).decode("utf-8") == "naïve café ☕"


def test_log_softmax_rows_are_distributions_even_for_large_logits():
    rows = log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]], dtype=np.float32))
    np.testing.assert_allclose(np.exp(rows).sum(-1), 1.0, atol=1e-12)
    assert np.isfinite(rows).all() and rows[1, 0] == pytest.approx(0.0) and rows[1, 1] == pytest.approx(-1000.0)
