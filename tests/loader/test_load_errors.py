"""Bad input to ``zoo.load`` fails with a clear error naming the file, tensor or name."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import zoo
from zoo.models.config import ConfigError
from zoo.registry import UnknownModelError, embedded_path
from zoo.sources.base import SourceError
from zoo.sources.safetensors import SafetensorsSource


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the embedded tiny checkpoint, split into two shards with an index."""
    src = SafetensorsSource(embedded_path("qwen38-tiny"))
    keys = src.keys()
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, names in halves.items():
        save_file({k: src.read(k) for k in names}, str(tmp_path / fname))
        weight_map.update({k: fname for k in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(embedded_path("qwen38-tiny") / "config.json", tmp_path / "config.json")
    return tmp_path


def test_sharded_copy_loads_and_matches_embedded(ckpt):
    ids = np.arange(12)[None] % 500
    a = zoo.load(ckpt, dtype="float32").logits(ids)
    b = zoo.load("qwen38-tiny", dtype="float32").logits(ids)
    np.testing.assert_array_equal(a, b)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        zoo.load(tmp_path)


def test_missing_shard_is_named(ckpt):
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match="model-00002-of-00002.safetensors"):
        zoo.load(ckpt)


def test_wrong_shape_names_tensor(ckpt):
    f = ckpt / "model-00001-of-00002.safetensors"
    src = SafetensorsSource(f)
    tensors = {k: src.read(k) for k in src.keys()}
    victim = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[victim] = np.zeros((3, 5), ml_dtypes.bfloat16)
    save_file(tensors, str(f))
    with pytest.raises(SourceError, match=victim.replace(".", r"\.")):
        zoo.load(ckpt)


def test_missing_tensor_names_parameter(ckpt):
    f = ckpt / "model-00001-of-00002.safetensors"
    src = SafetensorsSource(f)
    tensors = {k: src.read(k) for k in src.keys() if k != "model.norm.weight"}
    if len(tensors) == len(src.keys()):
        f = ckpt / "model-00002-of-00002.safetensors"
        src = SafetensorsSource(f)
        tensors = {k: src.read(k) for k in src.keys() if k != "model.norm.weight"}
    save_file(tensors, str(f))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"parameter\(s\): norm\.weight"):
        zoo.load(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "bad_offsets"])
def test_corrupt_safetensors_names_file(ckpt, damage):
    f = ckpt / "model-00001-of-00002.safetensors"
    raw = bytearray(f.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage_header":
        raw[8:40] = b"\xff" * 32
    else:  # an entry whose byte range does not match its shape
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 2
        blob = json.dumps(header).encode()
        raw = len(blob).to_bytes(8, "little") + blob + raw[8 + n:]
    f.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="model-00001-of-00002.safetensors"):
        zoo.load(ckpt)


def test_unknown_model_name():
    with pytest.raises(UnknownModelError, match="no-such-model"):
        zoo.load("no-such-model")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="llama"):
        zoo.load(tmp_path)


def test_config_missing_field(tmp_path):
    cfg = json.loads((embedded_path("qwen38-tiny") / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        zoo.load(tmp_path)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="float8"):
        zoo.load("qwen38-tiny", dtype="float8")
