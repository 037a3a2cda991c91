"""``ApiError``: an HTTP error the OpenAI and Anthropic surfaces render in their own error schema;
``parse_body``: a request body validated by a pydantic model, or a 400 naming the bad field."""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


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


def validation_error(e: ValidationError, prefix: str = "", skip: int = 0) -> ApiError:
    """A 400 naming the most specific invalid field of a request body (or of the part of it at
    ``prefix``, the first ``skip`` parts of each location left out); where the field could take
    one of several forms, what each form expects."""
    errors = e.errors()
    if errors[0]["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}")
    located = [(field_path(err["loc"][skip:], prefix), err["msg"]) for err in errors]
    deepest = max(located, key=lambda x: x[0].count(".") + x[0].count("["))[0]
    messages = list(dict.fromkeys(msg for path, msg in located if path == deepest))
    return ApiError(400, f"{deepest or 'body'}: {' or '.join(messages)}", param=deepest or None)


def parse_body(model: type[BaseModel], raw: bytes):
    """``raw`` (JSON) validated as ``model``; a 400 ``ApiError`` otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
