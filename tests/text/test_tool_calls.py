"""The incremental reasoning and tool-call parsers: the same result however the text is split
(at every character position, and one character at a time) as in one piece."""

from __future__ import annotations

import json

import pytest

from zoo.text.reasoning_parser import Reasoning, ReasoningParser, Text, prompt_opens_reasoning
from zoo.text.tool_calls import (
    FORMATS,
    GlmToolParser,
    QwenToolParser,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    detect_format,
    tool_call_format,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"},
    "opts": {"type": "object"}}}}}]


def pieces_variants(text: str):
    """The text in one piece, split in two at every position, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def run(parser_factory, pieces):
    parser = parser_factory()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.flush()


def summarize(events):
    """(content, reasoning, [(name, arguments JSON string)]), checking the event order."""
    content = reasoning = ""
    calls, open_calls = [], set()
    for e in events:
        if isinstance(e, Text):
            content += e.text
        elif isinstance(e, Reasoning):
            reasoning += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.name
            calls.append([e.name, ""])
            open_calls.add(e.index)
        elif isinstance(e, ToolCallArgs):
            assert e.index in open_calls and e.delta
            calls[e.index][1] += e.delta
        elif isinstance(e, ToolCallEnd):
            open_calls.remove(e.index)
    assert not open_calls
    return content, reasoning, [tuple(c) for c in calls]


def check_all_splits(parser_factory, text):
    whole = summarize(run(parser_factory, [text]))
    for pieces in pieces_variants(text):
        assert summarize(run(parser_factory, pieces)) == whole, pieces
    return whole


QWEN_TWO_CALLS = (
    "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, \"CA\"\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nline1\nline2\n\n"
    "</parameter>\n</function>\n</tool_call>\n")


def test_qwen_calls_any_split():
    content, _, calls = check_all_splits(lambda: QwenToolParser(TOOLS), QWEN_TWO_CALLS)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": 'San Francisco, "CA"', "days": 3, "opts": {"a": [1, 2]}}),
        ("get_weather", {"city": "line1\nline2\n"})]
    assert calls[0][1] == json.dumps({"city": 'San Francisco, "CA"', "days": 3, "opts": {"a": [1, 2]}})


def test_qwen_text_after_call_no_params_and_json_body():
    text = ("<tool_call>\n<function=ping>\n</function>\n</tool_call>\n\nDone, a < b.\n"
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>")
    content, _, calls = check_all_splits(lambda: QwenToolParser(TOOLS), text)
    assert content == "Done, a < b."
    assert calls == [("ping", "{}"), ("get_weather", '{"city": "Oslo"}')]


def test_qwen_plain_text_and_unknown_body_stay_text():
    text = "No tools here: <b>bold</b>\n<tool_call>\nnot a call\n</tool_call>"
    content, _, calls = check_all_splits(lambda: QwenToolParser(TOOLS), text)
    assert calls == [] and content == "No tools here: <b>bold</b><tool_call>not a call\n</tool_call>"


def test_qwen_cut_off_call_is_closed_with_what_it_has():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    _, _, calls = check_all_splits(lambda: QwenToolParser(TOOLS), text)
    assert calls == [("get_weather", '{"city": "Par"}')]


GLM_TWO_CALLS = ("I will look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing \\ <\"x\"></arg_value>"
                 "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                 "<tool_call>get_weather\n<arg_key>units</arg_key>\n<arg_value>metric</arg_value>\n</tool_call>")


def test_glm_calls_any_split():
    content, _, calls = check_all_splits(lambda: GlmToolParser(TOOLS), GLM_TWO_CALLS)
    assert content == "I will look."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": 'Beijing \\ <"x">', "days": 2}), ("get_weather", {"units": "metric"})]


def test_glm_no_args_and_cut_off():
    _, _, calls = check_all_splits(lambda: GlmToolParser(TOOLS), "<tool_call>now</tool_call> ok")
    assert calls == [("now", "{}")]
    _, _, calls = check_all_splits(lambda: GlmToolParser(TOOLS), "<tool_call>get_weather<arg_key>days</arg_key>"
                                                                 "<arg_value>1")
    assert calls == [("get_weather", '{"days": 1}')]


THINK = "\nI should add 2 and 2.\n\nThat is 4.\n</think>\n\nThe answer is 4.\n"


def test_reasoning_opened_by_template_any_split():
    content, reasoning, _ = check_all_splits(lambda: ReasoningParser(in_reasoning=True), THINK)
    assert reasoning == "I should add 2 and 2.\n\nThat is 4."
    assert content == "The answer is 4.\n"


def test_reasoning_opened_by_model_and_absent():
    content, reasoning, _ = check_all_splits(ReasoningParser, "  <think>hmm</think>yes <think>no</think>")
    assert (reasoning, content) == ("hmm", "yes <think>no</think>")
    content, reasoning, _ = check_all_splits(ReasoningParser, "<thin and plain")
    assert (reasoning, content) == ("", "<thin and plain")
    content, reasoning, _ = check_all_splits(lambda: ReasoningParser(in_reasoning=True), "cut off mid-thou")
    assert (reasoning, content) == ("cut off mid-thou", "")


def test_prompt_and_format_detection():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n")
    from zoo.server.app import tool_format_of
    assert tool_format_of("qwen38", None) == "qwen" and tool_format_of("glm53", "") == "glm"
    assert tool_format_of("qwen38", "{{ '<arg_key>' }}") == "glm"
    assert tool_format_of("other", None) is None
    assert detect_format("{{ '<function=' + name }}") == "qwen" and detect_format("plain") is None
    assert FORMATS["qwen"].call_prefix("f") == "<tool_call>\n<function=f>\n"
    assert FORMATS["qwen"].call_prefix() == "<tool_call>\n<function="
    assert FORMATS["glm"].call_prefix() == "<tool_call>" and FORMATS["glm"].call_prefix("f") == "<tool_call>f"
    assert FORMATS["qwen"].parser is QwenToolParser and FORMATS["glm"].parser is GlmToolParser


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call format 'hermes'; known: glm, qwen"):
        tool_call_format("hermes")
    assert tool_call_format("glm") is FORMATS["glm"]


@pytest.mark.parametrize("fmt,parser", [("qwen", QwenToolParser), ("glm", GlmToolParser)])
def test_forced_call_prefix_parses(fmt, parser):
    tail = ("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>" if fmt == "qwen"
            else "<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")
    _, _, calls = check_all_splits(lambda: parser(TOOLS), FORMATS[fmt].call_prefix("get_weather") + tail)
    assert calls == [("get_weather", '{"city": "Rome"}')]


def written_call(fmt, name: str, arguments: dict) -> str:
    """A call as the server's tool-call grammar writes it from ``fmt``'s attributes: a string is raw
    text that writes its own closing frame, any other value JSON."""
    out = fmt.opening(name)
    for key, value in arguments.items():
        raw = isinstance(value, str)
        head, tail = fmt.argument(key, raw)
        out += head + (value + fmt.frame if raw else json.dumps(value)) + tail
    return out + fmt.call_close


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_what_it_writes(name):
    """The format object's writing attributes and its parser agree: two written calls (string,
    integer and object arguments; a multi-line string) parse back to their arguments, whatever the split."""
    fmt = FORMATS[name]
    first = {"city": "San Francisco", "days": 3, "opts": {"a": [1, "x"]}}
    second = {"city": "line1\nline2", "units": "metric"}
    text = "Checking." + written_call(fmt, "get_weather", first) + "\n" + written_call(fmt, "get_weather", second)
    content, _, calls = check_all_splits(lambda: fmt.new_parser(TOOLS), text)
    assert content == "Checking."
    assert calls == [("get_weather", json.dumps(first)), ("get_weather", json.dumps(second))]
    assert set(fmt.markers) >= {fmt.call_open} and any(m in fmt.opening("f") + fmt.argument("k", True)[0]
                                                       for m in fmt.template_markers)


def test_serving_takes_a_format_name_auto_or_none():
    """``create_app``'s tool_format: "auto" (the chat template, else the architecture's row), a name,
    None; an unknown name fails naming the choices (before any engine starts)."""
    import zoo
    from zoo.server.app import create_app
    model = zoo.load("qwen38-tiny", dtype="float32")
    assert create_app(model).state.service.tool_format is FORMATS["qwen"]
    assert create_app(model, tool_format="glm").state.service.tool_format is FORMATS["glm"]
    assert create_app(model, tool_format=None).state.service.tool_format is None
    with pytest.raises(ValueError, match=r"unknown tool format 'hermes'; use one of \['glm', 'qwen'\], 'auto' or None"):
        create_app(model, tool_format="hermes")


def test_zoo_serve_offers_every_format():
    from zoo.cli import build_parser
    parser = build_parser()
    for choice in ("auto", "none", *FORMATS):
        assert parser.parse_args(["serve", "--tool-format", choice]).tool_format == choice
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-format", "hermes"])
