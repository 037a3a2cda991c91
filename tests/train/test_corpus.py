"""The synthetic chat corpus (zoo.train.corpus) and the demo models' chat templates
(zoo.train.templates): determinism, right answers (recomputed here from the question text), the
loss mask, and that what the templates render is what the server prompts with and parses back.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from zoo.server.service import KEEP, Service
from zoo.server.structured import marker_tokens
from zoo.text.detokenize import TextDecoder
from zoo.text.reasoning_parser import Reasoning, Text
from zoo.text.tool_calls import ToolCallArgs, ToolCallStart, detect_format
from zoo.train import corpus as C
from zoo.train.templates import GLM_ARG_MARKERS, MARKERS, build_tokenizer, chat_format

ARCHS = ("qwen", "glm")


@pytest.fixture(scope="module", params=ARCHS)
def built(request):
    """(format, a quick BPE with vocabulary 512 trained on the format's corpus text)."""
    return chat_format(request.param), build_tokenizer(request.param, C.corpus_text(request.param, 400, 0))


@pytest.fixture(scope="module")
def dialogues():
    """Every family, with and without thinking, tools and system messages, in both formats."""
    return {arch: C.examples(arch, 240, 7, split="all") for arch in ARCHS}


def runs(mask: np.ndarray) -> list[slice]:
    """The maximal runs of ones in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [slice(a, b) for a, b in zip(edges[::2], edges[1::2])]


def test_deterministic_by_seed():
    a = C.examples("qwen", 80, 0)
    assert a == C.examples("qwen", 80, 0)
    assert C.examples("qwen", 30, 0) == a[:30]                       # example i does not depend on n
    b = C.examples("qwen", 80, 1)
    assert sum(x == y for x, y in zip(a, b)) < 8                      # (small talk may repeat)
    assert [e.messages for e in C.examples("glm53-tiny", 80, 0)] == [e.messages for e in a]
    assert C.corpus_text("glm", 20, 3) == C.corpus_text("glm", 20, 3)
    assert {e.family for e in C.examples("qwen", 300, 0)} == set(C.FAMILIES)
    with pytest.raises(ValueError, match="unknown task"):
        C.examples("qwen", 1, 0, tasks=("poetry",))


# -- answers, recomputed from the question -------------------------------------------------------
UNITS = {"kilometers": ("km", "meters", "m", 1000), "kilograms": ("kg", "grams", "g", 1000),
         "hours": ("h", "minutes", "min", 60)}
TOOL_FACTORS = {("miles", "kilometers"): 1.609344, ("pounds", "kilograms"): 0.45359237,
                ("inches", "centimeters"): 2.54, ("feet", "meters"): 0.3048}
SMALL_TALK = {"hello": "Hello! How can I help you today?", "hi": "Hello! How can I help you today?",
              "hey": "Hello! How can I help you today?", "name": "I am zoo's tiny demo model.",
              "who": "I am zoo's tiny demo model.", "how are": "I am fine, thank you. How can I help?",
              "thank": "You're welcome!", **dict.fromkeys(("goodbye", "bye", "see you"), "Goodbye! Have a nice day.")}


def expected(e: C.Example) -> tuple[str, dict | None]:
    """(final answer, tool call or None) of ``e``, from its question (and its tool result)."""
    q, f = e.question, e.family
    nums = [int(x) for x in re.findall(r"\d+", q)]
    words = re.findall(r"'(\w+)'", q)
    result = next((json.loads(m["content"]) for m in e.messages if m["role"] == "tool"), None)
    if f in ("add", "add_tool"):
        a, b = nums
        call = {"name": "add", "arguments": {"a": a, "b": b}} if f == "add_tool" else None
        assert (f == "add_tool") == (a >= 1000 and b >= 1000)
        return f"{a} + {b} = {a + b}.", call
    if f == "sub":
        a, b = nums[::-1] if q.startswith("Subtract") else nums
        assert a >= b
        return f"{a} - {b} = {a - b}.", None
    if f == "compare":
        lo, hi = sorted(nums)
        return (f"{lo} is smaller than {hi}." if "smaller" in q else f"{hi} is larger than {lo}."), None
    if f == "count":
        letter = re.search(r"(?:many|letter) (\w)\b", q).group(1)
        return f"There are {words[0].count(letter)} {letter}'s in '{words[0]}'.", None
    if f == "reverse":
        return f"'{words[0]}' reversed is '{words[0][::-1]}'.", None
    if f == "spell":
        return f"'{words[0]}' is spelled {'-'.join(words[0])}.", None
    if f == "convert":
        v, src = re.search(r"(\d+) (\w+)", q).groups()
        v = int(v)
        for big, (b, small_name, s, k) in UNITS.items():
            if src == big:
                return f"{v} {b} = {v * k} {s}.", None
            if src == small_name:
                assert v % k == 0
                return f"{v} {s} = {v // k} {b}.", None
    if f == "convert_tool":
        v, src = re.search(r"(\d+) (\w+)", q).groups()
        units = {u for pair in TOOL_FACTORS for u in pair}
        dst = next(w for w in re.findall(r"[a-z]+", q) if w in units and w != src)
        k = TOOL_FACTORS[(src, dst)] if (src, dst) in TOOL_FACTORS else 1 / TOOL_FACTORS[(dst, src)]
        r = f"{round(int(v) * k, 2):g}"
        assert result == {"value": float(r)}
        return f"{v} {src} = {r} {dst}.", {"name": "convert_units",
                                           "arguments": {"value": int(v), "from_unit": src, "to_unit": dst}}
    if f == "weather":
        city = re.search(r"in ([A-Z]\w+)", q).group(1)
        assert result["city"] == city and -5 <= result["temperature"] <= 35
        return (f"It is {result['temperature']} degrees and {result['condition']} in {city}.",
                {"name": "get_weather", "arguments": {"city": city}})
    if f == "lookup":
        assert result["word"] == words[0]
        return f"'{words[0]}' means {result['definition']}.", {"name": "lookup_word",
                                                               "arguments": {"word": words[0]}}
    assert f == "chat"
    if " can " in q:
        assert e.answer.startswith("I can ")
        return e.answer, None
    return next(v for k, v in SMALL_TALK.items() if re.search(rf"\b{k}", q.lower())), None


def check_reasoning(e: C.Example) -> None:
    """The derivations are true: every column sum / difference, and the conclusion."""
    think = e.messages[e.turns()[0]].get("reasoning_content", "")
    if e.family == "add":
        for a, b, one, t in re.findall(r"(\d) \+ (\d)( \+ 1)? = (\d+)", think):
            assert int(a) + int(b) + bool(one) == int(t), think
    if e.family == "sub":
        for a, one, b, t in re.findall(r"(\d+)( - 1)? - (\d) = (\d+)", think):
            assert int(a) - bool(one) - int(b) == int(t) >= 0, think
    if e.family in ("add", "sub", "count", "convert"):
        last = re.findall(r"\d+", e.answer)[-1]
        assert re.search(rf" So {last}( \w+)?\.$", think), think


def test_every_family_answers_right():
    seen = set()
    for e in C.examples("qwen", 1500, 11, split="all", thinking=1.0):
        answer, call = expected(e)
        assert e.answer == answer, (e.question, e.answer)
        assert e.call == call, e.question
        assert e.messages[-1]["content"] == answer and e.messages[-1]["reasoning_content"]
        if call:
            assert call["name"] in [t["function"]["name"] for t in e.tools]
            assert [m["role"] for m in e.messages[-4:]] == ["user", "assistant", "tool", "assistant"]
        else:
            assert [m["role"] for m in e.messages[-2:]] == ["user", "assistant"]
        check_reasoning(e)
        seen.add(e.family)
    assert seen == set(C.FAMILIES)


def test_held_out_split_is_disjoint():
    train = C.examples("qwen", 3000, 0, split="train")
    held = C.examples("qwen", 600, 1, split="eval")
    train_q, train_keys = {e.question for e in train}, {e.key for e in train}
    keyed = [e for e in held if e.key]
    assert not any(e.key in train_keys for e in keyed)
    assert not any(e.question in train_q for e in keyed)             # not even in another phrasing
    assert {e.family for e in keyed} == set(C.FAMILIES) - {"chat"}
    plain = {e.key for e in C.examples("qwen", 3000, 0, split="all")}
    other = [e for e in C.examples("qwen", 600, 1, split="all") if e.key]
    shared = sum(e.key in plain for e in other) / len(other)
    print(f"\nheld-out questions also in training: 0 of {len(keyed)} (split); "
          f"with seeds alone {shared:.0%} of {len(other)}")
    assert shared > 0.05                                              # which is why the split exists


# -- rendering: loss mask, server prompts, server parsing ---------------------------------------
def generated(e: C.Example, turn: int) -> str:
    """What the model writes in a turn, built here from the format's description."""
    m = e.messages[e.turns()[turn]]
    calls = [c["function"] for c in m.get("tool_calls") or []]
    value = lambda v: v if isinstance(v, str) else json.dumps(v)
    if e.arch == "qwen":
        out = (m["reasoning_content"] + "\n</think>\n\n" if e.thinking else "") + m["content"]
        for c in calls:
            params = "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in c["arguments"].items())
            out += f"<tool_call>\n<function={c['name']}>\n{params}</function>\n</tool_call>"
        return out + "<|im_end|>"
    out = (m["reasoning_content"] + "</think>" if e.thinking else "") + m["content"]
    for c in calls:
        out += f"<tool_call>{c['name']}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{value(v)}</arg_value>"
                                                    for k, v in c["arguments"].items()) + "</tool_call>"
    return out + ("<|observation|>" if calls else "<|user|>")


