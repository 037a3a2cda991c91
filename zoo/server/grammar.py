"""Output grammars for structured outputs, as llguidance grammar strings.

What a request can ask for, and the grammar made of it:

    json_object                    any JSON object
    json_schema (+ strict)         JSON valid against the schema (strict: unknown keywords are errors;
                                   otherwise ignored, as OpenAI's non-strict mode)
    regex                          text matching the (Rust ``regex``) expression
    grammar                        a Lark grammar (llguidance's dialect) or GBNF (llama.cpp's)
    choice                         exactly one of a list of strings
    tool calls                     the model's native tool-call text for the named tool(s), each
                                   argument value valid against the tool's JSON schema

JSON is written as Python's ``json.dumps`` writes it (``", "`` and ``": "`` separators, no other
whitespace): finite, and what models write themselves. Every builder raises ``GrammarError`` with
the grammar compiler's message for a grammar it cannot compile (the server's 400).

Sizes, checked before anything compiles (``check_size``; the server's 400): a grammar's text at most
``MAX_GRAMMAR_BYTES``, a choice list at most ``MAX_CHOICES`` options. Measured with llguidance 1.9.1
on a 2-core CPU, compiles near the cap take about a second; ten times over it (10,000 JSON
properties, a 50,000-way Lark rule) took 10-60 s each and then failed on a limit. The server then
compiles each request's grammar once, under ``zoo.engine.constraint.LIMITS``.

Tool calls (``tool_call_grammar``) are written in a ``zoo.text.tool_calls.ToolCallFormat``: its
call opening, each argument's framing and its closing (the format's attributes), so every format
the parsers read has its grammar.

A string-typed value is raw text (no quotes, no ``<``); an ``enum`` / ``const`` of strings is one
of those strings; any other value is JSON constrained by its sub-schema (llguidance's inline
``%json``). Arguments come in the schema's property order: the required ones always, the others
optionally. ``prefix``: the part of the first call already in the prompt (a forced call opening),
which the grammar then starts after.
"""

from __future__ import annotations

import json

import llguidance

from zoo.engine.constraint import LIMITS
from zoo.text.tool_calls import ToolCallFormat, tool_call_format

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_GRAMMAR_BYTES = 128 * 1024     # a grammar's text (a schema's, a regex's, a Lark grammar's, tools')
MAX_CHOICES = 1000                 # options of a choice constraint (llguidance: 2000 items per grammar row)


class GrammarError(ValueError):
    """A grammar, schema or regex that does not compile; the message names the problem."""


def check_size(grammar: str, what: str = "grammar") -> str:
    """``grammar`` if its text is within ``MAX_GRAMMAR_BYTES``, else ``GrammarError``."""
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what}: the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES} (make the schema, "
                           "regex or grammar smaller)")
    return grammar


def check(grammar: str, tokenizer: llguidance.LLTokenizer | None = None, what: str = "grammar") -> str:
    """``grammar`` if llguidance compiles it (with ``tokenizer``), else ``GrammarError``."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{what}: {error.strip()}")
    return grammar


def json_schema(schema: dict | bool, *, strict: bool = False) -> str:
    """Grammar of JSON valid against ``schema``."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
    options = {**JSON_STYLE, "lenient": not strict}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"json_schema: {e}") from None


def json_object() -> str:
    return json_schema({"type": "object"})


def regex(pattern: str) -> str:
    if not isinstance(pattern, str):
        raise GrammarError("regex: expected a string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect) or a GBNF one (converted)."""
    if not isinstance(text, str):
        raise GrammarError("grammar: expected a string")
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise GrammarError(f"grammar: {e}") from None


def choice(options: list) -> str:
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("choice: expected a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise GrammarError(f"choice: {len(options)} options; at most {MAX_CHOICES}")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))


# -- tool calls -------------------------------------------------------------------------------------
def _literal(text: str, tokens: dict[str, int] | None = None) -> str:
    """Lark for ``text``: a string literal, with each marker of ``tokens`` (text -> token id) in it
    written as that token (``<[id]>``: the model's own marker token, not its spelling in bytes)."""
    parts, rest = [], text
    while rest:
        hits = [(rest.find(m), m) for m in tokens or {} if m in rest]
        if not hits:
            parts.append(json.dumps(rest, ensure_ascii=False))
            break
        at, marker = min(hits)
        if at:
            parts.append(json.dumps(rest[:at], ensure_ascii=False))
        parts.append(f"<[{tokens[marker]}]>")
        rest = rest[at + len(marker):]
    return " ".join(parts) or '""'


def _value(schema: dict, frame: str) -> tuple[str, bool]:
    """Lark expression for one argument value (see the module doc), and whether it is raw text
    (which may end in the format's ``frame``: the lexer takes the longest match, so a raw value
    followed by a literal starting with the frame would swallow it; the parser strips it)."""
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if options is not None and all(isinstance(o, str) for o in options):
        return "(" + " | ".join(_literal(o) for o in options) + ")", False
    if schema.get("type") == "string":
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is None and high is None:
            return "/[^<]*/", True
        tail = "(?:%s)?" % frame.encode("unicode_escape").decode() if frame else ""
        return "/[^<]{%d,%s}%s/" % (low or 0, "" if high is None else high, tail), True
    return "%json " + json.dumps(schema), False


def _call(fmt: ToolCallFormat, name: str, parameters: dict) -> tuple[str, list[tuple[str, str, str, str]]]:
    """A call's opening text and its arguments as (text before, value expression, text after,
    "" for a required argument or "?")."""
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    args = []
    for key, sub in props.items():
        value, raw = _value(sub if isinstance(sub, dict) else {}, fmt.frame)
        head, tail = fmt.argument(key, raw)
        args.append((head, value, tail, "" if key in required else "?"))
    return fmt.opening(name), args


def tool_call_grammar(fmt: ToolCallFormat | str, tools: list[dict], *, prefix: str = "", repeat: bool = True,
                      tokens: dict[str, int] | None = None) -> str:
    """Grammar of tool calls of ``tools`` (OpenAI function tools) in format ``fmt`` (a
    ``ToolCallFormat`` or its name; see the module doc); ``prefix``: text of the first call already
    written; ``repeat``: more calls may follow; ``tokens``: marker text -> the model's token id for it
    (markers written as those tokens)."""
    if not isinstance(fmt, ToolCallFormat):
        try:
            fmt = tool_call_format(fmt)
        except ValueError as e:
            raise GrammarError(f"tool calls: {e}") from None
    closing = fmt.call_close
    rules, calls, firsts = [], [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        opening, args = _call(fmt, fn.get("name") or "", fn.get("parameters") or {})
        body = " ".join(f"({_literal(h, tokens)} {v} {_literal(t, tokens)}){o}" for h, v, t, o in args)
        rules.append(f"args_{i}: {body or chr(34) * 2} {_literal(closing, tokens)}")
        calls.append(f"{_literal(opening, tokens)} args_{i}")
        if opening.startswith(prefix):
            rest = opening[len(prefix):]
            firsts.append((_literal(rest, tokens) + " " if rest else "") + f"args_{i}")
    if not firsts:
        raise GrammarError(f"tool calls: no tool's call starts with {prefix!r}")
    more = ' ("\\n"? call)*' if repeat else ""
    text = f"start: first{more}\nfirst: {' | '.join(firsts)}\ncall: {' | '.join(calls)}\n" + "\n".join(rules)
    return llguidance.LLMatcher.grammar_from_lark(text)
