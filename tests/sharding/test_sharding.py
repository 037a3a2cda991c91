"""Sharding on a ``jax.sharding.Mesh`` of 8 virtual CPU devices, both models, both layouts.

Each test runs one check of ``tests/sharding_checks.py`` in its own Python process, because the
device count (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) must be set before jax is
imported and must not leak into the other test modules. Checkpoints are written here (random
weights, ``tests/random_checkpoints.py``; a GLM GGUF with Q8_0 expert banks from the llama.cpp
fixture). Oracle: the same computation on one device, <= 1e-5 relative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.gguf_files import dequantized, metadata_of, write_gguf
from tests.support.paths import DATA, ROOT
from tests.support.random_checkpoints import write_random_checkpoint
from zoo.formats.ggml import QType
from zoo.sources.gguf import GGUFSource

TOL = 1e-5

# Tiny configs with the dims the 8-way splits need (heads, widths, experts divisible by 8), every
# mechanism alive: GLM: KDA, MLA with a full and a shared indexer, dense + MoE (8 experts top-2 +
# shared), 4 hyper-connection streams. Qwen: gated DeltaNet + gated attention with 4 KV heads, as
# Qwen3.8-27B: on "tp" (8-way) its KV cache is split over the slots, on "ep" (4-way tp) over the heads.
GLM = {"model_type": "glm5_next_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "q_lora_rank": 48,
       "kv_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 8, "index_head_dim": 16,
       "index_kpool": 4, "index_topk": 8, "linear_num_heads": 8, "linear_head_dim": 16, "swiglu_limit": 2.0,
       "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"],
       "indexer_types": ["full", "full", "shared"], "mlp_layer_types": ["dense", "sparse", "sparse"],
       "num_nextn_predict_layers": 1}
QWEN = {"model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False}
# float32 Qwen of ~200 MB whose largest tensor is 16 MB, for the host-memory check
QWEN_BIG = {**QWEN, "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
            "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
MEMORY_BUDGET = 80 * 2**20


def run_check(name: str, **args) -> dict:
    """Run ``tests.support.sharding_checks NAME`` on 8 virtual devices; its JSON measurements."""
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.support.sharding_checks", name, json.dumps(args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"check {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(name, result)
    return result


def test_glm_both_layouts_with_generator_in_tensor_parallel_and_int8(tmp_path):
    r = run_check("glm", path=str(write_random_checkpoint(tmp_path / "glm", GLM, seed=1)))
    assert max(r["tp_err"], r["ep_err"], r["ep_int8_err"]) <= TOL and r["tp_cache_split"] > 0


def test_qwen_both_layouts_with_generator_in_expert_parallel(tmp_path):
    r = run_check("qwen", path=str(write_random_checkpoint(tmp_path / "qwen", QWEN, seed=2)))
    assert r["tp_err"] <= TOL and r["ep_err"] <= TOL and r["ep_cache_split"] > 0


def test_prefix_cache_on_the_mesh_one_model_per_layout(tmp_path):
    """Restored prefixes on 8 devices (GLM on "ep" with MTP drafts, Qwen on "tp" plain) give the
    single-device tokens: the restore copies go by the cache's logical axes, not by the model, and
    the MTP slots and hidden row are restored only with drafts."""
    paths = {"glm": str(write_random_checkpoint(tmp_path / "glm", GLM, seed=1)),
             "qwen": str(write_random_checkpoint(tmp_path / "qwen", QWEN, seed=2))}
    r = run_check("prefix_cache", paths=paths, layouts={"glm": ["ep"], "qwen": ["tp"]},
                  drafts={"glm": [2], "qwen": [0]})
    assert sorted(r) == ["glm/ep/k2", "qwen/tp/k0"]
    assert all(v["hits"][1] > 0 and v["logprob_err"] <= TOL for v in r.values()), r


def test_quantized_expert_banks_split_by_rows_and_input_blocks(tmp_path):
    """The llama.cpp GLM fixture with its routed experts re-quantized to Q8_0 (8 blocks per row of
    ``down``), everything else as stored (Q8_0, Q6_K, F32); its sharded forward also lowers for TPU
    with the Pallas kernels (each inside ``shard_map``)."""
    src = GGUFSource(DATA / "glm53-q256-udmix.gguf")
    tensors = {}
    for key in src.keys():
        info = src.info(key)
        if key.endswith("_exps.weight"):
            tensors[key] = (dequantized(src, key), QType.Q8_0)
        else:
            tensors[key] = (src.read(key) if info.quantized else np.asarray(src.read(key), np.float32),
                            info.qtype if info.quantized else QType.F32)
    path = write_gguf(tmp_path / "glm-q8-experts.gguf", src.architecture, metadata_of(src.files[0]), tensors)
    r = run_check("quantized", path=str(path))
    assert r["tp_err"] <= TOL and r["max_bank_fraction"] == 1 / 8 and r["tpu_kernels"] > 0


@pytest.mark.parametrize("budget", [MEMORY_BUDGET])
def test_sharded_load_stays_under_a_host_memory_budget(tmp_path, budget):
    path = write_random_checkpoint(tmp_path / "big", QWEN_BIG, seed=3)
    r = run_check("memory", path=str(path), budget=budget)
    assert r["model_bytes"] > 2 * budget and r["transient"] < budget


def test_abstract_load_places_like_the_real_load():
    """``zoo.load(..., weights=False)`` on 8 devices: every leaf of every parameter has the kind,
    shape, dtype and sharding the real load places (QArray packing per device included)."""
    per_device = run_check("abstract")
    assert len(per_device) == 12 and all(b > 0 for b in per_device.values())
