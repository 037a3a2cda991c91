"""The abstract load (``zoo.load(..., weights=False)``): every parameter of the kind, shape and dtype
a real load of the same checkpoint and recipe stores, without reading a weight file; per-device
bytes equal too. On 8 devices the shardings are compared in ``tests/sharding/test_sharding.py``."""

from __future__ import annotations

import pytest

import zoo
from tests.support.abstract_checks import differences
from zoo.loader.abstract import shard_bytes
from zoo.quant.qarray import QArray
from zoo.registry import embedded_path

CASES = [(name, quant) for name in ("qwen38-tiny", "glm53-tiny") for quant in (None, "bf16", "Q8_0", "int8")]


@pytest.mark.parametrize("name,quant", CASES)
def test_abstract_load_has_the_leaves_of_the_real_load(name, quant):
    dtype = "bfloat16" if quant == "bf16" else "float32"
    abstract = zoo.load(name, quant=quant, dtype=dtype, weights=False)
    real = zoo.load(name, quant=quant, dtype=dtype)
    assert abstract.load_info["source"] == "abstract" and abstract.tokenizer is None
    assert differences(abstract, real, shardings=False) == []
    assert shard_bytes(abstract.module) == shard_bytes(real.module)


def test_q8_0_quantizes_the_stacked_hf_expert_banks():
    """GLM's HF checkpoint stores one tensor per expert; under Q8_0 the stacked banks are quantized
    like every other matmul weight (as the planner counts them)."""
    model = zoo.load("glm53-tiny", quant="Q8_0", dtype="float32")
    bank = model.module.layers[1].mlp.experts.down_kernel.get_value()
    assert isinstance(bank, QArray) and bank.qtype.name == "Q8_0"


def test_abstract_load_reads_no_file(tmp_path):
    """A checkpoint directory with a config.json and no weights loads abstractly."""
    (tmp_path / "config.json").write_text((embedded_path("qwen38-tiny") / "config.json").read_text())
    model = zoo.load(tmp_path, quant="int8", weights=False)
    assert model.config.arch == "qwen38" and shard_bytes(model.module) > 0
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        zoo.load("glm53-flash", quant="Q9", weights=False)
