"""The Anthropic surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over ``Service``: the request (``anthropic_request``: what is accepted, how it
becomes the chat template's messages) is rendered and generated; the answer events become content
blocks: ``thinking`` (empty when ``thinking.display`` is ``omitted``), ``text``, ``tool_use``.
Streaming sends message_start, content_block_start / _delta / _stop per block, message_delta
(stop reason, usage) and message_stop, with ``ping`` events while silent. ``max_tokens`` may be
any size: the generation is clipped to the context, and an answer cut there stops with
``model_context_window_exceeded`` (one cut by ``max_tokens`` itself: ``max_tokens``). Query
strings (Claude Code's ``?beta=true``) and ``anthropic-beta`` headers are accepted and change
nothing. Errors use Anthropic's schema ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from zoo.server.protocols.anthropic_request import CountRequest, MessagesRequest, render_prompt
from zoo.server.service import KEEPALIVE, POLL_S, Finish, collect_finished, guarded
from zoo.server.validation import ApiError, parse_body
from zoo.text.reasoning_parser import Reasoning, Text
from zoo.text.tool_calls import ToolCallArgs, ToolCallEnd, ToolCallStart

router = APIRouter()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = await run_in_threadpool(parse_body, CountRequest, await request.body())   # tool schemas: off the loop
    return {"input_tokens": len((await run_in_threadpool(render_prompt, request.app.state.service, body)).ids)}


def _stop_reason(finish: Finish, clipped: bool) -> str:
    """``clipped``: the context had room for fewer tokens than ``max_tokens``."""
    if finish.reason == "length":
        return "model_context_window_exceeded" if clipped else "max_tokens"
    if finish.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if finish.tool_calls else "end_turn"


def _usage(prompt_tokens: int, output_tokens: int, read: int = 0, written: int = 0) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens neither read from the prefix cache
    nor written to it up to a ``cache_control`` mark (the three add up to the prompt)."""
    return {"input_tokens": prompt_tokens - read - written, "output_tokens": output_tokens,
            "cache_creation_input_tokens": written, "cache_read_input_tokens": read}


def _finish_usage(finish: Finish) -> dict:
    return _usage(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens, finish.cache_written)


def _start_usage(job, prompt) -> dict:
    """The usage message_start reports: the job is admitted, so its cached prefix is known."""
    hit = job.req.prefix_hit
    read = 0 if hit is None else hit.length
    return _usage(len(prompt.ids), 0, read, max(0, max(prompt.marks, default=0) - read))


@router.post("/v1/messages")
async def messages(request: Request):
    service = request.app.state.service
    body = await run_in_threadpool(parse_body, MessagesRequest, await request.body())
    prompt = await run_in_threadpool(render_prompt, service, body)   # rendering + tokenizing: off the event loop
    thinking = body.thinking
    budget = thinking.budget_tokens if thinking is not None and thinking.type == "enabled" else None
    options = service.request_options(prompt.ids, max_tokens=body.max_tokens, thinking_budget=budget,
                                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                      stop=body.stop_sequences or (), thinking_opened=prompt.opens_reasoning,
                                      grammar=prompt.grammar, cache_marks=prompt.marks)
    job = await service.start(prompt.ids, options, images=prompt.images, request=request)
    events = service.events(job, prompt.parser, prompt.initial, tick=None if body.stream else POLL_S)
    clipped = body.max_tokens > service.context - len(prompt.ids)
    omit = thinking is not None and thinking.display == "omitted"
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": _start_usage(job, prompt)}
    if body.context_management is not None:
        message["context_management"] = {"applied_edits": []}       # accepted, none applied
    if body.stream:
        return EventSourceResponse(guarded(_stream(events, job, message, clipped, omit),
                                           lambda msg: _sse(ApiError(500, msg).anthropic_body())), ping=0, sep="\n")
    result = await collect_finished(events, request, job)
    if result is None:
        return None                         # the client is gone
    out, finish = result
    blocks: list[dict] = []
    for e in out:
        _add_to_blocks(blocks, e, omit)
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial_json") or "{}")
    return {**message, "content": blocks, "stop_reason": _stop_reason(finish, clipped),
            "stop_sequence": finish.stop_sequence, "usage": _finish_usage(finish)}


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


def _add_to_blocks(blocks: list[dict], e, omit: bool) -> None:
    """Non-streaming: fold one event into the content blocks (``omit``: thinking blocks stay empty)."""
    if isinstance(e, ToolCallStart):
        blocks.append({**_block_start(e), "partial_json": ""})
    elif isinstance(e, ToolCallArgs):
        blocks[-1]["partial_json"] += e.delta
    elif isinstance(e, (Text, Reasoning)):
        kind = "thinking" if isinstance(e, Reasoning) else "text"
        if not blocks or blocks[-1]["type"] != kind:
            blocks.append(_block_start(e))
        if not (omit and kind == "thinking"):
            blocks[-1][kind] += e.text


def _sse(data: dict) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(data, ensure_ascii=False), event=data["type"], sep="\n")


async def _stream(events, job, message: dict, clipped: bool, omit: bool):
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
                    yield _sse(ApiError(e.error_status, e.error or "generation failed").anthropic_body())
                    return
                yield _sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(e, clipped),
                                                               "stop_sequence": e.stop_sequence},
                            "usage": _finish_usage(e)})
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
            if not (omit and kind == "thinking"):
                yield _sse({"type": "content_block_delta", "index": index, "delta": _delta(e)})
    finally:
        job.cancel()
