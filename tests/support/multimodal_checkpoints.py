"""Tiny random multimodal checkpoints with an MTP layer, written by transformers' ``save_pretrained``
(the models of ``tests/models/{qwen38,glm53}/test_multimodal.py`` with one text layer of each kind,
``ONE_OF_EACH``: the engine's programs compile in about half the time; plus an ``mtp.*`` shard), and a
greedy oracle over the model's own full forward.

    qwen_mm_checkpoint(path) -> path        Qwen3.5 text model + 2-block tower (ids: image 5, start 3, end 4)
    glm_mm_checkpoint(path) -> path         GLM-5.3 text model + 2-block tower (image 500, start 502, end 503)
    image_tokens(model) -> (placeholder, start, end)
    greedy_reference(model, prompt, images, n) -> (tokens, first logits)
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from safetensors.numpy import save_file

from tests.support.random_checkpoints import ONE_OF_EACH, with_layers
from zoo.engine.image_prefill import multimodal


def qwen_mm_checkpoint(path: Path) -> Path:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.models.qwen38 import reference as ref
    from tests.models.qwen38.test_multimodal import TOKENS, VISION, text_config

    cfg = Qwen3_5Config(text_config=with_layers(text_config(), ONE_OF_EACH["qwen38-tiny"]),
                        vision_config={**VISION, "out_hidden_size": 128},
                        tie_word_embeddings=False, **TOKENS)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    ref.redraw_(model.model.language_model, seed=3)
    ref.redraw_(model.lm_head, seed=4)
    ref.redraw_vision_(model.model.visual, seed=5)
    model.save_pretrained(path)
    save_file(ref.mtp_tensors(model.config.text_config, seed=6), str(path / "model-mtp.safetensors"))
    _index_mtp(path)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    return path


def glm_mm_checkpoint(path: Path) -> Path:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.models.glm53 import reference as ref
    from tests.models.glm53.test_multimodal import TOKENS, VISION, _text_config

    cfg = Glm5NextConfig(text_config=with_layers(_text_config(), ONE_OF_EACH["glm53-tiny"]), vision_config=VISION,
                         **TOKENS)
    torch.manual_seed(11)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    ref.redraw_(model, seed=11)
    ref.redraw_vision_(model.model.visual, seed=12)
    model.save_pretrained(path)
    save_file(ref.mtp_tensors(model.config.text_config, seed=13, with_copies=True), str(path / "model-mtp.safetensors"))
    _index_mtp(path)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _index_mtp(path: Path) -> None:
    """A sharded save's index also names the MTP shard's tensors (a single-file save needs none)."""
    index_path = path / "model.safetensors.index.json"
    if not index_path.exists():
        return
    from safetensors import safe_open

    with safe_open(str(path / "model-mtp.safetensors"), "np") as f:
        keys = list(f.keys())
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in keys})
    index_path.write_text(json.dumps(index))


def image_tokens(model) -> tuple[int, int, int]:
    """(placeholder, image start, image end) ids of ``model``."""
    cfg = model.config
    start = getattr(cfg, "vision_start_token_id", None) or getattr(cfg, "image_start_token_id")
    end = getattr(cfg, "vision_end_token_id", None) or getattr(cfg, "image_end_token_id")
    return cfg.image_token_id, start, end


@partial(jax.jit, static_argnums=(0, 8, 9))
def _prefill(graphdef, s, ids, cache, patches, index, is_image, positions, grid, inputs):
    m = nnx.merge(graphdef, s)
    rows = jnp.take(m.encode_images(patches, grid), index, axis=0)
    logits, _, cache = m(ids, jnp.ones(ids.shape, bool), cache, mm=inputs(rows, is_image, positions))
    return logits[:, -1], cache


@partial(jax.jit, static_argnums=0)
def _step(graphdef, s, tok, cache):
    logits, _, cache = nnx.merge(graphdef, s)(tok, jnp.ones(tok.shape, bool), cache)
    return logits[:, -1], cache


def greedy_reference(model, prompt, images, n: int, eos=()):
    """Greedy tokens of ``prompt`` with ``images`` (``ImageInput``s) by the model's full forward: one
    prefill of the whole prompt (the tower run on all images at once), then n-1 text steps, cut at
    the first of ``eos``; returns (tokens, logits of the first token [V])."""
    mm = multimodal(model)
    graphdef, state = nnx.split(model.module)
    ids = np.asarray(prompt, np.int64)[None]
    batch = mm.prepare(ids, [[(im.patches, tuple(im.grid)) for im in images]], model.config)
    cache = model.module.init_cache(1, ids.shape[1] + n)
    logits, cache = _prefill(graphdef, state, jnp.asarray(ids, jnp.int32), cache, jnp.asarray(batch.patches),
                             jnp.asarray(batch.index), jnp.asarray(batch.is_image),
                             None if batch.positions is None else jnp.asarray(batch.positions), batch.grid,
                             mm.MMInputs)
    first = np.asarray(logits[0])
    out = [int(np.argmax(first))]
    while len(out) < n and out[-1] not in eos:
        logits, cache = _step(graphdef, state, jnp.asarray([[out[-1]]], jnp.int32), cache)
        out.append(int(np.argmax(np.asarray(logits[0]))))
    if out[-1] in eos:
        out.pop()
    return out, first
