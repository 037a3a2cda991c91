"""Generation on the embedded tiny model: greedy == step-by-step argmax of the full forward,
seeded sampling, stop tokens/strings, streaming, and the ``zoo generate`` command."""

from __future__ import annotations

import numpy as np
import pytest

import zoo
from zoo.cli import main as cli_main


@pytest.fixture(scope="module")
def model():
    return zoo.load("qwen38-tiny", dtype="float32")


def greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(model.logits([seq])[0, -1])))
    return seq[len(prompt):]


def test_greedy_matches_full_forward_argmax(model):
    prompts = [[5, 17, 200, 33, 8, 91, 4], [300, 2, 77]]
    gens = model.generate(prompts, max_new_tokens=8)
    for p, g in zip(prompts, gens):
        expected = greedy_by_full_forward(model, p, 8)
        stop = set(model.generator().eos_token_ids)
        cut = next((i for i, t in enumerate(expected) if t in stop), len(expected))
        assert g.tokens == expected[:cut]
        assert g.finish_reason == ("stop" if cut < 8 else "length")
        assert g.stats["prompt_tokens"] == len(p)


def test_seeded_sampling_is_reproducible(model):
    p = [[10, 20, 30, 40]]
    a = model.generate(p, max_new_tokens=12, temperature=1.0, seed=1)[0].tokens
    b = model.generate(p, max_new_tokens=12, temperature=1.0, seed=1)[0].tokens
    c = model.generate(p, max_new_tokens=12, temperature=1.0, seed=2)[0].tokens
    assert a == b and a != c
    top1 = model.generate(p, max_new_tokens=12, temperature=1.0, top_k=1, seed=3)[0].tokens
    assert top1 == model.generate(p, max_new_tokens=12)[0].tokens


def test_stop_token_and_stream(model):
    p = [11, 22, 33]
    full = model.generate([p], max_new_tokens=10)[0].tokens
    assert list(model.stream(p, max_new_tokens=10)) == full
    i = next((i for i in range(1, len(full)) if full[i] not in full[:i]), None)   # its first occurrence
    assert i is not None, f"the output {full} repeats one token"
    stopped = model.generate([p], max_new_tokens=10, stop=[full[i]])[0]
    assert stopped.tokens == full[:i] and stopped.finish_reason == "stop"


def test_stop_string_truncates(model):
    tok = model.tokenizer
    p = tok.encode("Hello")
    full = model.generate([p], max_new_tokens=16)[0].tokens
    text = tok.decode(full)
    at = next((i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip()), None)
    assert at is not None, f"the generated text {text!r} has no two visible characters in its second half"
    needle = text[at:at + 2]
    g = model.generate([p], max_new_tokens=16, stop=[needle])[0]
    assert needle not in tok.decode(g.tokens) and g.finish_reason == "stop"
    assert text.startswith(tok.decode(g.tokens))


def mid_token_needle(tok, tokens: list[int]) -> tuple[int, str]:
    """(i, needle): two visible characters of the output text that first occur starting inside
    output token i (after its first character), in the second half of the output."""
    text = tok.decode(tokens)
    for i in range(len(tokens) // 2, len(tokens) - 1):
        at, piece = len(tok.decode(tokens[:i])), tok.decode(tokens[i:i + 1])
        needle = text[at + 1:at + 3]
        if len(piece) >= 2 and piece.isascii() and needle.strip() == needle and len(needle) == 2 \
                and text.find(needle) == at + 1:
            return i, needle
    raise AssertionError(f"the output {[tok.decode([t]) for t in tokens]} has no token to cut inside")


def test_a_stop_string_ends_the_request_in_the_engine_at_the_character(model):
    """A stop string that starts inside a token: the engine ends the request ("stop", the stop
    string in its stats); its text keeps the characters of that token before the stop string, its
    tokens end before that token (as the Python API always cut them); text given to ``on_tokens``
    only ever grows by text that stays (a possible start of the stop string is held back)."""
    tok = model.tokenizer
    p = tok.encode("Hello")
    full = model.generate([p], max_new_tokens=24)[0].tokens
    text = tok.decode(full)
    i, needle = mid_token_needle(tok, full)
    gen = model.generator()
    seen = []
    req = gen.submit(gen.make_request(p, max_new_tokens=24, stop=["never there", needle],
                                      on_tokens=lambda r, _: seen.append(r.text)))
    while not req.done.is_set():
        gen.step()
    g = req.result()
    assert (g.finish_reason, g.stats["stop_sequence"]) == ("stop", needle)
    assert g.text == text[:text.find(needle)] and len(g.text) > len(tok.decode(full[:i]))
    assert g.tokens == full[:i] and g.stats["generated_tokens"] == i
    assert all(g.text.startswith(t) for t in seen) and seen[-1] == g.text
    assert model.generate([p], max_new_tokens=24)[0].text is None          # no stop strings: no text
    assert model.generate([p], max_new_tokens=24, stop=["never there"])[0].text == text


def test_chat_template_and_roundtrip(model):
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n"   # thinking by default
    off = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], enable_thinking=False)
    assert off == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(tok.encode("Hello, world! 123"), skip_special_tokens=False) == "Hello, world! 123"
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)


