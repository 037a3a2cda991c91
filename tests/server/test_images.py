"""Images in requests, end to end: a real server on 127.0.0.1 over a tiny random multimodal checkpoint
(``tests/support/multimodal_server.py``), driven by the official ``openai`` and ``anthropic`` SDKs.

Oracle: the greedy tokens of the in-process model (its own multimodal prefill, no engine) for the
same prompt ids and preprocessed image; the prompt ids built independently (chat template + the
HF-style placeholder run); every bad image a 400 naming the problem, the server serving after.
"""

from __future__ import annotations

import base64
import http.server
import inspect
import json
import re
import threading
import time
import zlib

import anthropic
import httpx2 as httpx
import openai
import pytest
from PIL import Image

import zoo
from tests.images import encode, png_bytes
from tests.support.multimodal_server import png, reference_greedy, write_checkpoint
from zoo.engine.generator import Generator
from zoo.images import ImageSpec, decode_image, preprocess
from zoo.server.app import ServerThread, create_app
from zoo.server.image_inputs import ImageParts, ImagePolicy
from zoo.server.logprob_render import LogprobRenderer
from zoo.server.validation import ApiError

KEY = "test-key"
STEPS = 8
ENGINE_TAKES_IMAGES = "images" in inspect.signature(Generator.make_request).parameters
needs_engine = pytest.mark.skipif(not ENGINE_TAKES_IMAGES, reason="the engine does not take images yet")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("qwen-mm"))
    model = zoo.load(path, dtype="float32")
    app = create_app(model, api_key=KEY, model_name="mm", max_batch=4, warmup=True)
    with ServerThread(app) as s:
        deadline = time.monotonic() + 900
        while httpx.get(s.url + "/health").status_code != 200:     # warming up: every program, images too
            assert time.monotonic() < deadline
            time.sleep(0.1)
        s.model, s.path, s.app = model, path, app
        yield s


@pytest.fixture(scope="module")
def text_only():
    app = create_app(zoo.load("qwen38-tiny", dtype="float32"), api_key=KEY, model_name="tiny", max_batch=2)
    with ServerThread(app) as s:
        yield s


def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def an(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def chat_image(url: str, text: str = "Describe: ") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, image_part(url)]}]


def expected(server, image: bytes, text: str = "Describe: "):
    """(prompt ids with the image's placeholder run, (patches, grid)): built here, not by the server."""
    tok = server.model.tokenizer
    spec = ImageSpec.from_hf_preprocessor_config(
        json.loads((server.path / "preprocessor_config.json").read_text()), "qwen3_5")
    p = preprocess(decode_image(image, max_pixels=10**7, max_bytes=10**7), spec)
    rendered = tok.apply_chat_template([{"role": "user", "content": text + spec.placeholder(p.n_tokens)}],
                                       add_generation_prompt=True)
    return tok.encode(rendered), (p.pixel_values, p.grid_thw), p.n_tokens


def test_openai_chat_with_an_image_generates_what_the_model_does(mm):
    image = png()
    ids, pixels, n = expected(mm, image)
    assert n == 35 and pixels[1] == (1, 10, 14)
    # /tokenize counts the image tokens: the server's ids are exactly the independently built ones
    tokenized = httpx.post(mm.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                           json={"messages": chat_image(data_url(image))}).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    text_tokens = len(ids) - n
    if not ENGINE_TAKES_IMAGES:
        pytest.skip("the engine does not take images yet: generation not compared")
    r = oa(mm).chat.completions.create(model="mm", messages=chat_image(data_url(image)), max_tokens=STEPS,
                                       temperature=0, logprobs=True)
    assert r.usage.prompt_tokens == text_tokens + n == len(ids)
    eos = frozenset(mm.app.state.service.engine.generator.eos_token_ids)
    want = reference_greedy(mm.model, ids, [pixels], STEPS, eos)
    renderer = LogprobRenderer(mm.model.tokenizer)
    got = [t.token for t in r.choices[0].logprobs.content]
    print(f"prompt {len(ids)} tokens ({n} image); greedy {want}")
    assert got == [renderer.piece(t)[0] for t in want]
    assert r.usage.completion_tokens == len(want)
    # the image matters: the same prompt with another picture (same size) is answered otherwise
    other_ids, other_pixels, _ = expected(mm, png(seed=1))
    assert other_ids == ids and reference_greedy(mm.model, ids, [other_pixels], STEPS, eos) != want


