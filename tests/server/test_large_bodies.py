"""Large prompts do not stall the server: a prompt with more characters than the context can hold
tokens of is refused before it is tokenized (a 400 naming its size), and the prompts that must be
tokenized are rendered and tokenized off the event loop (in worker threads, where the tokenizer
releases the GIL), so ``/health`` and other requests go on meanwhile (``bench/soak.py`` measures it)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx2 as httpx
import pytest

from tests.support.server_helpers import QWEN_TEMPLATE, scripted_model
from zoo.server.app import ServerThread, create_app

KEY = "bodies-key"
HEADERS = {"x-api-key": KEY}


def chat_body(text: str) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


def anthropic_body(text: str) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    model = scripted_model(tmp_path_factory.mktemp("small-ctx"), QWEN_TEMPLATE, ["ok"])
    with ServerThread(create_app(model, api_key=KEY, model_name="small", context=32768, max_batch=1)) as s:
        yield s


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(small_context):
    text = "word " * 200_000                                   # 1 MB; the context is 32768 tokens
    with httpx.Client(base_url=small_context.url, headers=HEADERS, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat_body(text))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "characters, more than the server's context of 32768 tokens can hold" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json=anthropic_body(text))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "characters" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 4})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        ok = c.post("/v1/chat/completions", json=chat_body("hello"))
        assert ok.status_code == 200


def test_prompts_are_rendered_and_tokenized_off_the_event_loop(tmp_path_factory):
    """Every surface renders and tokenizes in a worker thread (the tokenizer releases the GIL there,
    so other requests and /health go on: ``bench/soak.py`` measures /health meanwhile). Two
    2M-character prompts, under a context large enough to pass the character check, are tokenized
    concurrently and then refused for their token count."""
    model = scripted_model(tmp_path_factory.mktemp("big-ctx"), QWEN_TEMPLATE, ["ok"], context=2**18)
    tok, on_loop = model.tokenizer, []

    def spy(fn):                              # records a call on a prompt-sized text made on the loop
        def call(*args, **kwargs):
            text = args[0] if args and isinstance(args[0], str) else ""
            try:
                if len(text) < 3_000 and fn.__name__ != "apply_chat_template":
                    raise RuntimeError        # small texts (the output's own tokens) are not checked
                asyncio.get_running_loop()
                on_loop.append((fn.__name__, "".join(__import__("traceback").format_stack(limit=4)[:2])))
            except RuntimeError:              # no loop in this thread: a worker thread
                pass
            return fn(*args, **kwargs)
        return call
    tok.encode, tok.encode_with_ends, tok.apply_chat_template = map(
        spy, (tok.encode, tok.encode_with_ends, tok.apply_chat_template))
    text = "lorem ipsum dolor sit amet, " * 75_000                 # 2.1M characters
    mid = "lorem ipsum " * 300                                      # 3.6k characters, ~1.5k tokens
    small = {"role": "user", "content": mid}
    # the huge prompts pass the character bound of a 262144-token context and are refused once
    # tokenized; nothing is prefilled there (the prompts that are, on a 4096-token server, are long
    # enough to be checked by the spy: > 3,000 characters)
    with ServerThread(create_app(model, api_key=KEY, model_name="big", context=2**18, max_batch=2)) as s, \
            httpx.Client(base_url=s.url, headers=HEADERS, timeout=120) as c:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            big = [pool.submit(c.post, "/v1/chat/completions", json=chat_body(text)),
                   pool.submit(c.post, "/v1/messages", json=anthropic_body(text))]
            for r in [f.result() for f in big]:
                assert r.status_code == 400 and "tokens; the server's context is 262144" in r.text
    with ServerThread(create_app(model, api_key=KEY, model_name="big", context=4096, max_batch=1)) as s, \
            httpx.Client(base_url=s.url, headers=HEADERS, timeout=120) as c:
        for path, body in [("/v1/chat/completions", chat_body(mid)), ("/v1/messages", anthropic_body(mid)),
                           ("/v1/messages/count_tokens", {"model": "m", "messages": [small]}),
                           ("/v1/completions", {"model": "m", "prompt": mid, "max_tokens": 2}),
                           ("/v1/responses", {"model": "m", "input": mid, "max_output_tokens": 2}),
                           ("/tokenize", {"model": "m", "prompt": mid}),
                           ("/tokenize", {"model": "m", "messages": [small]})]:
            assert c.post(path, json=body).status_code == 200, path
    assert on_loop == [], on_loop[0][1]
