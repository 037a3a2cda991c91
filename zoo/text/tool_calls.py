"""Incremental parsers for the models' native tool-call formats, into OpenAI-style tool calls.

    Qwen3.x (XML style)   <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
                          </function>\\n</tool_call>     (a JSON body {"name", "arguments"}, the older
                          Qwen/Hermes form, is accepted too)
    GLM                   <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>
                          (whitespace between the elements is allowed)

A parser takes the answer text (reasoning already split off) in pieces split anywhere, even inside
a marker, and returns events: ``Text`` for text outside calls, ``ToolCallStart`` once a call's name
is complete, ``ToolCallArgs`` with the next piece of the call's JSON arguments, ``ToolCallEnd``.
String values stream as they arrive; other values (typed by the tool's JSON schema) are converted
when complete. The concatenated argument pieces are exactly ``json.dumps(arguments)``, whatever
the split. Whitespace next to a tool call is layout and is dropped.

Each format is one ``ToolCallFormat`` (``FORMATS``, by name; ``tool_call_format(name)``): its
parser, the chat-template markers that reveal it (``detect_format``), and how a call is written
(its opening for a forced call, each argument's framing, its closing: what the server's tool-call
grammar emits). The architecture table names each model's format by its key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from zoo.text.reasoning_parser import Text, partial_suffix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


def _find(buf: str, markers) -> tuple[int, str | None]:
    """(position, marker) of the earliest marker in ``buf``; else (how much of ``buf`` cannot be the
    start of a marker, None)."""
    hits = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
    if hits:
        return min(hits)
    return len(buf) - partial_suffix(buf, markers), None


class _Arguments:
    """Writes one call's arguments as JSON pieces: ``key()``, ``chunk()``*, ``end_value()``, ``close()``."""

    def __init__(self, properties: dict):
        self.properties = properties
        self.count = 0
        self.streaming = False
        self.pending = ""

    def key(self, name: str) -> str:
        schema = self.properties.get(name) if isinstance(self.properties, dict) else None
        types = schema.get("type", "string") if isinstance(schema, dict) else "string"   # `true`: any value
        types = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)] \
            if isinstance(types, list) else ["string"]
        self.streaming = not types or types == ["string"]
        self.pending = ""
        head = ("{" if self.count == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self.count += 1
        return head + ('"' if self.streaming else "")

    def chunk(self, text: str) -> str:
        if self.streaming:
            return json.dumps(text, ensure_ascii=False)[1:-1]
        self.pending += text
        return ""

    def end_value(self) -> str:
        if self.streaming:
            return '"'
        try:
            value = json.loads(self.pending)
        except ValueError:
            value = self.pending
        return json.dumps(value, ensure_ascii=False)

    def close(self) -> str:
        return "}" if self.count else "{}"


class ToolParser:
    """Base: the text outside calls, call bookkeeping and the shared scanning loop.

    Subclasses implement ``_step(out) -> bool`` for the states inside a call: consume what they can
    from ``self._buf`` and return False when they need more text.
    """

    MARKERS: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self._schemas = {}
        for tool in tools or []:
            fn = tool.get("function", tool)
            self._schemas[fn.get("name")] = (fn.get("parameters") or {}).get("properties") or {}
        self._buf = ""
        self._state = "text"
        self._strip = False           # drop whitespace after a call
        self._space = ""              # whitespace held back: dropped if a call follows
        self._index = -1
        self._args: _Arguments | None = None

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while self._buf and (self._text_step(out) if self._state == "text" else self._step(out)):
            pass
        return out

    def flush(self) -> list:
        """End of output: text held back is emitted; an unfinished call is closed with what it has."""
        out: list = []
        if self._state == "text":
            body = (self._space + self._buf).rstrip()
            body = body.lstrip() if self._strip else body
            if body:
                out.append(Text(body))
        else:
            self._flush_call(out)
        self._buf = self._space = ""
        return out

    # -- text outside calls ----------------------------------------------------------------------
    def _text_step(self, out: list) -> bool:
        if self._strip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip = False
        pos, marker = _find(self._buf, (CALL_OPEN,))
        text = self._buf[:pos]
        body = text.rstrip()
        if body:
            out.append(Text(self._space + body))
            self._space = ""
        if marker:
            self._space, self._buf, self._state = "", self._buf[pos + len(marker):], "call"
            return True
        self._space += text[len(body):]
        self._buf = self._buf[pos:]
        return False

    # -- calls ------------------------------------------------------------------------------------
    def _start(self, out: list, name: str) -> None:
        self._index += 1
        self._args = _Arguments(self._schemas.get(name, {}))
        out.append(ToolCallStart(self._index, name))

    def _emit(self, out: list, piece: str) -> None:
        if piece:
            out.append(ToolCallArgs(self._index, piece))

    def _end(self, out: list) -> None:
        self._emit(out, self._args.close())
        out.append(ToolCallEnd(self._index))
        self._args = None
        self._state, self._strip = "text", True

    def _step(self, out: list) -> bool:
        raise NotImplementedError

    def _flush_call(self, out: list) -> None:
        raise NotImplementedError


class QwenToolParser(ToolParser):
    """Qwen3.x: ``<function=NAME>`` with ``<parameter=KEY>`` blocks (values framed by newlines)."""

    MARKERS = (CALL_OPEN, CALL_CLOSE)
    FUNC, FUNC_CLOSE, PARAM, PARAM_CLOSE = "<function=", "</function>", "<parameter=", "</parameter>"

    def _step(self, out: list) -> bool:
        buf = self._buf
        if self._state == "call":                       # after <tool_call>: XML or JSON body
            head = buf.lstrip()
            if head.startswith(self.FUNC):
                self._buf, self._state = head[len(self.FUNC):], "name"
                return True
            if head.startswith("{"):
                self._buf, self._state = head, "json"
                return True
            if not head or self.FUNC.startswith(head):
                return False
            self._buf, self._state = head, "json"      # not a call we know: keep it, report as text
            return True
        if self._state == "name":
            end = buf.find(">")
            if end < 0:
                return False
            self._start(out, buf[:end].strip())
            self._buf, self._state = buf[end + 1:], "body"
            return True
        if self._state == "body":                       # between parameters
            pos, marker = _find(buf, (self.PARAM, self.FUNC_CLOSE, CALL_CLOSE))
            if marker is None:
                self._buf = buf[pos:]
                return False
            self._buf = buf[pos + len(marker):]
            if marker == self.PARAM:
                self._state = "key"
            elif marker == self.FUNC_CLOSE:
                self._state = "after"
            else:
                self._end(out)
            return True
        if self._state == "key":
            end = buf.find(">")
            if end < 0:
                return False
            self._emit(out, self._args.key(buf[:end].strip()))
            self._buf, self._state = buf[end + 1:], "value_start"
            return True
        if self._state == "value_start":                # the newline after <parameter=KEY>
            self._buf, self._state = (buf[1:] if buf.startswith("\n") else buf), "value"
            return True
        if self._state == "value":
            pos, marker = _find(buf, (self.PARAM_CLOSE, self.FUNC_CLOSE, CALL_CLOSE))
            if marker is None:
                text = buf[:pos]
                text = text[:-1] if text.endswith("\n") else text     # maybe the framing newline
                self._emit(out, self._args.chunk(text))
                self._buf = buf[len(text):]
                return False
            value = buf[:pos]
            self._emit(out, self._args.chunk(value[:-1] if value.endswith("\n") else value))
            self._emit(out, self._args.end_value())
            self._buf = buf[pos + len(marker):]
            if marker == self.PARAM_CLOSE:
                self._state = "body"
            elif marker == self.FUNC_CLOSE:
                self._state = "after"
            else:
                self._end(out)
            return True
        if self._state == "after":                      # after </function>
            pos, marker = _find(buf, (CALL_CLOSE,))
            self._buf = buf[pos + len(marker):] if marker else buf[pos:]
            if marker:
                self._end(out)
            return bool(marker)
        return self._json_step(out)

    def _json_step(self, out: list) -> bool:
        pos, marker = _find(self._buf, (CALL_CLOSE,))
        if marker is None:
            return False
        body, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError(body)
        except (ValueError, KeyError, TypeError):
            out.append(Text(CALL_OPEN + body + CALL_CLOSE))
            self._state, self._strip = "text", True
            return True
        self._start(out, name)
        self._emit(out, json.dumps(arguments, ensure_ascii=False))
        out.append(ToolCallEnd(self._index))
        self._args, self._state, self._strip = None, "text", True
        return True

    def _flush_call(self, out: list) -> None:
        if self._state in ("call", "json"):
            if (CALL_OPEN + self._buf).strip():
                out.append(Text(CALL_OPEN + self._buf))
            return
        if self._state == "name":
            self._start(out, self._buf.strip())
        elif self._state == "key":
            self._emit(out, self._args.key(self._buf.strip()))
            self._emit(out, self._args.end_value())
        elif self._state in ("value_start", "value"):
            tail = self._buf[1:] if self._state == "value_start" and self._buf.startswith("\n") else self._buf
            self._emit(out, self._args.chunk(tail.removesuffix("\n")))
            self._emit(out, self._args.end_value())
        self._end(out)


class GlmToolParser(ToolParser):
    """GLM: ``NAME`` then ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` pairs."""

    KEY, KEY_CLOSE, VALUE, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    MARKERS = (CALL_OPEN, CALL_CLOSE, KEY, KEY_CLOSE, VALUE, VALUE_CLOSE)

    def _step(self, out: list) -> bool:
        buf = self._buf
        if self._state == "call":                       # the name: up to a newline or the first tag
            pos, marker = _find(buf, ("\n", self.KEY, CALL_CLOSE))
            name = buf[:pos].strip()
            if marker is None or (marker == "\n" and not name):
                if marker == "\n":
                    self._buf = buf[pos + 1:]
                return marker is not None
            self._start(out, name)
            self._buf, self._state = buf[pos:], "args"
            return True
        if self._state == "args":                       # between key/value pairs
            pos, marker = _find(buf, (self.KEY, CALL_CLOSE))
            if marker is None:
                self._buf = buf[pos:]
                return False
            self._buf = buf[pos + len(marker):]
            if marker == self.KEY:
                self._state = "key"
            else:
                self._end(out)
            return True
        if self._state == "key":
            pos, marker = _find(buf, (self.KEY_CLOSE,))
            if marker is None:
                return False
            self._emit(out, self._args.key(buf[:pos].strip()))
            self._buf, self._state = buf[pos + len(marker):], "before_value"
            return True
        if self._state == "before_value":
            pos, marker = _find(buf, (self.VALUE, CALL_CLOSE))
            if marker is None:
                self._buf = buf[pos:]
                return False
            self._buf = buf[pos + len(marker):]
            if marker == self.VALUE:
                self._state = "value"
            else:
                self._emit(out, self._args.end_value())
                self._end(out)
            return True
        # value
        pos, marker = _find(buf, (self.VALUE_CLOSE, CALL_CLOSE))
        self._emit(out, self._args.chunk(buf[:pos]))
        self._buf = buf[pos + len(marker):] if marker else buf[pos:]
        if marker is None:
            return False
        self._emit(out, self._args.end_value())
        if marker == self.VALUE_CLOSE:
            self._state = "args"
        else:
            self._end(out)
        return True

    def _flush_call(self, out: list) -> None:
        if self._state == "call":
            self._start(out, self._buf.strip())
        elif self._state == "key":
            self._emit(out, self._args.key(self._buf.strip()))
            self._emit(out, self._args.end_value())
        elif self._state == "before_value":
            self._emit(out, self._args.end_value())
        elif self._state == "value":
            self._emit(out, self._args.chunk(self._buf))
            self._emit(out, self._args.end_value())
        self._end(out)


@dataclass(frozen=True)
class ToolCallFormat:
    """One native tool-call syntax. A call is written

        call_open + name_open + NAME + name_close
        (key_open + KEY + key_close + frame + VALUE + frame + value_close) per argument
        call_close

    name              the format's key in ``FORMATS`` (the architecture table's ``tool_format``)
    parser            the ``ToolParser`` subclass that reads it
    template_markers  text whose presence in a chat template reveals the format (``detect_format``)
    frame             the text framing each value on both sides ("\\n" for Qwen, "" for none): the
                      parser strips it, and a raw (string) value the grammar writes may end in it
                      itself (the lexer takes the longest match), so a raw value's closing frame is
                      left to the value
    """

    name: str
    parser: type[ToolParser]
    template_markers: tuple[str, ...]
    call_open: str
    name_open: str
    name_close: str
    key_open: str
    key_close: str
    value_close: str
    call_close: str
    frame: str = ""

    @property
    def markers(self) -> tuple[str, ...]:
        """The markers the parser reads (a tokenizer's special tokens that must stay text)."""
        return self.parser.MARKERS

    def new_parser(self, tools: list[dict] | None = None) -> ToolParser:
        """A parser of this format for a request's ``tools`` (OpenAI function tools)."""
        return self.parser(tools)

    def opening(self, name: str) -> str:
        """The text of a call of function ``name`` before its first argument."""
        return self.call_open + self.name_open + name + self.name_close

    def call_prefix(self, name: str | None = None) -> str:
        """The text that opens a forced call: ``opening(name)`` when ``name`` is given, else up to
        where the function name goes."""
        return self.opening(name) if name else self.call_open + self.name_open

    def argument(self, key: str, raw: bool) -> tuple[str, str]:
        """``(text before, text after)`` one argument's value; ``raw``: the value is raw text that
        writes its own closing frame."""
        return (self.key_open + key + self.key_close + self.frame,
                ("" if raw else self.frame) + self.value_close)


QWEN = ToolCallFormat(
    "qwen", QwenToolParser, template_markers=(QwenToolParser.FUNC, QwenToolParser.PARAM),
    call_open=CALL_OPEN, name_open="\n" + QwenToolParser.FUNC, name_close=">\n",
    key_open=QwenToolParser.PARAM, key_close=">", value_close=QwenToolParser.PARAM_CLOSE + "\n",
    call_close=QwenToolParser.FUNC_CLOSE + "\n" + CALL_CLOSE, frame="\n")
GLM = ToolCallFormat(
    "glm", GlmToolParser, template_markers=(GlmToolParser.KEY,),
    call_open=CALL_OPEN, name_open="", name_close="",
    key_open=GlmToolParser.KEY, key_close=GlmToolParser.KEY_CLOSE + GlmToolParser.VALUE,
    value_close=GlmToolParser.VALUE_CLOSE, call_close=CALL_CLOSE)
# detect_format tries them in this order (GLM's ``<arg_key>`` is the more specific marker)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (GLM, QWEN)}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(FORMATS))}") from None


def detect_format(chat_template: str | None) -> str | None:
    """The name of the tool-call format a chat template writes, from its markers (None: it shows none)."""
    template = chat_template or ""
    return next((f.name for f in FORMATS.values() if any(m in template for m in f.template_markers)), None)
