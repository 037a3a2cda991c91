"""Tensor-name maps: source tensor name -> model parameter path (+ a layout transform), as data.

A map is a ``NameMap``: prefixes stripped from source names, patterns of names that are ignored on
purpose (vision towers), and rules ``(regex, parameter-path template, transform)``. The regex is
matched against the whole stripped name; the template may use its groups (``\\1``). A transform
names a function in ``TRANSFORMS`` that turns the stored array into the parameter's layout, or is a
``Transform``: a ``TRANSFORMS`` entry preceded by a ``HeadOrder`` (a permutation of heads that
depends on the config, e.g. llama.cpp's value-head order in ``qwen35`` GGUFs). Maps whose rules
depend on the config are built by a function of it (``GGUF_NAME_MAPS``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np


def _conv(w: np.ndarray) -> np.ndarray:
    """A depthwise conv weight stored channels first, with or without unit dims (HF ``[C, 1, K]``,
    GGUF ``[C, K]``, ``[C, 1, K]`` or ``[1, C, 1, K]`` by llama.cpp version) -> ``[K, C]``."""
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)


def _a_log_from_ssm_a(w: np.ndarray) -> np.ndarray:
    """GGUF ``ssm_a`` holds ``-exp(A_log)``; the parameter is ``A_log``."""
    return np.log(-w.astype(np.float32))


TRANSFORMS: dict[str | None, Callable[[np.ndarray], np.ndarray]] = {
    None: lambda w: w,
    # torch Linear / GGUF matrix [*lead, out, in] -> [*lead, in, out] (lead: stacked experts), for
    # a weight consumed through zoo.quant.matmul / moe: storage may keep it quantized (a QArray)
    "T": lambda w: np.ascontiguousarray(np.swapaxes(w, -1, -2)),
    # the same for a matrix the model reads directly (a router, MLA's absorbed kv_b): always dense
    "transpose": lambda w: np.ascontiguousarray(np.swapaxes(w, -1, -2)),
    "conv": _conv,
    "minus_one": lambda w: w.astype(np.float32) - np.float32(1),   # GGUF stores (1 + w) norms
    "a_log_from_ssm_a": _a_log_from_ssm_a,
}


@dataclass(frozen=True)
class HeadOrder:
    """A head permutation to undo on one axis of a stored (numpy-order) tensor.

    llama.cpp writes ``qwen35`` value heads *tiled* (``[G0_v0, G1_v0, ..., G0_v1, G1_v1, ...]``)
    where HF keeps them *grouped* by key head (``[G0_v0..v{r-1}, G1_v0..]``): stored head
    ``s * groups + g`` is logical head ``g * per_group + s``. Entries ``[start, start + span)``
    of ``axis`` are heads of ``unit`` entries each (``span = groups * per_group * unit``); the rest
    of the axis is left alone.
    """

    axis: int
    start: int
    groups: int
    per_group: int
    unit: int

    @property
    def span(self) -> int:
        return self.groups * self.per_group * self.unit

    def index(self, n: int) -> np.ndarray:
        """int[n]: ``logical = stored.take(index, axis)`` for an axis of length ``n``."""
        if self.start + self.span > n:
            raise ValueError(f"head order needs {self.start + self.span} entries on axis {self.axis}, "
                             f"the tensor has {n}")
        heads = np.arange(self.span).reshape(self.per_group, self.groups, self.unit).transpose(1, 0, 2)
        return np.concatenate([np.arange(self.start), self.start + heads.reshape(-1),
                               np.arange(self.start + self.span, n)])

    def restore(self, w: np.ndarray) -> np.ndarray:
        return np.take(w, self.index(w.shape[self.axis]), axis=self.axis)

    def as_view(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The order as a reshape + transpose of the whole axis, ``(shape, axes)`` with
        ``stored = logical.reshape(shape).transpose(axes).reshape(n)``; None unless the head span
        is the whole axis."""
        if self.start or self.span != n:
            return None
        return (self.groups, self.per_group, self.unit), (1, 0, 2)