@needs_engine
def test_anthropic_and_responses_give_the_same_output(mm):
    image = png(seed=2)
    ids, _, _ = expected(mm, image, "What is it? ")
    chat = oa(mm).chat.completions.create(model="mm", messages=chat_image(data_url(image), "What is it? "),
                                          max_tokens=STEPS, temperature=0)
    msg = chat.choices[0].message
    chat_text = ((msg.model_extra or {}).get("reasoning_content") or "") + (msg.content or "")
    m = an(mm).messages.create(model="mm", max_tokens=STEPS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
        {"type": "text", "text": "What is it? "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}}]}])
    m_text = "".join(getattr(b, "thinking", None) or getattr(b, "text", "") for b in m.content)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens == len(ids)
    r = oa(mm).responses.create(model="mm", max_output_tokens=STEPS, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "What is it? "},
                                    {"type": "input_image", "image_url": data_url(image)}]}])
    r_text = "".join(c.text for item in r.output if item.type == "reasoning" for c in (item.content or [])) \
        + r.output_text
    assert r.usage.input_tokens == len(ids) == chat.usage.prompt_tokens
    assert chat.usage.completion_tokens == m.usage.output_tokens == r.usage.output_tokens
    assert chat_text == m_text == r_text


def bad_openai(server, content_parts, match: str, client=None):
    with pytest.raises(openai.BadRequestError) as e:
        (client or oa(server)).chat.completions.create(model="mm", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, *content_parts]}])
    assert match in e.value.message, e.value.message


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_are_a_400_naming_the_problem_and_the_server_keeps_serving(mm):
    corrupt = png()[:60] + b"\x00" * 40
    tiff = encode(Image.new("RGB", (8, 8), (1, 2, 3)), "TIFF")
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"/>'
    bomb = png_bytes(100_000, 100_000, zlib.compress(b"\x00" * 64))
    where = "messages[0].content[1].image_url.url"
    bad_openai(mm, [image_part(data_url(corrupt))], f"{where}: cannot decode the image")
    bad_openai(mm, [image_part(data_url(tiff, "image/tiff"))], "unsupported image format TIFF")
    bad_openai(mm, [image_part(data_url(svg, "image/svg+xml"))], "unsupported image format SVG")
    bad_openai(mm, [image_part(data_url(bomb))], "decompression bomb")
    bad_openai(mm, [image_part(data_url(png()))] * 9, "too many images: at most 8 per request")
    bad_openai(mm, [image_part("http://127.0.0.1:1/cat.png")], f"{where}: image URLs are not allowed")
    bad_openai(mm, [image_part("file:///etc/passwd")], "unsupported image URL scheme 'file'")
    bad_openai(mm, [image_part("data:text/plain;base64,aGk=")], "is not an image type")
    # the placeholder text typed by the user: its pad token does not count as an image
    with pytest.raises(openai.BadRequestError, match="placeholder"):
        oa(mm).chat.completions.create(model="mm", max_tokens=2, messages=chat_image(data_url(png()),
                                                                                   "<|image_pad|> "))
    with pytest.raises(openai.BadRequestError, match="file_id"):
        oa(mm).responses.create(model="mm", input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}])
    with pytest.raises(anthropic.BadRequestError, match="image URLs are not allowed"):
        an(mm).messages.create(model="mm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="document blocks are not supported"):
        an(mm).messages.create(model="mm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].content\[0\].source.data: malformed base64"):
        an(mm).messages.create(model="mm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!!"}}]}])
    # still serving: a text request, and (engine permitting) an image request
    assert oa(mm).chat.completions.create(model="mm", max_tokens=2, messages=[
        {"role": "user", "content": "hello"}]).usage.completion_tokens >= 1
    if ENGINE_TAKES_IMAGES:
        assert oa(mm).chat.completions.create(model="mm", max_tokens=2, messages=chat_image(
            data_url(png()))).usage.prompt_tokens > 35