def test_tokenizer_and_template_fit_the_server(built):
    fmt, tok = built
    assert [tok.token_to_id(s) for s in fmt.special] == list(range(len(fmt.special)))
    assert set(tok.special_tokens().values()) == set(fmt.special)
    markers = MARKERS + (GLM_ARG_MARKERS if fmt.name == "glm" else ())
    assert set(marker_tokens(tok, KEEP)) == set(markers)           # the parsers' markers are single tokens
    assert detect_format(fmt.template) == fmt.name
    assert tok.eos_token == fmt.final_stop and len(tok.eos_token_ids) == 1


def test_loss_mask_is_exactly_the_assistant_turns(built, dialogues):
    fmt, tok = built
    for e in dialogues[fmt.name]:
        ids, mask = C.render(e, None, tok)
        assert ids.shape == mask.shape and ids.dtype == mask.dtype == np.int32
        assert tok.decode(ids, skip_special_tokens=False) == "".join(t for t, _ in C.segments(e))
        spans = runs(mask)
        assert len(spans) == len(e.turns())
        for turn, span in enumerate(spans):
            assert tok.decode(ids[span], skip_special_tokens=False) == generated(e, turn)
        given = tok.decode(ids[mask == 0], skip_special_tokens=False)
        assert e.question in given and e.answer not in given
        assert all(m["content"] in given for m in e.messages if m["role"] in ("system", "user", "tool"))


