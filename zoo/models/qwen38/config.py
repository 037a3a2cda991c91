"""Qwen3.8 configuration: the frozen dataclass read from an HF ``qwen3_5`` config.json."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zoo.models.config import ConfigError, rope_field, text_part
from zoo.models.qwen38.vision import VisionConfig

# transformers' ``Qwen3_5Config`` defaults
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID = 248056, 248057, 248053, 248054
MROPE_SECTION = (11, 11, 10)          # ``Qwen3_5TextRotaryEmbedding``'s default


@dataclasses.dataclass(frozen=True)
class Qwen38Config:
    """Qwen3.8 (HF ``qwen3_5``): gated-DeltaNet + gated-attention hybrid, dense MLP, and the optional
    vision tower.

    ``layer_types[i]`` is ``"linear_attention"`` (gated DeltaNet) or ``"full_attention"``.
    ``vision``: the tower's config (HF ``vision_config``), None for a text-only model.
    ``mrope_section``: how many of the rotary frequencies follow the (t, h, w) position axes
    (interleaved: frequency j follows h when j % 3 == 1 and j < 3 * section[1], w when j % 3 == 2
    and j < 3 * section[2], t otherwise; ``rotary_axes``). Text tokens have equal axes, so this
    matters only for image tokens.
    """

    arch: ClassVar[str] = "qwen38"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    mrope_section: tuple[int, ...] = MROPE_SECTION
    vision: VisionConfig | None = None
    image_token_id: int = IMAGE_TOKEN_ID
    video_token_id: int = VIDEO_TOKEN_ID
    vision_start_token_id: int = VISION_START_TOKEN_ID
    vision_end_token_id: int = VISION_END_TOKEN_ID

    LAYER_TYPES: ClassVar[frozenset[str]] = frozenset({"linear_attention", "full_attention"})

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - self.LAYER_TYPES
        if unknown:
            raise ConfigError(f"unknown layer types {sorted(unknown)}; known: {sorted(self.LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if len(self.mrope_section) != 3:
            raise ConfigError(f"mrope_section {self.mrope_section} must have 3 entries (t, h, w)")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_axes(self) -> tuple[int, ...]:
        """The position axis (0 t, 1 h, 2 w) each of the rotary_dim / 2 frequencies follows
        (HF ``Qwen3_5TextRotaryEmbedding.recomposition_frequencies``, interleaved M-RoPE)."""
        half = self.rotary_dim // 2
        axes = [0] * half
        for axis in (1, 2):
            for j in range(axis, min(3 * self.mrope_section[axis], half), 3):
                axes[j] = axis
        return tuple(axes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen38Config":
        t = text_part(hf)
        try:
            n_layers = int(t["num_hidden_layers"])
            layer_types = t.get("layer_types")
            if layer_types is None:
                interval = int(t.get("full_attention_interval", 4))
                layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                               for i in range(n_layers)]
            eos = t.get("eos_token_id", hf.get("eos_token_id"))
            eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
            vision = hf.get("vision_config")
            token = lambda name, default: int(hf.get(name, t.get(name, default)))     # noqa: E731
            return cls(
                vocab_size=int(t["vocab_size"]),
                hidden_size=int(t["hidden_size"]),
                intermediate_size=int(t["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=int(t["num_attention_heads"]),
                num_key_value_heads=int(t["num_key_value_heads"]),
                head_dim=int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]),
                layer_types=tuple(layer_types),
                linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
                linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
                rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_field(t, "rope_theta", 10_000_000.0)),
                partial_rotary_factor=float(rope_field(t, "partial_rotary_factor", 0.25)),
                max_position_embeddings=int(t.get("max_position_embeddings", 262_144)),
                attention_bias=bool(t.get("attention_bias", False)),
                tie_word_embeddings=bool(t.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
                mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", 0)),
                eos_token_id=eos,
                pad_token_id=t.get("pad_token_id"),
                mrope_section=tuple(int(n) for n in rope_field(t, "mrope_section", MROPE_SECTION)),
                vision=VisionConfig.from_hf(vision) if isinstance(vision, dict) else None,
                image_token_id=token("image_token_id", IMAGE_TOKEN_ID),
                video_token_id=token("video_token_id", VIDEO_TOKEN_ID),
                vision_start_token_id=token("vision_start_token_id", VISION_START_TOKEN_ID),
                vision_end_token_id=token("vision_end_token_id", VISION_END_TOKEN_ID),
            )
        except KeyError as e:
            raise ConfigError(f"config is missing the field {e.args[0]!r}") from None


CONFIG = Qwen38Config
