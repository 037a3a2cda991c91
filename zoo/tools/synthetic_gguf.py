"""A full-size synthetic GGUF of a registry model: the real config, llama.cpp's tensor names and shapes,
a low-bit type mix like Unsloth's, and random code bytes under sane scales (for scale tests and
``bench/scale.py``; nothing in it is a trained weight).

    write_synthetic_gguf(path, "qwen38-27b", layers=None, vocab=None) -> Path
    synthetic_config("qwen38-27b", layers=4) -> config          # the text config the file describes

Everything comes from the architecture's own tables: the tensors from its inventory
(``Architecture.part("inventory")``: names, numpy-order shapes, classes), the metadata from the
inverse of its GGUF config reader (``part("gguf_metadata")``), so reading the file back gives the
same config (the tests check it). ``layers=N`` keeps N of the model's layers, every kind of layer the
model has among them (its ``layer_types`` / ``mlp_layer_types`` / ``indexer_types``), at full width:
every shape stays real, the file is shorter. ``vocab=V`` shrinks the vocabulary (the embedding, the
head and the tokenizer) for suite-sized files.

The vocabulary is the tiny model's byte-level BPE (``zoo/assets/<tiny>/tokenizer.json``) grown to
the vocabulary size with merged tokens (each new token the merge of two earlier ones), so the header
holds as many strings as the real model's. Quantized tensors are drawn from a pool of random blocks
whose float fields (the block scales) are set to a small positive value; float tensors are small
random values, norms (stored ``1 + w`` by llama.cpp) 1, ``ssm_a`` -1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from zoo import registry
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.models.architectures import architecture
from zoo.models.config import config_from_hf

TINY = {"qwen38": "qwen38-tiny", "glm53": "glm53-tiny"}           # whose tokenizer seeds the vocabulary
PRE = {"qwen38": "qwen35", "glm53": "glm4"}                        # tokenizer.ggml.pre
PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types")     # config lists with one entry per layer
POOL_BLOCKS = 1 << 14                                              # random blocks a tensor's data is drawn from
SCALE = 2e-3                                                       # every block scale (d, dmin)
MAX_GROWN = 6                                                      # a grown token merges two of at most this


# -- the config -----------------------------------------------------------------------------------

def pick_layers(hf: dict, layers: int) -> list[int]:
    """``layers`` layer indices in order: the first layer of every kind (its entries in the per-layer
    lists) first, then the earliest others."""
    n = int(hf["num_hidden_layers"])
    if not 1 <= layers <= n:
        raise ValueError(f"layers must be 1..{n}, got {layers}")
    kinds = [tuple(hf[k][i] for k in PER_LAYER if isinstance(hf.get(k), list)) for i in range(n)]
    first = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    if len(first) > layers:
        raise ValueError(f"{layers} layers cannot hold the model's {len(first)} kinds of layer; take {len(first)}")
    rest = [i for i in range(n) if i not in first]
    return sorted(first + rest[:layers - len(first)])


def synthetic_hf(name: str, layers: int | None = None, vocab: int | None = None,
                 overrides: dict | None = None) -> dict:
    """The preset's HF config, text part only, with ``layers`` of its layers, ``vocab`` tokens and
    ``overrides`` (HF fields, e.g. fewer routed experts for a suite-sized GLM file)."""
    hf = json.loads(registry.preset_path(f"{name}.json").read_text())
    hf.pop("vision_config", None)
    hf.update(overrides or {})
    if "layer_types" not in hf and "full_attention_interval" in hf:          # Qwen: the pattern, spelled out
        every = int(hf["full_attention_interval"])
        hf["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                             for i in range(int(hf["num_hidden_layers"]))]
    if layers is not None:
        keep = pick_layers(hf, layers)
        hf["num_hidden_layers"] = len(keep)
        for key in PER_LAYER:
            if isinstance(hf.get(key), list):
                hf[key] = [hf[key][i] for i in keep]
    if vocab is not None:
        hf["vocab_size"] = int(vocab)
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id"):
        hf.pop(key, None)
    return hf


def synthetic_config(name: str, layers: int | None = None, vocab: int | None = None, overrides: dict | None = None):
    """The text config a synthetic file of ``name`` describes (``synthetic_hf``)."""
    return config_from_hf(synthetic_hf(name, layers, vocab, overrides), source=f"{name} (synthetic)")


# -- the vocabulary -------------------------------------------------------------------------------

def vocabulary(arch_id: str, size: int, seed: int = 0) -> dict:
    """``tokenizer.ggml.*`` metadata: the tiny model's BPE grown to ``size`` tokens by merges."""
    tiny = registry.preset_path(f"{TINY[arch_id]}.json").parents[1] / "assets" / TINY[arch_id]
    doc = json.loads((tiny / "tokenizer.json").read_text())
    base = sorted(doc["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in base]
    special = {a["id"]: a["content"] for a in doc.get("added_tokens", [])}
    for i, text in special.items():
        if i < len(tokens):
            tokens[i] = text
        else:
            tokens += [f"<|unused_{j}|>" for j in range(len(tokens), i)] + [text]
    if size < len(tokens):
        raise ValueError(f"a vocabulary of {size} is smaller than the tokenizer's own {len(tokens)} tokens")
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    types = [3 if i in special else 1 for i in range(len(tokens))]
    rng = np.random.default_rng(seed)
    normal = [t for i, t in enumerate(tokens) if i not in special and " " not in t and len(t) <= MAX_GROWN]
    seen = set(tokens)
    while len(tokens) < size:                      # tokens of a real BPE's lengths (a few characters)
        a, b = rng.integers(0, len(normal), 2)
        left, right = normal[a], normal[b]
        if left + right in seen:
            continue
        seen.add(left + right)
        tokens.append(left + right)
        if len(left + right) <= MAX_GROWN:
            normal.append(left + right)
        merges.append(f"{left} {right}")
        types.append(1)
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    ids = {text: i for i, text in special.items()}
    out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": PRE[arch_id], "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    for key, field in (("eos_token_id", "eos_token"), ("padding_token_id", "pad_token"), ("bos_token_id", "bos_token")):
        text = config.get(field)
        text = text.get("content") if isinstance(text, dict) else text
        if text in ids:
            out[f"tokenizer.ggml.{key}"] = ids[text]
    if config.get("chat_template"):
        out["tokenizer.chat_template"] = config["chat_template"]
    return out


# -- the tensors ----------------------------------------------------------------------------------

def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else None


def ggml_type(tensor, n_layers: int) -> QType:
    """A type mix like Unsloth's low-bit files: experts and MLPs at 2-3 bits (every fourth layer lower),
    attention and the SSM projections at 4 bits, the embedding Q4_K, the head Q6_K, the MTP block and
    small projections Q8_0, everything a matmul does not read (norms, biases, conv, routers) F32.
    A row that is not a whole number of the type's blocks falls back to Q8_0, then F32."""
    name, layer = tensor.name, layer_of(tensor.name)
    if name == "token_embd.weight":
        want = QType.Q4_K
    elif not tensor.matmul:
        return QType.F32
    elif name == "output.weight":
        want = QType.Q6_K
    elif layer is not None and layer >= n_layers or tensor.shape[0] < 256:    # the MTP block; alpha / beta
        want = QType.Q8_0
    elif tensor.cls in ("routed_experts", "mlp", "shared_experts"):
        low = layer is not None and layer % 4 == 1
        if "down" in name:
            want = QType.Q3_K if low else QType.IQ3_S
        else:
            want = QType.IQ2_S if low else QType.IQ3_XXS
    else:
        want = QType.Q4_K
    for qtype in (want, QType.Q8_0):
        if tensor.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return QType.F32


class BlockPool:
    """Random blocks of one type with every float field set to ``SCALE`` (a sane scale)."""

    def __init__(self, qtype: QType, rng: np.random.Generator):
        layout = BLOCK_LAYOUTS[qtype]
        self.type_size = layout.type_size
        blocks = rng.integers(0, 256, (POOL_BLOCKS, layout.type_size), dtype=np.uint8)
        for field in layout.fields:
            if np.dtype(field.dtype).kind == "f":
                value = np.full((POOL_BLOCKS, field.count), SCALE, field.dtype)
                blocks[:, field.offset:field.end] = value.view(np.uint8).reshape(POOL_BLOCKS, -1)
        self.blocks = blocks

    def draw(self, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
        """uint8 [n_blocks * type_size]: the pool tiled from a random start."""
        start = int(rng.integers(0, POOL_BLOCKS))
        reps = -(-(n_blocks + start) // POOL_BLOCKS)
        return np.tile(self.blocks, (reps, 1))[start:start + n_blocks].reshape(-1)


def float_values(tensor, rng: np.random.Generator) -> np.ndarray:
    name = tensor.name
    if name.endswith("ssm_a"):
        return np.full(tensor.shape, -1.0, np.float32)
    if "norm" in name and name.endswith(".weight"):
        return np.ones(tensor.shape, np.float32)
    return (rng.standard_normal(tensor.shape, dtype=np.float32) * 0.02).astype(np.float32)


def _add(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_key_value(key, value, GGUFValueType.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, GGUFValueType.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, GGUFValueType.STRING)
    elif isinstance(value, list):
        first = value[0] if value else ""
        sub = (GGUFValueType.BOOL if isinstance(first, bool) else GGUFValueType.INT32 if isinstance(first, int)
               else GGUFValueType.FLOAT32 if isinstance(first, float) else GGUFValueType.STRING)
        writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
    else:
        raise TypeError(f"metadata {key}: no GGUF type for {type(value).__name__}")


def write_synthetic_gguf(path: str | Path, name: str, layers: int | None = None, vocab: int | None = None,
                         seed: int = 0, overrides: dict | None = None) -> Path:
    """Write the synthetic GGUF of registry model ``name`` to ``path`` (streamed: one tensor in memory
    at a time, written under a temporary name and renamed when whole); returns ``path``. See the
    module docstring."""
    cfg = synthetic_config(name, layers, vocab, overrides)
    arch = architecture(cfg.arch)
    gguf_arch = arch.gguf_architectures[0]
    tensors = arch.part("inventory")(cfg)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".partial-{path.name}")
    writer = GGUFWriter(partial, gguf_arch)
    writer.add_name(f"{name} (synthetic)")
    for key, value in arch.part("gguf_metadata")(cfg).items():
        _add(writer, f"{gguf_arch}.{key}", value)
    for key, value in vocabulary(cfg.arch, cfg.vocab_size, seed).items():
        _add(writer, key, value)
    types = [ggml_type(t, cfg.num_hidden_layers) for t in tensors]
    for t, qtype in zip(tensors, types):
        if qtype == QType.F32:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = math.prod(t.shape) // block * size
            writer.add_tensor_info(t.name, (*t.shape[:-1], t.shape[-1] // block * size), np.dtype(np.uint8),
                                   nbytes, raw_dtype=qtype)
    rng = np.random.default_rng(seed)
    pools: dict[QType, BlockPool] = {}
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, qtype in zip(tensors, types):
            if qtype == QType.F32:
                writer.write_tensor_data(float_values(t, rng))
                continue
            pool = pools.get(qtype) or pools.setdefault(qtype, BlockPool(qtype, rng))
            writer.write_tensor_data(pool.draw(math.prod(t.shape) // GGML_QUANT_SIZES[qtype][0], rng))
        writer.close()
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def described(cfg) -> dict:
    """The config fields a GGUF carries (for comparing a file's config with the one it was written for)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("vision", "eos_token_id", "pad_token_id")}
