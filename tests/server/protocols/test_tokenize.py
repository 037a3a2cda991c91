"""``POST /tokenize`` and ``/detokenize`` (vLLM's shapes) over real HTTP on 127.0.0.1, against the
embedded tiny model: a text or a chat, the round trip, the API key, and a 400 naming each kind of
bad input."""

from __future__ import annotations

import httpx2 as httpx
import pytest

import zoo
from zoo.server.app import ServerThread, create_app

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, zoo"}]


@pytest.fixture(scope="module")
def server():
    model = zoo.load("qwen38-tiny", dtype="float32")
    app = create_app(model, api_key=KEY, model_name="tiny")
    with ServerThread(app) as s:
        s.model, s.context = model, app.state.service.engine.generator.context
        yield s


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_text_and_detokenize(server):
    tok = server.model.tokenizer
    text = "Hello, wörld ✓ <|im_end|>"
    r = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server.context           # the server's context (its engine's)
    assert out["token_strs"][-1] == "<|im_end|>" and any(s.startswith("bytes:\\x") for s in out["token_strs"])
    back = post(server, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_tokenize_messages(server):
    tok = server.model.tokenizer
    for gen_prompt in (True, False):
        r = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": gen_prompt})
        assert r.status_code == 200, r.text
        expected = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt))
        assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    with_prompt = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert tok.decode(with_prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n")


def test_bad_input_is_a_400_naming_it(server):
    vocab = server.model.tokenizer.vocab_size
    cases = [
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "exactly one of"),
        ("/tokenize", {"model": "tiny"}, "exactly one of"),
        ("/tokenize", {"messages": []}, "messages: empty"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": 42}, "prompt"),
        ("/detokenize", {"tokens": [5, vocab]}, f"tokens[1]: token id {vocab} is not in the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]: token id -1"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ]
    for path, body, message in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error", (body, error)


def test_api_key_required(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert post(server, path, body, headers={}).status_code == 401
        assert post(server, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
