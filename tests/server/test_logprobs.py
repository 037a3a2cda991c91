"""Log-probabilities over real HTTP on 127.0.0.1 (the official ``openai`` SDK, and raw requests
shaped as lm-evaluation-harness's ``local-completions`` sends them), against a numpy log-softmax in
float32 of ``Model.logits`` on the embedded tiny model; a second server speculates with its MTP
head (k = 2) and must report the same numbers."""

from __future__ import annotations

import httpx2 as httpx
import numpy as np
import openai
import pytest

from tests.support.helpers import random_tiny_model
from zoo.engine.logprobs import TokenLogprob
from zoo.server.app import ServerThread, create_app
from zoo.server.logprob_render import LogprobRenderer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOL = 1e-5
MESSAGES = [{"role": "user", "content": "Hello, zoo"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo model's config and tokenizer with random weights and a plain ChatML template (answers
    with no reasoning block; log-probabilities spread over the vocabulary)."""
    return random_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(model):
    with ServerThread(create_app(model, api_key=KEY, model_name="tiny", keepalive_s=0.1)) as s:
        yield s


@pytest.fixture(scope="module")
def spec(model):
    with ServerThread(create_app(model, api_key=KEY, model_name="tiny", keepalive_s=0.1, spec_tokens=2)) as s:
        yield s


@pytest.fixture(scope="module")
def ids_of(model):
    """Token string (as the server writes it) -> token id."""
    render = LogprobRenderer(model.tokenizer)
    table = {render.piece(i)[0]: i for i in range(model.tokenizer.vocab_size)}
    assert len(table) == model.tokenizer.vocab_size           # the strings name the tokens
    return table


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def reference(model, seq: list[int]) -> np.ndarray:
    """[S, V] float32: row t is the model's log-distribution of the token after seq[:t+1]."""
    x = model.logits([seq])[0].astype(np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def chat_prompt(model) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))


def check_entries(model, ids_of, prompt: list[int], entries: list[dict], n_top: int) -> list[int]:
    """Chat-shaped logprob entries of the tokens after ``prompt`` against the reference; their ids."""
    gen = [ids_of[e["token"]] for e in entries]
    ref = reference(model, prompt + gen)
    for i, (tok, e) in enumerate(zip(gen, entries)):
        row = ref[len(prompt) - 1 + i]
        assert abs(e["logprob"] - row[tok]) <= TOL
        assert e["bytes"] == list(model.tokenizer.token_bytes(tok))
        assert [ids_of[t["token"]] for t in e["top_logprobs"]] == list(np.argsort(-row, kind="stable")[:n_top])
        np.testing.assert_allclose([t["logprob"] for t in e["top_logprobs"]], np.sort(row)[::-1][:n_top], atol=TOL)
    return gen


def chat_logprobs(server, stream: bool, **kwargs) -> tuple[list[dict], int]:
    """(logprobs.content entries, completion tokens) of a greedy chat completion."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, **kwargs)
    if not stream:
        r = client(server).chat.completions.create(**kw)
        return [e.model_dump() for e in r.choices[0].logprobs.content], r.usage.completion_tokens
    entries, usage = [], None
    for chunk in client(server).chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            entries += [e.model_dump() for e in (choice.logprobs.content if choice.logprobs else None) or []]
    return entries, usage.completion_tokens


def test_chat_logprobs_stream_and_not(plain, model, ids_of):
    entries, n = chat_logprobs(plain, stream=False, top_logprobs=3)
    assert len(entries) == n > 0
    gen = check_entries(model, ids_of, chat_prompt(model), entries, 3)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)      # greedy: the argmax
    streamed, n_streamed = chat_logprobs(plain, stream=True, top_logprobs=3)
    assert n_streamed == n and [ids_of[e["token"]] for e in streamed] == gen
    np.testing.assert_allclose([e["logprob"] for e in streamed], [e["logprob"] for e in entries], atol=1e-6)
    r = client(plain).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None
    none_top, _ = chat_logprobs(plain, stream=False)
    assert [e["top_logprobs"] for e in none_top] == [[]] * len(none_top)


def test_completions_logprobs_legacy_shape(plain, model, ids_of):
    prompt = model.tokenizer.encode("Once upon a time")
    r = client(plain).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                         logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    gen = [ids_of[t] for t in lp.tokens]
    ref = reference(model, prompt + gen)
    for i, tok in enumerate(gen):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.token_logprobs[i] - row[tok]) <= TOL
        top = lp.top_logprobs[i]
        assert [ids_of[t] for t in top] == list(np.argsort(-row, kind="stable")[:2])
        np.testing.assert_allclose(list(top.values()), np.sort(row)[::-1][:2], atol=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    text, offsets, scored = "", [], []
    for chunk in client(plain).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                                  temperature=0, logprobs=2, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                scored += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == r.choices[0].text and offsets == lp.text_offset
    np.testing.assert_allclose(scored, lp.token_logprobs, atol=1e-6)


def lm_eval_request(server, prompt, max_tokens: int = 0) -> dict:
    """The body lm-evaluation-harness's ``local-completions`` posts for log-likelihoods."""
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_logprobs(model, ids: list[int], lp: dict) -> None:
    ref = reference(model, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    for i in range(1, len(ids)):
        (top,) = lp["top_logprobs"][i].values()                         # logprobs: 1 -> one alternative
        assert abs(top - ref[i - 1].max()) <= TOL


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_prompt_logprobs_lm_eval_shape(request, model, which):
    server = request.getfixturevalue(which)
    tok = model.tokenizer
    batch = [tok.encode("The capital of France is Paris"), tok.encode("Once upon a time, a zoo")]
    out = lm_eval_request(server, batch)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {"prompt_tokens": sum(map(len, batch)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, batch)),
                            "prompt_tokens_details": {"cached_tokens": 0}}    # prompt logprobs: all prefilled
    for ids, choice in zip(batch, out["choices"]):
        lp = choice["logprobs"]
        assert choice["finish_reason"] == "length" and choice["text"] == tok.decode(ids)
        assert [model.tokenizer.encode(t) for t in lp["tokens"]] == [[i] for i in ids]
        assert len(lp["token_logprobs"]) == len(ids)
        check_prompt_logprobs(model, ids, lp)
    texts = ["The capital of France is Paris", "Once upon a time, a zoo"]
    by_text = lm_eval_request(server, texts)
    assert [c["text"] for c in by_text["choices"]] == texts
    assert [c["logprobs"]["token_logprobs"][1:] for c in by_text["choices"]] == \
        [c["logprobs"]["token_logprobs"][1:] for c in out["choices"]]