@dataclass(frozen=True)
class Transform:
    """Undo ``heads`` on the stored array, then apply ``TRANSFORMS[layout]``."""

    layout: str | None = None
    heads: HeadOrder | None = None

    def __call__(self, w: np.ndarray) -> np.ndarray:
        return TRANSFORMS[self.layout](w if self.heads is None else self.heads.restore(w))


def apply_transform(transform: "str | Transform | None", w: np.ndarray) -> np.ndarray:
    """A rule's transform (a ``TRANSFORMS`` name or a ``Transform``) applied to a stored array."""
    return transform(w) if isinstance(transform, Transform) else TRANSFORMS[transform](w)


def layout_of(transform: "str | Transform | None") -> str | None:
    """The ``TRANSFORMS`` name a rule's transform ends with."""
    return transform.layout if isinstance(transform, Transform) else transform


@dataclass(frozen=True)
class Rule:
    """``index`` (optional) names the regex group holding a slice index: many source tensors then fill
    slices of one parameter along its first axis (experts stored one tensor per expert on disk,
    stacked into one ``[E, in, out]`` bank); ``transform`` applies to each source tensor."""

    pattern: str
    target: str
    transform: str | Transform | None = None
    index: str | None = None


class Target(NamedTuple):
    """Where a source tensor goes: parameter ``path`` (after ``transform``), or slice ``index`` of it.
    ``index_span`` is where the index sits in the source name."""

    path: str
    transform: str | Transform | None
    index: int | None = None
    index_span: tuple[int, int] | None = None

    def sibling(self, name: str, index: int | str) -> str:
        """The source name of slice ``index`` of the same parameter, given this slice's ``name``."""
        start, end = self.index_span
        return f"{name[:start]}{index}{name[end:]}"


def _kv_b_from_k_v(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """llama.cpp's MLA split undone: ``attn_k_b [H, C, dn]`` (each head's k part transposed) and
    ``attn_v_b [H, dv, C]`` -> ``kv_b_proj.weight [H*(dn+dv), C]`` (per head rows ``[k_nope | v]``)."""
    return np.ascontiguousarray(np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1).reshape(-1, k_b.shape[1]))


def _kv_b_shape(k_b: tuple[int, ...], v_b: tuple[int, ...]) -> tuple[int, int]:
    if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
        raise ValueError(f"attn_k_b {k_b} and attn_v_b {v_b} are not [H, C, dn] and [H, dv, C]")
    return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])


class Combiner(NamedTuple):
    """How the parts of a ``Join`` make one tensor: ``fn(*float32 parts)`` and ``shape(*part shapes)``
    (which raises ``ValueError`` for parts that do not fit together)."""

    fn: Callable[..., np.ndarray]
    shape: Callable[..., tuple[int, ...]]


COMBINERS: dict[str, Combiner] = {"kv_b_from_k_v": Combiner(_kv_b_from_k_v, _kv_b_shape)}


@dataclass(frozen=True)
class Join:
    """Stored tensors that together make one tensor: ``pattern`` matches the first part's name; the
    ``parts`` and the joined ``name`` are templates over its groups. The parts are read as float32 and
    combined by ``COMBINERS[combine]``; the rules then map the joined name like a stored tensor
    (``zoo.quant.views.JoinedSource`` presents it). Nothing is joined when the file already holds a
    tensor of the joined name."""

    pattern: str
    parts: tuple[str, ...]
    name: str
    combine: str


class NameMap:
    """Rules (first match wins), prefixes to strip, names ignored on purpose, and ``joins``: tensors
    the source must present joined (``Join``) before the rules apply."""

    def __init__(self, rules, strip_prefixes: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
                 joins: tuple[Join, ...] = ()):
        self.rules = tuple(rules)
        self.joins = tuple(joins)
        self.strip_prefixes = strip_prefixes
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]
        self._compiled_ignore = [re.compile(p) for p in ignore]

    def resolve(self, name: str) -> Target | None:
        """The ``Target`` of a source name; None if no rule matches."""
        stripped = name
        for prefix in self.strip_prefixes:
            if stripped.startswith(prefix):
                stripped = stripped[len(prefix):]
                break
        offset = len(name) - len(stripped)
        for regex, rule in self._compiled:
            m = regex.fullmatch(stripped)
            if m:
                if rule.index is None:
                    return Target(m.expand(rule.target), rule.transform)
                start, end = m.span(rule.index)
                return Target(m.expand(rule.target), rule.transform, int(m.group(rule.index)),
                              (start + offset, end + offset))
        return None

    def lookup(self, name: str) -> tuple[str, str | Transform | None] | None:
        """(parameter path, transform) for a source name; None if no rule matches."""
        target = self.resolve(name)
        return None if target is None else (target.path, target.transform)

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


