"""A training step on 8 virtual CPU devices ("tp" mesh) equals the one-device step.

Like ``tests/sharding``, the check runs in its own process (``tests/train/sharded_check.py``): the
device count must be set before jax is imported. The model is a random 2-layer Qwen3.8 with an MTP
layer and widths the 8-way split divides (``tests.support.random_checkpoints``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import ROOT
from tests.support.random_checkpoints import write_random_checkpoint

QWEN = {"model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False}


def test_sharded_step_equals_single_device_step(tmp_path):
    path = write_random_checkpoint(tmp_path / "qwen", QWEN, seed=5)
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    args = json.dumps({"path": str(path), "ckpt": str(tmp_path / "ckpt")})
    proc = subprocess.run([sys.executable, "-m", "tests.train.sharded_check", args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["metrics_err"] <= 1e-5 and r["grad_err"] <= 1e-4 and r["params_err"] <= 1e-5, r
    assert r["split_params"] > 0 and r["split_traces"] == r["split_params"] and r["restored_exact"], r
