"""Images compile nothing after warmup (issue 34): a warmed ``Generator`` on a tiny multimodal checkpoint
(Qwen3.5-style, 2-block tower, MTP drafts, the prefix cache on) serves prompts with images of many
grids with zero XLA compilations (``zoo.engine.compile_cache.CompileCounter``).

The mix: a small square image, a non-square one, a two-frame (t = 2) one, one of exactly the first
bucket's 256 rows, one near the largest bucket (360 of 384 rows), two images in one prompt, a prompt
whose cached prefix covers its image (the tower skipped), and a prefix hit ending inside an image
run. Oracle for four of them: the greedy tokens of the model's full forward
(``greedy_reference``). Also: the buckets' rule, the program set's names, the warmup's stages, and
the refusal of an image over ``max_image_tokens``.
"""

from __future__ import annotations

import numpy as np
import pytest

import zoo
from tests.support.multimodal_checkpoints import greedy_reference, image_tokens, qwen_mm_checkpoint
from zoo.engine.compile_cache import CompileCounter
from zoo.engine.generator import Generator
from zoo.engine.image_prefill import image_buckets
from zoo.engine.prefix_cache import PrefixCache
from zoo.engine.request import ImageInput

GB, NEW, CAP = 2**30, 4, 384            # CAP: not 256 * 2^i, so it is the last bucket itself


def prompt_parts(model, seed: int):
    """(patch dim, ``text(n)``: n random ids that are no special token, ``run_of(image)``: its
    placeholder run with the start and end tokens) for building prompts with images."""
    pad, start, end = image_tokens(model)
    rng = np.random.default_rng(seed)
    return (model.config.vision.patch_dim, lambda n: rng.integers(10, 400, n).tolist(),
            lambda im: [start] + [pad] * im.n_tokens + [end])


def test_the_buckets_are_powers_of_two_times_256_up_to_the_cap():
    assert image_buckets(1024) == (256, 512, 1024)
    assert image_buckets(1000) == (256, 512, 1000)
    assert image_buckets(384) == (256, 384)
    assert image_buckets(256) == (256,)
    assert image_buckets(100) == (100,)
    assert image_buckets(4096) == (256, 512, 1024, 2048, 4096)
    with pytest.raises(ValueError, match="max_image_tokens must be >= 1"):
        image_buckets(0)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    model = zoo.load(qwen_mm_checkpoint(tmp_path_factory.mktemp("qwen")), dtype="float32")
    gen = Generator(model, spec_tokens=2, spec_policy="fixed", max_batch=2, context=1024, prefill_chunk=256,
                    prefix_cache=PrefixCache(GB, GB, 16), max_image_tokens=CAP)
    progress = []
    gen.warmup(lambda *a: progress.append(a))
    return model, gen, progress


def test_the_program_set_and_the_warmup_cover_images(warm):
    model, gen, progress = warm
    L = gen._L
    assert gen._images.buckets == (256, CAP) and gen.prefill_widths == (16, 256)
    assert [name for name, _, _ in gen.program_set()] == [
        f"decode B=2 L={L} MTP k=2", f"prefill width=16 L={L} + MTP rows", f"prefill width=256 L={L} + MTP rows",
        f"prefill width=16 L={L} with images + MTP rows", f"prefill width=256 L={L} with images + MTP rows"]
    mm = gen.program_set()[3][2][-1]                   # the abstract MMInputs: Qwen's M-RoPE positions too
    d = model.config.hidden_size
    assert (mm.rows.shape, mm.is_image.shape, mm.positions.shape) == ((1, 16, d), (1, 16), (3, 1, 16))
    names = [p[0] for p in progress]
    assert [p[2] for p in progress] == list(range(1, len(progress) + 1)) and progress[-1][3] == len(progress)
    images = ["image tower rows=256", f"image tower rows={CAP}", "image rows width=16", "prefill width=16 with images",
              "image rows width=256", "prefill width=256 with images"]
    assert [n for n in names if "image" in n] == images
    assert len(names) == 12                            # 6 text stages as before, 6 for images


