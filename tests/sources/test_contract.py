"""Every weight source, and every view over sources, implements the one source contract
(``zoo.sources.base.WeightSource``) and raises its one error type."""

from __future__ import annotations

import pytest

from tests.support.paths import DATA
from zoo.loader.gguf_model import config_from_gguf
from zoo.models.glm53.weights import gguf_names
from zoo.models.qwen38.weights import hf_names
from zoo.registry import embedded_path
from zoo.sources.base import SourceError, WeightSource
from zoo.sources.fp8 import Fp8Dequantized
from zoo.sources.gguf import GGUFSource
from zoo.sources.safetensors import SafetensorsSource
from zoo.sources.views import MixedSource, Part, joined


def sources():
    st = SafetensorsSource(embedded_path("qwen38-tiny"))
    gguf = GGUFSource(DATA / "glm53-q256-udmix.gguf")
    view = joined(gguf, gguf_names(config_from_gguf(gguf)))
    mixed = MixedSource([Part("checkpoint", st, hf_names(None), lambda p: True)])
    return {"safetensors": st, "gguf": gguf, "fp8 view": Fp8Dequantized(st), "joined view": view, "mixed view": mixed}


@pytest.mark.parametrize("name", ["safetensors", "gguf", "fp8 view", "joined view", "mixed view"])
def test_every_source_implements_the_contract(name):
    src = sources()[name]
    assert isinstance(src, WeightSource)
    key = src.keys()[0]
    assert key in src and tuple(src.info(key).shape)
    assert src.read(key).shape[0] == src.info(key).shape[0] or getattr(src.info(key), "quantized", False)
    with pytest.raises(SourceError, match="no tensor|not"):
        src.info("no.such.tensor")
