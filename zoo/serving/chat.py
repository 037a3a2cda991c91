"""What the OpenAI and Anthropic surfaces share: from messages to prompt tokens, and from generated
tokens to answer events.

    prompt   messages (HF chat-template form) -> chat template (tools, enable_thinking) -> text
             [+ "</think>" and a tool-call opening when a call is forced] -> token ids
    output   token ids -> TextDecoder (incremental detokenizer, stop strings)
                       -> OutputParser (ReasoningParser, then the model's ToolParser)
                       -> Reasoning / Text / ToolCallStart / ToolCallArgs / ToolCallEnd events
    driver   ``Service.events(job, ...)``: those events as tokens arrive, ``KEEPALIVE`` after a
             silent tick, then one ``Finish``; cancels the request if the consumer goes away.
             A request with logprobs also gets a ``Logprobs`` event before the events of the
             tokens it scores (every generated token, reasoning included, in order)
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator

import jinja2

from zoo.serving.engine_thread import TICK, EngineThread, Job
from zoo.serving.errors import ApiError
from zoo.serving.logprob_render import LogprobRenderer
from zoo.serving.logprobs import TokenLogprob
from zoo.serving.reasoning import CLOSE, Reasoning, ReasoningParser, Text, partial_suffix, prompt_opens_reasoning
from zoo.serving.tool_parsers import PARSERS, ToolCallArgs, ToolCallStart, ToolParser, call_prefix

# special tokens that are text to the parsers; every other special token is hidden from the output
KEEP = frozenset(ReasoningParser.MARKERS).union(*(p.MARKERS for p in PARSERS.values()))
KEEPALIVE = object()
POLL_S = 1.0           # non-streaming requests: how often to check that the client is still there


@dataclass
class Finish:
    """The end of a generation. ``reason``: "stop" (end of turn or stop string), "length", "error"."""
    reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    tool_calls: bool = False
    error: str | None = None


@dataclass
class Logprobs:
    """The logprob records of tokens that just arrived (their text follows in the next events)."""
    records: list[TokenLogprob]


class TextDecoder:
    """Token ids -> text pieces: hides control tokens, holds back incomplete UTF-8 and text that
    may be the start of a stop string; ``stopped`` is the stop string that ended the text."""

    def __init__(self, tokenizer, hidden: frozenset[int], stop: list[str] = ()):
        self._tok = tokenizer
        self._hidden = hidden               # ids of control tokens, left out of the text
        self._ids: list[int] = []
        self._prefix = self._read = 0       # decode window: ids[_prefix:_read] were already emitted
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped: str | None = None

    def feed(self, tokens: list[int]) -> str:
        if self.stopped is not None:
            return ""
        self._ids += [t for t in tokens if t not in self._hidden]
        done = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=False)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=False)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._cut(text[len(done):], final=False)

    def flush(self) -> str:
        """The rest of the text (a partial stop string is no match now)."""
        if self.stopped is not None:
            return ""
        done = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=False)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=False)
        self._prefix = self._read = len(self._ids)
        return self._cut(text[len(done):], final=True)

    def _cut(self, text: str, final: bool) -> str:
        self._pending += text
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            i, self.stopped = min(hits)
            out, self._pending = self._pending[:i], ""
            return out
        keep = 0 if final else partial_suffix(self._pending, self._stop)
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out


class OutputParser:
    """Answer text -> events: reasoning split off first (chat only), then tool calls (if any)."""

    def __init__(self, *, reasoning: bool, in_reasoning: bool = False, tools: ToolParser | None = None):
        self._reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self._tools = tools

    def feed(self, text: str) -> list:
        return self._through_tools(self._reasoning.feed(text) if self._reasoning else [Text(text)] * bool(text))

    def flush(self) -> list:
        out = self._through_tools(self._reasoning.flush() if self._reasoning else [])
        return out + (self._tools.flush() if self._tools else [])

    def _through_tools(self, events: list) -> list:
        if self._tools is None:
            return events
        out = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, Text) else [e]
        return out


def coalesce(events: list) -> list:
    """Merge neighbouring pieces of the same kind (fewer, larger stream chunks)."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if type(e) is type(last) and isinstance(e, (Text, Reasoning)):
            out[-1] = type(e)(last.text + e.text)
        elif isinstance(e, ToolCallArgs) and isinstance(last, ToolCallArgs) and e.index == last.index:
            out[-1] = ToolCallArgs(e.index, last.delta + e.delta)
        else:
            out.append(e)
    return out


