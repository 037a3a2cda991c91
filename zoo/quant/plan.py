"""Memory planner: bytes per tensor, per tensor class and per device, from a config and a recipe
alone (no download), or from a GGUF header.

    plan(name, quant=..., devices=8, layout="tp") -> Plan   a registry name: its preset + a recipe
    plan_config(cfg, recipe, devices) -> Plan    any config (e.g. a test-local one)
    plan_gguf(path, devices) -> Plan             a GGUF's header (local, hf:// or https://): its tensors as stored

The tensor inventory of an architecture is written in llama.cpp's GGUF names and numpy-order
shapes (matrices ``[out, in]``, expert banks ``[E, out, in]``); the tests check it against real
GGUF files. Each tensor gets a storage kind from the recipe (``zoo.quant.recipes``) and its bytes:

* a ggml type: the GGUF payload (``zoo.quant.ggml.tensor_nbytes``);
* ``"FP8"``: one byte per weight plus an f32 scale per 128x128 block (per expert for banks).

Per device (``devices`` chips in a ``zoo.mesh`` layout, "tp" or "ep"): every tensor is split as
``zoo.load(..., mesh=...)`` places it (``zoo.quant.plan_mesh``): in "tp" the routed-expert banks
are split as REFERENCE.md section 4 describes (gate/up by output rows, down by input blocks; every
chip holds a slice of every expert), in "ep" by expert over ``ep`` and by width over ``tp``; a
quantized bank is counted in the plane layout of one device's slice (``plane_nbytes``, which adds
the packing padding of the f16/u16 fields); what the layout does not split is replicated.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from zoo.quant.ggml import LAYOUTS, QType, tensor_nbytes
from zoo.quant.plan_mesh import per_device_bytes, plan_mesh
from zoo.quant.recipes import Recipe, get_recipe

FP8_BLOCK = 128


@dataclass(frozen=True)
class Tensor:
    """One tensor of the inventory: llama.cpp name, numpy-order shape, class; ``matmul`` when the
    model consumes it as a matrix (a block type may store it)."""

    name: str
    shape: tuple[int, ...]
    cls: str
    matmul: bool = True

    @property
    def expert_bank(self) -> bool:
        return self.name.endswith("_exps.weight")


@dataclass(frozen=True)
class TensorPlan:
    tensor: Tensor
    kind: str
    nbytes: int
    per_device_bytes: int


@dataclass(frozen=True)
class Plan:
    model: str
    recipe: str
    devices: int
    tensors: tuple[TensorPlan, ...]
    layout: str = "tp"

    @property
    def by_class(self) -> dict[str, int]:
        """Stored bytes per tensor class (``routed_experts``, ``attention``, ``mlp``, ...)."""
        out: Counter = Counter()
        for t in self.tensors:
            out[t.tensor.cls] += t.nbytes
        return dict(out)

    @property
    def by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for t in self.tensors:
            out[t.kind] += t.nbytes
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def per_device_bytes(self) -> int:
        """Bytes every device holds (planes of its expert slices + its share of the rest)."""
        return sum(t.per_device_bytes for t in self.tensors)

    def fits(self, budget_bytes: int) -> bool:
        """Whether the weights fit ``budget_bytes`` per device (caches and activations not counted)."""
        return self.per_device_bytes <= budget_bytes

    def to_dict(self, budget_bytes: int | None = None) -> dict:
        """The plan as JSON-ready data (with ``fits`` when a budget is given)."""
        out = {"model": self.model, "recipe": self.recipe, "devices": self.devices, "layout": self.layout,
               "total_bytes": self.total_bytes, "per_device_bytes": self.per_device_bytes,
               "by_class": self.by_class, "by_kind": self.by_kind,
               "tensors": [{"name": t.tensor.name, "shape": list(t.tensor.shape), "class": t.tensor.cls,
                            "kind": t.kind, "bytes": t.nbytes, "per_device_bytes": t.per_device_bytes}
                           for t in self.tensors]}
        if budget_bytes is not None:
            out.update(budget_bytes=budget_bytes, fits=self.fits(budget_bytes))
        return out

    def summary(self) -> str:
        rows = [f"{self.model} / {self.recipe} on {self.devices} device(s), layout {self.layout}"]
        rows += [f"  {cls:18s} {n / 1e9:10.3f} GB" for cls, n in sorted(self.by_class.items())]
        rows.append(f"  {'total':18s} {self.total_bytes / 1e9:10.3f} GB, "
                    f"{self.per_device_bytes / 1e9:.3f} GB per device")
        return "\n".join(rows)


# --- inventories ----------------------------------------------------------------------------------


def _qwen35_block(i: int, cfg, linear: bool, mtp: bool) -> list[Tensor]:
    d, hd, b = cfg.hidden_size, cfg.head_dim, f"blk.{i}."
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    c = (lambda cls: "mtp") if mtp else (lambda cls: cls)
    att = c("attention")
    out = [Tensor(b + "attn_norm.weight", (d,), c("norms"), False),
           Tensor(b + "post_attention_norm.weight", (d,), c("norms"), False)]
    if linear:
        conv = 2 * nk * dk + nv * dv
        out += [Tensor(b + "attn_qkv.weight", (conv, d), att), Tensor(b + "attn_gate.weight", (nv * dv, d), att),
                Tensor(b + "ssm_beta.weight", (nv, d), att), Tensor(b + "ssm_alpha.weight", (nv, d), att),
                Tensor(b + "ssm_conv1d.weight", (conv, cfg.linear_conv_kernel_dim), att, False),
                Tensor(b + "ssm_a", (nv,), att, False), Tensor(b + "ssm_dt.bias", (nv,), att, False),
                Tensor(b + "ssm_norm.weight", (dv,), att, False), Tensor(b + "ssm_out.weight", (d, nv * dv), att)]
    else:
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        out += [Tensor(b + "attn_q.weight", (2 * h * hd, d), att), Tensor(b + "attn_k.weight", (kv * hd, d), att),
                Tensor(b + "attn_v.weight", (kv * hd, d), att), Tensor(b + "attn_output.weight", (d, h * hd), att),
                Tensor(b + "attn_q_norm.weight", (hd,), att, False),
                Tensor(b + "attn_k_norm.weight", (hd,), att, False)]
    i_ = cfg.intermediate_size
    return out + [Tensor(b + "ffn_gate.weight", (i_, d), c("mlp")), Tensor(b + "ffn_up.weight", (i_, d), c("mlp")),
                  Tensor(b + "ffn_down.weight", (d, i_), c("mlp"))]


def qwen35_tensors(cfg) -> list[Tensor]:
    """Every tensor of a ``qwen35`` GGUF for a ``Qwen38Config`` (MTP blocks after the main ones)."""
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    out = [Tensor("token_embd.weight", (cfg.vocab_size, d), "embedding", False),
           Tensor("output_norm.weight", (d,), "norms", False)]
    if not cfg.tie_word_embeddings:
        out.append(Tensor("output.weight", (cfg.vocab_size, d), "output"))
    for i, lt in enumerate(cfg.layer_types):
        out += _qwen35_block(i, cfg, lt == "linear_attention", mtp=False)
    for j in range(cfg.mtp_num_hidden_layers):
        b = f"blk.{n + j}.nextn."
        out += [Tensor(b + "eh_proj.weight", (d, 2 * d), "mtp")]
        out += [Tensor(b + f"{x}.weight", (d,), "mtp", False) for x in ("enorm", "hnorm", "shared_head_norm")]
        out += _qwen35_block(n + j, cfg, False, mtp=True)
    return out


def _glm_block(i: int, cfg, mixer: str, mlp: str, indexer: bool, mtp: bool) -> list[Tensor]:
    d, b = cfg.hidden_size, f"blk.{i}."
    c = (lambda cls: "mtp") if mtp else (lambda cls: cls)
    out = [Tensor(b + "attn_norm.weight", (d,), c("norms"), False),
           Tensor(b + "ffn_norm.weight", (d,), c("norms"), False)]
    if not mtp:
        n = cfg.hc_mult
        for s in ("attn", "ffn"):
            out += [Tensor(b + f"hc_{s}_fn.weight", ((2 + n) * n, n * d), "hyper_connections", False),
                    Tensor(b + f"hc_{s}_base.weight", ((2 + n) * n,), "hyper_connections", False),
                    Tensor(b + f"hc_{s}_scale.weight", (3,), "hyper_connections", False)]
    att = c("attention")
    if mixer == "linear_attention":
        h, dk = cfg.linear_num_heads, cfg.linear_head_dim
        out += [Tensor(b + f"attn_{p}.weight", (h * dk, d), att) for p in "qkv"]
        out += [Tensor(b + f"ssm_conv1d_{p}.weight", (h * dk, 1, cfg.linear_conv_kernel_dim), att, False)
                for p in "qkv"]
        out += [Tensor(b + "ssm_f_a.weight", (dk, d), att), Tensor(b + "ssm_f_b.weight", (h * dk, dk), att),
                Tensor(b + "ssm_a", (h,), att, False), Tensor(b + "ssm_dt.bias", (h * dk,), att, False),
                Tensor(b + "ssm_beta.weight", (h, d), att), Tensor(b + "ssm_g_a.weight", (dk, d), att),
                Tensor(b + "ssm_g_b.weight", (h * dk, dk), att), Tensor(b + "ssm_norm.weight", (dk,), att, False),
                Tensor(b + "attn_output.weight", (d, h * dk), att)]
    else:
        h, q, kv = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        out += [Tensor(b + "attn_q_a.weight", (q, d), att), Tensor(b + "attn_q_a_norm.weight", (q,), att, False),
                Tensor(b + "attn_q_b.weight", (h * nope, q), att), Tensor(b + "attn_kv_a_mqa.weight", (kv, d), att),
                Tensor(b + "attn_kv_a_norm.weight", (kv,), att, False),
                Tensor(b + "attn_k_b.weight", (h, kv, nope), att), Tensor(b + "attn_v_b.weight", (h, v, kv), att),
                Tensor(b + "attn_output.weight", (d, h * v), att)]
        if indexer:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            out += [Tensor(b + "indexer.attn_q_b.weight", (hi * di, q), att),
                    Tensor(b + "indexer.attn_k.weight", (di, d), att),
                    Tensor(b + "indexer.k_norm.weight", (di,), att, False),
                    Tensor(b + "indexer.k_norm.bias", (di,), att, False),
                    Tensor(b + "indexer.proj.weight", (hi, d), att),
                    Tensor(b + "indexer_compressor_ape.weight", (cfg.index_kpool, di), att, False),
                    Tensor(b + "indexer_compressor_gate.weight", (di, d), att)]
    if mlp == "dense":
        i_ = cfg.intermediate_size
        return out + [Tensor(b + "ffn_gate.weight", (i_, d), c("mlp")), Tensor(b + "ffn_up.weight", (i_, d), c("mlp")),
                      Tensor(b + "ffn_down.weight", (d, i_), c("mlp"))]
    e, ie, sh = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    return out + [
        Tensor(b + "ffn_gate_inp.weight", (e, d), c("router"), False),
        Tensor(b + "exp_probs_b.bias", (e,), c("router"), False),
        Tensor(b + "ffn_gate_exps.weight", (e, ie, d), c("routed_experts")),
        Tensor(b + "ffn_up_exps.weight", (e, ie, d), c("routed_experts")),
        Tensor(b + "ffn_down_exps.weight", (e, d, ie), c("routed_experts")),
        Tensor(b + "ffn_gate_shexp.weight", (sh, d), c("shared_experts")),
        Tensor(b + "ffn_up_shexp.weight", (sh, d), c("shared_experts")),
        Tensor(b + "ffn_down_shexp.weight", (d, sh), c("shared_experts"))]


def glm5next_tensors(cfg) -> list[Tensor]:
    """Every tensor of a ``glm5-next`` GGUF for a ``Glm53Config``; MTP blocks (MLA with a full
    indexer + MoE, no hyper-connections) after the main ones."""
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    out = [Tensor("token_embd.weight", (cfg.vocab_size, d), "embedding", False),
           Tensor("output_norm.weight", (d,), "norms", False)]
    if not cfg.tie_word_embeddings:
        out.append(Tensor("output.weight", (cfg.vocab_size, d), "output"))
    for i in range(n):
        out += _glm_block(i, cfg, cfg.layer_types[i], cfg.mlp_layer_types[i],
                          cfg.indexer_types[i] == "full", mtp=False)
    for j in range(cfg.mtp_num_hidden_layers):
        b = f"blk.{n + j}.nextn."
        out += [Tensor(b + "eh_proj.weight", (d, 2 * d), "mtp")]
        out += [Tensor(b + f"{x}.weight", (d,), "mtp", False) for x in ("enorm", "hnorm", "shared_head_norm")]
        out += _glm_block(n + j, cfg, "indexed_attention", "sparse", True, mtp=True)
    return out


# config ``arch`` -> inventory function
INVENTORIES: dict[str, Callable] = {"qwen35": qwen35_tensors, "glm5next": glm5next_tensors}


# --- bytes ----------------------------------------------------------------------------------------


def _kind(t: Tensor, recipe: Recipe) -> str:
    key = f"{t.cls}:{t.name}"
    kind = next((k for pattern, k in recipe.plan if re.match(pattern, key)), recipe.fallback)
    if kind in QType.__members__ and LAYOUTS[QType[kind]].block_size > 1:
        if not t.matmul or t.shape[-1] % LAYOUTS[QType[kind]].block_size:
            return recipe.fallback
    if kind == "FP8" and not t.matmul:
        return recipe.fallback
    return kind


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    if kind == "FP8":
        *lead, rows, cols = shape
        scales = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
        return math.prod(lead) * (rows * cols + scales)
    return tensor_nbytes(QType[kind], shape)


def _mesh(devices: int, layout: str):
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return plan_mesh(layout, devices)


def plan_config(cfg, recipe: str | Recipe, devices: int = 8, model: str | None = None, layout: str = "tp") -> Plan:
    """The plan of ``cfg`` (a config object with ``arch``) under ``recipe`` on ``devices`` chips."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    mesh = _mesh(devices, layout)
    try:
        inventory = INVENTORIES[cfg.arch](cfg)
    except KeyError:
        raise ValueError(f"no tensor inventory for architecture {cfg.arch!r}; known: {sorted(INVENTORIES)}") from None
    tensors = []
    for t in inventory:
        kind = _kind(t, recipe)
        nbytes = _nbytes(t.shape, kind)
        tensors.append(TensorPlan(t, kind, nbytes, per_device_bytes(t.name, t.shape, kind, nbytes, mesh)))
    return Plan(model or cfg.arch, recipe.name, devices, tuple(tensors), layout)


