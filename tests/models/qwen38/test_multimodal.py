"""Qwen3.8 with images vs transformers' ``Qwen3_5ForConditionalGeneration`` (PyTorch, CPU, float32):
a tiny random multimodal checkpoint (the ``qwen38-tiny`` text model + a 2-block tower) written by
``save_pretrained`` and read by ``zoo.load``.

Oracle: max |zoo - torch| / max |torch| <= 1e-4 on the logits of the real tokens (a prompt with two
images of different grids, a left-padded one with one image), and on generate-style decoding after
the multimodal prefill; the 3-axis positions equal ``get_rope_index`` exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

import zoo
from tests.models.qwen38 import reference as ref
from tests.support.helpers import rel_err
from zoo.models.qwen38.multimodal import MMInputs, gather_rows, prepare, rope_index, text_positions
from zoo.models.qwen38.vision import VisionConfig

PRESET = Path(__file__).resolve().parents[3] / "zoo" / "configs" / "qwen38-tiny.json"
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=16)
TOKENS = dict(image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4)
IMG, VS, VE = TOKENS["image_token_id"], TOKENS["vision_start_token_id"], TOKENS["vision_end_token_id"]
GRIDS = ((1, 4, 6), (1, 8, 4), (1, 4, 4))      # row 0: the first two (6 and 8 rows); row 1: the third (4)
NEW = 4                                         # decoded tokens


def text_config() -> dict:
    t = json.loads(PRESET.read_text())
    for k in ("model_type", "architectures", "mtp_num_hidden_layers"):
        t.pop(k)
    return t


def prompts(rng) -> tuple[np.ndarray, np.ndarray]:
    """Row 0: text, image 1, text, image 2, text; row 1 (left-padded): text, image 3, text."""
    text = lambda n: list(rng.integers(10, 512, size=n))        # noqa: E731   no special token
    image = lambda g: [VS] + [IMG] * (g[0] * g[1] * g[2] // 4) + [VE]   # noqa: E731
    row0 = text(5) + image(GRIDS[0]) + text(3) + image(GRIDS[1]) + text(4)
    row1 = text(4) + image(GRIDS[2]) + text(6)
    t = len(row0)
    ids = np.zeros((2, t), np.int64)
    mask = np.zeros((2, t), bool)
    ids[0], mask[0] = row0, True
    ids[1, t - len(row1):], mask[1, t - len(row1):] = row1, True
    return ids, mask


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-mm")
    hf_cfg = Qwen3_5Config(text_config=text_config(), vision_config={**VISION, "out_hidden_size": 128},
                           tie_word_embeddings=False, **TOKENS)
    hf_cfg._attn_implementation = "eager"
    hf_cfg.text_config._attn_implementation = "eager"
    hf_cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = Qwen3_5ForConditionalGeneration(hf_cfg).eval()
    ref.redraw_(theirs.model.language_model, seed=3)
    ref.redraw_(theirs.lm_head, seed=4)
    ref.redraw_vision_(theirs.model.visual, seed=5)
    theirs.save_pretrained(path)
    model = zoo.load(path, dtype="float32")
    rng = np.random.default_rng(1)
    ids, mask = prompts(rng)
    patch_dim = 3 * 2 * 4 * 4
    pixels = [rng.standard_normal((t * h * w, patch_dim)).astype(np.float32) for t, h, w in GRIDS]
    images = [[(pixels[0], GRIDS[0]), (pixels[1], GRIDS[1])], [(pixels[2], GRIDS[2])]]
    return theirs, model, ids, mask, pixels, images


def hf_inputs(ids, mask, pixels):
    return dict(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask.astype(np.int64)),
                pixel_values=torch.from_numpy(np.concatenate(pixels)),
                image_grid_thw=torch.tensor(GRIDS, dtype=torch.long),
                mm_token_type_ids=torch.as_tensor((ids == IMG).astype(np.int32)))


def forward_fn(module):
    """jit ``(ids, mask, cache, batch pieces) -> (logits, cache)`` with the tower run inside."""
    graphdef, state = nnx.split(module)

    @jax.jit
    def text(s, ids, mask, cache):
        logits, _, cache = nnx.merge(graphdef, s)(ids, mask, cache)
        return logits, cache

    def mm(s, ids, mask, cache, patches, index, is_image, positions, grid):
        m = nnx.merge(graphdef, s)
        encoded = m.encode_images(patches, grid)
        inputs = MMInputs(jnp.take(encoded, index, axis=0), is_image, positions)
        logits, _, cache = m(ids, mask, cache, mm=inputs)
        return logits, cache

    mm = jax.jit(mm, static_argnums=8)
    return (lambda ids, mask, cache: text(state, ids, mask, cache),
            lambda ids, mask, cache, b: mm(state, ids, mask, cache, b.patches, b.index, b.is_image, b.positions,
                                           b.grid))


def test_config_and_tower_load_through_zoo(case):
    theirs, model, *_ = case
    cfg = model.config
    assert cfg.vision == VisionConfig(**VISION, out_hidden_size=128)
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (5, 6, 3, 4)
    assert cfg.mrope_section == (2, 1, 1) and cfg.rotary_axes == (0, 1, 2, 0)
    assert model.module.visual is not None and model.load_info["unused_tensors"] == []
    # the fused qkv is head-major: HF's [3, H, hd] rows reordered to [H, 3, hd] columns
    hf_qkv = theirs.model.visual.blocks[0].attn.qkv.weight.detach().numpy()              # [3 * 32, 32]
    ours = np.asarray(model.module.visual.blocks[0].attn.qkv.kernel[...])               # [32, 3 * 32]
    np.testing.assert_array_equal(ours.T.reshape(2, 3, 16, 32), hf_qkv.reshape(3, 2, 16, 32).transpose(1, 0, 2, 3))


def test_rope_index_equals_transformers(case):
    theirs, model, ids, mask, pixels, images = case
    kw = hf_inputs(ids, mask, pixels)
    want, deltas = theirs.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"], kw["image_grid_thw"],
                                               attention_mask=kw["attention_mask"])
    batch = prepare(ids, images, model.config, mask)
    np.testing.assert_array_equal(batch.positions, want.numpy())
    np.testing.assert_array_equal(batch.next_pos, (deltas[:, 0] + kw["attention_mask"].sum(1)).numpy())
    # one row, no padding
    row = ids[0]
    np.testing.assert_array_equal(rope_index(row, GRIDS[:2], model.config), want[:, 0].numpy())
    # videos: each frame its own run (HF splits video grids into frames)
    frame = [VS] + [TOKENS["video_token_id"]] * 4 + [VE]
    vids = np.array([[20, 21] + frame + [22] + frame + [23, 24]])
    types = torch.as_tensor(np.where(vids == TOKENS["video_token_id"], 2, 0).astype(np.int32))
    want, _ = theirs.model.get_rope_index(torch.as_tensor(vids), types, video_grid_thw=torch.tensor([[2, 4, 4]]))
    np.testing.assert_array_equal(rope_index(vids[0], [], model.config, video_grids=[(2, 4, 4)]), want[:, 0].numpy())
    with pytest.raises(ValueError, match="placeholders for grid"):
        rope_index(row, GRIDS[1:], model.config)


def test_multimodal_logits_match_transformers(case):
    theirs, model, ids, mask, pixels, images = case
    with torch.no_grad():
        want = theirs(**hf_inputs(ids, mask, pixels)).logits.numpy()
    batch = prepare(ids, images, model.config, mask)
    _, mm = forward_fn(model.module)
    ours, cache = mm(ids, mask, model.module.init_cache(2, ids.shape[1]), batch)
    ours = np.asarray(ours)
    for row in range(2):
        err = rel_err(ours[row, mask[row]], want[row, mask[row]])
        print(f"row {row}: multimodal logits rel err vs transformers {err:.2e}")
        assert err <= 1e-4
    assert np.std(want[mask]) > 0.5, "weights too small to exercise the model"
    np.testing.assert_array_equal(np.asarray(cache.slots.pos), batch.next_pos)
    # the images matter: the same ids with the placeholders embedded as tokens differ
    plain, _, _ = model.module(jnp.asarray(ids), jnp.asarray(mask), model.module.init_cache(2, ids.shape[1]))
    assert rel_err(np.asarray(plain)[0, mask[0]], want[0, mask[0]]) > 1e-2


def test_decoding_after_a_multimodal_prefill_matches_transformers_generate(case):
    theirs, model, ids, mask, pixels, images = case
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        out = theirs.generate(**hf_inputs(ids, mask, pixels), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    new_ids = out.sequences[:, ids.shape[1]:].numpy()
    want = np.stack([step.numpy() for step in out.logits], axis=1)                   # [B, NEW, V]
    text, mm = forward_fn(model.module)
    batch = prepare(ids, images, model.config, mask)
    logits, cache = mm(ids, mask, model.module.init_cache(2, ids.shape[1] + NEW), batch)
    steps = [np.asarray(logits)[:, -1]]
    for k in range(NEW - 1):
        logits, cache = text(new_ids[:, k:k + 1], np.ones((2, 1), bool), cache)
        steps.append(np.asarray(logits)[:, 0])
    ours = np.stack(steps, axis=1)
    err = rel_err(ours, want)
    print(f"prefill + {NEW - 1} decode steps vs transformers generate: rel err {err:.2e}")
    assert err <= 1e-4
    np.testing.assert_array_equal(np.asarray(cache.slots.pos), batch.next_pos + NEW - 1)


def test_text_positions_on_three_axes_are_the_text_path_bit_for_bit(case):
    """All three axes equal (and no image row) reduce exactly to the 1-D rotary of the text path."""
    _, model, *_ = case
    rng = np.random.default_rng(7)
    ids = rng.integers(10, 512, size=(2, 24))
    mask = np.ones((2, 24), bool)
    mask[1, :9] = False
    text, _ = forward_fn(model.module)
    graphdef, state = nnx.split(model.module)

    @jax.jit
    def with_mm(s, ids, mask, cache, positions):
        inputs = MMInputs(jnp.zeros((*ids.shape, model.config.hidden_size)), jnp.zeros(ids.shape, bool), positions)
        logits, _, cache = nnx.merge(graphdef, s)(ids, mask, cache, mm=inputs)
        return logits, cache

    a, cache_a = text(ids, mask, model.module.init_cache(2, 24))
    b, cache_b = with_mm(state, ids, mask, model.module.init_cache(2, 24), text_positions(mask))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cache_a.slots.pos), np.asarray(cache_b.slots.pos))


def test_gather_rows_places_each_image_at_its_tokens(case):
    _, model, ids, mask, _, images = case
    batch = prepare(ids, images, model.config, mask)
    encoded = jnp.arange(18 * 3, dtype=jnp.float32).reshape(18, 3)                   # 6 + 8 + 4 rows
    got = gather_rows(encoded, batch)
    rows = np.asarray(got.rows)[batch.is_image]
    np.testing.assert_array_equal(rows, np.asarray(encoded))
    assert batch.grid == GRIDS and batch.patches.shape == (24 + 32 + 16, 96)
    with pytest.raises(ValueError, match="placeholder"):
        prepare(ids, [images[0][:1], images[1]], model.config, mask)


def test_the_weight_cache_keeps_the_tower_and_its_config(case, tmp_path):
    """A streamed cache entry of the multimodal checkpoint restores the tower (its config is a nested
    dataclass in the manifest) with the same weights; ``vision=False`` is another entry (text only)."""
    import importlib

    build = importlib.import_module("zoo.weight_cache.build").build
    _, model, *_ = case
    path = model.load_info["path"]
    entry = build(path, dtype="float32", root=tmp_path, progress=False)
    restored = zoo.load(path, dtype="float32", cache=tmp_path)
    assert restored.load_info["source"] == "cache" and restored.load_info["cache_path"] == str(entry)
    assert restored.config == model.config and restored.config.vision is not None
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(restored.module.visual)),
                              nnx.to_flat_state(nnx.state(model.module.visual))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
    text_only = zoo.load(path, dtype="float32", cache=tmp_path, vision=False)
    assert text_only.load_info["source"] == "source" and text_only.module.visual is None
    assert text_only.config.vision is None and len(list(tmp_path.glob("*/manifest.json"))) == 2
