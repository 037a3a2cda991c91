"""``zoo.server.protocols.anthropic_request``: an Anthropic Messages request as Claude Code sends it becomes
the chat template's messages and tools (no server, no model)."""

from __future__ import annotations

import pytest

from zoo.server.protocols.anthropic_request import CountRequest, reasoning_effort, template_messages, template_tools
from zoo.server.service import fold_system_messages
from zoo.server.validation import ApiError

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}}
EPHEMERAL = {"type": "ephemeral"}


def claude_code_request(**overrides) -> CountRequest:
    """The shape of Claude Code 2.1's first request (texts shortened)."""
    body = {
        "model": "claude-opus-5-5",
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.3a1; cc_entrypoint=cli; "
                                            "cch=5f0e1;"},
                   {"type": "text", "text": "You are an agent.", "cache_control": EPHEMERAL}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                         {"type": "text", "text": "Say hello"}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": EPHEMERAL}],
             "output_config": {"effort": "low"}}],
        "tools": [{"name": "ToolSearch", "description": "find tools", "input_schema": SCHEMA},
                  {"name": "Later", "description": "deferred", "input_schema": SCHEMA, "defer_loading": True},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "metadata": {"user_id": "{\"device_id\": \"x\"}"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "some_future_field": {"anything": True},
    }
    return CountRequest.model_validate({**body, **overrides})


def test_system_messages_inside_messages_join_the_user_turn():
    body = claude_code_request()
    messages, prefill, referenced = template_messages(body)
    assert messages == [{"role": "system", "content": "You are an agent."},         # the billing header dropped
                        {"role": "user", "content": "<system-reminder>r</system-reminder>Say hello\n\n# Environment"}]
    assert prefill == "" and referenced == []
    assert reasoning_effort(body) == "low"                                 # the system message's per-turn effort wins
    assert reasoning_effort(claude_code_request(messages=body.model_dump()["messages"][:1])) == "medium"


def test_the_billing_header_is_not_part_of_the_prompt():
    """Claude Code's first system block is billing metadata, some versions with a per-request hash
    (``cch=``): two turns that differ only there render the same prompt (the prefix cache holds)."""
    one, two = (claude_code_request(system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; "
                                                                    f"cch={h};"},
                                            {"type": "text", "text": "You are an agent."}]) for h in ("a1", "b2"))
    assert template_messages(one)[0] == template_messages(two)[0]
    assert template_messages(one)[0][0] == {"role": "system", "content": "You are an agent."}
    only = claude_code_request(system="x-anthropic-billing-header: cc_version=2.1;")
    assert template_messages(only)[0][0]["role"] == "user"                 # nothing else: no system turn at all
    kept = claude_code_request(system="Mention x-anthropic-billing-header: in the answer.")
    assert template_messages(kept)[0][0]["content"] == "Mention x-anthropic-billing-header: in the answer."


def test_fold_system_messages():
    msgs = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
            {"role": "user", "content": "u"}, {"role": "assistant", "content": "x"},
            {"role": "system", "content": "late"}, {"role": "system", "content": ""}, {"role": "user", "content": "v"}]
    assert fold_system_messages(msgs) == [
        {"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "late"}, {"role": "user", "content": "v"}]


def test_deferred_tools_wait_for_a_tool_reference_and_server_tools_are_left_out():
    body = claude_code_request()
    assert [t["function"]["name"] for t in template_tools(body, [])] == ["ToolSearch"]
    history = [*body.model_dump()["messages"][:1],
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                  "input": {"query": "select:Later"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                   {"type": "tool_reference", "tool_name": "Later"}], "cache_control": EPHEMERAL}]}]
    messages, _, referenced = template_messages(claude_code_request(messages=history))
    assert referenced == ["Later"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": "Tool Later loaded."}
    assert messages[-2]["tool_calls"][0]["function"] == {"name": "ToolSearch", "arguments": {"query": "select:Later"}}
    assert [t["function"]["name"] for t in template_tools(body, referenced)] == ["ToolSearch", "Later"]


def test_thinking_blocks_history_and_prefill():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                 {"type": "redacted_thinking", "data": "xx"},
                                                 {"type": "text", "text": "Hello"}]},
               {"role": "user", "content": "again"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"},
                                                 {"type": "text", "text": "Sure:"}]}]
    messages, prefill, _ = template_messages(claude_code_request(messages=history))
    assert messages[2] == {"role": "assistant", "content": "Hello", "reasoning_content": "hmm"}
    assert prefill == "Sure:"


@pytest.mark.parametrize("messages, where", [
    ([{"role": "system", "content": "only system"}], "messages: at least one"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0]: image blocks"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text: Field required"),
    ([{"role": "user", "content": [{"type": "video"}]}], "messages[0].content[0]: Input tag 'video'"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}],
     "messages[0].content[0].cache_control.type: Input should be 'ephemeral'"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_reference"}]}]}], "messages[0].content[0].content[0].tool_name: Field required"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "tool_use", "id": "t",
                                                                           "name": "x", "input": {}}]}],
     "messages[1].content[0]: 'tool_use' blocks are not supported here"),
])
def test_malformed_content_is_a_400_naming_the_block(messages, where):
    with pytest.raises(ApiError) as e:
        template_messages(claude_code_request(messages=messages))
    assert e.value.status == 400 and e.value.message.startswith(where), e.value.message
