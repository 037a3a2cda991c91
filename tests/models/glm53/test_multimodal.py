"""GLM-5.3 with images: zoo's multimodal forward (``zoo.load`` of an HF ``glm5_next`` checkpoint with a
vision tower, ``multimodal.prepare`` -> ``encode_images`` -> ``gather_rows`` -> ``model(..., mm=)``) vs transformers'
``Glm5NextForConditionalGeneration(input_ids, attention_mask, pixel_values, image_grid_thw)``
(PyTorch, CPU, float32, same random weights); the cache path (prefill with images, then decode);
the MTP layer with image rows (vs the numpy MTP of ``reference``, fed the image rows as embeddings).

Oracle: max |zoo - torch| <= 1e-4 * max |torch logit| (``rel_err``), with margins at the reference's
discrete choices (router, indexer top-k) checked, so agreement is not luck.
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

import zoo
from tests.models.glm53 import reference as ref
from tests.support.helpers import rel_err
from zoo import registry
from zoo.models.glm53.multimodal import MMInputs, gather_rows, mm_inputs, placeholder_masks, prepare
from zoo.models.glm53.vision import VisionConfig, merged_lengths

MARGIN = 1e-5
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, projection_intermediate_size=40,
              swiglu_limit=1.5, rms_norm_eps=1e-5, rope_parameters={"rope_type": "axial", "rope_theta": 500.0})
TOKENS = dict(image_token_id=500, video_token_id=501, image_start_token_id=502, image_end_token_id=503,
              video_start_token_id=504, video_end_token_id=505)
GRIDS = (((1, 4, 6), (1, 8, 4)), ((1, 4, 4),))     # row 0: two images of different grids; row 1: one
T, PAD, DECODE = 32, 8, 3                          # prompt length, row 1's left padding, decode steps


def _text_config() -> dict:
    tiny = json.loads(registry.preset_path("glm53-tiny.json").read_text())
    drop = {"model_type", "architectures", "num_nextn_predict_layers"}
    return {k: v for k, v in tiny.items() if k not in drop}


def _prompt(rng, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """ids, mask [2, T]: row 0 text, image A, text, image B, text; row 1 left padding, text, image C, text."""
    start, end, pad = TOKENS["image_start_token_id"], TOKENS["image_end_token_id"], TOKENS["image_token_id"]
    text = lambda n: list(rng.integers(1, 400, n))          # below the special ids
    a, b = merged_lengths(GRIDS[0], 2)
    (c,) = merged_lengths(GRIDS[1], 2)
    row0 = text(5) + [start] + [pad] * a + [end] + text(3) + [start] + [pad] * b + [end]
    row0 += text(T - len(row0))
    row1 = text(4) + [start] + [pad] * c + [end]
    row1 = [0] * PAD + row1 + text(T - PAD - len(row1))
    ids = np.array([row0, row1], np.int64)
    mask = np.ones(ids.shape, bool)
    mask[1, :PAD] = False
    assert ids.max() < vocab
    return ids, mask


@pytest.fixture(scope="module")
def glm_mm(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm-mm")
    hf_cfg = Glm5NextConfig(text_config=_text_config(), vision_config=VISION, **TOKENS)
    hf_cfg._attn_implementation = "eager"
    hf_cfg.text_config._attn_implementation = "eager"
    hf_cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(11)
    tm = Glm5NextForConditionalGeneration(hf_cfg).eval()
    ref.redraw_(tm, seed=11)
    ref.redraw_vision_(tm.model.visual, seed=12)
    tm.save_pretrained(path)
    mtp = ref.mtp_tensors(tm.config.text_config, seed=13, with_copies=True)
    save_file(mtp, str(path / "model-mtp.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    assert not (path / "model.safetensors.index.json").exists()   # one file + the MTP file, no index

    model = zoo.load(path, dtype="float32")
    rng = np.random.default_rng(5)
    ids, mask = _prompt(rng, hf_cfg.text_config.vocab_size)
    patch_dim = 3 * 2 * 4 * 4
    patches = [rng.standard_normal((sum(t * h * w for t, h, w in g), patch_dim)).astype(np.float32) for g in GRIDS]
    nxt = rng.integers(1, 400, (2, DECODE))
    return dict(path=path, torch=tm, model=model, ids=ids, mask=mask, patches=patches, next=nxt, mtp=mtp)


# -- zoo side ---------------------------------------------------------------------------------------
@partial(jax.jit, static_argnums=(0, 3))
def _encode(graphdef, state, patches, grid):
    return nnx.merge(graphdef, state).encode_images(patches, grid)


@partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask, cache, mm):
    return nnx.merge(graphdef, state)(ids, mask, cache, mm=mm)


@partial(jax.jit, static_argnums=0)
def _mtp(graphdef, state, hidden, next_ids, mask, cache, mm):
    return nnx.merge(graphdef, state).mtp_forward(hidden, next_ids, mask, cache, mm=mm)


def _images(c) -> list[list[tuple[np.ndarray, tuple[int, int, int]]]]:
    """Each row's images as ``(patches, grid)`` pairs (``prepare``'s input)."""
    out = []
    for grid, patches in zip(GRIDS, c["patches"]):
        split = np.split(patches, np.cumsum([t * h * w for t, h, w in grid])[:-1])
        out.append(list(zip(split, grid)))
    return out


def _mm(c, ids, mask=None) -> MMInputs:
    """``mm_inputs`` with the tower jitted (its grid static)."""
    batch = prepare(ids, _images(c)[:len(ids)], c["model"].config, mask)
    graphdef, state = nnx.split(c["model"].module)
    return gather_rows(_encode(graphdef, state, jnp.asarray(batch.patches), batch.grid), batch)


def _run(c, ids, mask, cache, mm):
    graphdef, state = nnx.split(c["model"].module)
    return _forward(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), cache, mm)


# -- torch side -------------------------------------------------------------------------------------
def _torch_row(c, r: int, ids: np.ndarray):
    """(logits [S, V], post-norm hidden [S, D], margins) of row r's unpadded tokens ``ids`` with its images."""
    tm = c["torch"]
    kwargs = dict(pixel_values=torch.from_numpy(c["patches"][r]), image_grid_thw=torch.tensor(GRIDS[r]))
    with torch.no_grad(), ref.record_margins(tm) as margins:
        out = tm.model(input_ids=torch.as_tensor(ids[None]), **kwargs)
        logits = tm.lm_head(out.last_hidden_state)
    return logits[0].numpy(), out.last_hidden_state[0].numpy(), margins


