"""The Anthropic surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over ``Service``: Anthropic messages (``system``, text / ``tool_use`` /
``tool_result`` / ``thinking`` blocks, a trailing assistant turn as a prefill) become the chat
template's messages; the answer events become content blocks: ``thinking``, ``text``,
``tool_use``. Streaming sends message_start, content_block_start / _delta / _stop per block,
message_delta (stop reason, usage) and message_stop, with ``ping`` events while silent.
Errors use Anthropic's schema ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from zoo.serving.chat import KEEPALIVE, POLL_S, Finish, collect_finished
from zoo.serving.errors import ApiError, parse_body
from zoo.serving.reasoning import Reasoning, Text
from zoo.serving.tool_parsers import ToolCallArgs, ToolCallEnd, ToolCallStart

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)   # enforced: </think> is forced after this many tokens


class OutputConfig(_Body):
    effort: str | None = None
    format: dict | None = None


class CountRequest(_Body):
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


def _text(content, where: str) -> str:
    """A string or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    out = []
    for block in content or []:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ApiError(400, f"{where}: {kind!r} blocks are not supported here (text only)")
        out.append(str(block.get("text", "")))
    return "".join(out)


def template_messages(body: CountRequest) -> tuple[list[dict], str]:
    """Anthropic messages -> the chat templates' form, and the trailing assistant text (prefill)."""
    out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    prefill = ""
    for i, m in enumerate(body.messages):
        role, content, where = m.get("role"), m.get("content"), f"messages.{i}.content"
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: expected 'user' or 'assistant', got {role!r}")
        if i == len(body.messages) - 1 and role == "assistant":
            prefill = _text(content, where)       # the answer continues this text
            break
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}: expected a string or a list of content blocks")
        out += _user_blocks(content, where) if role == "user" else [_assistant_blocks(content, where)]
    return out, prefill


def _user_blocks(blocks: list, where: str) -> list[dict]:
    """A user turn: its tool results (as "tool" messages), then its text."""
    tools, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_result":
            result = _text(b.get("content") or "", f"{where}.{j}.content")
            tools.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                          "content": f"Error: {result}" if b.get("is_error") else result})
        else:
            raise ApiError(400, f"{where}.{j}: {kind!r} blocks are not supported in user turns")
    return tools + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_blocks(blocks: list, where: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            msg["content"] += str(b.get("text", ""))
        elif kind == "thinking":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking", ""))
        elif kind == "tool_use":
            if not isinstance(b.get("input", {}), dict):
                raise ApiError(400, f"{where}.{j}.input: expected an object")
            msg.setdefault("tool_calls", []).append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"), "arguments": b.get("input", {})}})
        elif kind != "redacted_thinking":
            raise ApiError(400, f"{where}.{j}: {kind!r} blocks are not supported in assistant turns")
    return msg


def _prompt(service, body: CountRequest):
    messages, prefill = template_messages(body)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []]
    choice, name = "auto", None
    if body.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[body.tool_choice.type]
        name = body.tool_choice.name
        if choice in ("required", "function") and not tools:
            raise ApiError(400, "tool_choice: the request has no tools")
        if choice == "function" and name not in {t.name for t in body.tools}:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the request's tools")
    thinking = None if body.thinking is None else body.thinking.type != "disabled"
    output = body.output_config or OutputConfig()
    if output.format is not None:
        raise ApiError(400, "output_config.format: structured outputs are not supported")
    kwargs = {"reasoning_effort": output.effort} if output.effort else {}
    return service.chat_prompt(messages, tools=tools or None, tool_choice=choice, tool_name=name,
                               thinking=thinking, template_kwargs=kwargs, prefill=prefill)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = parse_body(CountRequest, await request.body())
    return {"input_tokens": len((await run_in_threadpool(_prompt, request.app.state.service, body)).ids)}


def _stop_reason(finish: Finish) -> str:
    if finish.reason == "length":
        return "max_tokens"
    if finish.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if finish.tool_calls else "end_turn"


