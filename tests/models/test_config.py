"""Configs: HF config.json read flat or nested, presets, the real shape's parameter count."""

from __future__ import annotations

import json

import numpy as np
from flax import nnx

from zoo.loader.open import without_vision
from zoo.models.config import config_from_hf, load_config
from zoo.models.qwen38.config import Qwen38Config
from zoo.registry import preset_path


def test_flat_and_nested_configs_agree():
    flat = json.loads(preset_path("qwen38-tiny.json").read_text())
    nested = {"model_type": "qwen3_5", "text_config": {**flat, "model_type": "qwen3_5_text"},
              "vision_config": {"depth": 1}}
    assert config_from_hf(flat) == config_from_hf({**nested, "vision_config": None})
    # a vision config makes a tower; the text model is the same
    with_tower = config_from_hf(nested)
    assert with_tower.vision is not None and without_vision(with_tower) == config_from_hf(flat)


def test_layer_types_from_interval_and_rope_fields():
    cfg = load_config(preset_path("qwen38-27b.json"))
    assert isinstance(cfg, Qwen38Config)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.layer_types.count("linear_attention") == 48
    assert all((i + 1) % 4 == 0 for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    old_style = {**json.loads(preset_path("qwen38-27b.json").read_text()), "rope_theta": 5e6,
                 "partial_rotary_factor": 0.5}
    del old_style["rope_parameters"]
    assert config_from_hf(old_style).rotary_dim == 128


def test_real_shape_parameter_count():
    """The 27B preset, built abstractly (no memory): text model + MTP layer + vision tower is the
    published 27,781,427,952; without the tower (``vision=False``), the text model + MTP layer."""
    from zoo.models.qwen38.model import Qwen38

    def count(cfg) -> int:
        model = nnx.eval_shape(lambda: Qwen38(cfg))
        return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model)))

    cfg = load_config(preset_path("qwen38-27b.json"))
    assert count(cfg) == 27_781_427_952
    assert count(without_vision(cfg)) == 27_320_697_856
