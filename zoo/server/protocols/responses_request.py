"""An OpenAI Responses request (``POST /v1/responses``), validated and turned into a chat-template
prompt, as Codex CLI and the ``openai`` SDK send it.

    instructions                 the leading system message (not carried over by previous_response_id)
    input                        a string (one user message) or items:
      message                    role developer / system (system text, ``service.fold_system_messages``),
                                 user, assistant; content a string or input_text / output_text parts;
                                 a user message also input_image parts (``image_url``: a data: URL,
                                 or http(s) where the server allows it; ``file_id``: a 400)
      function_call              an assistant tool call (``arguments``: a JSON object as a string)
      function_call_output       a tool result (its output may hold input_image parts too)
      reasoning                  the reasoning of the assistant turn that follows it (its
                                 reasoning_text content, else its summary)
    tools                        function tools, and the function tools of ``namespace`` tools (a
                                 call of one names its namespace); hosted tools (web_search, ...) and
                                 custom (free-form) tools are not run here and are left out
    tool_choice                  auto / none / required / {"type": "function", "name"}
    reasoning                    effort (none / minimal: thinking off; else the template's
                                 reasoning_effort), summary (the reasoning is also the summary)
    max_output_tokens, temperature, top_p, stream, store, previous_response_id, parallel_tool_calls,
    include ("message.output_text.logprobs": logprobs, ``top_logprobs`` alternatives each; other
    values are ignored), top_logprobs, prompt_cache_key, metadata, text (format "text" only)

Unknown fields are ignored; a malformed known field, an unknown item type, or content this server
cannot take (files, audio; images for a text-only model) is a 400 naming it. Known fields are strict
(``zoo.server.validation.Body``: ``1.0`` or ``true`` is no integer) and bounded: ``max_output_tokens``
1..2**31-1, ``top_logprobs`` 0..20, ``temperature`` 0..2, ``top_p`` (0, 1]; a function tool's
``parameters`` must be a valid JSON Schema (the 400 names the tool), a tool's ``name`` match
``^[a-zA-Z0-9_-]{1,64}$``.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zoo.engine.logprobs import MAX_TOP
from zoo.server.service import content_text as _text
from zoo.server.service import fold_system_messages
from zoo.server.validation import ApiError, Body, MaxTokens, ToolName, check_json_schema, validation_error

EFFORT_OFF = ("none", "minimal")       # reasoning efforts that turn thinking off
SUMMARIES = ("auto", "concise", "detailed")


class _Body(Body):
    pass


class FunctionTool(_Body):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict | None = None         # a JSON Schema (checked), or None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, value, info: ValidationInfo):
        return None if value is None else check_json_schema(value, f"tool {info.data.get('name')!r}")


class NamespaceTool(_Body):
    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[dict]


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class TextFormat(_Body):
    """``{"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}`` (the
    json_schema fields are kept as given, their types checked)."""
    model_config = ConfigDict(extra="allow")
    type: str = "text"

    @model_validator(mode="after")
    def _typed_extras(self):
        for name, kind, label in (("name", str, "a string"), ("strict", bool, "a boolean"),
                                  ("description", str, "a string")):
            value = (self.model_extra or {}).get(name)
            if value is not None and not isinstance(value, kind):
                raise PydanticCustomError("format_field", "{name}: expected {label}", {"name": name, "label": label})
        return self


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512     # OpenAI's documented limits


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """``metadata`` within OpenAI's limits: at most 16 pairs, keys of at most 64 characters, values
    of at most 512 (more is a 400 naming the limit; the store keeps what it is given)."""
    if value is None:
        return None
    if len(value) > METADATA_KEYS:
        raise PydanticCustomError("metadata", "at most {n} key-value pairs, got {got}",
                                  {"n": METADATA_KEYS, "got": len(value)})
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise PydanticCustomError("metadata", "keys are at most {n} characters, got one of {got}",
                                      {"n": METADATA_KEY_CHARS, "got": len(key)})
        if len(item) > METADATA_VALUE_CHARS:
            raise PydanticCustomError("metadata", "values are at most {n} characters, got one of {got}",
                                      {"n": METADATA_VALUE_CHARS, "got": len(item)})
    return value


class ResponsesRequest(_Body):
    model: str = ""
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    max_output_tokens: MaxTokens | None = None      # up to 2**31-1: the generation is clipped to the context
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)    # with include "message.output_text.logprobs"
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    background: bool | None = None
    conversation: str | dict | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value):
        return check_metadata(value)

    @property
    def summary(self) -> bool:
        """The request asks for a reasoning summary."""
        return self.reasoning is not None and self.reasoning.summary in SUMMARIES


def check_supported(body: ResponsesRequest) -> None:
    """400 for the known fields whose meaning this server cannot give."""
    if body.background:
        raise ApiError(400, "background: background responses are not supported", param="background")
    if body.conversation is not None:
        raise ApiError(400, "conversation: conversations are not supported; use previous_response_id",
                       param="conversation")


def function_tools(body: ResponsesRequest) -> tuple[list[dict], dict[str, str]]:
    """The request's function tools in the chat templates' form, and the namespace of each function
    that came from a ``namespace`` tool (by name). Other tool types are left out."""
    tools, namespaces = [], {}
    for i, raw in enumerate(body.tools or []):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "function":
            tools.append(_function(raw, f"tools[{i}]"))
        elif kind == "namespace":
            space = _parse(NamespaceTool, raw, f"tools[{i}]")
            for j, inner in enumerate(space.tools):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    tools.append(_function(inner, f"tools[{i}].tools[{j}]"))
                    namespaces[inner["name"]] = space.name
        elif not isinstance(kind, str):
            raise ApiError(400, f"tools[{i}]: a tool needs a 'type'", param=f"tools[{i}]")
    return tools, namespaces


def _parse(model: type[BaseModel], raw, where: str):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e, where) from None


def _function(raw: dict, where: str) -> dict:
    fn = _parse(FunctionTool, raw, where)
    return {"type": "function", "function": {"name": fn.name, "description": fn.description or "",
                                             "parameters": fn.parameters or {"type": "object", "properties": {}}}}


def tool_choice(body: ResponsesRequest, tools: list[dict]) -> tuple[str, str | None]:
    """("auto" | "none" | "required" | "function", the forced function's name)."""
    choice = body.tool_choice or "auto"
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function":
            raise ApiError(400, f"tool_choice: only function tools can be chosen here, got {choice.get('type')!r}",
                           param="tool_choice")
        if not isinstance(name, str) or name not in names:
            raise ApiError(400, f"tool_choice: no function named {name!r} among the request's tools",
                           param="tool_choice")
        return "function", name
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs function tools", param="tool_choice")
    return choice, None


def _arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        raise ApiError(400, f"{where}: not valid JSON", param=where) from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}: expected a JSON object", param=where)
    return args


