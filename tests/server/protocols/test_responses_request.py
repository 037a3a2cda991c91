"""``zoo.server.protocols.responses_request``: Responses API input items and tools, as Codex CLI sends them,
become the chat template's messages and tools (no server, no model)."""

from __future__ import annotations

import json

import pytest

from zoo.server.protocols.response_store import ResponseStore
from zoo.server.protocols.responses_request import ResponsesRequest, function_tools, template_messages, tool_choice
from zoo.server.validation import ApiError

PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}}


def message(role: str, text: str, kind: str = "input_text") -> dict:
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def test_a_codex_history_becomes_template_messages():
    items = [message("developer", "You are Codex."), message("developer", "Sandbox rules."),
             message("user", "<environment_context/>"), message("user", "list files"),
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
              "content": [{"type": "reasoning_text", "text": "I should run ls."}], "encrypted_content": None},
             message("assistant", "Running ls.", "output_text"),
             {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}"},
             {"type": "function_call", "call_id": "call_2", "name": "exec_command", "arguments": ""},
             {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
             message("assistant", "Two files.", "output_text"),
             message("developer", "Permissions changed."),
             {"role": "user", "content": "thanks"}]
    assert template_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief.\n\nYou are Codex.\n\nSandbox rules."},
        {"role": "user", "content": "<environment_context/>"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running ls.", "reasoning_content": "I should run ls.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": {"cmd": "ls"}}},
            {"id": "call_2", "type": "function", "function": {"name": "exec_command", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "b"},
        {"role": "assistant", "content": "Two files.", "reasoning_content": "Done."},
        {"role": "user", "content": "Permissions changed."},
        {"role": "user", "content": "thanks"}]


def test_function_and_namespace_tools_hosted_tools_left_out():
    body = ResponsesRequest.model_validate({"input": "hi", "tools": [
        {"type": "function", "name": "exec_command", "description": "run", "strict": False, "parameters": PARAMS},
        {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
            {"type": "function", "name": "spawn_agent", "parameters": PARAMS},
            {"type": "custom", "name": "freeform", "format": {"type": "grammar"}}]},
        {"type": "web_search", "external_web_access": False},
        {"type": "custom", "name": "apply_patch"}]})
    tools, namespaces = function_tools(body)
    assert [t["function"]["name"] for t in tools] == ["exec_command", "spawn_agent"]
    assert tools[0]["function"] == {"name": "exec_command", "description": "run", "parameters": PARAMS}
    assert namespaces == {"spawn_agent": "agents"}
    assert tool_choice(body, tools) == ("auto", None)
    forced = body.model_copy(update={"tool_choice": {"type": "function", "name": "spawn_agent"}})
    assert tool_choice(forced, tools) == ("function", "spawn_agent")


@pytest.mark.parametrize("items, where", [
    ([{"type": "computer_call", "id": "x"}], "input[0].type: input items of type 'computer_call'"),
    ([{"type": "message", "role": "tool", "content": "x"}], "input[0].role: unknown role 'tool'"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}],
     "input[0].content[0]: input_image parts are not supported"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}],
     "input[0].arguments: not valid JSON"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
     "input[0].arguments: expected a JSON object"),
    ([{"type": "function_call_output", "output": "x"}], "input[0]: a function_call_output needs 'call_id'"),
    (["just a string"], "input[0]: expected an object"),
])
def test_malformed_items_are_a_400_naming_the_item(items, where):
    with pytest.raises(ApiError) as e:
        template_messages(None, items)
    assert e.value.status == 400 and e.value.message.startswith(where), e.value.message


@pytest.mark.parametrize("tools, choice, where", [
    ([{"type": "function"}], None, "tools[0].name: Field required"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": ""}]}], None,
     "tools[0].tools[0].name: String should have at least 1 character"),
    ([{"name": "untyped"}], None, "tools[0]: a tool needs a 'type'"),
    ([], {"type": "function", "name": "nope"}, "tool_choice: no function named 'nope'"),
    ([], "required", "tool_choice 'required' needs function tools"),
    ([{"type": "web_search"}], {"type": "web_search"}, "tool_choice: only function tools"),
])
def test_malformed_tools_are_a_400(tools, choice, where):
    body = ResponsesRequest.model_validate({"input": "hi", "tools": tools, "tool_choice": choice})
    with pytest.raises(ApiError) as e:
        tool_choice(body, function_tools(body)[0])
    assert e.value.status == 400 and e.value.message.startswith(where), e.value.message