@router.post("/v1/messages")
async def messages(request: Request):
    service = request.app.state.service
    body = parse_body(MessagesRequest, await request.body())
    prompt = await run_in_threadpool(_prompt, service, body)      # rendering + tokenizing: off the event loop
    budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
    job = await service.start(prompt.ids, max_tokens=body.max_tokens, temperature=body.temperature,
                              top_p=body.top_p, top_k=body.top_k, seed=None, thinking_budget=budget,
                              thinking_opened=prompt.opens_reasoning)
    events = service.events(job, service.decoder(body.stop_sequences or []), prompt.parser,
                            prompt.initial, tick=None if body.stream else POLL_S)
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(prompt.ids), "output_tokens": 0}}
    if body.stream:
        return EventSourceResponse(_stream(events, job, message), ping=0, sep="\n")
    result = await collect_finished(events, request, job)
    if result is None:
        return None                         # the client is gone
    out, finish = result
    blocks: list[dict] = []
    for e in out:
        _add_to_blocks(blocks, e)
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial_json") or "{}")
    return {**message, "content": blocks, "stop_reason": _stop_reason(finish), "stop_sequence": finish.stop_sequence,
            "usage": {"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens}}


def _block_start(e) -> dict:
    """The empty content block an event opens."""
    if isinstance(e, Reasoning):
        return {"type": "thinking", "thinking": "", "signature": ""}
    if isinstance(e, Text):
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": e.name, "input": {}}


def _delta(e) -> dict:
    if isinstance(e, Reasoning):
        return {"type": "thinking_delta", "thinking": e.text}
    if isinstance(e, Text):
        return {"type": "text_delta", "text": e.text}
    return {"type": "input_json_delta", "partial_json": e.delta}


def _add_to_blocks(blocks: list[dict], e) -> None:
    """Non-streaming: fold one event into the content blocks."""
    if isinstance(e, ToolCallStart):
        blocks.append({**_block_start(e), "partial_json": ""})
    elif isinstance(e, ToolCallArgs):
        blocks[-1]["partial_json"] += e.delta
    elif isinstance(e, (Text, Reasoning)):
        kind = "thinking" if isinstance(e, Reasoning) else "text"
        if not blocks or blocks[-1]["type"] != kind:
            blocks.append(_block_start(e))
        blocks[-1][kind] += e.text


def _sse(data: dict) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(data, ensure_ascii=False), event=data["type"], sep="\n")


async def _stream(events, job, message: dict):
    index, open_kind = -1, None               # the open block: its index and kind ("thinking", "text", "tool")
    try:
        yield _sse({"type": "message_start", "message": message})
        async for e in events:
            if e is KEEPALIVE:
                yield _sse({"type": "ping"})
                continue
            if isinstance(e, Finish):
                if open_kind is not None:
                    yield _sse({"type": "content_block_stop", "index": index})
                if e.reason == "error":
                    yield _sse(ApiError(500, e.error or "generation failed").anthropic_body())
                    return
                yield _sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(e),
                                                               "stop_sequence": e.stop_sequence},
                            "usage": {"input_tokens": e.prompt_tokens, "output_tokens": e.completion_tokens}})
                yield _sse({"type": "message_stop"})
                return
            if isinstance(e, ToolCallEnd):
                yield _sse({"type": "content_block_stop", "index": index})
                open_kind = None
                continue
            kind = "thinking" if isinstance(e, Reasoning) else "text" if isinstance(e, Text) else "tool"
            if isinstance(e, ToolCallStart) or (isinstance(e, (Text, Reasoning)) and kind != open_kind):
                if open_kind is not None:
                    yield _sse({"type": "content_block_stop", "index": index})
                index, open_kind = index + 1, kind
                yield _sse({"type": "content_block_start", "index": index, "content_block": _block_start(e)})
                if isinstance(e, ToolCallStart):
                    continue
            yield _sse({"type": "content_block_delta", "index": index, "delta": _delta(e)})
    finally:
        job.cancel()
