"""GLM-5.3 configuration: the frozen dataclass read from an HF ``glm5_next`` config.json."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zoo.models.config import ConfigError, text_part
from zoo.models.glm53.vision import VisionConfig

# transformers' ``Glm5NextConfig`` defaults of the multimodal token ids
TOKEN_IDS = {"image_token_id": 154854, "video_token_id": 154855, "image_start_token_id": 154830,
             "image_end_token_id": 154831, "video_start_token_id": 154832, "video_end_token_id": 154833}


def _indexer_types(t: dict[str, Any], n_layers: int) -> list[str]:
    """``indexer_types``, or transformers' derivation from ``index_topk_pattern`` / freq + offset."""
    if t.get("indexer_types") is not None:
        return list(t["indexer_types"])
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(t.get("index_topk_freq", 1)), 1), int(t.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


@dataclasses.dataclass(frozen=True)
class Glm53Config:
    """GLM-5.3-Flash (HF ``glm5_next``) text model: KDA + MLA/indexer hybrid, MoE, mHC streams.

    ``layer_types[i]``: ``"linear_attention"`` (Kimi Delta Attention) or ``"indexed_attention"``
    (MLA with the k-pool indexer); ``mlp_layer_types[i]``: ``"dense"`` or ``"sparse"`` (MoE);
    ``indexer_types[i]`` (read on indexed layers): ``"full"`` runs the layer's indexer, ``"shared"``
    reuses the selection of the last full layer before it. ``mtp_num_hidden_layers`` counts the
    MTP layers stored after the last layer (``layers.{num_hidden_layers}``).

    ``vision``: the vision tower (``zoo.models.glm53.vision``) when config.json has a ``vision_config``,
    else None (text only); the ``*_token_id`` fields are the multimodal placeholders and delimiters
    (``zoo.models.glm53.multimodal``: a video's frames are ``image_token_id`` runs inside a
    ``video_start_token_id`` ... ``video_end_token_id`` span; ``video_token_id`` is the prompt's
    marker, not a placeholder).
    """

    arch: ClassVar[str] = "glm53"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float | None = 10.0
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1_048_576
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    vision: VisionConfig | None = None
    image_token_id: int = TOKEN_IDS["image_token_id"]
    video_token_id: int = TOKEN_IDS["video_token_id"]
    image_start_token_id: int = TOKEN_IDS["image_start_token_id"]
    image_end_token_id: int = TOKEN_IDS["image_end_token_id"]
    video_start_token_id: int = TOKEN_IDS["video_start_token_id"]
    video_end_token_id: int = TOKEN_IDS["video_end_token_id"]

    LAYER_TYPES: ClassVar[frozenset[str]] = frozenset({"linear_attention", "indexed_attention"})
    MLP_TYPES: ClassVar[frozenset[str]] = frozenset({"dense", "sparse"})
    INDEXER_TYPES: ClassVar[frozenset[str]] = frozenset({"full", "shared"})

    def __post_init__(self):
        n = self.num_hidden_layers
        for name, values, known in (("layer_types", self.layer_types, self.LAYER_TYPES),
                                    ("mlp_layer_types", self.mlp_layer_types, self.MLP_TYPES),
                                    ("indexer_types", self.indexer_types, self.INDEXER_TYPES)):
            if len(values) != n:
                raise ConfigError(f"{name} has {len(values)} entries for {n} layers")
            if set(values) - known:
                raise ConfigError(f"unknown {name} {sorted(set(values) - known)}; known: {sorted(known)}")
        indexed = [i for i, lt in enumerate(self.layer_types) if lt == "indexed_attention"]
        if indexed and self.indexer_types[indexed[0]] != "full":
            raise ConfigError(f"layer {indexed[0]} is the first indexed layer but its indexer is 'shared'")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ConfigError(f"index_topk {self.index_topk} must be a positive multiple of "
                              f"index_kpool {self.index_kpool}")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"{self.n_routed_experts} experts in {self.n_group} groups, "
                              f"top {self.topk_group} groups: inconsistent")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ConfigError(f"vision_config.out_hidden_size {self.vision.out_hidden_size} != hidden_size "
                              f"{self.hidden_size}: the tower's rows replace token embeddings")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Glm53Config":
        t = text_part(hf)
        vision = hf.get("vision_config")              # text_part leaves it out; read from the outer dict
        try:
            n_layers = int(t["num_hidden_layers"])
            if int(t.get("qk_rope_head_dim") or 0):
                raise ConfigError("qk_rope_head_dim must be 0: GLM-5.3's latent attention has no rotary part")
            if t.get("q_lora_rank") is None:
                raise ConfigError("q_lora_rank is required (the indexer reads the q latent)")
            heads = int(t["num_attention_heads"])
            if int(t.get("num_key_value_heads") or heads) != heads:
                raise ConfigError("num_key_value_heads must equal num_attention_heads")
            layer_types = t.get("layer_types") or [
                "linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n_layers)]
            layer_types = ["indexed_attention" if lt == "full_attention" else lt for lt in layer_types]
            n_dense = int(t.get("first_k_dense_replace", min(3, n_layers)))
            mlp_types = t.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
            linear = dict(t.get("linear_attn_config") or {})
            lower = linear.get("gate_lower_bound", t.get("linear_lower_bound", -5.0))
            if lower is None and linear.get("safe_gate", False):
                lower = -5.0
            eos = t.get("eos_token_id", hf.get("eos_token_id"))
            eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
            mtp = t.get("num_nextn_predict_layers", t.get("mtp_num_hidden_layers", 0))
            limit = t.get("swiglu_limit", 10.0)
            return cls(
                vocab_size=int(t["vocab_size"]),
                hidden_size=int(t["hidden_size"]),
                intermediate_size=int(t["intermediate_size"]),
                moe_intermediate_size=int(t["moe_intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                layer_types=tuple(layer_types),
                mlp_layer_types=tuple(mlp_types),
                indexer_types=tuple(_indexer_types(t, n_layers)),
                n_routed_experts=int(t.get("n_routed_experts", t.get("num_local_experts", 288))),
                n_shared_experts=int(t.get("n_shared_experts", 1)),
                num_experts_per_tok=int(t.get("num_experts_per_tok", 8)),
                n_group=int(t.get("n_group") or 1),
                topk_group=int(t.get("topk_group") or 1),
                routed_scaling_factor=float(t.get("routed_scaling_factor", 2.5)),
                norm_topk_prob=bool(t.get("norm_topk_prob", True)),
                swiglu_limit=None if limit is None else float(limit),
                q_lora_rank=int(t["q_lora_rank"]),
                kv_lora_rank=int(t.get("kv_lora_rank", 512)),
                qk_nope_head_dim=int(t.get("qk_nope_head_dim", 256)),
                v_head_dim=int(t.get("v_head_dim", 256)),
                index_topk=int(t.get("index_topk", 2048)),
                index_head_dim=int(t.get("index_head_dim", 128)),
                index_n_heads=int(t.get("index_n_heads", 32)),
                index_kpool=int(t.get("index_kpool", 16)),
                index_kpool_always_select_tail=bool(t.get("index_kpool_always_select_tail", True)),
                linear_num_heads=int(linear.get("num_heads", t.get("linear_num_heads", 64))),
                linear_head_dim=int(linear.get("head_dim", t.get("linear_head_dim", 128))),
                linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4))),
                linear_lower_bound=None if lower is None else float(lower),
                hc_mult=int(t.get("hc_mult", 4)),
                hc_eps=float(t.get("hc_eps", 1e-6)),
                hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
                rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(t.get("max_position_embeddings", 1_048_576)),
                attention_bias=bool(t.get("attention_bias", False)),
                tie_word_embeddings=bool(t.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
                mtp_num_hidden_layers=int(mtp or 0),
                eos_token_id=eos,
                pad_token_id=t.get("pad_token_id"),
                vision=VisionConfig.from_hf(vision) if isinstance(vision, dict) else None,
                **{k: int(next((d[k] for d in (hf, t) if d.get(k) is not None), v)) for k, v in TOKEN_IDS.items()},
            )
        except KeyError as e:
            raise ConfigError(f"config is missing the field {e.args[0]!r}") from None


CONFIG = Glm53Config
