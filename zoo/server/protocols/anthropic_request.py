"""An Anthropic Messages request, validated and turned into a chat-template prompt.

What is accepted is what the real API accepts and agent clients (Claude Code) send: ``system`` as a
string or text blocks; ``system`` role messages inside ``messages`` (a leading run joins the system
prompt, a later one joins the user turn it follows, ``service.fold_system_messages``; its own
``output_config.effort`` overrides the request's); ``cache_control`` on the request, system,
message and tool blocks (validated, nothing cached); ``thinking`` of type ``enabled`` (its
``budget_tokens`` enforced), ``adaptive``, ``between_tools`` or ``disabled``, with ``display``;
``output_config.effort`` (the template's ``reasoning_effort``); ``context_management`` and
``metadata`` (validated, not applied); custom tools (``input_schema``; ``defer_loading`` tools stay
out of the prompt until a ``tool_reference`` block names one); server tools (a ``type`` other
than ``custom``: not run here, left out). Images (a model with a vision tower): ``image`` blocks in
user turns and in tool results, ``source`` ``{"type": "base64", "media_type", "data"}`` or
``{"type": "url", "url"}`` (where the server allows URLs; ``zoo.server.image_inputs``).
Unknown fields are ignored; a malformed known field, or content this server cannot take
(documents, images in assistant or system turns, images for a text-only model), is a 400 naming it.

Validation (``zoo.server.validation.Body``: strict types, so ``1.0`` or ``true`` is no integer):
``max_tokens`` 1..2**31-1, ``thinking.budget_tokens`` 1..2**31-1, ``top_k`` 0..2**31-1,
``temperature`` 0..1, ``top_p`` (0, 1], at most 16 ``stop_sequences``; as the real API, every
message needs non-empty content (``""`` or ``[]``) except a final assistant one, and a text block
needs non-empty text (anywhere: messages, system, tool results); a custom tool's ``input_schema``
must be a valid JSON Schema with ``"type": "object"`` (the 400 names the tool), a tool's ``name``
match ``^[a-zA-Z0-9_-]{1,128}$``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zoo.server.service import ChatPrompt, fold_system_messages
from zoo.server.structured import response_format_grammar
from zoo.server.validation import (
    AnthropicToolName,
    ApiError,
    Body,
    Budget,
    MaxTokens,
    TopK,
    check_json_schema,
    validation_error,
)


class _Body(Body):
    pass


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(_Body):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _not_empty(cls, text: str) -> str:
        if not text:
            raise PydanticCustomError("empty_text", "text content blocks must be non-empty")
        return text


class ImageBlock(_Block):
    type: Literal["image", "document"]
    source: dict


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict


class ToolReferenceBlock(_Block):
    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict] | None = None
    is_error: bool | None = None


ContentBlock = TypeAdapter(Annotated[TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
                                     | ToolResultBlock, Field(discriminator="type")])
ResultBlock = TypeAdapter(Annotated[TextBlock | ImageBlock | ToolReferenceBlock, Field(discriminator="type")])


class Tool(_Body):
    type: str | None = None               # None or "custom": a client tool; anything else: a server tool
    name: AnthropicToolName
    description: str | None = None
    input_schema: dict | None = None       # a custom tool's: a JSON Schema of "type": "object" (checked)
    cache_control: CacheControl | None = None
    defer_loading: bool = False

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, schema, info: ValidationInfo):
        if schema is None or info.data.get("type") not in (None, "custom"):
            return schema                   # a server tool's: not used here
        return check_json_schema(schema, f"tool {info.data.get('name')!r}", object_type=True)

    @model_validator(mode="after")
    def _custom_tools_have_a_schema(self):
        if self.custom and self.input_schema is None:
            raise PydanticCustomError("missing_schema", "tool {name!r}: a custom tool needs input_schema",
                                      {"name": self.name})
        return self


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Budget | None = None      # enforced: </think> is forced after this many tokens
    display: Literal["summarized", "omitted"] | None = None


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict | None = None


class Metadata(_Body):
    user_id: str | None = None


class ContextEdit(_Body):
    type: str


class ContextManagement(_Body):
    edits: list[ContextEdit] = []


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict]
    output_config: OutputConfig | None = None      # per-turn control, on a system message


class CountRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    context_management: ContextManagement | None = None
    metadata: Metadata | None = None


class MessagesRequest(CountRequest):
    max_tokens: MaxTokens                  # any size up to 2**31-1: the generation is clipped to the context
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = 0


def _validate(adapter: TypeAdapter, block, where: str):
    try:
        return adapter.validate_python(block)
    except ValidationError as e:
        raise validation_error(e, where, skip=1) from None   # a location starts with the block's type


def _blocks(content: str | list[dict], where: str) -> list:
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)] if content else []
    return [_validate(ContentBlock, b, f"{where}[{j}]") for j, b in enumerate(content)]


def _unsupported(block, where: str, turn: str) -> ApiError:
    if isinstance(block, ImageBlock) and block.type == "document":
        return ApiError(400, f"{where}: document blocks are not supported (this server takes text and images)")
    if isinstance(block, ImageBlock):
        return ApiError(400, f"{where}: image blocks are not supported in {turn} turns")
    return ApiError(400, f"{where}: {block.type!r} blocks are not supported in {turn} turns")


def _image(block: ImageBlock, where: str, turn: str, images) -> str:
    """An ``image`` block: the text standing for it (``images`` collects its bytes or URL)."""
    if block.type != "image":
        raise _unsupported(block, where, turn)
    if images is None:
        raise ApiError(400, f"{where}: image blocks are not supported (this server takes text only)")
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        return images.add_base64(source.get("media_type"), source.get("data"), f"{where}.source")
    if kind == "url":
        return images.add_url(source.get("url"), f"{where}.source.url")
    raise ApiError(400, f"{where}.source.type: image sources of type {kind!r} are not supported (base64 or url)")


def _tool_result_text(block: ToolResultBlock, where: str, referenced: list[str], images=None) -> str:
    """A tool result's content as text; a ``tool_reference`` block loads the tool it names (its
    definition joins the prompt's tools) and reads as a line saying so."""
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    out, loaded = [], False
    for k, raw in enumerate(block.content):
        b = _validate(ResultBlock, raw, f"{where}.content[{k}]")
        if isinstance(b, ToolReferenceBlock):
            referenced.append(b.tool_name)
            out.append(f"Tool {b.tool_name} loaded.")
            loaded = True
        elif isinstance(b, ImageBlock):
            out.append(_image(b, f"{where}.content[{k}]", "tool result", images))
        else:
            out.append(b.text)
    return ("\n" if loaded else "").join(out)


