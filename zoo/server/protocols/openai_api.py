"""The OpenAI surface: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

A thin adapter: it validates the request (400 in OpenAI's error schema), turns it into a prompt
and sampling parameters for ``Service``, and renders ``Service.events`` as one JSON response or
as SSE chunks (``data: {...}``, ``: keep-alive`` comments when silent, ``data: [DONE]``).
Reasoning comes back as ``reasoning_content``; tool calls as ``tool_calls`` (arguments streamed
as deltas); ``stream_options.include_usage`` adds the final usage chunk. A choice whose output
grammar hits a limit mid-output ends with ``finish_reason: "error"`` and ``error: {"message"}``
(``service.choice_error``), streamed or not; the request's other choices go on. A client that leaves
while its request waits for rows ends all its choices (499, ``Service.admitted``).

Log-probabilities (``zoo.engine.logprobs``): chat ``logprobs: true`` (+ ``top_logprobs`` 0..20)
gives ``choices[].logprobs.content`` for every generated token (reasoning included), streamed
chunks carrying those of the tokens that arrived with them; completions ``logprobs: N`` (0..20)
gives the legacy object, and with ``echo`` the prompt's tokens first (the first one's logprob
None). Completions take a list of prompts (``n`` choices each; at most ``MAX_PROMPTS``, and
prompts x n within the engine's queue; all queued at once) and ``max_tokens: 0`` with ``echo``
(prompt logprobs only: lm-evaluation-harness's log-likelihood requests).

Validation (``zoo.server.validation.Body``: strict types, unknown fields ignored): every numeric field
is bounded (``max_tokens`` / ``max_completion_tokens`` 1..2**31-1, completions' ``max_tokens``
0..2**31-1; ``n`` 1..16; ``top_k`` -1..2**31-1; ``seed`` int64; ``thinking_budget`` 1..2**31-1;
``temperature`` 0..2; ``top_p`` (0, 1]; prompt token ids 0..2**31-1, then the vocabulary). Fields
the engine does not implement are accepted at their neutral value only, else a 400 saying so:
``presence_penalty`` / ``frequency_penalty`` (-2..2; 0), ``repetition_penalty`` (> 0; 1),
``logit_bias`` (token-id keys, -100..100; empty), ``best_of`` (equal to ``n``). A tool's
``function.parameters`` must be a valid JSON Schema, its ``name`` match ``^[a-zA-Z0-9_-]{1,64}$``.
Every 400 names the field.

Images (a model with a vision tower): user messages' content may hold ``{"type": "image_url",
"image_url": {"url": ...}}`` (or ``"image_url": "..."``), a ``data:image/...;base64,`` URL, or an
http(s) URL where the server allows them (``zoo.server.image_inputs``); ``usage.prompt_tokens``
counts the image tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from zoo.engine.constraint import OutputGrammar
from zoo.engine.logprobs import MAX_TOP
from zoo.server.service import (
    KEEPALIVE,
    POLL_S,
    Finish,
    Logprobs,
    OutputParser,
    choice_error,
    collect_choices,
    content_text,
    guarded,
    merge_events,
)
from zoo.server.structured import EXTENSIONS, request_grammar
from zoo.server.validation import (
    INT32_MAX,
    ApiError,
    Body,
    Budget,
    MaxTokens,
    Seed,
    TokenId,
    TokenKey,
    ToolName,
    check_json_schema,
    parse_body,
)
from zoo.text.reasoning_parser import Reasoning, Text
from zoo.text.tool_calls import ToolCallArgs, ToolCallStart

router = APIRouter()
EFFORT_OFF = ("none", "minimal")       # reasoning_effort values that turn thinking off
MAX_CHOICES = 16                       # n: at most this many choices (each takes a batch row)
MAX_PROMPTS = 256                      # /v1/completions: prompts in one request (and prompts x n <= the queue)
MAX_STOPS = 16                         # stop: at most this many sequences
# sampling fields the engine does not implement: only their neutral value is accepted (else a 400)
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class _Body(Body):
    pass


class FunctionDef(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict | None = None         # a JSON Schema (checked), or None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, value, info: ValidationInfo):
        return None if value is None else check_json_schema(value, f"tool {info.data.get('name')!r}")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """Fields shared by chat and text completions."""
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)        # not implemented: 0 only
    frequency_penalty: float | None = Field(None, ge=-2, le=2)       # not implemented: 0 only
    repetition_penalty: float | None = Field(None, gt=0)             # vLLM's; not implemented: 1 only
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-100, le=100)]] | None = None   # not implemented: {}
    response_format: dict | None = None
    structured_outputs: dict | None = None       # zoo extensions (vLLM's fields): see zoo.server.structured
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    prompt_cache_key: str | None = None            # accepted; the prefix cache is keyed by the prompt's tokens

    def output_grammar(self) -> OutputGrammar | None:
        """The grammar the output must follow (400 for a bad or doubled constraint)."""
        return request_grammar(self.response_format, self.model_dump(include=set(EXTENSIONS)))


class ChatRequest(Sampling):
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    thinking_budget: Budget | None = None      # zoo extension: force </think> after N reasoning tokens
    chat_template_kwargs: dict | None = None


def _prompt_form(value) -> str | None:
    """Which form of ``prompt`` a value is meant as (the first item decides for a list)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        first = value[0] if value else 0
        return "list[str]" if isinstance(first, str) else "list[list]" if isinstance(first, list) else "list[int]"
    return None