def test_a_text_only_model_refuses_images(text_only):
    client = oa(text_only)
    bad_openai(text_only, [image_part(data_url(png()))], "this model takes text only", client=client)
    with pytest.raises(anthropic.BadRequestError, match="this model takes text only"):
        an(text_only).messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png()).decode()}}]}])
    assert client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "hello"}]).choices[0].finish_reason in ("stop", "length")


def test_anthropic_count_tokens_counts_image_tokens(mm):
    image = png(seed=3)
    ids, _, n = expected(mm, image, "Count: ")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    count = an(mm).messages.count_tokens(model="mm", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Count: "}, block]}])
    assert count.input_tokens == len(ids)
    # an image in a tool result counts too: two images, two placeholder runs
    two = an(mm).messages.count_tokens(model="mm", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Count: "}, block]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}],
        tools=[{"name": "shot", "description": "a screenshot", "input_schema": {"type": "object"}}])
    assert two.input_tokens > count.input_tokens + n


class _Images(http.server.BaseHTTPRequestHandler):
    """/a.png: a PNG; /slow.png: the PNG after 2 s; /drip.png: 40 bytes, one every 0.2 s (how many
    were sent before the client hung up: ``drip_sent``); /missing.png: 404; /text: not an image;
    /to-a.png: a redirect to /a.png."""
    drip_sent: list[int] = []

    def do_GET(self):
        if self.path == "/missing.png":
            self.send_error(404)
            return
        if self.path == "/to-a.png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(2)
        body = b"not an image" if self.path == "/text" else png()
        if self.path == "/drip.png":
            self.send_response(200)
            self.end_headers()
            sent = 0
            try:
                for byte in body[:40]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    sent += 1
                    time.sleep(0.2)
            except OSError:                  # the client hung up
                pass
            _Images.drip_sent.append(sent)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_image_urls_are_fetched_only_when_allowed_within_a_timeout_and_a_cap(mm):
    """``allow_urls``: an http URL is fetched (in ``prepare``, off the event loop) within the
    policy's timeout and byte cap; every failure is a 400 naming the part."""
    vision = mm.app.state.service.vision
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        def fetch(path: str, *, private: bool = True, **policy):
            parts = ImageParts(vision, ImagePolicy(allow_urls=True, allow_private_urls=private, **policy))
            sentinel = parts.add_url(base + path, "messages[0].content[0].image_url.url")
            assert parts.substitute(f"a {sentinel} b") == f"a {vision.placeholder} b"
            return vision.prepare(parts.order, parts.policy)

        [image] = fetch("/a.png")
        assert image.n_tokens == 35 and image.grid == (1, 10, 14)
        assert fetch("/to-a.png")[0].n_tokens == 35                       # a redirect is followed
        # every failure is the same 400 (no port scanner): a loopback address (refused by default,
        # also behind a redirect), too many bytes, a 404, a slow or dripping server, not an image
        failures = [("/a.png", {"private": False}), ("/to-a.png", {"private": False}),
                    ("/a.png", {"max_url_bytes": 100}), ("/missing.png", {}), ("/slow.png", {"url_timeout_s": 0.5}),
                    ("/drip.png", {"url_timeout_s": 1.0}), ("/text", {})]
        texts = set()
        for path, policy in failures:
            with pytest.raises(ApiError) as e:
                fetch(path, **policy)
            assert e.value.status == 400 and "image_url.url: the image URL could not be fetched as an image" in \
                e.value.message, (path, e.value.message)
            texts.add(re.sub(r"\(.*\)", "", e.value.message))
        assert len(texts) == 1
        # the dripping server was cut off at the deadline (1 s: ~5 bytes, and the writes that find the
        # socket closed), not after its 40 bytes (a read of 64 KiB waited for every byte)
        time.sleep(0.5)
        assert _Images.drip_sent and _Images.drip_sent[0] < 40, _Images.drip_sent
        with pytest.raises(ApiError, match="not allowed"):
            ImageParts(vision, ImagePolicy()).add_url(base + "/a.png", "x")
    finally:
        site.shutdown()


def test_a_requests_images_share_one_decoded_pixel_budget(mm):
    """``max_request_pixels``: each 40x56 image (2,240 pixels) fits alone, two do not fit 3,000."""
    vision = mm.app.state.service.vision
    policy = ImagePolicy(max_request_pixels=3000)
    one = ImageParts(vision, policy)
    data = base64.b64encode(png()).decode()
    s1 = one.add_base64("image/png", data, "messages[0].content[0].source")
    one.substitute(s1)
    assert len(vision.prepare(one.order, policy)) == 1
    two = ImageParts(vision, policy)
    s1 = two.add_base64("image/png", data, "messages[0].content[0].source")
    s2 = two.add_base64("image/png", data, "messages[0].content[1].source")
    two.substitute(f"{s1} {s2}")
    with pytest.raises(ApiError, match=r"messages\[0\].content\[1\].source: the request's images hold more than 3000"):
        vision.prepare(two.order, policy)


def test_max_image_tokens_caps_how_large_images_are_resized(mm):
    """``create_app(max_image_tokens=N)`` (``zoo serve --max-image-tokens``): the spec's max_pixels is
    capped at N * factor**2 (factor = patch 4 * merge 2), so no image makes more than N tokens; this
    processor's own 4,096 pixels (64 tokens) are under the default 1024 and stay."""
    from zoo.server.image_inputs import VisionInputs
    assert mm.app.state.service.vision.spec.max_pixels == 4096
    assert mm.app.state.service.engine.generator.max_image_tokens == 1024
    data = base64.b64encode(png(200, 120)).decode()
    counts = {}
    for cap in (None, 40, 16, 2):
        vision = VisionInputs.from_model(mm.model, ImagePolicy(), cap)
        assert vision.spec.max_pixels == (4096 if cap is None else cap * 64)
        assert vision.spec.min_pixels <= vision.spec.max_pixels
        parts = ImageParts(vision, ImagePolicy())
        parts.substitute(parts.add_base64("image/png", data, "x"))
        (image,) = vision.prepare(parts.order)
        counts[cap] = image.n_tokens
    assert counts[None] == 60 and 16 < counts[40] <= 40 and 0 < counts[16] <= 16 and counts[2] <= 2, counts


def test_an_image_over_the_engines_limit_is_a_400_and_leaves_no_waiting_job(mm):
    """Qwen's resize keeps one side at least one merged patch, so a very wide image under a tiny
    ``max_image_tokens`` (2) still makes 17 tokens: the engine refuses it (a 400 naming the count and
    the limit), and the refused request holds no place in the queue."""
    app = create_app(mm.model, api_key=KEY, model_name="mm", max_batch=1, max_image_tokens=2, prefix_cache_gb=0)
    with ServerThread(app) as s:
        wide = data_url(png(1200, 8))
        for _ in range(2):
            with pytest.raises(openai.BadRequestError, match="17 image tokens, more than this engine's limit of 2"):
                oa(s).chat.completions.create(model="mm", messages=chat_image(wide), max_tokens=2)
        engine = app.state.service.engine
        assert engine._waiting == 0 and not engine._jobs
        r = oa(s).chat.completions.create(model="mm", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")


def test_a_warmed_server_compiles_nothing_for_images(mm):
    """The module's server warmed up before it served (``create_app(warmup=True)``): images of other
    sizes and aspect ratios (other grids; this processor keeps every image under 64 tokens, so one
    tower bucket: the buckets are ``tests/engine/test_images_compile_once.py``'s), two in one
    message, through both SDKs, streamed or not, with logprobs, compile nothing
    (``zoo.engine.compile_cache.CompileCounter``)."""
    from zoo.engine.compile_cache import CompileCounter

    two = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, image_part(data_url(png(40, 24))),
                                        image_part(data_url(png(64, 64, seed=2)))]}]
    with CompileCounter() as counter:
        for w, h in ((16, 16), (200, 120), (56, 30)):
            oa(mm).chat.completions.create(model="mm", messages=chat_image(data_url(png(w, h))), max_tokens=3,
                                           logprobs=True, top_logprobs=2)
        oa(mm).chat.completions.create(model="mm", messages=two, max_tokens=3, temperature=0.8, seed=1)
        with oa(mm).chat.completions.create(model="mm", messages=chat_image(data_url(png(90, 50))), max_tokens=3,
                                            stream=True) as stream:
            list(stream)
        an(mm).messages.create(model="mm", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(30, 70)).decode()}},
            {"type": "text", "text": "What is it?"}]}])
    assert counter.compiled == 0 and counter.loaded == 0, (counter.compiled, counter.loaded)