def _user_turn(blocks: list, where: str, referenced: list[str], images=None) -> list[dict]:
    """A user turn: its tool results (as "tool" messages), then its text (images in it)."""
    tools, text = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ImageBlock):
            text.append(_image(b, f"{where}[{j}]", "user", images))
        elif isinstance(b, ToolResultBlock):
            result = _tool_result_text(b, f"{where}[{j}]", referenced, images)
            tools.append({"role": "tool", "tool_call_id": b.tool_use_id,
                          "content": f"Error: {result}" if b.is_error else result})
        else:
            raise _unsupported(b, f"{where}[{j}]", "user")
    return tools + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_turn(blocks: list, where: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            msg["content"] += b.text
        elif isinstance(b, ThinkingBlock):
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b.thinking
        elif isinstance(b, ToolUseBlock):
            msg.setdefault("tool_calls", []).append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):
            raise _unsupported(b, f"{where}[{j}]", "assistant")
    return msg


def _text(blocks: list, where: str) -> str:
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise ApiError(400, f"{where}[{j}]: {b.type!r} blocks are not supported here (text only)")
    return "".join(b.text for b in blocks)


BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system: str | list[TextBlock] | None) -> str:
    """The request's system prompt as the model sees it: its text blocks joined, less Claude Code's
    billing header (a first block ``x-anthropic-billing-header: cc_version=...; cch=...;``). It is
    client metadata, not instructions, and some versions put a per-request hash in it, which would
    make every turn's prompt differ from its first token on and defeat the prefix cache."""
    if system is None:
        return ""
    blocks = [system] if isinstance(system, str) else [b.text for b in system]
    return "".join(t for t in blocks if not t.lstrip().startswith(BILLING_HEADER))