def test_the_response_store_is_bounded_in_entries_and_in_bytes():
    store = ResponseStore(limit=3, max_bytes=10_000)
    item = [{"role": "user", "content": "x" * 2000}]
    for i in range(4):
        store.put(f"r{i}", None, item, {"id": f"r{i}"})
    assert store.get("r0") is None and store.get("r1") is not None          # the entry bound, oldest first
    store.put("big", None, [{"role": "user", "content": "y" * 7000}], {"id": "big"})   # the byte bound: r2, r3 go
    assert [store.get(k) is not None for k in ("r1", "r2", "r3", "big")] == [True, False, False, True]   # r1: read
    assert store.bytes <= 10_000
    assert store.put("huge", None, [{"role": "user", "content": "z" * 20_000}], {"id": "huge"}) is None
    assert store.get("huge") is None and store.get("big") is not None       # larger than the bound: not kept
    store.put("big", None, item, {"id": "big"})                              # replacing counts the new size only
    assert store.bytes == store.get("r1").size + store.get("big").size == sum(
        len(json.dumps(t.items)) + len(json.dumps(t.response)) for t in (store.get("r1"), store.get("big")))


def test_a_chain_longer_than_the_index_keeps_every_turn_it_needs():
    """A conversation of 300 turns in a store indexing 256: the early responses leave the index
    (not found by id) but the chain from the latest one is whole, each turn stored once; when the
    chain's last response goes, every turn of it is freed."""
    store = ResponseStore(limit=256, max_bytes=10 << 20)
    parent = None
    for i in range(300):
        parent = store.put(f"r{i}", parent, [{"role": "user", "content": f"q{i}"}, {"type": "message", "a": i}],
                           {"id": f"r{i}"})
    assert len(store) == 256 and store.get("r0") is None and store.get("r43") is None
    chain = store.get("r299").conversation()
    assert [m["content"] for m in chain[::2]] == [f"q{i}" for i in range(300)]
    assert store.bytes == sum(len(json.dumps(t.items)) + len(json.dumps(t.response))
                              for t in _turns(store.get("r299")))
    other = store.put("x", None, [{"role": "user", "content": "y" * 10}], {"id": "x"})
    for i in range(256):                         # new responses push every one of the chain's out
        store.put(f"n{i}", other, [], {"id": f"n{i}"})
    assert store.get("r299") is None and store.get("x") is None
    assert store.bytes == other.size + sum(store.get(f"n{i}").size for i in range(256))     # x: held by them


def test_a_parent_evicted_while_its_turn_ran_is_held_again():
    store = ResponseStore(limit=1, max_bytes=1 << 20)
    first = store.put("a", None, [{"content": "one"}], {"id": "a"})
    store.put("b", None, [{"content": "two"}], {"id": "b"})           # a leaves the index and is freed
    assert store.get("a") is None and store.bytes == store.get("b").size
    turn = store.put("c", first, [{"content": "three"}], {"id": "c"})  # a's turn ran meanwhile: it continues a
    assert [m["content"] for m in turn.conversation()] == ["one", "three"]
    assert store.bytes == first.size + turn.size


def test_only_the_latest_turn_keeps_its_prompt_and_it_counts():
    from zoo.server.protocols.response_store import prompt_bytes
    from zoo.text.tokenizer import Encoded

    store = ResponseStore(limit=8, max_bytes=1 << 20)
    first = store.put("a", None, [{"content": "one"}], {"id": "a"}, prompt=Encoded("p" * 100, [1] * 10, [10] * 10))
    assert first.size == len(json.dumps(first.items)) + len(json.dumps(first.response)) + 100 + 72 * 10
    second = store.put("b", first, [{"content": "two"}], {"id": "b"}, prompt=Encoded("q" * 200, [2] * 20, [5] * 20))
    assert first.prompt is None and second.prompt is not None and prompt_bytes(second.prompt) == 200 + 72 * 20
    assert store.bytes == first.size + second.size and first.size == len(json.dumps(first.items)) + len(
        json.dumps(first.response))


def _turns(turn):
    while turn is not None:
        yield turn
        turn = turn.parent
