"""The OpenAI Responses surface: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

A thin adapter over ``Service``, as Codex CLI and the ``openai`` SDK use it. The request
(``responses_request``: what is accepted, how it becomes the chat template's messages) is rendered
and generated; the answer events become output items, in order:

    reasoning       {"type": "reasoning", "content": [reasoning_text], "summary": [summary_text]}
                    (the summary, when ``reasoning.summary`` asks for one, is the reasoning itself)
    message         {"type": "message", "role": "assistant", "content": [output_text]}
    function_call   {"type": "function_call", "call_id", "name", "arguments"} (tool calls in the
                    model's native format; ``namespace`` set for a function of a namespace tool)

Streaming sends the named SSE events of the real API, each with a ``sequence_number``:
response.created, response.in_progress; per item response.output_item.added, its parts and deltas
(response.content_part.added / response.output_text.delta / .done / response.content_part.done;
response.reasoning_text.delta / .done and response.reasoning_summary_part.added /
response.reasoning_summary_text.delta / .done / response.reasoning_summary_part.done;
response.function_call_arguments.delta / .done), response.output_item.done; then
response.completed, or response.incomplete (the output cut at ``max_output_tokens`` or the context:
``incomplete_details.reason`` "max_output_tokens"), or response.failed; ``: keep-alive`` comments
while silent. A stored response (``store``, the default) is kept in a bounded in-memory store
(``response_store``: the last ``STORE_LIMIT``, at most ``STORE_BYTES`` of JSON; a turn keeps the
turns before it) for ``previous_response_id``: its conversation (input and output items) comes
before the new input, and its prompt's tokens are reused up to where the new prompt's text differs.
``parallel_tool_calls`` false keeps the first call only. Errors use OpenAI's schema.
``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` 0..20) fills the output_text
part's ``logprobs`` (every generated token, reasoning included, in order; each
``response.output_text.delta`` carries those of the tokens that arrived with it).
"""

from __future__ import annotations

import copy
import json
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from zoo.server.protocols.response_store import STORE_BYTES, STORE_LIMIT, ResponseStore, Turn
from zoo.server.protocols.responses_request import (
    EFFORT_OFF,
    ResponsesRequest,
    check_supported,
    function_tools,
    input_items,
    template_messages,
    tool_choice,
)
from zoo.server.service import KEEPALIVE, POLL_S, Finish, Logprobs, collect_finished, guarded
from zoo.server.structured import response_format_grammar
from zoo.server.validation import ApiError, parse_body
from zoo.text.reasoning_parser import Reasoning, Text
from zoo.text.tool_calls import ToolCallArgs, ToolCallEnd, ToolCallStart

router = APIRouter()
LOGPROBS = "message.output_text.logprobs"     # the ``include`` value asking for them
SHOWN_ID_CHARS = 64        # of an unknown id, this much is echoed in the 404


