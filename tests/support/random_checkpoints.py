"""Random HF checkpoints of any tiny config, written with numpy alone (no torch): every parameter of
the zoo model, under its on-disk HF name and layout, with a realistic spread of values.

The on-disk name of a parameter is its path with the inverse of the architecture's name map applied
(``NAMES`` below); ``zoo.load`` then checks that every parameter was found.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from zoo.models.architectures import architecture as arch
from zoo.models.config import config_from_hf

# parameter path -> (on-disk name, layout): "T" stored [out, in], "conv" stored [C, 1, K],
# "experts" one [out, in] tensor per expert, None as is. First match wins.
NAMES: tuple[tuple[str, str, str | None], ...] = (
    (r"embed_tokens\.embedding", r"model.embed_tokens.weight", None),
    (r"lm_head\.kernel", r"lm_head.weight", "T"),
    (r"(layers\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)", r"model.\1.hc_\2_\3", None),
    (r"(layers\.\d+)\.self_attn\.(q|k|v)_conv", r"model.\1.self_attn.\2_conv1d.weight", "conv"),
    (r"(layers\.\d+)\.linear_attn\.conv_weight", r"model.\1.linear_attn.conv1d.weight", "conv"),
    (r"(.*)\.self_attn\.kv_b", r"model.\1.self_attn.kv_b_proj.weight", None),
    (r"(.*)\.indexer\.compress_gate\.kernel", r"model.\1.indexer.index_kpool_compress_gate", "T"),
    (r"(.*)\.indexer\.compress_ape", r"model.\1.indexer.index_kpool_compress_ape", None),
    (r"(.*)\.mlp\.router\.weight", r"model.\1.mlp.gate.weight", "T"),
    (r"(.*)\.mlp\.router\.correction_bias", r"model.\1.mlp.gate.e_score_correction_bias", None),
    (r"(.*)\.mlp\.experts\.(gate|up|down)_kernel", r"model.\1.mlp.experts.{e}.\2_proj.weight", "experts"),
    (r"(.*)\.(A_log|dt_bias)", r"model.\1.\2", None),
    (r"(.*)\.kernel", r"model.\1.weight", "T"),
    (r"(.*)", r"model.\1", None),
)


def _value(path: str, shape: tuple[int, ...], rng: np.random.Generator, zero_centered: bool) -> np.ndarray:
    """A parameter-layout value with the spread its role has in a trained model."""
    normal = lambda scale, mean=0.0: (mean + scale * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return np.log(rng.uniform(0.5, 4.0, shape)).astype(np.float32)
    if leaf == "dt_bias":
        return normal(1.0, -2.0)
    if leaf in ("base", "compress_ape", "bias"):
        return normal(0.5)
    if leaf == "scale":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if leaf == "correction_bias":
        return normal(0.2)
    if leaf == "embedding":
        return normal(1.0)
    if leaf.endswith("_conv") or leaf == "conv_weight":
        return normal(shape[0] ** -0.5)
    if len(shape) == 1:
        return normal(0.1) if zero_centered else normal(0.2, 1.0)
    return normal(shape[-2] ** -0.5)               # [.., in, out]: N(0, 1/fan_in)


def _on_disk(path: str, value: np.ndarray) -> dict[str, np.ndarray]:
    for pattern, name, layout in NAMES:
        m = re.fullmatch(pattern, path)
        if m is None:
            continue
        name = m.expand(name)
        if layout == "T":
            return {name: np.ascontiguousarray(value.T)}
        if layout == "conv":
            return {name: np.ascontiguousarray(value.T[:, None, :])}
        if layout == "experts":
            return {name.format(e=e): np.ascontiguousarray(w.T) for e, w in enumerate(value)}
        return {name: value}
    raise AssertionError(path)


# GLM-5's MTP layer is stored as one more decoder layer, ``model.layers.{num_hidden_layers}``;
# Qwen3.x's at the top level: ``mtp.layers.0.*`` and ``mtp.fc`` / ``mtp.pre_fc_norm_*`` / ``mtp.norm``.
GLM_MTP = (("mtp.block.", ""), ("mtp.fc.", "eh_proj."), ("mtp.embed_norm.", "enorm."),
           ("mtp.hidden_norm.", "hnorm."), ("mtp.final_norm.", "shared_head.norm."))
QWEN_MTP = {"mtp.fc.kernel": ("mtp.fc.weight", "T"),
            "mtp.embed_norm.weight": ("mtp.pre_fc_norm_embedding.weight", None),
            "mtp.hidden_norm.weight": ("mtp.pre_fc_norm_hidden.weight", None),
            "mtp.final_norm.weight": ("mtp.norm.weight", None)}


def _hf_tensors(path: str, value: np.ndarray, cfg) -> dict[str, np.ndarray]:
    """The on-disk tensors of one parameter (``NAMES``, with each architecture's MTP nesting)."""
    if cfg.arch == "glm53":
        for prefix, inside in GLM_MTP:
            if path.startswith(prefix):
                return _on_disk(f"layers.{cfg.num_hidden_layers}.{inside}{path[len(prefix):]}", value)
    elif path in QWEN_MTP:
        name, layout = QWEN_MTP[path]
        return {name: np.ascontiguousarray(value.T) if layout == "T" else value}
    elif path.startswith("mtp.block."):
        inner = _on_disk("layers.0." + path[len("mtp.block."):], value)
        return {"mtp." + k[len("model."):]: v for k, v in inner.items()}
    return _on_disk(path, value)


def write_random_checkpoint(path: Path, config: dict, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float32) of a random model into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(config)
    abstract = nnx.eval_shape(lambda: arch(cfg.arch).model_class()(cfg))
    rng = np.random.default_rng(seed)
    zero_centered = cfg.arch == "qwen38"
    tensors: dict[str, np.ndarray] = {}
    for p, var in nnx.to_flat_state(nnx.state(abstract)):
        name = ".".join(map(str, p))
        tensors.update(_hf_tensors(name, _value(name, tuple(var.get_value().shape), rng, zero_centered), cfg))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


# The chat template of the untrained demo models: plain ChatML, no reasoning block, no tools.
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# Of each demo model's 8 layers, one of every kind (attention, MLP and indexer type): Qwen's alternation
# (DeltaNet, gated attention); GLM's KDA with the dense MLP and MLA with the full and with the shared
# indexer, both with the MoE. Every program of a random model compiles in about half the time (XLA
# compiles the layers unrolled), and nothing a random model is used for depends on its depth.
ONE_OF_EACH = {"qwen38-tiny": (0, 1), "glm53-tiny": (0, 3, 4)}
PER_LAYER_KEYS = ("layer_types", "mlp_layer_types", "indexer_types")


def with_layers(config: dict, layers: tuple[int, ...]) -> dict:
    """A config.json's dict with only ``layers`` of its decoder layers (in order). Per-layer lists are
    cut to them; a config without them (Qwen's ``full_attention_interval``) takes its first n layers."""
    listed = [key for key in PER_LAYER_KEYS if isinstance(config.get(key), list)]
    if not listed and tuple(layers) != tuple(range(len(layers))):
        raise ValueError(f"this config gives no per-layer types: only its first layers can be kept, not {layers}")
    return {**config, "num_hidden_layers": len(layers), **{key: [config[key][i] for i in layers] for key in listed}}


def random_tiny_checkpoint(path: Path, name: str = "qwen38-tiny", template: str | None = CHATML, seed: int = 0,
                           layers: tuple[int, ...] | None = None, overrides: dict | None = None) -> Path:
    """An embedded demo model with *random* weights: its config and tokenizer, weights drawn here (the
    MTP head too: drafts are almost never accepted) and ``template`` as its chat template (None: the
    shipped one). For tests that need a model with no learned preferences: sampling spreads over the
    vocabulary, a constraint is tested against outputs the model did not learn to write, an MTP head
    has everything to gain from fitting. The shipped demo models are trained (``tests/test_demo_models.py``).
    ``layers``: the decoder layers kept (None: ``ONE_OF_EACH``, one of every kind the model has);
    ``overrides``: config.json entries replaced (e.g. a head width)."""
    from zoo.registry import embedded_path
    src, path = embedded_path(name), Path(path)
    config = with_layers(json.loads((src / "config.json").read_text()), layers or ONE_OF_EACH[name])
    config.update(overrides or {})
    write_random_checkpoint(path, config, seed)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, path / f)
    if template is not None:
        spec = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**spec, "chat_template": template}))
    return path
