"""An image reaches GLM-5.3 through both SDKs: a tiny multimodal GLM checkpoint (transformers' own
class, a GLM tower, GLM's placeholder tokens and preprocessing) served on loopback; the OpenAI chat
and the Anthropic message with the same PNG are answered with the tokens the model's own multimodal
forward decodes greedily, and another picture changes them."""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest

import zoo
from tests.support.multimodal_checkpoints import greedy_reference
from tests.support.multimodal_server import png, write_glm_checkpoint
from zoo.engine.request import ImageInput
from zoo.images import ImageSpec, decode_image, image_key, preprocess
from zoo.server.app import ServerThread, create_app
from zoo.server.logprob_render import LogprobRenderer

KEY = "test-key"
STEPS = 8


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = write_glm_checkpoint(tmp_path_factory.mktemp("glm-mm"))
    model = zoo.load(path, dtype="float32")
    app = create_app(model, api_key=KEY, model_name="glm-mm", max_batch=2)
    with ServerThread(app) as s:
        s.model, s.path, s.app = model, path, app
        yield s


def expected(server, image: bytes, text: str):
    """(prompt ids with the image's placeholder run, ImageInput): built here, not by the server."""
    tok = server.model.tokenizer
    spec = ImageSpec.from_hf_preprocessor_config(
        json.loads((server.path / "preprocessor_config.json").read_text()), "glm5_next")
    p = preprocess(decode_image(image, max_pixels=10**7, max_bytes=10**7), spec)
    rendered = tok.apply_chat_template([{"role": "user", "content": text + spec.placeholder(p.n_tokens)}],
                                       add_generation_prompt=True)
    return tok.encode(rendered), ImageInput(image_key(image), p.pixel_values, tuple(p.grid_thw), p.n_tokens)


def test_an_image_reaches_glm_through_both_sdks(glm):
    image, text = png(seed=3), "What is it? "
    ids, inp = expected(glm, image, text)
    assert inp.n_tokens == 35 and ids.count(glm.model.config.image_token_id) == 35
    eos = tuple(glm.app.state.service.engine.generator.eos_token_ids)
    want, _ = greedy_reference(glm.model, ids, [inp], STEPS, eos)
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    chat = openai.OpenAI(base_url=glm.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="glm-mm", max_tokens=STEPS, temperature=0, logprobs=True, messages=[{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}])
    renderer = LogprobRenderer(glm.model.tokenizer)
    assert [t.token for t in chat.choices[0].logprobs.content] == [renderer.piece(t)[0] for t in want]
    assert chat.usage.prompt_tokens == len(ids)
    msg = anthropic.Anthropic(base_url=glm.url, api_key=KEY, max_retries=0).messages.create(
        model="glm-mm", max_tokens=STEPS, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}]}])
    assert msg.usage.output_tokens == chat.usage.completion_tokens == len(want)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens \
        == len(ids)
    c = chat.choices[0].message
    chat_text = ((c.model_extra or {}).get("reasoning_content") or "") + (c.content or "")
    assert "".join(getattr(b, "thinking", None) or getattr(b, "text", "") for b in msg.content) == chat_text
    # the picture matters: another one of the same size is answered otherwise by the model itself
    other_ids, other = expected(glm, png(seed=4), text)
    assert other_ids == ids and greedy_reference(glm.model, ids, [other], STEPS, eos)[0] != want


def test_max_image_tokens_caps_glm_images(glm):
    """GLM's resize (a canvas within max_pixels) under ``max_image_tokens``: at most that many tokens."""
    from zoo.server.image_inputs import ImageParts, ImagePolicy, VisionInputs
    data = base64.b64encode(png(300, 180)).decode()
    for cap in (48, 10, 1):
        vision = VisionInputs.from_model(glm.model, ImagePolicy(), cap)
        parts = ImageParts(vision, ImagePolicy())
        parts.substitute(parts.add_base64("image/png", data, "x"))
        (image,) = vision.prepare(parts.order)
        assert 0 < image.n_tokens <= cap, (cap, image.n_tokens, image.grid)