def response_store(app) -> ResponseStore:
    """The app's store, made on first use (requests run on one event loop: no race)."""
    store = getattr(app.state, "responses", None)
    if store is None:
        store = app.state.responses = ResponseStore()
    return store


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    where = f"{param}: " if param else ""
    shown = response_id if len(response_id) <= SHOWN_ID_CHARS else \
        f"{response_id[:SHOWN_ID_CHARS]}... ({len(response_id)} characters)"
    return ApiError(404, f"{where}response {shown!r} not found (this server keeps the last {STORE_LIMIT} "
                         f"stored responses, up to {STORE_BYTES >> 20} MiB, in memory)", param=param,
                    code="previous_response_not_found" if param else None)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Answer events -> the response's output items, and the stream events that build them."""

    def __init__(self, response: dict, *, summary: bool, namespaces: dict[str, str], parallel_calls: bool,
                 count_tokens, render_logprobs=None):
        """``render_logprobs``: records -> the output_text logprobs entries (None: not asked for)."""
        self.response = response
        self.render_logprobs = render_logprobs
        self._pending: list = []              # logprob records not yet given to a text delta
        self._logprobs: list[dict] = []       # the open message's logprobs entries
        self.summary, self.namespaces, self.parallel_calls = summary, namespaces, parallel_calls
        self.count_tokens = count_tokens
        self._seq = 0
        self._item: dict | None = None        # the open item
        self._text = ""                       # its text so far (reasoning, message) or arguments (call)
        self._skipping = False                # inside a call left out (parallel_tool_calls false)
        self._reasoning = ""

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _where(self) -> dict:
        return {"item_id": self._item["id"], "output_index": self._index}

    def start(self) -> list[dict]:
        return [self._event("response.created", response=copy.deepcopy(self.response)),
                self._event("response.in_progress", response=copy.deepcopy(self.response))]

    def _take_logprobs(self) -> list[dict]:
        entries = self.render_logprobs(self._pending) if self.render_logprobs and self._pending else []
        self._pending = []
        self._logprobs += entries
        return entries

    def feed(self, e) -> list[dict]:
        if isinstance(e, Logprobs):
            self._pending += e.records
            return []
        kind = ("reasoning" if isinstance(e, Reasoning) else "message" if isinstance(e, Text)
                else "function_call" if isinstance(e, ToolCallStart) else None)
        if self._skipping:
            self._skipping = not isinstance(e, ToolCallEnd)
            return []
        out = []
        if kind is not None and (self._item is None or self._item["type"] != kind or kind == "function_call"):
            out += self._close("completed")
            if kind == "function_call" and not self.parallel_calls and any(
                    i["type"] == "function_call" for i in self.response["output"]):
                self._skipping = True
                return out
            out += self._open(kind, e)
        if isinstance(e, Reasoning):
            self._text += e.text
            out.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=e.text))
            if self.summary:
                out.append(self._event("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                       delta=e.text))
        elif isinstance(e, Text):
            self._text += e.text
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=e.text,
                                   logprobs=self._take_logprobs()))
        elif isinstance(e, ToolCallArgs):
            self._text += e.delta
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=e.delta))
        elif isinstance(e, ToolCallEnd):
            out += self._close("completed")
        return out

    def _open(self, kind: str, e) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        elif kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": e.name, "arguments": ""}
            if e.name in self.namespaces:
                item["namespace"] = self.namespaces[e.name]
        self.response["output"].append(item)
        self._item, self._text = item, ""
        if kind == "message":
            self._logprobs = []
        out = [self._event("response.output_item.added", output_index=self._index, item=copy.deepcopy(item))]
        if kind == "message":
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        elif kind == "reasoning" and self.summary:
            out.append(self._event("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                   part={"type": "summary_text", "text": ""}))
        return out

    def _close(self, status: str) -> list[dict]:
        item, text = self._item, self._text
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            self._reasoning += text
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._event("response.reasoning_text.done", **self._where(), content_index=0, text=text))
            if self.summary:
                part = {"type": "summary_text", "text": text}
                item["summary"] = [part]
                out += [self._event("response.reasoning_summary_text.done", **self._where(), summary_index=0,
                                    text=text),
                        self._event("response.reasoning_summary_part.done", **self._where(), summary_index=0,
                                    part=part)]
        elif item["type"] == "message":
            self._take_logprobs()
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
            item["content"], item["status"] = [part], status
            out += [self._event("response.output_text.done", **self._where(), content_index=0, text=text,
                                logprobs=copy.deepcopy(self._logprobs)),
                    self._event("response.content_part.done", **self._where(), content_index=0, part=part)]
        else:
            item["arguments"], item["status"] = text, status
            out.append(self._event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                   arguments=text))
        out.append(self._event("response.output_item.done", output_index=self._index, item=copy.deepcopy(item)))
        self._item, self._text = None, ""
        return out

    def finish(self, finish: Finish) -> list[dict]:
        """Close the open item and the response: completed, incomplete (cut by a length) or failed."""
        cut = finish.reason == "length"
        out = self._close("incomplete" if cut else "completed")
        r = self.response
        if finish.reason == "error":
            r.update(status="failed", error={"code": "server_error", "message": finish.error or "generation failed"})
            return out + [self._event("response.failed", response=copy.deepcopy(r))]
        reasoning_tokens = len(self.count_tokens(self._reasoning)) if self._reasoning else 0
        r.update(status="incomplete" if cut else "completed", completed_at=int(time.time()),
                 incomplete_details={"reason": "max_output_tokens"} if cut else None,
                 usage={"input_tokens": finish.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
                        "output_tokens": finish.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                        "total_tokens": finish.prompt_tokens + finish.completion_tokens})
        return out + [self._event("response.incomplete" if cut else "response.completed", response=copy.deepcopy(r))]


