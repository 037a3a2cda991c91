"""The server's output pipeline without a model: the incremental detokenizer (split UTF-8, stop
strings across tokens, control tokens hidden, parser markers kept) and the coalescing of events."""

from __future__ import annotations

from zoo.registry import embedded_path
from zoo.server.service import KEEP, OutputParser, coalesce
from zoo.text.detokenize import TextDecoder
from zoo.text.reasoning_parser import Reasoning, Text
from zoo.text.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(embedded_path("qwen38-tiny"))
HIDDEN = frozenset(i for i, t in TOK.special_tokens().items() if t not in KEEP)


def decode_one_by_one(ids, stop=()):
    dec = TextDecoder(TOK, HIDDEN, stop)
    pieces = [dec.feed([i]) for i in ids] + [dec.flush()]
    return pieces, dec.stopped


def test_multibyte_text_never_splits_a_character():
    text = "Zoo: é, 动物园, 🦒!"
    pieces, stopped = decode_one_by_one(TOK.encode(text))
    assert "".join(pieces) == text and stopped is None
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_tokens_and_control_tokens():
    ids = TOK.encode("<think>alpha</think> beta ST") + TOK.encode("OP gamma<|im_end|><|endoftext|>")
    pieces, stopped = decode_one_by_one(ids, stop=["STOP", "zzz"])
    assert "".join(pieces) == "<think>alpha</think> beta " and stopped == "STOP"
    pieces, stopped = decode_one_by_one(ids, stop=["never"])
    assert "".join(pieces) == "<think>alpha</think> beta STOP gamma" and stopped is None


def test_output_parser_and_coalesce():
    parser = OutputParser(reasoning=True)
    events = coalesce([e for piece in "<think>a b</think>\n\nc d" for e in parser.feed(piece)] + parser.flush())
    assert events == [Reasoning("a b"), Text("c d")]
