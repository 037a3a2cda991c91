"""Prompts with images through the engine (``Generator`` + ``zoo.engine.image_prefill``) on tiny random
multimodal checkpoints (Qwen3.5 and GLM-5.3, each with a 2-block tower and an MTP layer).

Oracle: greedy tokens equal the argmax decoding of the model's own full forward (one prefill of the
whole prompt with the tower run on all its images, then text steps: ``greedy_reference``), with the
prompt in one piece, in pieces of 16 (the image run spans three), and with MTP drafts (k = 2);
the prefix cache keys images by content (same ids, another image: no hit, other tokens), a repeat
hits, and hits ending inside an image run or after it give the oracle's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import zoo
from tests.support.multimodal_checkpoints import glm_mm_checkpoint, greedy_reference, image_tokens, qwen_mm_checkpoint
from zoo.engine.generator import Generator
from zoo.engine.prefix_cache import PrefixCache
from zoo.engine.request import ImageInput
from zoo.engine.step_programs import takes_rows

NEW, GB = 6, 2**30
GRID = (1, 8, 8)                    # 64 patches, 16 placeholder tokens (merge 2)


@pytest.fixture(scope="module", params=["qwen", "glm"])
def arch(request, tmp_path_factory):
    make = {"qwen": qwen_mm_checkpoint, "glm": glm_mm_checkpoint}[request.param]
    model = zoo.load(make(tmp_path_factory.mktemp(request.param)), dtype="float32")
    assert model.config.vision is not None and model.module.mtp is not None
    rng = np.random.default_rng(3)
    images = [ImageInput(f"{i:064x}", rng.standard_normal((64, model.config.vision.patch_dim)).astype(np.float32),
                         GRID, 16) for i in range(2)]
    pad, start, end = image_tokens(model)
    text = lambda n: rng.integers(10, 400, n).tolist()             # noqa: E731   no special id
    prompt = text(5) + [start] + [pad] * 16 + [end] + text(10)     # 33 tokens: the run is 6..21
    chunked = Generator(model, prefill_chunk=16, prefix_cache=PrefixCache(GB, GB, 16))
    return dict(model=model, images=images, prompt=prompt, text=text, chunked=chunked,
                eos=chunked.eos_token_ids, whole=Generator(model, prefix_cache=0))


def run(gen: Generator, prompt, images, **kw):
    return gen.generate([prompt], max_new_tokens=NEW, images=images, **kw)[0]


def test_greedy_with_an_image_equals_the_full_forward(arch):
    a = arch
    want, _ = greedy_reference(a["model"], a["prompt"], a["images"][:1], NEW, a["eos"])
    got = run(a["whole"], a["prompt"], a["images"][:1])
    assert got.tokens == want and got.stats["prompt_tokens"] == 33 and len(want) > 1
    pieces = run(a["chunked"], a["prompt"], a["images"][:1])       # 16 + 16 + 1: the run spans the pieces
    assert pieces.tokens == want
    spec = Generator(a["model"], spec_tokens=2, spec_policy="fixed", prefill_chunk=16, prefix_cache=0)
    drafted = run(spec, a["prompt"], a["images"][:1])
    assert drafted.tokens == want and drafted.stats["drafted"] > 0
    assert takes_rows(a["model"].module) == ("glm" in type(a["model"].module).__module__)   # GLM's MTP takes the rows


def test_the_prefix_cache_keys_images_by_content(arch):
    a = arch
    gen, prompt, (img_a, img_b) = a["chunked"], a["prompt"], a["images"]
    gen.prefix.clear()
    want_a, first_a = greedy_reference(a["model"], prompt, [img_a], NEW, a["eos"])
    want_b, first_b = greedy_reference(a["model"], prompt, [img_b], NEW, a["eos"])
    assert np.abs(first_a - first_b).max() > 1e-3                     # the two images differ in their logits
    first = run(gen, prompt, [img_a])
    assert first.tokens == want_a and first.stats["cached_tokens"] == 0
    hits = gen.prefix.stats.hits
    again = run(gen, prompt, [img_a])
    assert again.tokens == want_a and again.stats["cached_tokens"] == 32 and gen.prefix.stats.hits == hits + 1
    other = run(gen, prompt, [img_b])                                  # the same ids, another image
    assert other.stats["cached_tokens"] == 0 and other.tokens == want_b
    assert gen.prefix.stats.hits == hits + 1
    # a hit ending inside the image run (snapshot at 16; the run is 6..21): the rest from the tower
    inside = prompt[:24] + a["text"](9)
    got = run(gen, inside, [img_a])
    assert got.stats["cached_tokens"] == 16
    assert got.tokens == greedy_reference(a["model"], inside, [img_a], NEW, a["eos"])[0]
    # a hit after the run (snapshot at 32): the tower is skipped
    after = prompt[:32] + a["text"](4)
    got = run(gen, after, [img_a])
    assert got.stats["cached_tokens"] == 32
    assert got.tokens == greedy_reference(a["model"], after, [img_a], NEW, a["eos"])[0]


def test_check_refuses_images_that_do_not_fit(arch):
    a = arch
    gen, prompt, images = a["whole"], a["prompt"], a["images"]
    pad = a["model"].config.image_token_id
    with pytest.raises(ValueError, match="1 run.*for 2 image"):
        gen.submit(gen.make_request(prompt, max_new_tokens=2, images=images))
    with pytest.raises(ValueError, match="1 run.*for 0 image|0 run|placeholder"):
        gen.submit(gen.make_request(prompt[:6] + prompt[22:], max_new_tokens=2, images=images[:1]))
    short = prompt[:6] + [pad] * 15 + prompt[22:]
    with pytest.raises(ValueError, match="image 0: .*16 rows.*has 15"):
        gen.submit(gen.make_request(short, max_new_tokens=2, images=images[:1]))
    assert not gen.has_work()


def test_a_text_only_model_refuses_images():
    model = zoo.load("qwen38-tiny", dtype="float32")
    gen = Generator(model, prefix_cache=0)
    image = ImageInput("0" * 64, np.zeros((64, 96), np.float32), GRID, 16)
    with pytest.raises(ValueError, match="this model takes text only"):
        gen.submit(gen.make_request([7, 8, 9], max_new_tokens=2, images=[image]))


def test_model_generate_takes_images_per_prompt(arch):
    a = arch
    if "glm" in type(a["model"].module).__module__:
        pytest.skip("one architecture is enough for the API (a GLM generator compiles for ~15 s)")
    prompts = [a["prompt"], a["prompt"]]
    got = a["model"].generate(prompts, max_new_tokens=NEW, images=[a["images"][:1], a["images"][1:]])
    for g, im in zip(got, (a["images"][:1], a["images"][1:])):
        assert g.tokens == greedy_reference(a["model"], a["prompt"], im, NEW, a["eos"])[0]
    with pytest.raises(ValueError, match="image lists for"):
        a["model"].generate(prompts, max_new_tokens=1, images=[a["images"][:1]])