def _nonempty_str(value) -> bool:
    return isinstance(value, str) and bool(value)


def _reasoning_text(item: dict, where: str) -> str:
    content = _text(item.get("content"), f"{where}.content")
    summary = item.get("summary") or []
    if not isinstance(summary, list):
        raise ApiError(400, f"{where}.summary: expected a list of summary_text parts", param=f"{where}.summary")
    return content or "\n".join(_text([s], f"{where}.summary") for s in summary)


def template_messages(instructions: str | None, items: list[dict], where: str = "input", images=None) -> list[dict]:
    """Instructions and input items -> the chat templates' form (see the module doc). ``images``
    (``image_inputs.ImageParts``) collects the input_image parts of user messages and tool outputs
    (None: they are a 400)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = ""                       # the reasoning of the assistant turn to come

    def assistant() -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"], reasoning = reasoning, ""
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{at}: expected an object", param=at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("developer", "system", "user", "assistant"):
                raise ApiError(400, f"{at}.role: unknown role {role!r}", param=f"{at}.role")
            text = _text(item.get("content"), f"{at}.content", images if role == "user" else None)
            if role == "assistant":
                assistant()["content"] = text
            else:
                out.append({"role": "user" if role == "user" else "system", "content": text})
        elif kind == "function_call":
            if not _nonempty_str(item.get("name")) or not _nonempty_str(item.get("call_id")):
                raise ApiError(400, f"{at}: a function_call needs 'name' and 'call_id' (strings)", param=at)
            last = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else assistant()
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": _arguments(item.get("arguments"), f"{at}.arguments")}})
        elif kind == "function_call_output":
            if not _nonempty_str(item.get("call_id")):
                raise ApiError(400, f"{at}: a function_call_output needs 'call_id' (a string)", param=at)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{at}.output", images)})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item, at)
        else:
            raise ApiError(400, f"{at}.type: input items of type {kind!r} are not supported", param=f"{at}.type")
    return fold_system_messages(out)


def input_items(body: ResponsesRequest) -> list[dict]:
    """``input`` as a list of items."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)
