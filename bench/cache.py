"""Cold GGUF load (parse + repack to planes + placement) vs restore from the repacked-weight cache.

    PYTHONPATH=. .venv/bin/python bench/cache.py [--experts 5120] [--workdir /tmp/zoo-bench-cache]

Builds a synthetic GLM-5.3 GGUF from the q256 fixture with its expert banks grown to ``--experts``
experts per layer (IQ2_S / IQ3_S blocks: each block keeps the f16 scale of a real llama.cpp block and
gets random code bytes, so nothing compresses, like real quantized weights; 5120 experts = 1.07 GB),
then measures in one run: a cold ``zoo.load(gguf)``, the same load writing the cache, and the
restore from the cache (including its digest verification). Prints seconds and the ratio.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import gguf
import numpy as np

import zoo
from tests.support.gguf_files import metadata_of, write_gguf
from zoo.sources.gguf import GGUFSource

FIXTURE = Path(__file__).parents[1] / "tests" / "data" / "glm53-q256-udmix.gguf"


def _fresh_blocks(blocks: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random code bytes under each block's real f16 scale (every IQ/Q8_0 block starts with it)."""
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][1]
    out = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
    rows = out.reshape(-1, block_bytes)
    rows[:, :2] = blocks.reshape(-1, block_bytes)[:, :2]
    return out


def synthetic_gguf(path: Path, n_experts: int) -> int:
    """Write the fixture with every expert tensor grown to ``n_experts``; returns the expert bytes."""
    src = GGUFSource(FIXTURE)
    rng = np.random.default_rng(0)
    meta = [(k, n_experts if k.endswith(".expert_count") else v, t, s) for k, v, t, s in metadata_of(FIXTURE)]
    tensors, expert_bytes = {}, 0
    for key in src.keys():
        info, data = src.info(key), src.read(key)
        if "_exps" in key or "gate_inp" in key or "exp_probs" in key:
            data = data[np.arange(n_experts) % data.shape[0]]
            if "_exps" in key:
                data = _fresh_blocks(data, info.qtype, rng)
                expert_bytes += data.nbytes
        tensors[key] = (data, info.qtype)
    write_gguf(path, src.architecture, meta, tensors)
    return expert_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=5120)
    ap.add_argument("--workdir", default="/tmp/zoo-bench-cache")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gguf = work / "synthetic-glm.gguf"
    t = time.perf_counter()
    expert_bytes = synthetic_gguf(gguf, args.experts)
    print(f"synthetic GGUF: {gguf.stat().st_size / 1e9:.2f} GB, quantized experts {expert_bytes / 1e9:.2f} GB "
          f"(written in {time.perf_counter() - t:.1f}s)")

    t = time.perf_counter()
    cold = zoo.load(gguf)
    cold_s = time.perf_counter() - t
    del cold
    t = time.perf_counter()
    saved = zoo.load(gguf, cache=work / "cache")
    save_s = time.perf_counter() - t
    del saved
    t = time.perf_counter()
    restored = zoo.load(gguf, cache=work / "cache")
    restore_s = time.perf_counter() - t
    assert restored.load_info["source"] == "cache"
    print(f"cold GGUF load   {cold_s:7.2f}s")
    print(f"load + save      {save_s:7.2f}s")
    print(f"cache restore    {restore_s:7.2f}s   (restore {restored.load_info['seconds']['restore']:.2f}s)")
    print(f"restore vs cold  {cold_s / restore_s:7.2f}x faster")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