def test_checkpoint_loads_the_tower(glm_mm):
    c = glm_mm
    cfg = c["model"].config
    assert cfg.vision is not None and cfg.vision.depth == 2 and cfg.vision.out_hidden_size == cfg.hidden_size
    assert (cfg.image_token_id, cfg.video_start_token_id, cfg.video_end_token_id) == (500, 504, 505)
    assert c["model"].load_info["unused_tensors"] == []
    qkv = c["model"].module.visual.blocks[1].attn.qkv.kernel.get_value()
    assert qkv.shape == (32, 96) and np.std(np.asarray(qkv)) > 0.05          # filled, not the zeros it starts as
    # the tower's rows are transformers' get_image_features
    graphdef, state = nnx.split(c["model"].module)
    ours = np.concatenate([np.asarray(_encode(graphdef, state, jnp.asarray(p), g))
                           for p, g in zip(c["patches"], GRIDS)])
    with torch.no_grad():
        theirs = torch.cat([torch.cat(c["torch"].model.get_image_features(
            torch.from_numpy(p), torch.tensor(g)).pooler_output) for p, g in zip(c["patches"], GRIDS)]).numpy()
    assert rel_err(ours, theirs) <= 1e-5
    # vision=False: the same checkpoint as a text model, the tower's tensors ignored
    text = zoo.load(c["path"], dtype="float32", vision=False)
    assert text.config.vision is None and text.module.visual is None and text.load_info["unused_tensors"] == []


