"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

    /tokenize    {"model", "prompt", "add_special_tokens": true}                 a text
                 {"model", "messages", "add_generation_prompt": true, "tools",   a chat, rendered with
                  "chat_template_kwargs", "add_special_tokens": false}           the chat template
                 -> {"tokens": [int], "count": int, "max_model_len": int, "token_strs": [str] | null}
                 (``return_token_strs``: each token's string, as in logprobs)
    /detokenize  {"model", "tokens": [int]} -> {"prompt": str}

Images in ``messages`` (as in chat completions) count their tokens: the ids hold each image's run
of placeholder tokens. Exactly one of ``prompt`` and ``messages``; a token id outside the vocabulary is a 400 naming it.
Fields are strict (``zoo.server.validation.Body``: a number is no string, ``true`` no token id); a
token id must be 0..2**31-1 before the vocabulary is checked; a tool's ``function.parameters``
must be a valid JSON Schema.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from zoo.server.protocols.openai_api import Tool, template_messages
from zoo.server.validation import ApiError, Body, TokenId, parse_body

router = APIRouter()


class _Body(Body):
    pass


class TokenizeRequest(_Body):
    model: str = ""
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None       # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str = ""
    tokens: list[TokenId]


def _token_ids(service, body: TokenizeRequest) -> list[int]:
    tok = service.tokenizer
    if body.messages is None:
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if not body.messages:
        raise ApiError(400, "messages: empty", param="messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    images = service.image_parts()
    messages = template_messages(body.messages, images)
    try:
        text = tok.apply_chat_template(messages, tools=tools,
                                       add_generation_prompt=body.add_generation_prompt,
                                       **(body.chat_template_kwargs or {}))
    except ApiError:
        raise
    except Exception as e:                  # a template's own error (raise_exception), a missing template
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if images:
        text = images.substitute(text)
    ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return service.with_images(ids, images)[0]


def _tokenize(service, raw: bytes) -> dict:
    body = parse_body(TokenizeRequest, raw)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' (a text) and 'messages' (a chat)",
                       param="messages" if body.messages is not None else "prompt")
    ids = _token_ids(service, body)
    strs = [service.logprob_renderer.piece(t)[0] for t in ids] if body.return_token_strs else None
    return {"tokens": ids, "count": len(ids), "max_model_len": service.context, "token_strs": strs}


def _detokenize(service, raw: bytes) -> dict:
    body = parse_body(DetokenizeRequest, raw)
    service.check_token_ids(body.tokens, "tokens")
    return {"prompt": service.tokenizer.decode(body.tokens, skip_special_tokens=False)}


# Both run in a worker thread, parsing included: a body of millions of tokens takes seconds, and the
# event loop (``/health``, every stream) must not wait for it.
@router.post("/tokenize")
async def tokenize(request: Request):
    return await run_in_threadpool(_tokenize, request.app.state.service, await request.body())


@router.post("/detokenize")
async def detokenize(request: Request):
    return await run_in_threadpool(_detokenize, request.app.state.service, await request.body())