def template_messages(body: CountRequest, images=None) -> tuple[list[dict], str, list[str]]:
    """Anthropic messages -> the chat templates' form; the trailing assistant text (a prefill); the
    tools named by ``tool_reference`` blocks. ``images`` (``image_inputs.ImageParts``) collects the
    image blocks of user turns and tool results (None: they are a 400). The system prompt is
    ``system_text``'s."""
    system = system_text(body.system)
    out = [{"role": "system", "content": system}] if system else []
    prefill, referenced = "", []
    if not any(m.role != "system" for m in body.messages):
        raise ApiError(400, "messages: at least one user or assistant message is needed")
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        final_assistant = i == len(body.messages) - 1 and m.role == "assistant"
        if not m.content and m.role != "system" and not final_assistant:
            raise ApiError(400, f"{where}: empty (all messages must have non-empty content except for the "
                                "optional final assistant message)", param=where)
        blocks = _blocks(m.content, where)
        if m.role == "system":
            out.append({"role": "system", "content": _text(blocks, where)})
        elif final_assistant:
            prefill = _text([b for b in blocks if not isinstance(b, (ThinkingBlock, RedactedThinkingBlock))], where)
        elif m.role == "user":
            out += _user_turn(blocks, where, referenced, images)
        else:
            out.append(_assistant_turn(blocks, where))
    return fold_system_messages(out), prefill, referenced


def template_tools(body: CountRequest, referenced: list[str]) -> list[dict]:
    """The custom tools the prompt shows: those not deferred, and deferred ones a reference loaded."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in body.tools or [] if t.custom and (not t.defer_loading or t.name in referenced)]


def reasoning_effort(body: CountRequest) -> str | None:
    """The reasoning effort: the last system message's ``output_config``, else the request's."""
    for m in reversed(body.messages):
        if m.role == "system" and m.output_config is not None and m.output_config.effort:
            return m.output_config.effort
    return body.output_config.effort if body.output_config is not None else None


def cache_marks(body: CountRequest) -> list[str]:
    """The texts of the system and message blocks marked with ``cache_control``, in prompt order:
    where they end in the prompt, the prefix cache keeps a snapshot (the prompt's end always gets
    one; marked tool definitions add nothing, the tools render before the system text)."""
    marks = []
    if isinstance(body.system, list):
        marks += [b.text for b in body.system if b.cache_control is not None and b.text]
    for m in body.messages:
        for b in [] if isinstance(m.content, str) else m.content:
            if not isinstance(b, dict) or b.get("cache_control") is None:
                continue
            text = b.get("text") if b.get("type") == "text" else b.get("content") if b.get("type") == "tool_result" \
                else None
            if isinstance(text, list):
                text = "".join(part.get("text", "") for part in text if isinstance(part, dict))
            if isinstance(text, str) and text:
                marks.append(text)
    return marks


def render_prompt(service, body: CountRequest) -> ChatPrompt:
    """The request as prompt tokens (image tokens included) and an output parser (``Service.chat_prompt``)."""
    images = service.image_parts()
    messages, prefill, referenced = template_messages(body, images)
    tools = template_tools(body, referenced)
    choice, name = "auto", None
    if body.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[body.tool_choice.type]
        name = body.tool_choice.name
        custom = [t.name for t in body.tools or [] if t.custom]
        if choice in ("required", "function") and not custom:
            raise ApiError(400, "tool_choice: the request has no tools")
        if choice == "function" and name not in custom:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the request's tools")
        if choice == "function":
            tools = template_tools(body, referenced + [name])        # a forced deferred tool is loaded
    thinking = None if body.thinking is None else body.thinking.type != "disabled"
    output = None
    if body.output_config is not None and body.output_config.format is not None:
        output = response_format_grammar(body.output_config.format, "output_config.format")
    effort = reasoning_effort(body)
    return service.chat_prompt(messages, tools=tools or None, tool_choice=choice, tool_name=name,
                               thinking=thinking, template_kwargs={"reasoning_effort": effort} if effort else {},
                               prefill=prefill, output=output, marks=cache_marks(body), images=images)
