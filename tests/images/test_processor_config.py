"""A checkpoint's image processor settings are found where transformers finds them: the
``"image_processor"`` entry of ``processor_config.json`` (transformers 5 saves the whole processor
there, the settings nested), else a flat ``preprocessor_config.json``. Both forms give the same
``ImageSpec``; a file that cannot be read is an error naming it; a checkpoint with neither uses the
family's defaults and says so in the log (``zoo.server.image_inputs.model_spec``)."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.support.paths import DATA
from zoo.images import ImageSpec
from zoo.models.config import load_config
from zoo.server.image_inputs import model_spec, processor_settings

# a real checkpoint's kind of settings (patch 4 like the fixture's tower), other than the class defaults
SETTINGS = dict(patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5], min_pixels=256, max_pixels=4096)


@pytest.fixture
def checkpoint(tmp_path):
    """A multimodal Qwen checkpoint directory (its HF config.json) and a stand-in for the loaded model
    with what ``model_spec`` reads of one: its config and where it was loaded from."""
    shutil.copy(DATA / "mmproj" / "qwen38" / "config.json", tmp_path / "config.json")
    return tmp_path, SimpleNamespace(config=load_config(tmp_path), load_info={"path": str(tmp_path)})


def hf_settings(**override) -> dict:
    """The settings as HF's own image processor serializes them (``to_dict``: its key names)."""
    return Qwen2VLImageProcessorPil(**{**SETTINGS, **override}).to_dict()


def write_processor_config(path, image_processor: dict | None) -> None:
    """``processor_config.json`` as transformers 5's ``ProcessorMixin.save_pretrained`` writes it."""
    body = {"processor_class": "Qwen3VLProcessor"}
    if image_processor is not None:
        body["image_processor"] = image_processor
    (path / "processor_config.json").write_text(json.dumps(body))


def test_the_nested_and_the_flat_forms_give_the_same_spec(checkpoint):
    path, model = checkpoint
    (path / "preprocessor_config.json").write_text(json.dumps(hf_settings()))
    flat = model_spec(model)
    (path / "preprocessor_config.json").unlink()
    write_processor_config(path, hf_settings())
    nested = model_spec(model)
    assert nested == flat
    assert nested.mean == (0.5, 0.5, 0.5) and nested.max_pixels == 4096      # not the class defaults
    assert nested != ImageSpec.qwen3_5(patch_size=4)


def test_the_nested_form_wins_and_a_processor_without_images_falls_back_to_the_flat_file(checkpoint):
    path, model = checkpoint
    (path / "preprocessor_config.json").write_text(json.dumps(hf_settings(image_mean=[0.1, 0.2, 0.3])))
    write_processor_config(path, hf_settings())
    assert model_spec(model).mean == (0.5, 0.5, 0.5)                        # as transformers: nested first
    write_processor_config(path, None)
    assert model_spec(model).mean == pytest.approx((0.1, 0.2, 0.3))
    assert processor_settings(path)[1] == path / "preprocessor_config.json"


def test_no_processor_config_uses_the_defaults_and_says_so(checkpoint, caplog):
    path, model = checkpoint
    with caplog.at_level(logging.WARNING, logger="zoo.serve"):
        spec = model_spec(model)
    assert spec == ImageSpec.qwen3_5(patch_size=4, temporal_patch_size=2, merge_size=2)
    assert "has no processor_config.json or preprocessor_config.json" in caplog.text


@pytest.mark.parametrize("name,body,problem", [
    ("processor_config.json", "{not json", "cannot read"),
    ("processor_config.json", '{"image_processor": [1, 2]}', 'its "image_processor" is not an object'),
    ("preprocessor_config.json", "[1, 2]", "is not a JSON object"),
    ("preprocessor_config.json", b"\xff\xfe", "cannot read"),
])
def test_an_unreadable_processor_config_is_an_error_naming_it(checkpoint, name, body, problem):
    path, model = checkpoint
    target = path / name
    target.write_bytes(body) if isinstance(body, bytes) else target.write_text(body)
    with pytest.raises(ValueError, match=f"images: {target}.*{problem}|images: cannot read {target}"):
        model_spec(model)


def test_settings_the_tower_cannot_take_are_an_error_naming_the_file(checkpoint):
    path, model = checkpoint
    write_processor_config(path, hf_settings(patch_size=16))
    with pytest.raises(ValueError, match="differs from the vision tower's"):
        model_spec(model)
    write_processor_config(path, {**hf_settings(), "do_resize": False})
    with pytest.raises(ValueError, match=f"images: {path / 'processor_config.json'}: .*do_resize=false"):
        model_spec(model)
