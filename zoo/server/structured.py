"""Structured-output fields of a request -> the grammar of its output (``zoo.server.grammar``).

Fields read (any API surface; at most one of them per request, else 400):

    response_format    {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
                       "schema", "strict"}}   (chat, completions; the Responses API's
                       ``text.format`` is the same with the json_schema fields inline)
    structured_outputs {"json": schema | "regex": str | "grammar": Lark/GBNF | "choice": [str]}
                       (zoo extension, vLLM's shape)
    guided_json, guided_regex, guided_grammar, guided_choice
                       (zoo extension, vLLM's older fields, as many clients still send them)

Tool calls are constrained by ``tool_output`` when ``tool_choice`` forces a call (``required``, a
named function) or, in ``auto`` mode, for each call the model opens if every tool is ``strict``.

Each result is an ``OutputGrammar`` whose ``source`` names the field. Here a bad value, or a grammar
over the size cap (``zoo.server.grammar.check_size``), is an ``ApiError`` 400 naming the field; the
grammar compiles once, when the request is submitted (``Service.compile_grammar``), where what
llguidance refuses is a 400 naming the same field.
"""

from __future__ import annotations

import json

from zoo.engine.constraint import OutputGrammar
from zoo.server import grammar as G
from zoo.server.validation import ApiError
from zoo.text.tool_calls import ToolCallFormat

EXTENSIONS = ("structured_outputs", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
_KINDS = {"json": "json", "regex": "regex", "grammar": "grammar", "choice": "choice", "json_object": "json_object"}


def _build(kind: str, value, where: str, strict: bool = False) -> OutputGrammar:
    """The grammar of one constraint field, its size checked (400 naming ``where``)."""
    try:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise G.GrammarError("json_schema: not valid JSON") from None
            grammar = G.json_schema(value, strict=strict)
        elif kind == "json_object":
            grammar = G.json_object()
        elif kind == "regex":
            grammar = G.regex(value)
        elif kind == "grammar":
            grammar = G.lark(value)
        else:
            grammar = G.choice(value)
        return OutputGrammar(G.check_size(grammar), source=where)
    except G.GrammarError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None


def response_format_grammar(fmt, where: str = "response_format") -> OutputGrammar | None:
    """The grammar of an OpenAI ``response_format`` (or Responses ``text.format``); None for text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, f"{where}: expected an object", param=where)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("json_object", None, where)
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, f"{where}.json_schema.schema: missing", param=f"{where}.json_schema")
        return _build("json", spec["schema"], f"{where}.json_schema.schema", strict=bool(spec.get("strict")))
    raise ApiError(400, f"{where}.type: expected text, json_object or json_schema, got {kind!r}", param=where)


def extension_grammar(fields: dict) -> tuple[str, OutputGrammar] | None:
    """(field name, grammar) from the extension fields present in ``fields``; None if none is."""
    found = []
    so = fields.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "structured_outputs: expected an object", param="structured_outputs")
        keys = [k for k in so if k in _KINDS and so[k] not in (None, False)]
        if len(keys) != 1:
            raise ApiError(400, "structured_outputs: give exactly one of json, regex, grammar, choice",
                           param="structured_outputs")
        found.append((f"structured_outputs.{keys[0]}", _KINDS[keys[0]], so[keys[0]]))
    for name in EXTENSIONS[1:]:
        if fields.get(name) is not None:
            found.append((name, name.removeprefix("guided_"), fields[name]))
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(400, f"{found[0][0]} and {found[1][0]}: give one output constraint", param=found[1][0])
    where, kind, value = found[0]
    return where, _build(kind, value, where)


def request_grammar(response_format, fields: dict, where: str = "response_format") -> OutputGrammar | None:
    """The output grammar a request asks for, from ``response_format`` or an extension field."""
    main = response_format_grammar(response_format, where)
    ext = extension_grammar(fields)
    if main is not None and ext is not None:
        raise ApiError(400, f"{where} and {ext[0]}: give one output constraint", param=ext[0])
    return main if ext is None else ext[1]


def strict_tools(tools: list[dict] | None) -> bool:
    """Every tool is a function marked ``strict``."""
    return bool(tools) and all(bool(t.get("function", t).get("strict")) for t in tools)


def marker_tokens(tokenizer, markers) -> dict[str, int]:
    """Marker text -> token id, for the markers the tokenizer has as one token."""
    return {m: ids[0] for m in markers if len(ids := tokenizer.encode(m)) == 1}


def tool_output(fmt: ToolCallFormat | str, tools: list[dict], *, prefix: str = "", repeat: bool = True,
                tokens: dict[str, int] | None = None) -> OutputGrammar:
    """The grammar of the tool calls that follow ``prefix`` (``repeat``: more calls may follow the
    first; ``tokens``: ``marker_tokens``); 400 if a tool's schema does not compile."""
    try:
        grammar = G.tool_call_grammar(fmt, tools, prefix=prefix, repeat=repeat, tokens=tokens)
        return OutputGrammar(G.check_size(grammar, "tools"), source="tools")
    except G.GrammarError as e:
        raise ApiError(400, f"tools: {e}", param="tools") from None