def test_server_prompts_and_parses_as_trained(built, dialogues):
    """chat_prompt renders each turn's prompt as the tokens before that turn's run; the run's
    tokens, decoded and parsed by the server's own pipeline, give the turn's reasoning, text and
    call; check_answer accepts it and rejects wrong ones."""
    fmt, tok = built
    service = Service(engine=None, tokenizer=tok, model_name="tiny", tool_format=fmt.name, context=4096,
                      default_max_tokens=64, keepalive_s=1.0)
    hidden = frozenset(i for i, t in tok.special_tokens().items() if t not in KEEP)
    for e in dialogues[fmt.name][:120]:
        ids, mask = C.render(e, None, tok)
        for turn, span in enumerate(runs(mask)):
            msgs = e.messages[:e.turns()[turn]]
            p = service.chat_prompt(msgs, tools=e.tools, thinking=e.thinking)
            assert p.ids == ids[:span.start].tolist()
            assert p.opens_reasoning == e.thinking
            assert tok.decode(p.ids, skip_special_tokens=False) == C.prompt(e, turn)
            decoder, events = TextDecoder(tok, hidden), []
            for t in ids[span].tolist():                          # token by token, as generated
                events += p.parser.feed(decoder.feed([t]))
            events += p.parser.feed(decoder.flush()) + p.parser.flush()
            m = e.messages[e.turns()[turn]]
            assert "".join(x.text for x in events if isinstance(x, Reasoning)) == m.get("reasoning_content", "")
            assert "".join(x.text for x in events if isinstance(x, Text)) == m["content"]
            names = [x.name for x in events if isinstance(x, ToolCallStart)]
            args = "".join(x.delta for x in events if isinstance(x, ToolCallArgs))
            want = [c["function"] for c in m.get("tool_calls") or []]
            assert names == [c["name"] for c in want]
            assert ([json.loads(args)] if args else []) == [c["arguments"] for c in want]
            out = tok.decode(ids[span], skip_special_tokens=False)
            assert C.check_answer(e, out, turn)
            for bad in wrong(out, e.thinking, fmt.name):
                assert not C.check_answer(e, bad, turn), bad


def wrong(out: str, thinking: bool, fmt: str) -> list[str]:
    """Outputs that are not right: another digit or letter in the answer or a value, another tool,
    text instead of a call, reasoning left open."""
    answer = out.split("</think>")[-1]
    bad = [out.replace(answer, answer.replace(d, str((int(d) + 1) % 10), 1)) for d in re.findall(r"\d", answer)[:1]]
    bad.append(out.replace(answer, "So " + answer))
    for name in ("get_weather", "add", "convert_units", "lookup_word"):
        if f"<function={name}>" in out or f"<tool_call>{name}<" in out:
            other = "lookup_word" if name != "lookup_word" else "add"
            bad.append(out.replace(name, other))
            bad.append(out.replace("<tool_call>", "I call <tool_call>"))
    if thinking:
        bad.append(out.replace("</think>", ""))
    return [b for b in bad if b != out]
