"""What the OpenAI and Anthropic surfaces share: from messages to prompt tokens, and from generated
tokens to answer events.

    prompt   messages (HF chat-template form) -> chat template (tools, enable_thinking) -> text
             [+ "</think>" and a tool-call opening when a call is forced] -> token ids
    options  the parsed request -> ``Service.request_options`` (the server's defaults: max tokens
             clipped to the context, a random seed, the thinking budget; the output detokenized
             with the parsers' markers kept, ``KEEP``) -> one ``RequestOptions``, passed unchanged
             to the engine (``start_choices``), which checks it (a 400 naming the problem)
    output   token ids -> the engine's TextDecoder (``zoo.text.detokenize``: control tokens hidden,
                          stop strings: the engine ends the request there, ``Finish.stop_sequence``)
                       -> text -> OutputParser (ReasoningParser, then the model's ToolParser)
                       -> Reasoning / Text / ToolCallStart / ToolCallArgs / ToolCallEnd events
    driver   ``Service.events(job, ...)``: those events as text arrives, ``KEEPALIVE`` after a
             silent tick, then one ``Finish``; cancels the request if the consumer goes away.
             A request with logprobs also gets a ``Logprobs`` event before the events of the
             tokens it scores (every generated token, reasoning included, in order)
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import jinja2

from zoo.engine.constraint import OutputGrammar
from zoo.engine.logprobs import TokenLogprob
from zoo.engine.options import RequestOptions, TokenIdError, check_token_ids
from zoo.server.engine_thread import TICK, EngineThread, Job
from zoo.server.image_inputs import ImageParts, ImagePolicy, VisionInputs
from zoo.server.logprob_render import LogprobRenderer
from zoo.server.structured import marker_tokens, strict_tools, tool_output
from zoo.server.validation import ApiError
from zoo.text.reasoning_parser import (
    CLOSE,
    OPEN,
    Reasoning,
    ReasoningParser,
    Text,
    prompt_opens_reasoning,
)
from zoo.text.tool_calls import FORMATS, ToolCallArgs, ToolCallFormat, ToolCallStart, ToolParser, tool_call_format

# special tokens that are text to the parsers; every other special token is hidden from the output
KEEP = frozenset(ReasoningParser.MARKERS).union(*(f.markers for f in FORMATS.values()))
KEEPALIVE = object()
log = logging.getLogger("zoo.serve")
POLL_S = 1.0           # non-streaming requests: how often to check that the client is still there
GRAMMAR_COMPILE_S = 10.0   # an output grammar that takes longer to compile is a 400
GRAMMAR_THREADS = 2        # output grammars compile on these threads only
_GRAMMAR_POOL = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="zoo-grammar")



@dataclass
class Finish:
    """The end of a generation. ``reason``: "stop" (end of turn or stop string), "length", "error".
    ``cached_tokens``: prompt tokens restored from the prefix cache; ``cache_written``: prompt tokens
    up to the last ``cache_control`` mark that this request prefilled (and cached)."""
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_written: int = 0
    stop_sequence: str | None = None
    tool_calls: bool = False
    error: str | None = None
    error_status: int = 500            # the HTTP status of ``error`` (503: the server is shutting down)
    grammar_error: bool = False        # ``error`` is the choice's output grammar's (``choice_error``)


@dataclass
class Logprobs:
    """The logprob records of tokens that just arrived (their text follows in the next events)."""
    records: list[TokenLogprob]


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


IMAGE_PARTS = ("image_url", "input_image")


def content_text(content, where: str, images=None) -> str:
    """Message (or tool output) content, a string or a list of text parts (OpenAI chat ``text``,
    Responses ``input_text`` / ``output_text`` / summaries, ``refusal``), as text. Image parts (chat
    ``image_url`` as ``{"url": ...}`` or a string, Responses ``input_image`` with ``image_url``)
    go to ``images`` (a ``image_inputs.ImageParts``) and read as the text standing for them; where
    ``images`` is None (not a user turn) they are a 400, as is any other part."""
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
        elif kind in IMAGE_PARTS and images is not None:
            out.append(_image_part(part, kind, f"{where}[{k}]", images))
        elif kind in IMAGE_PARTS:
            raise ApiError(400, f"{where}[{k}]: {kind} parts are not supported here (images are taken in user "
                                "messages, by a model with a vision tower)", param=where)
        elif kind in ("input_file", "input_audio", "file"):
            raise ApiError(400, f"{where}[{k}]: {kind} parts are not supported (this server takes text and images)",
                           param=where)
        else:
            raise ApiError(400, f"{where}[{k}]: unknown content part type {kind!r}", param=where)
    return "".join(out)


def _image_part(part: dict, kind: str, where: str, images) -> str:
    if kind == "input_image" and part.get("file_id") is not None and part.get("image_url") is None:
        raise ApiError(400, f"{where}.file_id: images by file_id are not supported (no Files API here); send "
                            "image_url as a data: URL", param=where)
    url = part.get("image_url")
    if kind == "image_url" and isinstance(url, dict):
        url = url.get("url")
        where += ".image_url.url"
    else:
        where += ".image_url"
    if url is None:
        raise ApiError(400, f"{where}: missing (expected the image's URL)", param=where)
    return images.add_url(url, where)


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


def _token_marks(text: str, ends: list[int], marks: Sequence[str]) -> tuple[int, ...]:
    """Token positions where each of ``marks`` (searched in order in ``text``) ends: the tokens whose
    text ends at or before that character (``ends``: per token). A text not found is skipped."""
    out, at = [], 0
    for mark in marks:
        found = text.find(mark, at)
        if found < 0:
            continue
        at = found + len(mark)
        n = bisect.bisect_right(ends, at)
        if n and (not out or n > out[-1]):
            out.append(n)
    return tuple(out)


@dataclass
class ChatPrompt:
    """A rendered chat request: prompt ids, the parser for its output, events of a forced prefix,
    the grammar its output follows (None: free)."""
    ids: list[int]
    parser: OutputParser
    initial: list
    opens_reasoning: bool = False      # the prompt ends inside a reasoning block (no close added)
    grammar: OutputGrammar | None = None
    new_parser: Callable[[], tuple[OutputParser, list]] | None = None   # (parser, initial) for another choice
    marks: tuple[int, ...] = ()        # token positions where the prefix cache should keep a snapshot
    images: tuple = ()                 # the engine's ImageInput per image, in prompt order
    encoded: object = None             # the rendered text's encoding (``Encoded``; None with images)

    def parsers(self, n: int) -> list[tuple[OutputParser, list]]:
        """(parser, initial events) for each of ``n`` choices."""
        return [(self.parser, self.initial)] + [self.new_parser() for _ in range(n - 1)]


@dataclass
class Service:
    """What the API surfaces need: the engine, the tokenizer, and the serving settings."""
    engine: EngineThread
    tokenizer: object
    model_name: str
    tool_format: ToolCallFormat | None   # or its name (``zoo.text.tool_calls.FORMATS``); None: calls not parsed
    context: int                    # tokens per request, prompt and output (the engine's)
    default_max_tokens: int
    keepalive_s: float
    thinking_budget: int | None = None   # reasoning tokens before "</think>" is forced (None: unlimited)
    vision: VisionInputs | None = None   # the model's image handling (None: text only)
    image_policy: ImagePolicy = dataclasses.field(default_factory=ImagePolicy)

    def __post_init__(self):
        if isinstance(self.tool_format, str):
            self.tool_format = tool_call_format(self.tool_format)
        self._keep = tuple(sorted(KEEP))        # special tokens the engine leaves in the output's text
        self.logprob_renderer = LogprobRenderer(self.tokenizer)
        self._markers = marker_tokens(self.tokenizer, KEEP)     # written as tokens in tool-call grammars

    def check_token_ids(self, ids: list[int], where: str) -> None:
        """400 naming the first id of ``ids`` outside the tokenizer's vocabulary (ids to detokenize;
        a prompt's ids are the engine's to check, ``start_choices``)."""
        try:
            check_token_ids(ids, self.tokenizer.vocab_size, where)
        except TokenIdError as e:
            raise ApiError(400, str(e), param=where) from None

    def check_prompt_chars(self, text: str, where: str = "the prompt") -> None:
        """400 before tokenizing when ``text`` has more characters than the context can hold tokens
        of (``Tokenizer.max_chars_per_token`` per token), so a huge body is refused in microseconds
        instead of being tokenized first; nothing is checked where the tokenizer gives no bound."""
        per_token = getattr(self.tokenizer, "max_chars_per_token", None)
        if per_token and len(text) > self.context * per_token:
            raise ApiError(400, f"{where} has {len(text)} characters, more than the server's context of "
                                f"{self.context} tokens can hold (a token spans at most {per_token} characters)",
                           code="context_length_exceeded")

    def image_parts(self) -> ImageParts:
        """A collector for one request's images (a text-only model refuses the first one)."""
        return ImageParts(self.vision, self.image_policy)

    def with_images(self, ids: list[int], images: ImageParts | None,
                    marks: Sequence[int] = ()) -> tuple[list[int], tuple[int, ...], list]:
        """Prompt ids (of a text in which ``images.substitute`` put the placeholders) with each
        image's pad run at full length, the marks moved, and the ``ImageInput``s (decoded and
        preprocessed here). A text-only model: the ids as they are."""
        if self.vision is None:
            return ids, tuple(marks), []
        prepared = self.vision.prepare(images.order, images.policy) if images else []
        ids, marks = self.vision.expand(ids, prepared, marks)
        return ids, marks, prepared

    # -- prompts ----------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice: str = "auto",
                    tool_name: str | None = None, thinking: bool | None = None,
                    template_kwargs: dict | None = None, prefill: str = "", output: OutputGrammar | None = None,
                    parallel_calls: bool = True, marks: Sequence[str] = (),
                    images: ImageParts | None = None, prior=None) -> ChatPrompt:
        """Render ``messages`` (HF form) with the chat template.

        tool_choice: "auto", "none" (tools left out of the prompt, no parsing), "required" or
        "function" (``tool_name``): the assistant turn is started with a tool-call opening, so the
        model must call (that) tool; an open reasoning block is closed first. ``thinking`` is the
        templates' ``enable_thinking``. ``prefill``: assistant text the answer continues (not
        repeated in the output). ``output``: the grammar of the answer (``zoo.server.structured``);
        ``parallel_calls`` False: a forced call is the only one (the grammar ends after it).
        ``marks``: texts of the messages (in order) after which the prefix cache should keep a
        snapshot (Anthropic ``cache_control``); each becomes the token position where it ends.
        ``images``: the request's images, whose sentinels the messages' text holds
        (``image_inputs``): each becomes the model's placeholder, expanded to its tokens.
        ``prior``: an earlier prompt's ``ChatPrompt.encoded`` whose tokens are reused where this
        one's text begins the same (``Tokenizer.encode_continuing``: the ids are those of a full
        encode; a Responses conversation passes its previous turn's).

        The output grammar: a forced call follows the tools' grammar; else ``output`` if given, else,
        when every tool is ``strict``, each call the model opens. It applies after the reasoning
        block closes, when the prompt opens one.
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
        if images:
            text = images.substitute(text)
        in_reasoning = prompt_opens_reasoning(text)
        forced = ""
        if use_tools and tool_choice in ("required", "function"):
            if self.tool_format is None:
                raise ApiError(400, f"tool_choice {tool_choice!r} needs a known tool-call format; this model "
                                    "has none (start the server with a tool format)", param="tool_choice")
            forced = self.tool_format.call_prefix(tool_name)
        close = "\n" + CLOSE + "\n\n" if in_reasoning and (forced or prefill) else ""

        def new_parser() -> tuple[OutputParser, list]:
            tools_parser = self.tool_format.new_parser(tools) if use_tools and self.tool_format else None
            parser = OutputParser(reasoning=True, in_reasoning=in_reasoning, tools=tools_parser)
            parser.feed(close + prefill)                 # already in the prompt, not part of the answer
            return parser, parser.feed(forced)

        opens = in_reasoning and not close
        close_ids = tuple(self.tokenizer.encode(CLOSE))
        wait = (close_ids,) if opens else ()
        # a template that knows reasoning but left it neither open nor closed: the model may open it
        may_open = (not opens and not close and thinking is not False and OPEN in (self.tokenizer.chat_template or "")
                    and not text.rstrip().endswith(CLOSE) and OPEN in self._markers)
        reasoning = (self._markers[OPEN], close_ids) if may_open else None
        grammar = None
        if forced:
            named = [t for t in tools if t.get("function", t).get("name") == tool_name] if tool_name else tools
            grammar = tool_output(self.tool_format, named, prefix=forced, repeat=parallel_calls, tokens=self._markers)
        elif output is not None:
            grammar = dataclasses.replace(output, wait=wait, reasoning=reasoning)
        elif use_tools and self.tool_format and strict_tools(tools):
            call_open = self.tool_format.call_open
            opening = tool_output(self.tool_format, tools, prefix=call_open, repeat=False, tokens=self._markers)
            trigger = tuple(self.tokenizer.encode(call_open))
            grammar = dataclasses.replace(opening, wait=wait + (trigger,), rearm=trigger)
        parser, initial = new_parser()
        self.check_prompt_chars(text + close + prefill + forced)
        encoded = self.tokenizer.encode_continuing(text + close + prefill + forced, None if images else prior)
        ids, token_marks, prepared = self.with_images(list(encoded.ids), images,
                                                      _token_marks(text, encoded.ends, marks))
        return ChatPrompt(ids, parser, initial, opens_reasoning=opens, grammar=grammar, new_parser=new_parser,
                          marks=token_marks, images=tuple(prepared), encoded=None if images else encoded)

    # -- generation -------------------------------------------------------------------------------
    def request_options(self, ids: list[int], *, max_tokens: int | None, seed: int | None = None,
                        thinking_budget: int | None = None, **fields) -> RequestOptions:
        """The engine's options for a request of prompt ``ids``, built once from the parsed request:
        ``max_tokens`` (None: the server's default) clipped to the context the prompt leaves (a
        prompt that fills it: 400), a random ``seed`` when None, the server's thinking budget when
        the request names none; the engine detokenizes the output, keeping the parsers' markers
        (``KEEP``); ``fields``: the other ``RequestOptions`` fields as the request gave them
        (``temperature``, ``stop``, ``n``, ``logprobs``, ``grammar``, ``cache_marks``, ...)."""
        if len(ids) >= self.context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the server's context is {self.context}",
                           code="context_length_exceeded")
        budget = self.context - len(ids)
        return RequestOptions(
            max_new_tokens=min(self.default_max_tokens if max_tokens is None else max_tokens, budget),
            seed=random.getrandbits(31) if seed is None else seed,
            thinking_budget=self.thinking_budget if thinking_budget is None else thinking_budget,
            detokenize=True, keep_special=self._keep, **fields)

    async def start(self, ids: list[int], options: RequestOptions, **kwargs) -> Job:
        """``start_choices`` for one choice."""
        return (await self.start_choices(ids, options, **kwargs))[0]

    async def start_choices(self, ids: list[int], options: RequestOptions, *, images: Sequence = (),
                            prompt_param: str = "prompt", request=None) -> list[Job]:
        """``submit_choices`` then ``admitted``: the request's jobs once they hold batch rows."""
        jobs = await self.submit_choices(ids, options, images=images, prompt_param=prompt_param)
        await self.admitted(jobs, request)
        return jobs

    async def submit_choices(self, ids: list[int], options: RequestOptions, *, images: Sequence = (),
                             prompt_param: str = "prompt") -> list[Job]:
        """Submit a request (prompt ``ids``, ``options`` from ``request_options``, passed on
        unchanged): 429 / 503 from the queue; 400 for what the engine refuses (its check of the options
        and of the prompt's ids, named ``prompt_param``). ``options.n`` choices: the prompt prefilled
        once, a job each; ``options.grammar``: a matcher per choice, compiled here in a worker thread;
        ``images``: the prompt's ``ImageInput``s (``ChatPrompt.images``), in prompt order."""
        constraints = None
        if options.grammar is not None:
            constraints = await self.compile_grammar(options.grammar, options.n)
        try:
            return self.engine.submit_choices(ids, options, constraints=constraints, images=tuple(images))
        except TokenIdError as e:                # the prompt's ids, checked by the engine
            raise ApiError(400, e.named(prompt_param), param=prompt_param) from None
        except ValueError as e:                  # the engine's own checks of a request
            raise ApiError(400, str(e)) from None

    async def compile_grammar(self, grammar: OutputGrammar, n: int) -> list:
        """``n`` constraints of ``grammar`` (``Generator.constraints``: compiled once), compiled on
        the server's grammar threads (``GRAMMAR_THREADS``, so hostile grammars cannot take the threads
        that tokenize and render): 400 naming ``grammar.source`` if it is refused or takes longer than
        ``GRAMMAR_COMPILE_S`` (a compile still queued then is dropped; one running ends on its own,
        bounded by the grammar size cap and llguidance's limits)."""
        future = _GRAMMAR_POOL.submit(self.engine.generator.constraints, grammar, n)
        where = grammar.source or "the output grammar"
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), GRAMMAR_COMPILE_S)
        except TimeoutError:
            raise ApiError(400, f"{where}: the grammar took longer than {GRAMMAR_COMPILE_S:g} s to compile; "
                                "simplify it", param=grammar.source) from None
        except ValueError as e:
            raise ApiError(400, f"{where}: {e}", param=grammar.source) from None
        finally:
            future.cancel()                      # a compile not started yet (the client left, a timeout)

    async def admitted(self, jobs: list[Job], request=None) -> None:
        """Wait until every job holds a batch row (or finished while waiting): 503 after the queue
        timeout; 400 for a request the engine can never fit; 499 if ``request``'s client goes away
        meanwhile (checked every ``POLL_S``). Any way out but success cancels every job, the waiting
        ones included, so nothing runs for a request that was not answered."""
        waiting = asyncio.gather(*(job.admitted() for job in jobs))
        try:
            while not (await asyncio.wait({waiting}, timeout=POLL_S))[0]:
                if request is not None and await request.is_disconnected():
                    raise ApiError(499, "the client closed the connection while the request waited",
                                   code="client_closed")
            waiting.result()
        except BaseException:
            waiting.cancel()
            for job in jobs:
                job.cancel()
            raise
        for job in jobs:
            if not job.admitted_to_row and (job.error or job.req.finish_reason == "error"):
                for other in jobs:
                    other.cancel()
                if job.error:                    # the server ended it (engine down, shutting down)
                    raise ApiError(job.error_status, job.error)
                status = job.req.stats.get("error_status", 400)
                prefix = "the request cannot be served" if status < 500 else "the engine failed on this request"
                raise ApiError(status, f"{prefix}: {job.req.stats.get('error', 'engine error')}")

    async def events(self, job: Job, parser: OutputParser, initial: list = (),
                     tick: float | None = None) -> AsyncIterator:
        """Answer events of ``job`` (the text the engine decoded, through ``parser``) as they come,
        ``KEEPALIVE`` after ``tick`` s (default: the keep-alive interval) without any (no tokens, or
        tokens that produce no output yet, such as a buffered tool-call value or a possible start
        of a stop string), then a ``Finish``. Leaving early cancels the request."""
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
                    try:
                        records, events, done = self._render(job, item, parser, scored)
                    except Exception as e:    # a bug in rendering this output: this request fails, in band
                        log.exception("rendering a request's output failed")
                        job.cancel()
                        yield Finish("error", len(job.req.prompt), job.received,
                                     error=f"the server failed to render the output: {type(e).__name__}: {e}")
                        return
                    if records:
                        yield Logprobs(records)
                        scored += len(records)
                    for e in events:
                        tool_calls |= isinstance(e, ToolCallStart)
                        yield e
                    if done:
                        yield self._finish(job, tool_calls)
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
    def _render(job: Job, item: tuple, parser: OutputParser, scored: int):
        """What ``job.next`` gave (``item``: tokens, their text, done) as (new logprob records,
        answer events, done)."""
        _, text, done = item
        records = job.logprobs[scored:]
        return records, coalesce(parser.feed(text) + (parser.flush() if done else [])), done

    @staticmethod
    def _finish(job: Job, tool_calls: bool) -> Finish:
        req = job.req
        cached = int(req.stats.get("cached_tokens", 0))
        written = max(0, max(req.options.cache_marks, default=0) - cached)
        finish = Finish("stop", len(req.prompt), job.received, cached, written, tool_calls=tool_calls)
        if req.finish_reason == "stop" and req.stats.get("stop_sequence") is not None:
            return dataclasses.replace(finish, stop_sequence=req.stats["stop_sequence"])
        if job.error:
            return dataclasses.replace(finish, reason="error", error=job.error, error_status=job.error_status)
        if job.finish_reason == "error":
            return dataclasses.replace(finish, reason="error", error=req.stats.get("error"),
                                       error_status=req.stats.get("error_status", 500),
                                       grammar_error=req.constraint is not None and req.constraint.error is not None)
        return dataclasses.replace(finish, reason="length" if job.finish_reason == "length" else "stop")