def test_multimodal_logits_match_transformers(glm_mm):
    c = glm_mm
    ids, mask = c["ids"], c["mask"]
    mm = _mm(c, ids, mask)
    assert mm.is_image.sum() == sum(sum(merged_lengths(g, 2)) for g in GRIDS) and mm.positions is None
    eager = mm_inputs(c["model"].module, prepare(ids, _images(c), c["model"].config, mask))
    assert rel_err(eager.rows, mm.rows) <= 1e-6 and (eager.is_image == mm.is_image).all()
    logits, _, _ = _run(c, ids, mask, c["model"].module.init_cache(2, T + DECODE), mm)
    logits = np.asarray(logits)
    text_only = np.asarray(_run(c, ids, mask, c["model"].module.init_cache(2, T + DECODE), None)[0])
    for r in range(2):
        valid = mask[r]
        theirs, _, margins = _torch_row(c, r, ids[r, valid])
        err = rel_err(logits[r, valid], theirs)
        print(f"row {r}: logits rel err vs transformers {err:.2e} (max |logit| {np.abs(theirs).max():.2f}, "
              f"margins {margins})")
        assert min(margins.values()) > MARGIN, "reference top-k near a tie: pick another seed"
        assert np.std(theirs) > 0.5
        assert err <= 1e-4
        first = np.argmax(mm.is_image[r])
        assert rel_err(text_only[r, first:], logits[r, first:]) > 1e-2     # the images matter
    # HF's batched call (left padding + attention_mask, all images at once) agrees on the real tokens
    with torch.no_grad():
        batched = c["torch"](input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask, dtype=torch.long),
                             pixel_values=torch.from_numpy(np.concatenate(c["patches"])),
                             image_grid_thw=torch.tensor(GRIDS[0] + GRIDS[1])).logits.numpy()
    err = rel_err(logits[mask], batched[mask])
    print(f"batched transformers call (left padded): rel err {err:.2e}")
    assert err <= 1e-4


def _torch_incremental(c, r: int, prompt: np.ndarray, nxt: np.ndarray):
    """transformers' logits of row r: its prompt with its images (``use_cache``), then ``nxt`` one
    token at a time through ``past_key_values`` -> (logits [1 + len(nxt), V], margins)."""
    tm = c["torch"]
    images = dict(pixel_values=torch.from_numpy(c["patches"][r]), image_grid_thw=torch.tensor(GRIDS[r]))
    with torch.no_grad(), ref.record_margins(tm) as margins:
        out = tm(input_ids=torch.as_tensor(prompt[None]), use_cache=True, **images)
        steps, cache = [out.logits[0, -1]], out.past_key_values
        for token in nxt:
            out = tm(input_ids=torch.as_tensor([[token]]), past_key_values=cache, use_cache=True)
            steps.append(out.logits[0, -1])
            cache = out.past_key_values
    return torch.stack(steps).numpy(), margins


def test_prefill_with_images_then_decode(glm_mm):
    """Prefill the prompt with its images through the cache, then DECODE text tokens one at a time;
    each row matches transformers' incremental decoding (its ``past_key_values``) of the same tokens."""
    c = glm_mm
    ids, mask, nxt = c["ids"], c["mask"], c["next"]
    cache = c["model"].module.init_cache(2, T + DECODE)
    logits, _, cache = _run(c, ids, mask, cache, _mm(c, ids, mask))
    steps = [np.asarray(logits)[:, -1]]
    for s in range(DECODE):
        logits, _, cache = _run(c, nxt[:, s:s + 1], np.ones((2, 1), bool), cache, None)
        steps.append(np.asarray(logits)[:, 0])
    ours = np.stack(steps, axis=1)                                          # [2, DECODE + 1, V]
    for r in range(2):
        theirs, margins = _torch_incremental(c, r, ids[r, mask[r]], nxt[r])
        err = rel_err(ours[r], theirs)
        print(f"row {r}: prefill + {DECODE} decode steps vs transformers' incremental: {err:.2e} (margins {margins})")
        assert min(margins.values()) > MARGIN
        assert err <= 1e-4


