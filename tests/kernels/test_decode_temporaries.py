"""A whole-model program decodes each quantized weight just before its matmul (``zoo.ops.matmul.decode_after``):
compiled for the CPU, a deep and narrow Qwen3.8 (24 layers at hidden 256, every matmul weight
quantized) holds at most about two layers' decoded weights in temporaries, where XLA, left alone,
decodes every layer's up front (on a 27B model: 51.6 GB of temporaries against 14.6 GB of weights):
the full forward (Q8_0 blocks) and the server's decode step as ``zoo compile --target cpu`` reports it
(int8)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from tests.support.paths import ROOT
from zoo.api import _full_forward
from zoo.quant.int8 import Int8Weight
from zoo.quant.qarray import QArray
from zoo.tools.compile_report import compile_report, table

LAYERS = 24


@pytest.fixture(scope="module")
def deep_narrow(tmp_path_factory):
    config = json.loads((ROOT / "zoo" / "assets" / "qwen38-tiny" / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS, head_dim=64,
                  linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=1024, mtp_num_hidden_layers=0)
    path = tmp_path_factory.mktemp("deep-narrow")
    (path / "config.json").write_text(json.dumps(config))
    return path


def decoded_bytes_per_layer(state) -> int:
    """bf16 bytes of every quantized matmul weight, decoded, over the layers."""
    total = 0
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, (QArray, Int8Weight))):
        if isinstance(leaf, (QArray, Int8Weight)):
            n = 1
            for d in leaf.shape:
                n *= d
            total += 2 * n
    return total // LAYERS


def test_a_whole_model_program_holds_about_one_layer_of_decoded_weights(deep_narrow):
    model = zoo.load(deep_narrow, quant="Q8_0", weights=False)
    graphdef, state = nnx.split(model.module)
    per_layer = decoded_bytes_per_layer(state)
    assert per_layer > 1_000_000                           # the layers' weights are quantized (~1.5 MB decoded)
    ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 32), jnp.bool_)
    compiled = jax.jit(functools.partial(_full_forward, graphdef)).lower(state, ids, mask).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries <= 2 * per_layer, (temporaries, per_layer)     # every layer's would be 24x


def test_zoo_compile_reports_the_servers_decode_step_on_the_cpu_within_two_layers(deep_narrow):
    """The same bound for the server's own decode step (int8 weights, 4 rows), as ``zoo compile
    --target cpu`` reports it (without the barrier: 102 MB of temporaries on the 48-layer model)."""
    report = compile_report(deep_narrow, quant="int8", target="cpu", batch=4, context=256, programs=("decode",),
                            spec_tokens=0)
    model = zoo.load(deep_narrow, quant="int8", weights=False)
    per_layer = decoded_bytes_per_layer(nnx.split(model.module)[1])
    (decode,) = report["programs"]
    assert report["target"] == "cpu" and report["ok"] and "roofline" not in decode
    assert 0 < decode["temporaries"] <= 2 * per_layer, (decode["temporaries"], per_layer)
    assert "decode B=4" in table(report)
