"""A tiny multimodal Qwen3.5-style checkpoint for server tests, and the in-process greedy reference.

``write_checkpoint(dir)`` writes, with transformers' ``Qwen3_5ForConditionalGeneration`` (random
weights at a realistic spread, as ``tests/models/qwen38/test_multimodal.py`` draws them): the
``qwen38-tiny`` text model (vocabulary 516) + a 2-block vision tower (patch 4, temporal 2, merge
2); ``tokenizer.json`` = the embedded tiny tokenizer plus the special tokens ``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>`` (ids 512..515, the config's token ids);
the embedded ``tokenizer_config.json`` (its chat template); and a ``preprocessor_config.json``
(mean = std = 0.5, 256..4096 pixels: a 40x56 image is a 10x14 patch grid, 35 image tokens).

``reference_greedy(model, ids, images, steps)``: the model's own multimodal prefill
(``zoo.models.qwen38.multimodal``) and greedy decoding, in process, no engine.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from zoo.registry import embedded_path

VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=16)
SPECIAL = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
VOCAB = 516                  # = the tokenizer (512 + 4): every id the model can emit decodes
PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "min_pixels": 256, "max_pixels": 4096,
                "image_processor_type": "Qwen2VLImageProcessor"}


def write_checkpoint(path: Path) -> Path:
    """The tiny multimodal checkpoint in ``path`` (module docstring); returns ``path``."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.models.qwen38 import reference as ref

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny = Path(embedded_path("qwen38-tiny"))
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    ids = [tok.token_to_id(t) for t in SPECIAL]
    assert max(ids) < VOCAB, ids
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(tiny / "tokenizer_config.json", path / "tokenizer_config.json")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))

    text = json.loads((tiny / "config.json").read_text())
    for k in ("model_type", "architectures", "mtp_num_hidden_layers"):
        text.pop(k, None)
    text["vocab_size"] = VOCAB
    cfg = Qwen3_5Config(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                        tie_word_embeddings=False, vision_start_token_id=ids[0], image_token_id=ids[1],
                        vision_end_token_id=ids[2], video_token_id=ids[3])
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    ref.redraw_(model.model.language_model, seed=3)
    ref.redraw_(model.lm_head, seed=4)
    ref.redraw_vision_(model.model.visual, seed=5)
    model.save_pretrained(path)
    return path


def png(width: int = 56, height: int = 40, seed: int = 0) -> bytes:
    """A random RGB PNG of that size."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def reference_greedy(model, ids: list[int], images: list[tuple[np.ndarray, tuple[int, int, int]]],
                     steps: int, eos: frozenset = frozenset()) -> list[int]:
    """Greedy tokens after ``ids`` (which hold each image's full placeholder run) and ``images``
    ((patches, grid) each, in order): one multimodal prefill of the model, then one token a step;
    stops after an ``eos`` token (included) or ``steps`` tokens."""
    from zoo.models.qwen38.multimodal import MMInputs, prepare

    module = model.module
    graphdef, state = nnx.split(module)
    batch = prepare(np.asarray([ids]), [images], model.config)

    def mm(s, ids, mask, cache, patches, index, is_image, positions, grid):
        m = nnx.merge(graphdef, s)
        rows = jnp.take(m.encode_images(patches, grid), index, axis=0)
        logits, _, cache = m(ids, mask, cache, mm=MMInputs(rows, is_image, positions))
        return logits, cache

    @jax.jit
    def text(s, ids, mask, cache):
        logits, _, cache = nnx.merge(graphdef, s)(ids, mask, cache)
        return logits, cache

    ids_a = jnp.asarray([ids])
    mask = jnp.ones(ids_a.shape, bool)
    cache = module.init_cache(1, len(ids) + steps)
    logits, cache = jax.jit(mm, static_argnums=8)(state, ids_a, mask, cache, jnp.asarray(batch.patches),
                                                  jnp.asarray(batch.index), jnp.asarray(batch.is_image),
                                                  jnp.asarray(batch.positions), batch.grid)
    out = [int(np.argmax(np.asarray(logits)[0, -1]))]
    while len(out) < steps and out[-1] not in eos:
        logits, cache = text(state, jnp.asarray([[out[-1]]]), jnp.ones((1, 1), bool), cache)
        out.append(int(np.argmax(np.asarray(logits)[0, 0])))
    return out


GLM_SPECIAL = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
               "<|video|>")
GLM_VOCAB = 518              # the embedded GLM tokenizer (512) + 6
GLM_PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "min_image_tokens": 4, "max_image_tokens": 64,
                    "image_processor_type": "Glm5NextImageProcessor"}


def write_glm_checkpoint(path: Path) -> Path:
    """The GLM-5.3 counterpart of ``write_checkpoint``: the ``glm53-tiny`` text model (vocabulary 518,
    no MTP layer) + a 2-block GLM tower (patch 4, temporal 2, merge 2) written by transformers'
    ``Glm5NextForConditionalGeneration``; the embedded tokenizer plus ``<|begin_of_image|>``,
    ``<|image|>``, ``<|end_of_image|>`` and the video tokens (ids 512..517, the config's ids), its chat
    template, and a GLM ``preprocessor_config.json`` (4..64 image tokens: a 40x56 image is 35)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.models.glm53 import reference as ref
    from tests.models.glm53.test_multimodal import VISION as GLM_VISION

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny = Path(embedded_path("glm53-tiny"))
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL])
    ids = [tok.token_to_id(t) for t in GLM_SPECIAL]
    assert max(ids) < GLM_VOCAB, ids
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(tiny / "tokenizer_config.json", path / "tokenizer_config.json")
    (path / "preprocessor_config.json").write_text(json.dumps(GLM_PREPROCESSOR))
    text = json.loads((tiny / "config.json").read_text())
    for k in ("model_type", "architectures", "num_nextn_predict_layers"):
        text.pop(k, None)
    text["vocab_size"] = GLM_VOCAB
    cfg = Glm5NextConfig(text_config=text, vision_config={**GLM_VISION, "out_hidden_size": text["hidden_size"]},
                         image_start_token_id=ids[0], image_token_id=ids[1], image_end_token_id=ids[2],
                         video_start_token_id=ids[3], video_end_token_id=ids[4], video_token_id=ids[5])
    torch.manual_seed(11)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    ref.redraw_(model, seed=11)
    ref.redraw_vision_(model.model.visual, seed=12)
    model.save_pretrained(path)
    return path
