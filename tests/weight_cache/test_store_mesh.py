"""A cache written on one mesh restores on another (1 device -> 8-way tensor parallel, TP -> EP),
straight into the target shardings; see ``tests/checkpoint_mesh_checks.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import DATA, ROOT


def test_cache_restores_on_other_meshes_and_layouts(tmp_path):
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    args = {"gguf": str(DATA / "glm53-q256-udmix.gguf"), "ids": str(DATA / "glm53-q256.input_ids.npy"),
            "cache": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "tests.support.checkpoint_mesh_checks", json.dumps(args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-8000:]}"
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    print("restored-on-another-mesh logits rel err:", errs)
    assert max(errs.values()) <= 1e-5