async def collect_finished(events: AsyncIterator, request, job,
                           choice_errors: bool = False) -> tuple[list, Finish] | None:
    """A non-streaming request's events and its Finish, the job cancelled once collected; None if
    the client went away. A generation error is an ``ApiError`` with its status, except, with
    ``choice_errors``, a choice's own (``choice_error``: its output grammar hit a limit), which is
    returned as that choice's Finish (reason "error") while the other choices stand."""
    try:
        out, finish = await collect(events, request)
    finally:
        job.cancel()
    if finish is None:
        return None
    if finish.reason == "error" and not (choice_errors and choice_error(finish)):
        raise ApiError(finish.error_status, finish.error or "generation failed")
    return out, finish


def choice_error(finish: Finish) -> bool:
    """The error belongs to one choice (its output grammar hit a limit mid-output), not to the
    request or the server: OpenAI's surfaces end that choice with finish_reason "error"."""
    return finish.reason == "error" and finish.grammar_error


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


_END = object()


async def guarded(stream: AsyncIterator, error_event: Callable[[str], object]) -> AsyncIterator:
    """The items of a response stream; if it raises, one ``error_event(message)`` ends it instead
    of a connection cut without a word (a server bug stays an in-band error of that request)."""
    try:
        async for item in stream:
            yield item
    except Exception as e:
        log.exception("a response stream failed")
        yield error_event(f"internal error: {type(e).__name__}: {e}")


async def merge_events(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, event) from several event streams as they come (one per choice); keep-alives of
    several streams at once are passed on once. Leaving early closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for e in stream:
                await queue.put((i, e))
        finally:
            await queue.put((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left, quiet = len(streams), False
        while left:
            i, e = await queue.get()
            if e is _END:
                left -= 1
            elif e is KEEPALIVE:
                if not quiet:
                    yield i, e
                quiet = True
            else:
                quiet = False
                yield i, e
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # each stream's own cleanup runs


async def collect_choices(streams: list[AsyncIterator], request, jobs: list) -> list[tuple[list, Finish]] | None:
    """``collect_finished`` for each choice, concurrently (``choice_errors``: OpenAI's choices); None
    if the client went away."""
    results = await asyncio.gather(*(collect_finished(s, request, j, True) for s, j in zip(streams, jobs)))
    if any(r is None for r in results):
        for job in jobs:
            job.cancel()
        return None
    return list(results)