TEXT_PARTS = ("text", "input_text", "output_text", "summary_text", "reasoning_text")


def content_text(content, where: str) -> str:
    """Message (or tool output) content, a string or a list of text parts (OpenAI chat ``text``,
    Responses ``input_text`` / ``output_text`` / summaries, ``refusal``), as text; any other part is
    a 400 naming it (this server takes text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or a list of content parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PARTS:
            out.append(str(part.get("text", "")))
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio", "image_url", "file"):
            raise ApiError(400, f"{where}[{k}]: {kind} parts are not supported (this server takes text only)",
                           param=where)
        else:
            raise ApiError(400, f"{where}[{k}]: unknown content part type {kind!r}", param=where)
    return "".join(out)


def fold_system_messages(messages: list[dict]) -> list[dict]:
    """``messages`` (template form) with their system text where every chat template takes it: the
    system messages before any other become one leading system message; a later one (agent clients
    send them mid-conversation) joins the user turn it follows, or starts one."""
    head: list[str] = []
    out: list[dict] = []
    for m in messages:
        if m["role"] != "system":
            out.append(m)
        elif not m["content"]:
            continue
        elif not out:
            head.append(m["content"])
        elif out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": "user", "content": m["content"]})
    return ([{"role": "system", "content": "\n\n".join(head)}] if head else []) + out


@dataclass
class ChatPrompt:
    """A rendered chat request: prompt ids, the parser for its output, events of a forced prefix."""
    ids: list[int]
    parser: OutputParser
    initial: list
    opens_reasoning: bool = False      # the prompt ends inside a reasoning block (no close added)


@dataclass
class Service:
    """What the API surfaces need: the engine, the tokenizer, and the serving settings."""
    engine: EngineThread
    tokenizer: object
    model_name: str
    tool_format: str | None         # "qwen" | "glm" | None (tool calls are not parsed)
    context: int                    # the model's maximum sequence length
    default_max_tokens: int
    keepalive_s: float
    thinking_budget: int | None = None   # reasoning tokens before "</think>" is forced (None: unlimited)

    def __post_init__(self):
        self._hidden = frozenset(i for i, t in self.tokenizer.special_tokens().items() if t not in KEEP)
        self.logprob_renderer = LogprobRenderer(self.tokenizer)

    def check_token_ids(self, ids: list[int], where: str) -> None:
        """400 naming the first id of ``ids`` outside the tokenizer's vocabulary."""
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise ApiError(400, f"{where}[{i}]: token id {t} is not in the vocabulary (0..{vocab - 1})",
                               param=where)

    def decoder(self, stop: list[str] = ()) -> TextDecoder:
        """A detokenizer for one request's output, ending the text at any of ``stop``."""
        return TextDecoder(self.tokenizer, self._hidden, stop)

    # -- prompts ----------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice: str = "auto",
                    tool_name: str | None = None, thinking: bool | None = None,
                    template_kwargs: dict | None = None, prefill: str = "") -> ChatPrompt:
        """Render ``messages`` (HF form) with the chat template.

        tool_choice: "auto", "none" (tools left out of the prompt, no parsing), "required" or
        "function" (``tool_name``): the assistant turn is started with a tool-call opening, so the
        model must call (that) tool; an open reasoning block is closed first. ``thinking`` is the
        templates' ``enable_thinking``. ``prefill``: assistant text the answer continues (not
        repeated in the output).
        """
        use_tools = bool(tools) and tool_choice != "none"
        kwargs = dict(template_kwargs or {})
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools if use_tools else None,
                                                      add_generation_prompt=True, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}") from None
        in_reasoning = prompt_opens_reasoning(text)
        forced = ""
        if use_tools and tool_choice in ("required", "function"):
            if self.tool_format is None:
                raise ApiError(400, f"tool_choice {tool_choice!r} needs a known tool-call format; this model "
                                    "has none (start the server with a tool format)", param="tool_choice")
            forced = call_prefix(self.tool_format, tool_name)
        close = "\n" + CLOSE + "\n\n" if in_reasoning and (forced or prefill) else ""
        tools_parser = PARSERS[self.tool_format](tools) if use_tools and self.tool_format else None
        parser = OutputParser(reasoning=True, in_reasoning=in_reasoning, tools=tools_parser)
        parser.feed(close + prefill)                 # already in the prompt, not part of the answer
        initial = parser.feed(forced)
        return ChatPrompt(self.tokenizer.encode(text + close + prefill + forced), parser, initial,
                          opens_reasoning=in_reasoning and not close)

    # -- generation -------------------------------------------------------------------------------
    async def start(self, ids: list[int], *, max_tokens: int | None, temperature: float, top_p: float,
                    top_k: int, seed: int | None, thinking_budget: int | None = None,
                    thinking_opened: bool = False, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> Job:
        """Submit a request and wait until it is admitted (429 / 503 from the queue; 400 if the
        engine can never fit it). ``thinking_budget``: reasoning tokens after which ``</think>`` is
        forced (``thinking_opened``: the prompt ends inside ``<think>``). ``logprobs`` /
        ``prompt_logprobs``: alternatives per generated / prompt token (None: no logprobs);
        ``max_tokens`` 0 (prompt logprobs only) needs ``prompt_logprobs``."""
        if len(ids) >= self.context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the model's context is {self.context}",
                           code="context_length_exceeded")
        budget = self.context - len(ids)
        max_new = min(self.default_max_tokens if max_tokens is None else max_tokens, budget)
        if thinking_budget is None:
            thinking_budget = self.thinking_budget
        job = self.engine.submit(ids, max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=random.getrandbits(31) if seed is None else seed,
                                 thinking_budget=thinking_budget, thinking_opened=thinking_opened,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            await job.admitted()
        except BaseException:
            job.cancel()
            raise
        if not job.admitted_to_row and job.req.finish_reason == "error":
            raise ApiError(400, f"the request cannot be served: {job.req.stats.get('error', 'engine error')}")
        return job

    async def events(self, job: Job, decoder: TextDecoder, parser: OutputParser, initial: list = (),
                     tick: float | None = None) -> AsyncIterator:
        """Answer events of ``job`` as they come, ``KEEPALIVE`` after ``tick`` s (default: the
        keep-alive interval) without any (no tokens, or tokens that produce no output yet, such as
        a buffered tool-call value), then a ``Finish``. Leaving early cancels the request."""
        tick = tick or self.keepalive_s
        tool_calls = any(isinstance(e, ToolCallStart) for e in initial)
        last = time.monotonic()               # when the consumer last got something
        scored = 0                            # logprob records already passed on
        try:
            for e in coalesce(list(initial)):
                yield e
            while True:
                item = await job.next(tick)
                if item is not TICK:
                    tokens, done = item
                    if len(job.logprobs) > scored:
                        yield Logprobs(job.logprobs[scored:])
                        scored = len(job.logprobs)
                    text = decoder.feed(tokens)
                    if decoder.stopped is not None and not done:
                        job.cancel("stop")
                        done = True
                    if done:
                        text += decoder.flush()
                    events = coalesce(parser.feed(text) + (parser.flush() if done else []))
                    for e in events:
                        tool_calls |= isinstance(e, ToolCallStart)
                        yield e
                    if done:
                        yield self._finish(job, decoder, tool_calls)
                        return
                    if events:
                        last = time.monotonic()
                        continue
                if time.monotonic() - last >= tick:
                    yield KEEPALIVE
                    last = time.monotonic()
        finally:
            job.cancel()

    @staticmethod
    def _finish(job: Job, decoder: TextDecoder, tool_calls: bool) -> Finish:
        finish = Finish("stop", len(job.req.prompt), job.received, tool_calls=tool_calls)
        if decoder.stopped is not None:
            return dataclasses.replace(finish, stop_sequence=decoder.stopped)
        if job.error or job.finish_reason == "error":
            return dataclasses.replace(finish, reason="error", error=job.error or job.req.stats.get("error"))
        return dataclasses.replace(finish, reason="length" if job.finish_reason == "length" else "stop")


async def collect_finished(events: AsyncIterator, request, job) -> tuple[list, Finish] | None:
    """A non-streaming request's events and its Finish, the job cancelled once collected; None if
    the client went away. A generation error becomes a 500."""
    try:
        out, finish = await collect(events, request)
    finally:
        job.cancel()
    if finish is None:
        return None
    if finish.reason == "error":
        raise ApiError(500, finish.error or "generation failed")
    return out, finish


async def collect(events: AsyncIterator, request) -> tuple[list, Finish | None]:
    """All events of a non-streaming request (made with ``tick=POLL_S``); (events, None) if the
    client went away meanwhile."""
    out = []
    async for e in events:
        if e is KEEPALIVE:
            if await request.is_disconnected():
                await events.aclose()
                return out, None
        elif isinstance(e, Finish):
            return out, e
        else:
            out.append(e)
    return out, None
