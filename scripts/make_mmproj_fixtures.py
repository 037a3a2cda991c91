"""Write the mmproj fixtures of ``tests/data/mmproj/`` (see ``tests/data/README.md``).

For each family (qwen38: transformers ``Qwen3_5ForConditionalGeneration``; glm53:
``Glm5NextForConditionalGeneration``) a tiny multimodal HF checkpoint with seeded random weights is
written to a temporary directory, and llama.cpp's own converter (``convert_hf_to_gguf.py --mmproj``)
turns it into ``mmproj-f32.gguf``, ``mmproj-f16.gguf`` and ``mmproj-q8_0.gguf``. The tower's HF
tensors (``model.visual.*``) are saved as ``tower.safetensors`` with the checkpoint's ``config.json``:
the reference the tests load through the HF rules.

    .venv/bin/python scripts/make_mmproj_fixtures.py [--llama-cpp DIR] [--out tests/data/mmproj]

DIR is a llama.cpp tree with ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` (default: the
one vendored in the llama-cpp-python 0.3.36 sdist, unpacked at /tmp/lcp).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = Path("/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
OUTTYPES = ("f32", "f16", "q8_0")
PREPROCESSOR = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}

# Row lengths (ggml ne0 = the input width) of 32, 64, 128 quantize to Q8_0; the intermediate width 48
# (and GLM's merger width 40) do not: those tensors fall back to F16, as Qwen3.5's real 4304 does.
QWEN_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=32)
QWEN_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["full_attention"],
                 rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
GLM_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, in_channels=3, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, projection_intermediate_size=40,
                  swiglu_limit=1.5, rms_norm_eps=1e-5, attention_bias=True,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})


def redraw_(module: torch.nn.Module, seed: int) -> None:
    """Matrices N(0, 1/fan_in), norm weights near 1, biases O(0.2), a position table N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif name == "pos_embed.weight":
                p.copy_(noise)
            else:
                p.copy_(noise / np.sqrt(p[0].numel()))


def qwen_model():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    cfg = Qwen3_5Config(text_config=QWEN_TEXT, vision_config=QWEN_VISION, tie_word_embeddings=False,
                        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4)
    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration(cfg).eval()


def glm_model():
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    text = json.loads((ROOT / "zoo" / "configs" / "glm53-tiny.json").read_text())
    for k in ("model_type", "architectures", "num_nextn_predict_layers"):
        text.pop(k)
    text.update(num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"],
                indexer_types=["full"], vocab_size=64)
    cfg = Glm5NextConfig(text_config=text, vision_config=GLM_VISION, image_token_id=50, video_token_id=51,
                         image_start_token_id=52, image_end_token_id=53, video_start_token_id=54,
                         video_end_token_id=55)
    torch.manual_seed(0)
    return Glm5NextForConditionalGeneration(cfg).eval()


FAMILIES = {"qwen38": (qwen_model, 5), "glm53": (glm_model, 12)}


def convert(llama_cpp: Path, ckpt: Path, out: Path, outtype: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    cmd = [sys.executable, "convert_hf_to_gguf.py", "--mmproj", str(ckpt), "--outfile", str(out), "--outtype", outtype]
    subprocess.run(cmd, cwd=llama_cpp, env=env, check=True, stdout=subprocess.DEVNULL)


def make(family: str, out_root: Path, llama_cpp: Path) -> None:
    build, seed = FAMILIES[family]
    model = build()
    redraw_(model.model.visual, seed)
    out = out_root / family
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        model.save_pretrained(ckpt)
        (ckpt / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        for outtype in OUTTYPES:
            convert(llama_cpp, ckpt, out / f"mmproj-{outtype}.gguf", outtype)
        shutil.copy(ckpt / "config.json", out / "config.json")
    tower = {f"model.visual.{k}": v.detach().numpy().copy() for k, v in model.model.visual.state_dict().items()}
    save_file(tower, str(out / "tower.safetensors"))
    sizes = ", ".join(f"{p.name} {p.stat().st_size // 1024} KiB" for p in sorted(out.iterdir()))
    print(f"{out}: {sizes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "mmproj")
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    args = ap.parse_args()
    for family in args.family or sorted(FAMILIES):
        make(family, args.out, args.llama_cpp)


if __name__ == "__main__":
    main()
