"""Request validation shared by every API surface.

``ApiError``: an HTTP error the OpenAI and Anthropic surfaces render in their own error schema;
``parse_body``: a request body validated by a pydantic model, or a 400 naming the bad field.

``Body`` is the base of every request model: unknown fields are ignored, known ones are *strict*
(a bool is not an int, a float is not an int, a number is not a string; a JSON integer is still a
float), and a float must be finite (no ``NaN`` / ``Infinity``). The bounded types keep any value
the engine cannot represent out of it:

    TokenId      a token id: 0 .. INT32_MAX (the vocabulary is checked later, by the service)
    TokenKey     the same as a JSON object key ("123")
    MaxTokens    a generation length: 1 .. INT32_MAX (clipped to the context later)
    Budget       a thinking budget: 1 .. INT32_MAX
    Seed         a sampling seed: the int64 range (the engine keeps its low 32 bits)
    TopK         top_k: 0 .. INT32_MAX (OpenAI's surfaces also take -1: off)
    ToolName     a tool's name as the real APIs take it: letters, digits, _ and -, at most 64
                 (AnthropicToolName: 128); anything else would break the tool-call format

``check_json_schema``: a tool's parameter schema is a valid JSON Schema (``jsonschema``), else 400.
"""

from __future__ import annotations

import re
from typing import Annotated

import jsonschema
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

INT32_MAX = 2**31 - 1                  # the engine keeps token ids, top_k and lengths as int32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OPENAI_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"          # the real APIs' tool-name patterns
ANTHROPIC_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


class ApiError(Exception):
    """An error answered with ``status``; ``param`` names the offending request field (OpenAI)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def openai_body(self) -> dict:
        kind = OPENAI_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


class Body(BaseModel):
    """The base of every request model (see the module doc)."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _token_id(value: int) -> int:
    if not 0 <= value <= INT32_MAX:
        raise PydanticCustomError("token_id", "token id {id} is not in any vocabulary (a token id is 0..{max})",
                                  {"id": value, "max": INT32_MAX})
    return value


def _token_key(value: str) -> str:
    if not (value.isascii() and value.isdigit() and len(value) <= 10 and int(value) <= INT32_MAX):
        raise PydanticCustomError("token_id", "a key must be a token id (an integer 0..{max} as a string)",
                                  {"max": INT32_MAX})
    return value


TokenId = Annotated[int, AfterValidator(_token_id)]
TokenKey = Annotated[str, AfterValidator(_token_key)]           # a token id as a JSON object key (logit_bias)
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
Budget = Annotated[int, Field(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TopK = Annotated[int, Field(ge=0, le=INT32_MAX)]
ToolName = Annotated[str, Field(min_length=1, pattern=OPENAI_TOOL_NAME)]            # OpenAI's (chat, Responses)
AnthropicToolName = Annotated[str, Field(min_length=1, pattern=ANTHROPIC_TOOL_NAME)]


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_json_schema(schema, what: str, *, object_type: bool = False):
    """``schema`` if it is a valid JSON Schema (its ``$schema`` draft, else 2020-12), with
    ``"type": "object"`` if ``object_type``; else a pydantic error saying what is wrong (``what``
    names the tool), for a field validator to raise."""
    if not isinstance(schema, dict):
        raise PydanticCustomError("json_schema", "{what}: expected a JSON Schema object, got {kind}",
                                  {"what": what, "kind": type(schema).__name__})
    if object_type and schema.get("type") != "object":
        raise PydanticCustomError("json_schema", '{what}: the input schema must have "type": "object"',
                                  {"what": what})
    if "$schema" in schema and not isinstance(schema["$schema"], str):
        raise PydanticCustomError("json_schema", "{what}: $schema must be a string", {"what": what})
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = f" (at {e.json_path})" if list(e.path) else ""
        raise PydanticCustomError("json_schema", "{what}: not a valid JSON Schema{at}: {error}",
                                  {"what": what, "at": at, "error": _short(e.message)}) from None
    except Exception as e:             # a schema the checker cannot even walk
        raise PydanticCustomError("json_schema", "{what}: not a valid JSON Schema: {error}",
                                  {"what": what, "error": _short(f"{type(e).__name__}: {e}")}) from None
    return schema


_BRANCH = re.compile(r"\[|^(str|int|float|bool|dict|list|none|function-\w+)$")   # a union member's label


def field_path(loc, prefix: str = "") -> str:
    """A pydantic error location as ``a.b[0].c`` (the labels pydantic gives union members left out)."""
    out = prefix
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _BRANCH.search(p):
            out += f".{p}" if out else str(p)
    return out


_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"),
          (dict, "an object"), (type(None), "null"))


def _kind(value) -> str:
    """What JSON value ``value`` is, in words."""
    return next((name for t, name in _KINDS if isinstance(value, t)), type(value).__name__)


def validation_error(e: ValidationError, prefix: str = "", skip: int = 0) -> ApiError:
    """A 400 naming the most specific invalid field of a request body (or of the part of it at
    ``prefix``, the first ``skip`` parts of each location left out); where the field could take
    one of several forms, what each form expects; for a value of the wrong type, what it was."""
    errors = e.errors()
    if errors[0]["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}")
    located = [(field_path(err["loc"][skip:], prefix), err) for err in errors]
    deepest = max(located, key=lambda x: x[0].count(".") + x[0].count("["))[0]
    found = [err for path, err in located if path == deepest]
    message = " or ".join(dict.fromkeys(err["msg"] for err in found))
    if all(err["type"].endswith("_type") for err in found):
        message += f", got {_kind(found[0]['input'])}"
    return ApiError(400, f"{deepest or 'body'}: {message}", param=deepest or None)


def parse_body(model: type[BaseModel], raw: bytes):
    """``raw`` (JSON) validated as ``model``; a 400 ``ApiError`` otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