def test_echo_with_completion(plain, model):
    """``echo`` with ``max_tokens`` > 0: the prompt then the completion, text and logprobs (what
    lm-eval's ``max_tokens: 1`` request reads, dropping the last token)."""
    ids = model.tokenizer.encode("The capital of France is Paris")
    out = lm_eval_request(plain, [ids], max_tokens=4)
    (choice,) = out["choices"]
    lp, n = choice["logprobs"], out["usage"]["completion_tokens"]
    alone = client(plain).completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=1)
    assert choice["text"] == model.tokenizer.decode(ids) + alone.choices[0].text
    assert len(lp["tokens"]) == len(ids) + n and lp["tokens"][len(ids):] == alone.choices[0].logprobs.tokens
    check_prompt_logprobs(model, ids, lp)
    np.testing.assert_allclose(lp["token_logprobs"][len(ids):], alone.choices[0].logprobs.token_logprobs, atol=1e-6)
    assert lp["text_offset"][len(ids)] == sum(len(t) for t in lp["tokens"][:len(ids)])


def test_responses_logprobs(plain, model, ids_of):
    kw = dict(model="tiny", input="Hello, zoo", max_output_tokens=10, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    r = client(plain).responses.create(**kw)
    (message,) = [o for o in r.output if o.type == "message"]
    entries = [e.model_dump() for e in message.content[0].logprobs]
    assert len(entries) == r.usage.output_tokens > 0
    check_entries(model, ids_of, chat_prompt(model), entries, 2)
    deltas, done = [], None
    for event in client(plain).responses.create(stream=True, **kw):
        if event.type == "response.output_text.delta":
            deltas += [e.model_dump() for e in event.logprobs]
        elif event.type == "response.output_text.done":
            done = [e.model_dump() for e in event.logprobs]
    assert [e["token"] for e in deltas] == [e["token"] for e in done] == [e["token"] for e in entries]
    plain_r = client(plain).responses.create(model="tiny", input="Hello, zoo", max_output_tokens=4)
    assert [o.content[0].logprobs for o in plain_r.output if o.type == "message"] in ([[]], [])


def test_speculative_logprobs_equal_plain(plain, spec):
    for stream in (False, True):
        a, n_a = chat_logprobs(plain, stream, top_logprobs=5)
        b, n_b = chat_logprobs(spec, stream, top_logprobs=5)
        assert n_a == n_b > 0 and [e["token"] for e in a] == [e["token"] for e in b]
        np.testing.assert_allclose([e["logprob"] for e in b], [e["logprob"] for e in a], atol=TOL)
        np.testing.assert_allclose([[t["logprob"] for t in e["top_logprobs"]] for e in b],
                                   [[t["logprob"] for t in e["top_logprobs"]] for e in a], atol=TOL)


def test_bad_logprob_requests_are_400(plain):
    c = client(plain)
    chat = [dict(logprobs=True, top_logprobs=21), dict(top_logprobs=2), dict(n=0),
            dict(response_format={"type": "json_schema"})]
    for case in chat:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **case)
        assert e.value.body["param"], case
    vocab = 512
    completions = [(dict(prompt="hi", logprobs=21), "logprobs"), (dict(prompt="hi", max_tokens=0), "max_tokens"),
                   (dict(prompt="hi", echo=True, stream=True), "echo"), (dict(prompt=[], max_tokens=1), "prompt"),
                   (dict(prompt=[[5], []], echo=True, max_tokens=0), "prompt"),
                   (dict(prompt=[5, vocab], max_tokens=1), "prompt"),
                   (dict(prompt="hi", suffix="x"), "suffix")]
    for body, param in completions:
        r = httpx.post(plain.url + "/v1/completions", json={"model": "tiny", **body}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for top in (-1, 21):
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model="tiny", input="hi", include=["message.output_text.logprobs"], top_logprobs=top)


def test_an_id_past_the_tokenizer_renders_as_an_empty_token(model):
    """Checkpoints pad their embedding past the tokenizer's vocabulary; a padding id among the top
    logprobs is rendered as an empty token with no bytes, not an error (a 500)."""
    render = LogprobRenderer(model.tokenizer)
    past = model.tokenizer.vocab_size + 3
    assert render.piece(past) == ("", [])
    assert render.chat([TokenLogprob(1, -0.5, ((past, -0.7),))])[0]["top_logprobs"][0] == \
        {"token": "", "logprob": -0.7, "bytes": []}