def plan_gguf(path, devices: int = 8, quant: str | None = None, layout: str = "tp") -> Plan:
    """The plan of a GGUF file (or split set) from its header alone: every tensor as stored (its own
    ggml type and bytes; ``quant=None``), or the file's model under a recipe. Classes come from the
    architecture's inventory; a tensor it does not list is class ``"other"``."""
    from pathlib import Path

    from zoo.quant.gguf import GGUFSource
    from zoo.quant.gguf_model import config_from_gguf

    src = GGUFSource(path)
    cfg = config_from_gguf(src)
    name = Path(src.files[0]).name
    if quant is not None:
        return plan_config(cfg, quant, devices, name, layout)
    mesh = _mesh(devices, layout)
    known = {t.name: t for t in INVENTORIES[cfg.arch](cfg)}
    tensors = []
    for key in src.keys():
        info = src.info(key)
        listed = known.get(key)
        t = Tensor(key, info.shape, listed.cls if listed else "other",
                   listed.matmul if listed else len(info.shape) >= 2)
        tensors.append(TensorPlan(t, info.qtype.name, info.nbytes,
                                  per_device_bytes(key, info.shape, info.qtype.name, info.nbytes, mesh)))
    return Plan(name, "as stored", devices, tuple(tensors), layout)


def plan(name: str, *, quant: str, devices: int = 8, layout: str = "tp") -> Plan:
    """``zoo.plan``: the plan of a registry model's config preset (``configs/``) under a recipe."""
    from zoo import registry
    from zoo.config import config_from_hf

    spec = registry.get_spec(name)
    if spec.preset is None:
        raise ValueError(f"model {name!r} has no config preset to plan from")
    path = registry.preset_path(spec.preset)
    return plan_config(config_from_hf(json.loads(path.read_text()), source=str(path)), quant, devices, name, layout)