Prompt = Annotated[Annotated[str, Tag("str")] | Annotated[list[TokenId], Tag("list[int]")]
                   | Annotated[list[str], Tag("list[str]")] | Annotated[list[list[TokenId]], Tag("list[list]")],
                   Discriminator(_prompt_form, custom_error_type="prompt_type", custom_error_message=(
                       "expected a string, a list of strings, a list of token ids or a list of lists of token ids"))]


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)      # 0: the prompt's logprobs only (with echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)      # not implemented: only equal to n


def parse(model: type[Sampling], raw: bytes):
    """Validate a JSON body (400 naming the first bad field) and what this server does not do."""
    body = parse_body(model, raw)
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop sequences", param="stop")
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise ApiError(400, f"{name}: {value} is not supported by this server (only {neutral:g}, no penalty)",
                           param=name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server (only an empty one)", param="logit_bias")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise ApiError(400, f"best_of: {best_of} is not supported by this server (only best_of equal to n, "
                            f"{body.n})", param="best_of")
    return body


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def template_messages(messages: list[dict], images=None) -> list[dict]:
    """OpenAI messages -> the chat templates' form (tool-call arguments as dicts). ``images``
    (``image_inputs.ImageParts``): collects the image parts of user messages (None: they are a 400)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role: unknown role {role!r}", param=f"messages[{i}].role")
        msg = {"role": "system" if role == "developer" else role,
               "content": content_text(m.get("content"), f"messages[{i}].content", images if role == "user" else None)}
        for name in ("reasoning_content", "tool_call_id", "name"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise ApiError(400, f"messages[{i}].{name}: expected a string", param=f"messages[{i}].{name}")
        if role == "assistant":
            if m.get("reasoning_content"):
                msg["reasoning_content"] = m["reasoning_content"]
            if m.get("tool_calls"):
                if not isinstance(m["tool_calls"], list):
                    raise ApiError(400, f"messages[{i}].tool_calls: expected a list of tool calls",
                                   param=f"messages[{i}].tool_calls")
                msg["tool_calls"] = [_template_call(tc, f"messages[{i}].tool_calls[{j}]")
                                     for j, tc in enumerate(m["tool_calls"])]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _template_call(call: dict, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not fn.get("name") or not isinstance(fn["name"], str):
        raise ApiError(400, f"{where}: expected {{'function': {{'name': ..., 'arguments': ...}}}}", param=where)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments: not valid JSON", param=where) from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments: expected a JSON object", param=where)
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tool_choice(body: ChatRequest) -> tuple[str, str | None]:
    choice = body.tool_choice or "auto"
    names = [t.function.name for t in body.tools or []]
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or name not in names:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the request's tools", param="tool_choice")
        return "function", name
    if choice not in ("auto", "none", "required"):
        raise ApiError(400, f"tool_choice: expected auto, none, required or a function, got {choice!r}",
                       param="tool_choice")
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
    return choice, None


def _finish_reason(finish: Finish) -> str:
    if finish.reason == "stop" and finish.tool_calls and finish.stop_sequence is None:
        return "tool_calls"
    return finish.reason


def _error_event(finish: Finish) -> ServerSentEvent:
    return _error_sse(finish.error or "generation failed", finish.error_status)


def _error_sse(message: str, status: int = 500) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(ApiError(status, message).openai_body()), sep="\n")


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "zoo"}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request.app.state.service.model_name)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    name = request.app.state.service.model_name
    if model_id != name:
        raise ApiError(404, f"model {model_id!r} not found; this server serves {name!r}", param="model")
    return _model_card(name)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    service = request.app.state.service
    body = await run_in_threadpool(parse, ChatRequest, await request.body())     # tool schemas checked off the loop
    output = await run_in_threadpool(body.output_grammar)       # a big schema's grammar: off the event loop
    choice, name = _tool_choice(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    thinking = None if body.reasoning_effort is None else body.reasoning_effort not in EFFORT_OFF
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    images = service.image_parts()

    def render():
        return service.chat_prompt(template_messages(body.messages, images), tools=tools, tool_choice=choice,
                                   tool_name=name, thinking=thinking, template_kwargs=kwargs, output=output,
                                   parallel_calls=body.parallel_tool_calls, images=images)
    # rendering, tokenizing a long prompt and decoding images take a while: in a worker thread
    prompt = await run_in_threadpool(render)
    options = service.request_options(prompt.ids, max_tokens=body.max_completion_tokens or body.max_tokens,
                                      seed=body.seed, thinking_budget=body.thinking_budget,
                                      temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                                      stop=_stops(body.stop), thinking_opened=prompt.opens_reasoning,
                                      logprobs=logprobs, n=body.n, grammar=prompt.grammar)
    jobs = await service.start_choices(prompt.ids, options, images=prompt.images, request=request)
    streams = [service.events(job, parser, initial, tick=None if body.stream else POLL_S)
               for job, (parser, initial) in zip(jobs, prompt.parsers(body.n))]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model or
            service.model_name}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        render = service.logprob_renderer.chat if logprobs is not None else None
        return EventSourceResponse(guarded(_chat_chunks(streams, jobs, head, usage, render), _error_sse),
                                   ping=0, sep="\n")
    results = await collect_choices(streams, request, jobs)
    if results is None:
        return None                         # the client is gone
    choices = [_chat_choice(i, out, finish, service, logprobs) for i, (out, finish) in enumerate(results)]
    return {**head, "object": "chat.completion", "usage": _usage_of([f for _, f in results]), "choices": choices}


def _chat_choice(index: int, out: list, finish: Finish, service, logprobs: int | None) -> dict:
    content = "".join(e.text for e in out if isinstance(e, Text))
    reasoning = "".join(e.text for e in out if isinstance(e, Reasoning))
    calls: list[dict] = []
    for e in out:
        if isinstance(e, ToolCallStart):
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ToolCallArgs):
            calls[e.index]["function"]["arguments"] += e.delta
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    scored = None
    if logprobs is not None:
        scored = {"content": service.logprob_renderer.chat([r for e in out if isinstance(e, Logprobs)
                                                            for r in e.records])}
    return {"index": index, "message": message, "finish_reason": _finish_reason(finish), "logprobs": scored,
            **_choice_error(finish)}


def _choice_error(finish: Finish) -> dict:
    """A choice that ended in its own error (its output grammar hit a limit: ``choice_error``)
    carries the message (a zoo extension beside finish_reason "error"); other choices nothing."""
    return {"error": {"message": finish.error}} if finish.reason == "error" else {}


def _usage_of(finishes: list[Finish], prompts: int = 1) -> dict:
    """Usage of several choices: the prompt counted once per prompt (``prompts`` of them, the
    choices of each consecutive), the completions summed."""
    per = len(finishes) // prompts
    prompt_tokens = sum(f.prompt_tokens for f in finishes[::per])
    completion = sum(f.completion_tokens for f in finishes)
    cached = sum(f.cached_tokens for f in finishes[::per])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _chat_chunks(streams, jobs, head: dict, include_usage: bool, render_logprobs=None):
    """SSE chunks of every choice as they come (``index``); with ``render_logprobs`` each chunk
    carries the logprobs of the tokens that arrived since that choice's last chunk."""
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    pending: list[list] = [[] for _ in streams]
    finishes: list[Finish] = []

    def chunk(i: int, delta: dict, finish_reason=None, error: dict | None = None) -> ServerSentEvent:
        scored = None
        if render_logprobs is not None and pending[i]:
            scored = {"content": render_logprobs(pending[i])}
            pending[i].clear()
        data = {**base, "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason,
                                     "logprobs": scored, **(error or {})}], **extra}
        return ServerSentEvent(json.dumps(data, ensure_ascii=False), sep="\n")

    try:
        for i in range(len(streams)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, e in merge_events(streams):
            if isinstance(e, Logprobs):
                pending[i] += e.records
            elif e is KEEPALIVE:
                yield ServerSentEvent(comment="keep-alive", sep="\n")
            elif isinstance(e, Text):
                yield chunk(i, {"content": e.text})
            elif isinstance(e, Reasoning):
                yield chunk(i, {"reasoning_content": e.text})
            elif isinstance(e, ToolCallStart):
                yield chunk(i, {"tool_calls": [{"index": e.index, "id": f"call_{uuid.uuid4().hex[:24]}",
                                                "type": "function", "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArgs):
                yield chunk(i, {"tool_calls": [{"index": e.index, "function": {"arguments": e.delta}}]})
            elif isinstance(e, Finish):
                if e.reason == "error" and not choice_error(e):
                    yield _error_event(e)
                    break
                finishes.append(e)
                yield chunk(i, {}, _finish_reason(e), _choice_error(e))
        else:
            if include_usage:
                yield ServerSentEvent(json.dumps({**base, "choices": [], "usage": _usage_of(finishes)}), sep="\n")
        yield ServerSentEvent("[DONE]", sep="\n")
    finally:
        for job in jobs:
            job.cancel()


def _prompts(body: CompletionRequest, max_choices: int) -> list[str | list[int]]:
    """The request's prompts: one string or id list each (400 if there are none, one is empty, there
    are more than ``MAX_PROMPTS``, or their choices, prompts x n, are more than ``max_choices``: the
    engine's queue, which they all enter at once)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "prompt: empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: {len(prompts)} prompts; at most {MAX_PROMPTS} in one request", param="prompt")
    if len(prompts) * body.n > max_choices:
        raise ApiError(400, f"prompt: {len(prompts)} prompts x n={body.n} are {len(prompts) * body.n} choices; "
                            f"this server queues at most {max_choices} at once", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ApiError(400, f"prompt[{i}]: empty" if len(prompts) > 1 else "prompt: empty", param="prompt")
    return prompts


@router.post("/v1/completions")
async def completions(request: Request):
    service = request.app.state.service
    body = await run_in_threadpool(parse, CompletionRequest, await request.body())
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 only with echo (the prompt's logprobs)", param="max_tokens")
    output = await run_in_threadpool(body.output_grammar)       # a big schema's grammar: off the event loop
    prompts = _prompts(body, service.engine.max_queue)
    if body.stream and body.echo:
        raise ApiError(400, "stream: echo needs a non-streaming request", param="echo")
    ids = []
    names = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    for p, name in zip(prompts, names):
        if isinstance(p, str):
            service.check_prompt_chars(p, name)
            ids.append(await run_in_threadpool(service.tokenizer.encode, p))
            if not ids[-1]:
                raise ApiError(400, "prompt: empty", param="prompt")
        else:
            ids.append(list(p))                 # its ids are checked by the engine (``start_choices``)
    prompt_logprobs = None
    if body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs
    elif body.max_tokens == 0:
        prompt_logprobs = 0                 # a prefill only; its logprobs go unreported
    jobs = []
    try:                                    # every prompt queued at once; choice index = prompt index * n + choice
        for p, name in zip(ids, names):
            options = service.request_options(p, max_tokens=body.max_tokens, seed=body.seed,
                                              temperature=body.temperature, top_p=body.top_p,
                                              top_k=max(body.top_k, 0), stop=_stops(body.stop),
                                              logprobs=body.logprobs, prompt_logprobs=prompt_logprobs, n=body.n,
                                              grammar=output)
            jobs += await service.submit_choices(p, options, prompt_param=name)
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    await service.admitted(jobs, request)    # cancels them all on a way out (the client gone included)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or service.model_name}
    streams = [service.events(job, OutputParser(reasoning=False), tick=None if body.stream else POLL_S)
               for job in jobs]
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        render = service.logprob_renderer.completion if body.logprobs is not None else None
        return EventSourceResponse(guarded(_completion_chunks(streams, jobs, head, usage, render, len(prompts)),
                                           _error_sse),
                                   ping=0, sep="\n")
    results = await collect_choices(streams, request, jobs)
    if results is None:
        return None                         # the client is gone
    choices = []
    for index, (job, (out, finish)) in enumerate(zip(jobs, results)):
        p = prompts[index // body.n]
        text = "".join(e.text for e in out if not isinstance(e, Logprobs))
        echoed = (p if isinstance(p, str) else service.tokenizer.decode(p, skip_special_tokens=False)) if body.echo \
            else ""
        scored = None
        if body.logprobs is not None:
            recs = (job.req.prompt_token_logprobs or []) if body.echo else []
            scored = service.logprob_renderer.completion(recs + job.logprobs)
        choices.append({"index": index, "text": echoed + text, "finish_reason": finish.reason, "logprobs": scored,
                        **_choice_error(finish)})
    return {**head, "usage": _usage_of([f for _, f in results], len(prompts)), "choices": choices}


async def _completion_chunks(streams, jobs, head: dict, include_usage: bool, render_logprobs=None, prompts: int = 1):
    """SSE chunks of every choice as they come (``index``); with ``render_logprobs`` each chunk
    carries the legacy logprobs object of the tokens that arrived since that choice's last chunk
    (``text_offset`` counting on across its chunks)."""
    extra = {"usage": None} if include_usage else {}
    pending: list[list] = [[] for _ in streams]
    offset = [0] * len(streams)
    finishes: list[Finish] = []

    def chunk(i: int, text: str, finish_reason=None, error: dict | None = None) -> ServerSentEvent:
        scored = None
        if render_logprobs is not None and (pending[i] or finish_reason is None):
            scored = render_logprobs(pending[i], offset[i])
            offset[i] += sum(len(t) for t in scored["tokens"])
            pending[i].clear()
        data = {**head, "choices": [{"index": i, "text": text, "finish_reason": finish_reason, "logprobs": scored,
                                     **(error or {})}], **extra}
        return ServerSentEvent(json.dumps(data, ensure_ascii=False), sep="\n")

    try:
        async for i, e in merge_events(streams):
            if isinstance(e, Logprobs):
                pending[i] += e.records
            elif e is KEEPALIVE:
                yield ServerSentEvent(comment="keep-alive", sep="\n")
            elif isinstance(e, Text):
                yield chunk(i, e.text)
            elif isinstance(e, Finish):
                if e.reason == "error" and not choice_error(e):
                    yield _error_event(e)
                    break
                finishes.append((i, e))
                yield chunk(i, "", e.reason, _choice_error(e))
        else:
            if include_usage:
                ordered = [f for _, f in sorted(finishes, key=lambda x: x[0])]
                yield ServerSentEvent(json.dumps({**head, "choices": [], "usage": _usage_of(ordered, prompts)}),
                                      sep="\n")
        yield ServerSentEvent("[DONE]", sep="\n")
    finally:
        for job in jobs:
            job.cancel()
