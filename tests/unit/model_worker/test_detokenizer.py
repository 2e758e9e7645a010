from __future__ import annotations

from model_worker.engine.detokenizer import IncrementalDetokenizer
from tests.unit.fakes import ByteTokenizer


def feed(text: str, stop=()):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "), stop)
    deltas = [detok.add_token(t) for t in tok.encode(text)]
    deltas.append(detok.flush())
    return deltas, detok


def test_never_emits_half_a_utf8_character():
    deltas, _ = feed("né 日本 🙂!")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "né 日本 🙂!"
    assert "" in deltas, "a partial character waits for its next byte"


def test_stop_string_is_not_emitted_even_across_tokens():
    deltas, detok = feed("hello ##END## trailing", stop=["##END##"])
    assert "".join(deltas) == "hello "
    assert detok.stopped_on == "##END##"
    assert all("#" not in d for d in deltas)


def test_earliest_of_several_stop_strings_wins():
    deltas, detok = feed("abc STOP2 def STOP1", stop=["STOP1", "STOP2"])
    assert "".join(deltas) == "abc " and detok.stopped_on == "STOP2"


def test_text_that_only_resembles_a_stop_prefix_is_released_at_the_end():
    deltas, detok = feed("value ##EN", stop=["##END##"])
    assert "".join(deltas) == "value ##EN" and detok.stopped_on is None