def test_cli_generate(capsys):
    assert cli_main(["generate", "--prompt", "Hello", "--max-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert "tokens in" in err and "tok/s" in err
    assert cli_main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_prefill_chunk_is_the_servers_choice(model):
    """A prompt longer than the prefill chunk is prefilled in several chunks (as ``zoo compile``
    chooses the chunk a chip leaves room for) and generates exactly what one chunk does."""
    from zoo.engine.generator import Generator

    prompt = [[(7 * i + 3) % 400 + 1 for i in range(40)]]
    one = Generator(model, prefill_chunk=64).generate(prompt, max_new_tokens=6)[0].tokens
    three = Generator(model, prefill_chunk=16).generate(prompt, max_new_tokens=6)[0].tokens
    assert three == one == greedy_by_full_forward(model, prompt[0], 6)[:len(one)]
    for bad in (0, 8, 100):
        with pytest.raises(ValueError, match="prefill_chunk must be a power of two >= 16"):
            Generator(model, prefill_chunk=bad)


def test_prefill_pieces_have_two_widths_and_fit_the_row(model):
    """``_plan``: pieces cover the prompt in order and end at every chunk multiple and mark; every
    piece is one of the two compiled widths (the chunk, or the small one for a tail of at most that
    many tokens), only a segment's last piece is padded, and every write fits the row's slots."""
    from zoo.engine.generator import Generator

    gen = Generator(model, prefill_chunk=64, context=300, prefix_cache=0)
    small = gen.prefill_small
    assert gen.prefill_widths == (16, 64) and small == 16
    assert gen._plan(0, 25) == [(0, 25, 64, True)]
    assert gen._plan(0, 40) == [(0, 40, 64, True)]
    assert gen._plan(0, 70) == [(0, 64, 64, True), (64, 70, 16, True)]
    for start, n, marks in [(s, n, m) for s in (0, 5, 64) for n in range(s + 1, 300, 7) for m in ((), (s + 50,))]:
        pieces = gen._plan(start, n, marks)
        ends = sorted({e for e in range(64, n, 64) if e > start} | {m for m in marks if start < m < n} | {n})
        assert [p[0] for p in pieces] == [start] + [p[1] for p in pieces[:-1]]
        assert [p[1] for p in pieces if p[3]] == ends and pieces[-1][1] == n
        for a, e, w, last in pieces:
            assert w in gen.prefill_widths and e - a <= w and a + w <= gen._L
            assert e - a == w or last                   # padded: only a segment's last piece
            assert w == small or e - a > small           # the chunk's width for more than a small tail


def test_the_small_width_follows_the_device_and_can_be_chosen(model):
    """``fill.small_width``: chunk / 64 on one CPU device (a piece there costs what its tokens cost),
    chunk / 16 on a mesh or an accelerator, never under ``PREFILL_MIN``; an explicit width is checked."""
    import jax
    from jax.sharding import Mesh

    from zoo.engine.fill import small_width
    from zoo.engine.generator import PREFILL_MIN, Generator

    assert small_width(1024, PREFILL_MIN) == 16 and small_width(4096, PREFILL_MIN) == 64
    assert small_width(256, PREFILL_MIN) == small_width(16, PREFILL_MIN) == 16
    one_cpu = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    assert small_width(4096, PREFILL_MIN, one_cpu) == 64             # zoo compile's CPU target: one device

    def mesh_of(platform: str, n: int):                              # what small_width reads of a Mesh
        return type("M", (), {"devices": np.asarray([type("D", (), {"platform": platform})()] * n)})()
    for mesh in (mesh_of("tpu", 8), mesh_of("cpu", 8), mesh_of("tpu", 1)):
        assert small_width(1024, PREFILL_MIN, mesh) == 64 and small_width(4096, PREFILL_MIN, mesh) == 256
    gen = Generator(model, prefill_chunk=1024, context=300, prefix_cache=0)
    assert gen.prefill_small == 16
    assert Generator(model, prefill_chunk=1024, context=300, prefix_cache=0, prefill_small=64).prefill_small == 64
    for bad in (8, 48, 2048):
        with pytest.raises(ValueError, match="prefill_small must be a power of two from 16 to the chunk"):
            Generator(model, prefill_chunk=1024, context=300, prefix_cache=0, prefill_small=bad)


def test_prompt_ids_outside_the_vocabulary_and_a_huge_top_k(model):
    """The Python API checks prompt ids against the vocabulary (an id the model cannot embed is an
    error, not a silently clipped lookup) and takes any top_k (past the vocabulary: every token)."""
    gen = model.generator()
    for bad in ([2**40], [-1], [model.config.vocab_size]):
        with pytest.raises(ValueError, match="not in the vocabulary"):
            gen.make_request([5] + bad, max_new_tokens=2)
    prompt = [5, 17, 200, 33]
    huge = model.generate([prompt], max_new_tokens=4, top_k=2**40)[0]
    assert huge.tokens == model.generate([prompt], max_new_tokens=4)[0].tokens
