"""Ahead-of-time compilation for a real target with the real TPU compiler (libtpu's topology, no TPU):
the engine's programs compile with the target's Pallas kernels, and the planner's per-chip bytes
equal the compiler's argument bytes. The full-size compiles are in ``bench/compile_tpu.py``."""

from __future__ import annotations

import json

import jax
import pytest

from zoo import registry
from zoo.models.config import load_config
from zoo.serving import aot
from zoo.tools.plan import plan_config

jax.numpy.zeros(1).block_until_ready()          # the CPU backend is in use before the target is opened

GLM_LAYERS = 4                                   # 3 KDA layers (dense MLP) + 1 MLA layer with the MoE


@pytest.fixture(scope="module")
def glm_reduced(tmp_path_factory):
    """GLM-5.3-Flash at full width with its first 4 layers and the MTP layer (a config.json only)."""
    hf = json.loads(registry.preset_path("glm53-flash.json").read_text())
    cfg = registry.preset_config(registry.get_spec("glm53-flash"))                    # the preset's layer types
    hf.update(num_hidden_layers=GLM_LAYERS, layer_types=list(cfg.layer_types[:GLM_LAYERS]),
              mlp_layer_types=list(cfg.mlp_layer_types[:GLM_LAYERS]),
              indexer_types=list(cfg.indexer_types[:GLM_LAYERS]))
    path = tmp_path_factory.mktemp("glm-reduced")
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.mark.parametrize("name", ["glm53-tiny", "qwen38-tiny"])
def test_quantized_tiny_models_compile_for_v5e_8(name):
    """Decode with MTP drafts and a prefill chunk compile for 8 v5e chips, through the Mosaic kernels."""
    report = aot.compile_report(name, quant="Q8_0", target="v5e-8", batch=2, context=256, spec_tokens=2,
                                prefill_chunk=64)
    assert report["chips"] == 8 and report["usable_hbm"] == int(15.75 * 2**30)
    for program in report["programs"]:
        assert program["pallas_calls"] > 0 and program["fits"]
        assert program["arguments"] >= program["batch_state"] > 0 and program["flops"] > 0
    assert "decode B=2 L=256 MTP k=2" in aot.table(report)


@pytest.mark.parametrize("quant", ["UD-IQ3_XXS", "int8"])
def test_planner_equals_the_compiler(glm_reduced, quant):
    """Per chip: planner bytes == the abstract load's weight shards == the compiler's argument bytes
    less the batch state, within 1% (the compiler pads small arrays to its tiles)."""
    report = aot.compile_report(glm_reduced, quant=quant, target="v5e-8", batch=1, context=2048, spec_tokens=1,
                                programs=("decode",))
    decode = report["programs"][0]
    planner = plan_config(load_config(glm_reduced), quant, 8).per_device_bytes
    compiler = decode["arguments"] - decode["batch_state"]
    print(f"{quant}: planner {planner:,} B, compiler {compiler:,} B per chip")
    assert planner == report["weights_per_chip"]
    assert abs(compiler - planner) <= 0.01 * planner
    assert decode["pallas_calls"] > 0


def test_cli_and_errors(capsys):
    from zoo.cli import main

    assert main(["compile", "qwen38-tiny", "--quant", "int8", "--context", "128", "--prefill-chunk", "32",
                 "--programs", "decode", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"] == "v5e-8" and doc["programs"][0]["fits"] is True
    too_long = aot.compile_report("qwen38-tiny", quant="int8", batch=32, context=2**24, programs=("decode",))
    decode = too_long["programs"][0]                 # 32 rows x 16M slots: the compiler says it needs more
    assert decode["fits"] is False and decode["required"] > decode["usable"] and "CompileTimeHbmOom" in decode["error"]
    assert "DOES NOT FIT" in aot.table(too_long)
    with pytest.raises(ValueError, match="unknown compile target 'v9'"):
        aot.compile_report("qwen38-tiny", target="v9")
    with pytest.raises(ValueError, match="unknown program 'train'"):
        aot.compile_report("qwen38-tiny", programs=("train",))


def test_both_forms_of_the_compilers_out_of_memory_message():
    temporaries = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
                   "for HLO temporaries (15.97G) exceeds available HBM (15.75G). HLO module: jit__step_impl.")
    capacity = ("Ran out of memory in memory space hbm. Used 15.78G of 15.75G hbm. Exceeded hbm capacity by 31.36M.")
    assert aot.required_bytes(temporaries) == int(15.97 * 2**30)
    assert aot.required_bytes(capacity) == int(15.78 * 2**30)
    assert aot.required_bytes("INVALID_ARGUMENT: something else") is None