def image(grid, seed: int, dim: int) -> ImageInput:
    t, h, w = grid
    patches = np.random.default_rng(seed).standard_normal((t * h * w, dim)).astype(np.float32)
    return ImageInput(f"{seed:064x}", patches, grid, t * h * w // 4)


def test_a_warmed_generator_compiles_nothing_for_images_of_any_grid(warm):
    model, gen, _ = warm
    dim, text, run_of = prompt_parts(model, seed=0)
    small, wide, frames = image((1, 4, 4), 1, dim), image((1, 6, 10), 2, dim), image((2, 4, 4), 3, dim)
    exact, near = image((1, 32, 32), 4, dim), image((1, 24, 60), 5, dim)     # 256 rows; 360 of 384
    left, right, inside = image((1, 4, 6), 6, dim), image((1, 8, 2), 7, dim), image((1, 16, 40), 8, dim)
    first = text(200) + run_of(inside)                                # the run is tokens 201..360
    cases = [
        (text(5) + run_of(small) + text(3), [small]),
        (text(2) + run_of(wide) + text(7), [wide]),
        (text(4) + run_of(frames) + text(4), [frames]),
        (text(3) + run_of(exact) + text(5), [exact]),
        (text(6) + run_of(near) + text(2), [near]),
        (text(3) + run_of(left) + text(5) + run_of(right) + text(4), [left, right]),
        None,                                                         # below: case 1 continued
        (first + text(10), [inside]),
        (first + text(12), [inside]),                                 # a hit at 256: inside the run
    ]
    cases[6] = (cases[1][0] + text(5), [wide])       # case 1's prompt is cached: the image is in the prefix
    encoded = []
    tower = gen._images.encode
    gen._images.encode = lambda state, im: encoded.append(im.key) or tower(state, im)
    try:
        with CompileCounter() as counter:
            out = [gen.generate([p], max_new_tokens=NEW, images=ims)[0] for p, ims in cases]
    finally:
        del gen._images.encode
    assert counter.compiled == 0 and counter.loaded == 0, (counter.compiled, counter.loaded)
    assert all(g.finish_reason in ("length", "stop") for g in out), [g.stats.get("error") for g in out]
    assert out[6].stats["cached_tokens"] == len(cases[1][0])
    assert out[8].stats["cached_tokens"] == 256
    assert encoded == [im.key for k, (_, ims) in enumerate(cases) if k != 6 for im in ims]   # 6: tower skipped
    for k in (4, 5, 6, 8):                            # near the bucket, two images, the tower skipped, the hit
        assert out[k].tokens == greedy_reference(model, cases[k][0], cases[k][1], NEW, gen.eos_token_ids)[0], k


def test_an_image_over_the_limit_is_refused(warm):
    model, gen, _ = warm
    pad, start, end = image_tokens(model)
    big = image((1, 32, 56), 9, model.config.vision.patch_dim)         # 448 rows > 384
    with pytest.raises(ValueError, match=f"448 image tokens, more than this engine's limit of {CAP}"):
        gen.submit(gen.make_request([7, start] + [pad] * 448 + [end], max_new_tokens=2, images=[big]))
    assert not gen.has_work()


def test_glm_warmed_compiles_nothing_for_images_of_any_grid(tmp_path_factory):
    """GLM-5.3 (no positions, its MTP layer takes the rows), kept small: one prefill width, one bucket
    (a cap below 256), MTP drafts, no prefix cache."""
    from tests.support.multimodal_checkpoints import glm_mm_checkpoint

    model = zoo.load(glm_mm_checkpoint(tmp_path_factory.mktemp("glm")), dtype="float32")
    gen = Generator(model, spec_tokens=1, spec_policy="fixed", max_batch=1, context=256, prefill_chunk=16,
                    prefix_cache=0, max_image_tokens=40)
    assert gen._images.buckets == (40,) and gen.prefill_widths == (16,) and not gen._images.positions
    names = [name for name, _, _ in gen.program_set()]
    assert names[-1] == f"prefill width=16 L={gen._L} with images + MTP rows" and len(names) == 3
    assert gen.program_set()[-1][2][-1].positions is None
    gen.warmup()
    dim, text, run_of = prompt_parts(model, seed=1)
    square, wide, full = image((1, 4, 4), 1, dim), image((1, 6, 10), 2, dim), image((1, 8, 20), 3, dim)
    cases = [(text(3) + run_of(square) + text(2), [square]),
             (text(2) + run_of(wide) + text(3) + run_of(full) + text(1), [wide, full])]   # 15 + 40 rows
    with CompileCounter() as counter:
        out = [gen.generate([p], max_new_tokens=NEW, images=ims)[0] for p, ims in cases]
    assert counter.compiled == 0 and counter.loaded == 0, (counter.compiled, counter.loaded)
    assert out[1].tokens == greedy_reference(model, cases[1][0], cases[1][1], NEW, gen.eos_token_ids)[0]
