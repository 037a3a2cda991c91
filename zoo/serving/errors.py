"""``ApiError``: an HTTP error the OpenAI and Anthropic surfaces render in their own error schema;
``parse_body``: a request body validated by a pydantic model, or a 400 naming the bad field."""

from __future__ import annotations

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


def validation_error(e: ValidationError) -> ApiError:
    """A 400 naming the first invalid field of a request body."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}")
    loc = ""
    for p in err["loc"]:
        loc += f"[{p}]" if isinstance(p, int) else (f".{p}" if loc else str(p))
    return ApiError(400, f"{loc or 'body'}: {err['msg']}", param=loc or None)


def parse_body(model: type[BaseModel], raw: bytes):
    """``raw`` (JSON) validated as ``model``; a 400 ``ApiError`` otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