def test_mtp_takes_the_image_rows(glm_mm):
    """The MTP layer embeds x_{t+1}; at an image placeholder that is the tower's row (vLLM's MTP
    drafters; transformers has no MTP): zoo vs the numpy MTP fed the rows as embeddings (row 0)."""
    c = glm_mm
    tm, ids = c["torch"], c["ids"][:1]
    mm = _mm(c, ids)
    graphdef, state = nnx.split(c["model"].module)
    mask = np.ones(ids.shape, bool)
    _, hidden, cache = _run(c, ids, mask, c["model"].module.init_cache(1, T), mm)
    shifted = MMInputs(mm.rows[:, 1:], mm.is_image[:, 1:])
    run = lambda m: np.asarray(_mtp(graphdef, state, hidden[:, :-1], jnp.asarray(ids[:, 1:], jnp.int32),
                                    jnp.asarray(mask[:, 1:]), cache, m)[0])
    ours = run(shifted)
    no_images = MMInputs(shifted.rows, jnp.zeros_like(shifted.is_image))
    plain = np.asarray(c["model"].module.mtp_forward(hidden[:, :-1], jnp.asarray(ids[:, 1:], jnp.int32),
                                                     jnp.asarray(mask[:, 1:]), cache)[0])
    assert rel_err(run(no_images), plain) <= 1e-6
    # numpy reference: each placeholder becomes a token of its own whose embedding is its row
    sd = tm.state_dict()
    embed = sd["model.language_model.embed_tokens.weight"].numpy()
    vocab = embed.shape[0]
    ext_ids = ids.copy()
    ext_ids[np.asarray(mm.is_image)] = vocab + np.arange(int(mm.is_image.sum()))
    ext_embed = np.concatenate([embed, np.asarray(mm.rows)[np.asarray(mm.is_image)]])
    _, torch_hidden, _ = _torch_row(c, 0, ids[0])
    theirs, margins = ref.numpy_mtp_logits(ext_ids, torch_hidden[None], ext_embed, sd["lm_head.weight"].numpy(),
                                           c["mtp"], tm.config.text_config)
    err = rel_err(ours, theirs)
    print(f"MTP with image rows vs numpy reference: {err:.2e} (margins {margins}); "
          f"vs placeholder embeddings {rel_err(plain, theirs):.2e}")
    assert min(margins.values()) > MARGIN
    assert err <= 1e-4 < rel_err(plain, theirs)


def test_prepare_follows_the_placeholder_rule():
    """Placeholders inside a video span are the video's (frames in order), the others the images';
    each takes the index of its row in the batch's encoded rows (images, then videos, row by row)."""
    from types import SimpleNamespace

    vision = VisionConfig(**{k: v for k, v in VISION.items() if k != "rope_parameters"})
    cfg = SimpleNamespace(hidden_size=64, vision=vision, **TOKENS)
    i, vs, ve, s, e = 500, 504, 505, 502, 503
    ids = np.array([[7, s, i, i, e, vs, s, i, e, 9, s, i, e, ve, s, i, e],
                    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, s, i, e, 8]])
    image_mask, video_mask = placeholder_masks(ids, cfg)
    assert image_mask[0].nonzero()[0].tolist() == [2, 3, 15] and video_mask[0].nonzero()[0].tolist() == [7, 11]
    patches = lambda g: np.zeros((g[0] * g[1] * g[2], vision.patch_dim), np.float32)
    images = [[(patches((1, 2, 4)), (1, 2, 4)), (patches((1, 2, 2)), (1, 2, 2))], [(patches((1, 2, 2)), (1, 2, 2))]]
    videos = [[(patches((2, 2, 2)), (2, 2, 2))], []]
    mask = np.ones(ids.shape, bool)
    mask[1, :12] = False
    batch = prepare(ids, images, cfg, mask, videos=videos)
    assert batch.grid == ((1, 2, 4), (1, 2, 2), (2, 2, 2), (1, 2, 2)) and batch.patches.shape == (24, vision.patch_dim)
    assert batch.index[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 2, 0]
    assert batch.index[1, 14] == 5 and (batch.is_image == (image_mask | video_mask)).all()
    assert batch.positions is None
    with pytest.raises(ValueError, match="row 0: 3 image placeholder tokens, its images make 2 rows"):
        prepare(ids, [images[0][:1], images[1]], cfg, mask, videos=videos)
    with pytest.raises(ValueError, match="row 0: 2 video placeholder tokens, its videos make 0 rows"):
        prepare(ids, images, cfg, mask)
    with pytest.raises(ValueError, match="expected"):
        prepare(ids, [images[0], [(patches((1, 2, 4)), (1, 2, 2))]], cfg, mask, videos=videos)
