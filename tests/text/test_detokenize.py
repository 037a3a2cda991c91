"""``TextDecoder`` (``zoo.text.detokenize``) with stop strings, on the tiny model's tokenizer (short
pieces: "Hello" is "H" "ell" "o"): the text ends right before a stop string, text before it in the
same token is kept, a stop string split over tokens is found, a possible start of one is held back
and never comes out if it completes, ``taken`` finds the token that completed it in a feed of
several, ``tokens_before_stop`` counts the tokens wholly before it, hidden tokens count nowhere."""

from __future__ import annotations

from zoo.registry import embedded_path
from zoo.text.detokenize import TextDecoder, hidden_special_tokens
from zoo.text.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(embedded_path("qwen38-tiny"))
TEXT = "Hello world, the zoo is open"
IDS = TOK.encode(TEXT)
END = TOK.token_to_id("<|im_end|>")


def one_by_one(ids, stop):
    dec = TextDecoder(TOK, hidden_special_tokens(TOK), stop)
    pieces = [dec.feed([t]) for t in ids] + [dec.flush()]
    return pieces, dec


def test_text_before_the_stop_string_in_the_same_token_is_kept():
    assert [TOK.decode([t]) for t in IDS[:3]] == ["H", "ell", "o"]
    pieces, dec = one_by_one(IDS, ["ll"])                  # starts inside "ell"
    assert "".join(pieces) == "He" and dec.stopped == "ll"
    assert dec.tokens_before_stop(IDS[:2]) == 1            # "H": the tokens wholly before it


def test_a_stop_string_across_tokens_and_the_first_of_several():
    pieces, dec = one_by_one(IDS, ["zoo is", "o wor", "never"])
    assert "".join(pieces) == "Hell" and dec.stopped == "o wor"     # the earliest in the text
    assert [TOK.decode([t]) for t in IDS[:6]] == ["H", "ell", "o", " ", "wo", "r"]
    assert dec.tokens_before_stop(IDS[:6]) == 2                      # "H" "ell"; "o" holds its start


def test_a_possible_start_is_held_back_and_released_when_it_is_not_one():
    pieces, dec = one_by_one(IDS, ["the zoo is closed"])
    assert "".join(pieces) == TEXT and dec.stopped is None
    at_o = IDS.index(TOK.encode(" o")[0])
    assert "".join(pieces[:at_o]) == "Hello world, "          # "the zoo is" waits for " o", which differs
    assert pieces[at_o] == "the zoo is o"
    pieces, dec = one_by_one(IDS[:at_o + 1], ["open sesame"])
    assert pieces[-2:] == [" ", "o"] and "".join(pieces) == "Hello world, the zoo is o"   # flush: no match


def test_streamed_text_never_holds_part_of_the_stop_string():
    for stop in ("zoo", "the zoo", ", t", "d, the"):
        pieces, dec = one_by_one(IDS, [stop])
        out = ""
        for piece in pieces:
            out += piece
            assert TEXT.startswith(out) and len(out) <= TEXT.find(stop), (stop, out)
        assert out == TEXT[:TEXT.find(stop)] and dec.stopped == stop


def test_a_feed_of_several_tokens_says_which_one_completed_the_stop_string():
    dec = TextDecoder(TOK, frozenset(), ["zoo"])
    n = IDS.index(TOK.encode("oo")[0])                      # "z" "oo": "oo" completes it
    first = dec.feed(IDS[:n - 3])
    assert dec.taken == n - 3 and dec.stopped is None
    rest = dec.feed(IDS[n - 3:])
    assert dec.stopped == "zoo" and dec.taken == 4            # of the fed ids, up to "oo" and no further
    assert first + rest == "Hello world, the "
    assert dec.feed(IDS[:2]) == "" and dec.taken == 0 and dec.flush() == ""


def test_hidden_tokens_are_left_out_and_kept_ones_are_text():
    ids = TOK.encode("<think>a</think> b") + [END] + TOK.encode(" c")
    pieces, dec = one_by_one(ids, ["a b"])                   # every special token hidden: "a b c"
    assert "".join(pieces) == "" and dec.stopped == "a b" and dec.tokens_before_stop(ids) == 1
    keep = ("<think>", "</think>", "<|im_end|>")
    kept = TextDecoder(TOK, hidden_special_tokens(TOK, keep), ["b<|im"])
    assert kept.feed(ids) == "<think>a</think> " and kept.stopped == "b<|im"
    assert kept.tokens_before_stop(ids) == ids.index(TOK.encode(" b")[0])
    assert END not in hidden_special_tokens(TOK, keep) and END in hidden_special_tokens(TOK)