def qwen35_gguf_names(cfg) -> NameMap:
    """llama.cpp's ``qwen35`` GGUF layout for a ``Qwen38Config`` (REFERENCE.md section 2).

    Numpy-order matrices are ``[out, in]`` ("T"); norms are stored ``1 + w`` ("minus_one", all but
    the DeltaNet output norm); ``ssm_a`` is ``-exp(A_log)``; every value-head tensor has its heads
    tiled (``HeadOrder``); the MTP block is ``blk.{num_hidden_layers}`` plus its ``nextn.*`` tensors
    (the ``nextn`` copies of the embedding and head, when present, are the shared ones: ignored).
    """
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    order = dict(groups=nk, per_group=nv // nk)
    v_rows = HeadOrder(axis=0, start=0, unit=cfg.linear_value_head_dim, **order)
    qkv_rows = HeadOrder(axis=0, start=2 * nk * cfg.linear_key_head_dim, unit=cfg.linear_value_head_dim, **order)
    head_rows = HeadOrder(axis=0, start=0, unit=1, **order)
    v_cols = HeadOrder(axis=1, start=0, unit=cfg.linear_value_head_dim, **order)

    def block(src: str, dst: str) -> list[Rule]:
        return [
            Rule(rf"{src}\.attn_norm\.weight", f"{dst}.input_layernorm.weight", "minus_one"),
            Rule(rf"{src}\.post_attention_norm\.weight", f"{dst}.post_attention_layernorm.weight", "minus_one"),
            Rule(rf"{src}\.attn_qkv\.weight", f"{dst}.linear_attn.in_proj_qkv.kernel", Transform("T", qkv_rows)),
            Rule(rf"{src}\.attn_gate\.weight", f"{dst}.linear_attn.in_proj_z.kernel", Transform("T", v_rows)),
            Rule(rf"{src}\.ssm_beta\.weight", f"{dst}.linear_attn.in_proj_b.kernel", Transform("T", head_rows)),
            Rule(rf"{src}\.ssm_alpha\.weight", f"{dst}.linear_attn.in_proj_a.kernel", Transform("T", head_rows)),
            Rule(rf"{src}\.ssm_conv1d\.weight", f"{dst}.linear_attn.conv_weight", Transform("conv", qkv_rows)),
            Rule(rf"{src}\.ssm_a", f"{dst}.linear_attn.A_log", Transform("a_log_from_ssm_a", head_rows)),
            Rule(rf"{src}\.ssm_dt\.bias", f"{dst}.linear_attn.dt_bias", Transform(None, head_rows)),
            Rule(rf"{src}\.ssm_norm\.weight", f"{dst}.linear_attn.norm.weight"),
            Rule(rf"{src}\.ssm_out\.weight", f"{dst}.linear_attn.out_proj.kernel", Transform("T", v_cols)),
            Rule(rf"{src}\.attn_(?P<p>q|k|v)\.weight", rf"{dst}.self_attn.\g<p>_proj.kernel", "T"),
            Rule(rf"{src}\.attn_(?P<p>q|k|v)\.bias", rf"{dst}.self_attn.\g<p>_proj.bias"),
            Rule(rf"{src}\.attn_output\.weight", f"{dst}.self_attn.o_proj.kernel", "T"),
            Rule(rf"{src}\.attn_output\.bias", f"{dst}.self_attn.o_proj.bias"),
            Rule(rf"{src}\.attn_(?P<p>q|k)_norm\.weight", rf"{dst}.self_attn.\g<p>_norm.weight", "minus_one"),
            Rule(rf"{src}\.ffn_(?P<p>gate|up|down)\.weight", rf"{dst}.mlp.\g<p>_proj.kernel", "T"),
        ]

    mtp = rf"blk\.{cfg.num_hidden_layers}"
    return NameMap(
        ignore=(rf"{mtp}\.nextn\.(embed_tokens|shared_head_head)\.",),
        rules=tuple(
            [Rule(r"token_embd\.weight", "embed_tokens.embedding"),
             Rule(r"output_norm\.weight", "norm.weight", "minus_one"),
             Rule(r"output\.weight", "lm_head.kernel", "T"),
             Rule(rf"{mtp}\.nextn\.eh_proj\.weight", "mtp.fc.kernel", "T"),
             Rule(rf"{mtp}\.nextn\.enorm\.weight", "mtp.embed_norm.weight", "minus_one"),
             Rule(rf"{mtp}\.nextn\.hnorm\.weight", "mtp.hidden_norm.weight", "minus_one"),
             Rule(rf"{mtp}\.nextn\.shared_head_norm\.weight", "mtp.final_norm.weight", "minus_one")]
            + block(mtp, "mtp.block")
            + block(r"blk\.(?P<i>\d+)", r"layers.\g<i>")
        ),
    )


def _glm5next_layer_rules(src: str, dst: str) -> list[Rule]:
    """One GLM-5.3 decoder layer's on-disk HF tensors, under source prefix ``src`` and parameter prefix ``dst``."""
    sa, ix, mlp = rf"{src}\.self_attn", rf"{src}\.self_attn\.indexer", rf"{src}\.mlp"
    linears = ("q_proj|k_proj|v_proj|f_a_proj|f_b_proj|b_proj|g_a_proj|g_b_proj|o_proj"   # KDA
               "|q_a_proj|q_b_proj|kv_a_proj_with_mqa")                                   # MLA
    return [
        Rule(rf"{src}\.hc_(?P<s>attn|ffn)_(?P<n>fn|base|scale)", rf"{dst}.\g<s>_hc.\g<n>"),
        Rule(rf"{src}\.(?P<n>input_layernorm|post_attention_layernorm)\.weight", rf"{dst}.\g<n>.weight"),
        Rule(rf"{sa}\.(?P<n>{linears})\.weight", rf"{dst}.self_attn.\g<n>.kernel", "T"),
        Rule(rf"{sa}\.(?P<n>q_a_proj|kv_a_proj_with_mqa|o_proj)\.bias", rf"{dst}.self_attn.\g<n>.bias"),
        Rule(rf"{sa}\.(?P<n>q|k|v)_conv1d\.weight", rf"{dst}.self_attn.\g<n>_conv", "conv"),
        Rule(rf"{sa}\.(?P<n>A_log|dt_bias)", rf"{dst}.self_attn.\g<n>"),
        Rule(rf"{sa}\.(?P<n>o_norm|q_a_layernorm|kv_a_layernorm)\.weight", rf"{dst}.self_attn.\g<n>.weight"),
        Rule(rf"{sa}\.kv_b_proj\.weight", rf"{dst}.self_attn.kv_b", "transpose"),
        Rule(rf"{ix}\.(?P<n>wq_b|wk|weights_proj)\.weight", rf"{dst}.self_attn.indexer.\g<n>.kernel", "T"),
        Rule(rf"{ix}\.k_norm\.(?P<n>weight|bias)", rf"{dst}.self_attn.indexer.k_norm.\g<n>"),
        Rule(rf"{ix}\.index_kpool_compress_gate", rf"{dst}.self_attn.indexer.compress_gate.kernel", "T"),
        Rule(rf"{ix}\.index_kpool_compress_ape", rf"{dst}.self_attn.indexer.compress_ape"),
        Rule(rf"{mlp}\.gate\.weight", rf"{dst}.mlp.router.weight", "transpose"),
        Rule(rf"{mlp}\.gate\.e_score_correction_bias", rf"{dst}.mlp.router.correction_bias"),
        Rule(rf"{mlp}\.experts\.(?P<e>\d+)\.(?P<n>gate|up|down)_proj\.weight",
             rf"{dst}.mlp.experts.\g<n>_kernel", "T", index="e"),
        Rule(rf"{mlp}\.shared_experts\.(?P<n>gate_proj|up_proj|down_proj)\.weight",
             rf"{dst}.mlp.shared_experts.\g<n>.kernel", "T"),
        Rule(rf"{mlp}\.(?P<n>gate_proj|up_proj|down_proj)\.weight", rf"{dst}.mlp.\g<n>.kernel", "T"),
    ]


@functools.lru_cache(maxsize=None)
def _glm5next_hf(num_hidden_layers: int) -> NameMap:
    mtp = rf"layers\.{num_hidden_layers}"
    return NameMap(
        strip_prefixes=("model.language_model.", "model."),
        ignore=(r"model\.visual\.", r"visual\.",
                r"(model\.(language_model\.)?)?layers\.\d+\.(embed_tokens|shared_head\.head)\."),
        rules=tuple(
            [Rule(r"embed_tokens\.weight", "embed_tokens.embedding"),
             Rule(r"norm\.weight", "norm.weight"),
             Rule(r"lm_head\.weight", "lm_head.kernel", "T"),
             Rule(rf"{mtp}\.eh_proj\.weight", "mtp.fc.kernel", "T"),
             Rule(rf"{mtp}\.enorm\.weight", "mtp.embed_norm.weight"),
             Rule(rf"{mtp}\.hnorm\.weight", "mtp.hidden_norm.weight"),
             Rule(rf"{mtp}\.shared_head\.norm\.weight", "mtp.final_norm.weight")]
            + _glm5next_layer_rules(mtp, "mtp.block")
            + _glm5next_layer_rules(r"layers\.(?P<i>\d+)", r"layers.\g<i>")
        ),
    )


def glm5next_hf(cfg) -> NameMap:
    """HF ``glm5_next`` checkpoints (on-disk names): ``model.language_model.*`` (multimodal) or
    ``model.*`` (text only), ``lm_head.weight`` at the top level; the MTP layer is
    ``layers.{num_hidden_layers}``; the vision tower and the MTP layer's copies of the embedding
    and head (when present) are ignored."""
    return _glm5next_hf(cfg.num_hidden_layers)


# llama.cpp's ``glm5next`` block: GGUF name after ``blk.N.`` -> parameter after the layer prefix,
# layout transform. KDA and MLA layers share ``attn_output`` (o_proj); ``attn_kv_b`` is joined from
# ``attn_k_b`` + ``attn_v_b`` (``GLM5NEXT_JOINS``); expert banks are stacked ``[E, out, in]``.
_GLM5NEXT_BLOCK = (
    (r"hc_(?P<s>attn|ffn)_(?P<n>fn|base|scale)\.weight", r"\g<s>_hc.\g<n>", None),
    (r"attn_norm\.weight", "input_layernorm.weight", None),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight", None),
    (r"attn_(?P<p>q|k|v)\.weight", r"self_attn.\g<p>_proj.kernel", "T"),
    (r"ssm_conv1d_(?P<p>q|k|v)\.weight", r"self_attn.\g<p>_conv", "conv"),
    (r"ssm_(?P<p>f_a|f_b|g_a|g_b)\.weight", r"self_attn.\g<p>_proj.kernel", "T"),
    (r"ssm_beta\.weight", "self_attn.b_proj.kernel", "T"),
    (r"ssm_a", "self_attn.A_log", "a_log_from_ssm_a"),
    (r"ssm_dt\.bias", "self_attn.dt_bias", None),
    (r"ssm_norm\.weight", "self_attn.o_norm.weight", None),
    (r"attn_output\.weight", "self_attn.o_proj.kernel", "T"),
    (r"attn_q_a\.weight", "self_attn.q_a_proj.kernel", "T"),
    (r"attn_kv_a_mqa\.weight", "self_attn.kv_a_proj_with_mqa.kernel", "T"),
    (r"attn_q_a\.bias", "self_attn.q_a_proj.bias", None),
    (r"attn_kv_a_mqa\.bias", "self_attn.kv_a_proj_with_mqa.bias", None),
    (r"attn_output\.bias", "self_attn.o_proj.bias", None),
    (r"attn_q_a_norm\.weight", "self_attn.q_a_layernorm.weight", None),
    (r"attn_q_b\.weight", "self_attn.q_b_proj.kernel", "T"),
    (r"attn_kv_a_norm\.weight", "self_attn.kv_a_layernorm.weight", None),
    (r"attn_kv_b\.weight", "self_attn.kv_b", "transpose"),
    (r"indexer\.attn_q_b\.weight", "self_attn.indexer.wq_b.kernel", "T"),
    (r"indexer\.attn_k\.weight", "self_attn.indexer.wk.kernel", "T"),
    (r"indexer\.k_norm\.(?P<n>weight|bias)", r"self_attn.indexer.k_norm.\g<n>", None),
    (r"indexer\.proj\.weight", "self_attn.indexer.weights_proj.kernel", "T"),
    (r"indexer_compressor_gate\.weight", "self_attn.indexer.compress_gate.kernel", "T"),
    (r"indexer_compressor_ape\.weight", "self_attn.indexer.compress_ape", None),
    (r"ffn_gate_inp\.weight", "mlp.router.weight", "transpose"),
    (r"exp_probs_b\.bias", "mlp.router.correction_bias", None),
    (r"ffn_(?P<p>gate|up|down)_exps\.weight", r"mlp.experts.\g<p>_kernel", "T"),
    (r"ffn_(?P<p>gate|up|down)_shexp\.weight", r"mlp.shared_experts.\g<p>_proj.kernel", "T"),
    (r"ffn_(?P<p>gate|up|down)\.weight", r"mlp.\g<p>_proj.kernel", "T"),
)
GLM5NEXT_JOINS = (Join(r"(?P<b>blk\.\d+)\.attn_k_b\.weight", (r"\g<b>.attn_k_b.weight", r"\g<b>.attn_v_b.weight"),
                       r"\g<b>.attn_kv_b.weight", "kv_b_from_k_v"),)


@functools.lru_cache(maxsize=None)
def _glm5next_gguf(num_hidden_layers: int) -> NameMap:
    def block(src: str, dst: str) -> list[Rule]:
        return [Rule(rf"{src}\.{pattern}", f"{dst}.{target}", transform)
                for pattern, target, transform in _GLM5NEXT_BLOCK]

    mtp = rf"blk\.{num_hidden_layers}"
    return NameMap(
        ignore=(rf"{mtp}\.nextn\.(embed_tokens|shared_head_head)\.",),
        joins=GLM5NEXT_JOINS,
        rules=tuple(
            [Rule(r"token_embd\.weight", "embed_tokens.embedding"),
             Rule(r"output_norm\.weight", "norm.weight"),
             Rule(r"output\.weight", "lm_head.kernel", "T"),
             Rule(rf"{mtp}\.nextn\.eh_proj\.weight", "mtp.fc.kernel", "T"),
             Rule(rf"{mtp}\.nextn\.enorm\.weight", "mtp.embed_norm.weight"),
             Rule(rf"{mtp}\.nextn\.hnorm\.weight", "mtp.hidden_norm.weight"),
             Rule(rf"{mtp}\.nextn\.shared_head_norm\.weight", "mtp.final_norm.weight")]
            + block(mtp, "mtp.block")
            + block(r"blk\.(?P<i>\d+)", r"layers.\g<i>")
        ),
    )


def glm5next_gguf_names(cfg) -> NameMap:
    """llama.cpp's ``glm5next`` / ``glm5-next`` GGUF layout for a ``Glm53Config`` (REFERENCE.md
    section 1): plain norms (no +1), ``ssm_a`` = ``-exp(A_log)``, KDA convs ``[C, (1,) K]`` (any unit
    dims), ``kv_b`` joined from ``attn_k_b`` + ``attn_v_b``, stacked expert banks ``[E, out, in]``
    ("T" -> ``[E, in, out]``); the MTP block is ``blk.{num_hidden_layers}`` plus its ``nextn.*``
    tensors (its copies of the embedding and head, when present, are the shared ones: ignored)."""
    return _glm5next_gguf(cfg.num_hidden_layers)


# GGUF ``general.architecture`` -> fn(config) -> NameMap.
GGUF_NAME_MAPS: dict[str, Callable] = {
    "qwen35": qwen35_gguf_names,
    "glm5next": glm5next_gguf_names,
    "glm5-next": glm5next_gguf_names,
}
