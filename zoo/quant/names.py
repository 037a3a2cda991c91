"""Tensor-name maps: source tensor name -> model parameter path (+ a layout transform), as data.

A map is a ``NameMap``: prefixes stripped from source names, patterns of names that are ignored on
purpose (vision towers), and rules ``(regex, parameter-path template, transform)``. The regex is
matched against the whole stripped name; the template may use its groups (``\\1``). A transform
names a function in ``TRANSFORMS`` that turns the stored array into the parameter's layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np


def _hf_conv(w: np.ndarray) -> np.ndarray:
    """HF depthwise conv weight ``[C, 1, K]`` -> ``[K, C]``."""
    return np.ascontiguousarray(w.reshape(w.shape[0], w.shape[-1]).T)


TRANSFORMS: dict[str | None, Callable[[np.ndarray], np.ndarray]] = {
    None: lambda w: w,
    "T": lambda w: np.ascontiguousarray(w.T),   # torch Linear [out, in] -> [in, out]
    "conv": _hf_conv,
}


@dataclass(frozen=True)
class Rule:
    pattern: str
    target: str
    transform: str | None = None


class NameMap:
    def __init__(self, rules, strip_prefixes: tuple[str, ...] = (), ignore: tuple[str, ...] = ()):
        self.rules = tuple(rules)
        self.strip_prefixes = strip_prefixes
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]
        self._compiled_ignore = [re.compile(p) for p in ignore]

    def lookup(self, name: str) -> tuple[str, str | None] | None:
        """(parameter path, transform) for a source name; None if no rule matches."""
        stripped = name
        for prefix in self.strip_prefixes:
            if stripped.startswith(prefix):
                stripped = stripped[len(prefix):]
                break
        for regex, rule in self._compiled:
            m = regex.fullmatch(stripped)
            if m:
                return m.expand(rule.target), rule.transform
        return None

    def ignored(self, name: str) -> bool:
        return any(p.match(name) for p in self._compiled_ignore)


def _qwen35_layer_rules(src: str, dst: str) -> list[Rule]:
    """One Qwen3.5 decoder layer's tensors, under source prefix ``src`` and parameter prefix ``dst``."""
    la, sa = rf"{src}\.linear_attn", rf"{src}\.self_attn"
    return [
        Rule(rf"{src}\.(?P<n>input_layernorm|post_attention_layernorm)\.weight", rf"{dst}.\g<n>.weight"),
        Rule(rf"{la}\.(?P<n>in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight",
             rf"{dst}.linear_attn.\g<n>.kernel", "T"),
        Rule(rf"{la}\.conv1d\.weight", rf"{dst}.linear_attn.conv_weight", "conv"),
        Rule(rf"{la}\.(?P<n>A_log|dt_bias)", rf"{dst}.linear_attn.\g<n>"),
        Rule(rf"{la}\.norm\.weight", rf"{dst}.linear_attn.norm.weight"),
        Rule(rf"{sa}\.(?P<n>q_proj|k_proj|v_proj|o_proj)\.weight", rf"{dst}.self_attn.\g<n>.kernel", "T"),
        Rule(rf"{sa}\.(?P<n>q_proj|k_proj|v_proj|o_proj)\.bias", rf"{dst}.self_attn.\g<n>.bias"),
        Rule(rf"{sa}\.(?P<n>q_norm|k_norm)\.weight", rf"{dst}.self_attn.\g<n>.weight"),
        Rule(rf"{src}\.mlp\.(?P<n>gate_proj|up_proj|down_proj)\.weight", rf"{dst}.mlp.\g<n>.kernel", "T"),
    ]


# HF qwen3_5 checkpoints: ``model.language_model.*`` (multimodal) or ``model.*`` (text only),
# ``lm_head.weight`` and ``mtp.*`` at the top level; the vision tower is ignored.
QWEN35_HF = NameMap(
    strip_prefixes=("model.language_model.", "model."),
    ignore=(r"model\.visual\.", r"visual\."),
    rules=tuple(
        [Rule(r"embed_tokens\.weight", "embed_tokens.embedding"),
         Rule(r"norm\.weight", "norm.weight"),
         Rule(r"lm_head\.weight", "lm_head.kernel", "T"),
         Rule(r"mtp\.fc\.weight", "mtp.fc.kernel", "T"),
         Rule(r"mtp\.pre_fc_norm_embedding\.weight", "mtp.embed_norm.weight"),
         Rule(r"mtp\.pre_fc_norm_hidden\.weight", "mtp.hidden_norm.weight"),
         Rule(r"mtp\.norm\.weight", "mtp.final_norm.weight")]
        + _qwen35_layer_rules(r"layers\.(?P<i>\d+)", r"layers.\g<i>")
        + _qwen35_layer_rules(r"mtp\.layers\.0", "mtp.block")
    ),
)