def _response_object(body: ResponsesRequest, model_name: str) -> dict:
    reasoning = body.reasoning
    return {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": body.model or model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "store": body.store, "temperature": body.temperature, "text": {"format": _format(body)},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
            "truncation": "disabled", "usage": None, "metadata": body.metadata or {}, "user": None}


def _format(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump()


def _render(service, body: ResponsesRequest, parent: Turn | None):
    """The prompt and the namespace of each namespaced function; ``parent``: the stored turn this
    one continues (its conversation comes first; its prompt's tokens are reused where they can be)."""
    prior = parent.conversation() if parent is not None else []
    tools, namespaces = function_tools(body)
    choice, name = tool_choice(body, tools)
    effort = body.reasoning.effort if body.reasoning is not None else None
    thinking = None if effort is None else effort not in EFFORT_OFF
    images = service.image_parts()
    messages = template_messages(body.instructions, prior + input_items(body), images=images)
    fmt = body.text.format if body.text is not None else None
    output = None if fmt is None else response_format_grammar(fmt.model_dump(), "text.format")
    prompt = service.chat_prompt(messages, tools=tools or None, tool_choice=choice, tool_name=name,
                                 thinking=thinking, template_kwargs={"reasoning_effort": effort} if effort else {},
                                 output=output, parallel_calls=body.parallel_tool_calls, images=images,
                                 prior=parent.prompt if parent is not None else None)
    return prompt, namespaces


@router.post("/v1/responses")
async def create_response(request: Request):
    service = request.app.state.service
    store = response_store(request.app)
    body = await run_in_threadpool(parse_body, ResponsesRequest, await request.body())
    check_supported(body)
    parent = None
    if body.previous_response_id:
        parent = store.get(body.previous_response_id)
        if parent is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
    # rendering and tokenizing a long prompt takes a while: in a worker thread, not on the event loop
    prompt, namespaces = await run_in_threadpool(_render, service, body, parent)
    logprobs = (body.top_logprobs or 0) if LOGPROBS in (body.include or []) else None
    options = service.request_options(prompt.ids, max_tokens=body.max_output_tokens, temperature=body.temperature,
                                      top_p=body.top_p, thinking_opened=prompt.opens_reasoning, logprobs=logprobs,
                                      grammar=prompt.grammar)
    job = await service.start(prompt.ids, options, images=prompt.images, request=request)
    events = service.events(job, prompt.parser, prompt.initial, tick=None if body.stream else POLL_S)
    builder = OutputBuilder(_response_object(body, service.model_name), summary=body.summary, namespaces=namespaces,
                            parallel_calls=body.parallel_tool_calls, count_tokens=service.tokenizer.encode,
                            render_logprobs=service.logprob_renderer.chat if logprobs is not None else None)

    def keep(response: dict) -> None:
        if body.store and response["status"] != "failed":
            store.put(response["id"], parent, input_items(body) + copy.deepcopy(response["output"]),
                      copy.deepcopy(response), prompt=prompt.encoded)

    if body.stream:
        return EventSourceResponse(guarded(_stream(events, job, builder, keep), lambda msg: _sse(
            {"type": "error", "code": "server_error", "message": msg, "param": None})), ping=0, sep="\n")
    result = await collect_finished(events, request, job)
    if result is None:
        return None                         # the client is gone
    out, finish = result
    builder.start()
    for e in out:
        builder.feed(e)
    builder.finish(finish)
    keep(builder.response)
    return builder.response


def _sse(event: dict) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(event, ensure_ascii=False), event=event["type"], sep="\n")


async def _stream(events, job, builder: OutputBuilder, keep):
    try:
        for event in builder.start():
            yield _sse(event)
        async for e in events:
            if e is KEEPALIVE:
                yield ServerSentEvent(comment="keep-alive", sep="\n")
            elif isinstance(e, Finish):
                for event in builder.finish(e):
                    yield _sse(event)
                keep(builder.response)
                return
            else:
                for event in builder.feed(e):
                    yield _sse(event)
    finally:
        job.cancel()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    found = response_store(request.app).get(response_id)
    if found is None:
        raise _not_found(response_id)
    return found.response
