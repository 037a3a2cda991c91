"""Layouts, rules and placement pieces on one device (abstract meshes): partition specs, meshes,
QArray planes packed per input shard, the stored types' sharding rules, cache axes, slice reads,
and the planner's per-device bytes in each layout. The 8-device runs are in ``test_sharding.py``."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

import zoo
from tests.support.gguf_fixtures import ROUTED_EXPERT_BYTES
from tests.support.helpers import CountingSource
from tests.support.kernel_cases import random_rows
from tests.support.paths import DATA
from zoo.formats.ggml import QType
from zoo.loader.fill import StackedSlices
from zoo.models.architectures import architecture as arch
from zoo.models.config import load_config
from zoo.quant.int8 import Int8Weight, quantize_int8
from zoo.quant.qarray import QArray
from zoo.registry import embedded_path
from zoo.sharding.cache_axes import cache_axes
from zoo.sharding.device_plan import plan_mesh
from zoo.sharding.mesh import MESH_LAYOUTS, make_mesh, partition_spec, resolve_mesh, sharding_rule, value_specs
from zoo.sharding.placement import ReadPlan, SliceView
from zoo.sources.base import TensorInfo
from zoo.sources.fp8 import Fp8Dequantized
from zoo.sources.gguf import GGUFSource
from zoo.sources.names import HeadOrder, Target, Transform

TP8 = AbstractMesh((8,), ("tp",))
EP8 = AbstractMesh((2, 4), ("ep", "tp"))


def test_partition_spec_follows_the_rules_with_safe_fallbacks():
    assert partition_spec(("embed", "heads"), (64, 128), TP8) == PartitionSpec(None, "tp")
    assert partition_spec(("embed", "heads"), (64, 4), TP8) == PartitionSpec(None, None)       # 4 heads on 8
    assert partition_spec(("heads", "mlp"), (64, 64), TP8) == PartitionSpec("tp", None)        # tp used once
    assert partition_spec(("mlp", "embed"), (512, 64), TP8, units=(256, 1)) == PartitionSpec(None, None)
    assert partition_spec(("mlp", "embed"), (4096, 64), TP8, units=(256, 1)) == PartitionSpec("tp", None)
    assert partition_spec(("experts", "embed", "mlp"), (8, 64, 32), EP8) == PartitionSpec("ep", None, "tp")
    assert partition_spec(("experts", "embed", "mlp"), (8, 64, 32), TP8) == PartitionSpec(None, None, "tp")
    with pytest.raises(ValueError, match="logical axis 'bogus' has no rule in layout 'tp'"):
        partition_spec(("bogus",), (8,), TP8)
    with pytest.raises(ValueError, match="differ in rank"):
        partition_spec(("embed",), (8, 8), TP8)


def test_meshes_and_layout_names():
    assert MESH_LAYOUTS["ep"].mesh_shape(8) == (2, 4) and MESH_LAYOUTS["ep"].mesh_shape(4) == (2, 2)
    assert MESH_LAYOUTS["tp"].mesh_shape(8) == (8,)
    mesh = make_mesh("ep")
    assert mesh.axis_names == ("ep", "tp") and mesh.devices.size == jax.local_device_count()
    assert resolve_mesh("tp").axis_names == ("tp",) and resolve_mesh(None) is None
    with pytest.raises(ValueError, match="unknown mesh layout 'xy'"):
        resolve_mesh("xy")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh or a layout name"):
        resolve_mesh(8)
    with pytest.raises(ValueError, match=r"match no layout"):
        resolve_mesh(Mesh(np.asarray(jax.devices()[:1]), ("data",)))
    with pytest.raises(ValueError, match="does not fit layout 'ep'"):
        make_mesh("ep", shape=(2, 2))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.IQ4_XS, QType.Q6_K, QType.IQ2_S], ids=lambda t: t.name)
def test_planes_packed_per_input_part_round_trip(qtype):
    """in_splits S: each of S parts of a row packed on its own (one block per part pads f16 words)."""
    rows = random_rows(qtype, (3,), rows=5, n_blocks=6)
    whole = QArray.from_blocks(rows, qtype)
    for splits in (2, 6):
        parts = QArray.from_blocks(rows, qtype, in_splits=splits)
        assert np.array_equal(np.asarray(parts.blocks()), rows)
    assert np.array_equal(np.asarray(parts.dequantize()), np.asarray(whole.dequantize()))
    if qtype != QType.Q6_K:               # its d is per block and whole words: nothing to pad
        assert parts.planes["d"].shape[-2] == 2 * whole.planes["d"].shape[-2]


def test_qarray_planes_follow_the_logical_split():
    """Input axis split only on whole word groups; experts on the lead axis; rows on the minor axis."""
    bank = QArray.from_blocks(random_rows(QType.Q8_0, (8,), rows=64, n_blocks=8), QType.Q8_0)   # [8, 256, 64]
    axes = ("experts", "mlp", "embed")
    assert value_specs(bank, axes, TP8)[0] == PartitionSpec(None, None, None)   # 8 blocks, d packs 2: 4 words
    packed = QArray.from_blocks(random_rows(QType.Q8_0, (8,), rows=64, n_blocks=8), QType.Q8_0, in_splits=8)
    spec, leaves = value_specs(packed, axes, TP8)
    assert spec == PartitionSpec(None, "tp", None) and leaves == [spec, spec]
    assert value_specs(bank, axes, AbstractMesh((2, 2), ("ep", "tp")))[0] == PartitionSpec("ep", "tp", None)
    gate = QArray.from_blocks(random_rows(QType.Q8_0, (8,), rows=64, n_blocks=2), QType.Q8_0)     # [8, 64, 64]
    assert value_specs(gate, ("experts", "embed", "mlp"), EP8)[0] == PartitionSpec("ep", None, "tp")
    permuted = QArray.from_blocks(random_rows(QType.Q8_0, (), rows=8, n_blocks=8), QType.Q8_0,
                                  in_order=((2, 4, 32), (1, 0, 2)))
    assert value_specs(permuted, ("heads", "embed"), AbstractMesh((2,), ("tp",)))[0] == PartitionSpec(None, None)


def test_qarray_cut_and_local_views():
    rows = random_rows(QType.IQ4_XS, (4,), rows=6, n_blocks=4)
    q = QArray.from_blocks(rows, QType.IQ4_XS)
    rule = sharding_rule(q)
    by_rows = rule.cut(q, (slice(1, 3), slice(0, 1024), slice(2, 4)))
    assert np.array_equal(np.asarray(by_rows.blocks()), rows[1:3, 2:4])
    by_blocks = rule.cut(q, (slice(0, 4), slice(512, 768), slice(0, 6)))          # block 2, re-packed
    assert by_blocks.shape == (4, 256, 6) and np.array_equal(np.asarray(by_blocks.blocks()), rows[..., 2 * 136:3 * 136])
    with pytest.raises(ValueError, match="whole blocks"):
        rule.cut(q, (slice(0, 4), slice(0, 100), slice(0, 6)))
    mesh = AbstractMesh((2, 2), ("ep", "tp"))
    spec = PartitionSpec("ep", "tp", None)
    target = rule.assemble(by_blocks, (8, 512, 6), spec, mesh)               # 2 x 2 shards like by_blocks
    assert target.in_splits == 2 and target.shape == (8, 512, 6)
    local = rule.local(target, [np.zeros(s.shape[:-3] + (s.shape[-3] // 2, s.shape[-2] // 2, s.shape[-1]), np.uint32)
                                for s in jax.tree.leaves(target)], spec, mesh)
    assert local.shape == (4, 256, 6) and local.in_splits == 1


def test_int8_weights_shard_their_scales_with_the_output_axis():
    w = quantize_int8(np.random.default_rng(0).standard_normal((8, 64, 32)).astype(np.float32))
    spec, leaves = value_specs(w, ("experts", "embed", "mlp"), EP8)
    assert spec == PartitionSpec("ep", None, "tp") and leaves == [spec, PartitionSpec("ep", "tp")]
    cut = sharding_rule(w).cut(w, (slice(0, 4), slice(0, 64), slice(8, 16)))
    assert isinstance(cut, Int8Weight) and cut.q.shape == (4, 64, 8) and cut.scale.shape == (4, 8)
    assert np.array_equal(cut.scale, np.asarray(w.scale)[:4, 8:16])


@pytest.mark.parametrize("name", ["qwen38-tiny", "glm53-tiny"])
def test_every_cache_leaf_has_logical_axes(name):
    cfg = load_config(embedded_path(name))
    model = nnx.eval_shape(lambda: arch(cfg.arch).model_class()(cfg))
    cache = jax.eval_shape(lambda: model.init_cache(2, 32))
    axes = cache_axes(cache)
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    assert len(axes) == len(leaves) and all(len(a) == x.ndim for a, (_, x) in zip(axes.values(), leaves))
    assert {a[0] for a in axes.values()} == {"batch"}
    assert any("cache_heads" in a for a in axes.values())
    with pytest.raises(ValueError, match="has no logical axes"):
        cache_axes(cache.replace(mtp=jax.ShapeDtypeStruct((2,), np.int32)))      # an array outside a container


def test_read_plans_and_slice_views():
    src = GGUFSource(DATA / "qwen38-q256-udmix.gguf")
    key = "blk.0.ffn_down.weight"                                               # IQ4_XS [256 out, 512 in]
    plan = ReadPlan.of(src, key, "matmul", (512, 256))
    assert plan.axes_of_source == (1, 0) and plan.sliced == (True, True) and (plan.block_axis, plan.block) == (0, 256)
    assert plan.read_index((slice(256, 512), slice(0, 32)), (512, 256)) == (slice(256, 512), slice(0, 32))
    assert plan.read_index((slice(0, 128), slice(0, 32)), (512, 256)) == (slice(0, 512), slice(0, 32))
    counting, rows = CountingSource(src), {}
    view = SliceView(counting, key, (slice(0, 32), slice(256, 512)), rows)
    assert view.info(key).shape == (32, 256)
    assert np.array_equal(view.read(key), src.read(key)[:32, 136:272])
    other = SliceView(counting, key, (slice(0, 32), slice(0, 256)), rows)      # same rows, other block
    assert np.array_equal(other.read(key), src.read(key)[:32, :136]) and len(counting.reads) == 1
    floats = ReadPlan.of(src, "blk.0.attn_norm.weight", "minus_one", (256,))
    assert floats.sliced == (True,) and floats.block_axis is None
    assert ReadPlan.of(src, "blk.0.ffn_gate.weight", "matmul", (256, 512)).sliced == (True, True)
    heads = Transform("matmul", HeadOrder(axis=0, start=0, groups=4, per_group=3, unit=64))
    assert ReadPlan.of(src, "blk.0.attn_gate.weight", heads, (256, 768)).axes_of_source is None


class _Dict:
    """An in-memory source that records what it reads."""

    def __init__(self, tensors):
        self.tensors, self.reads = tensors, []

    def keys(self):
        return list(self.tensors)

    def info(self, key):
        return TensorInfo(self.tensors[key].dtype, self.tensors[key].shape)

    def read(self, key, index=()):
        out = self.tensors[key][index]
        self.reads.append((key, out.shape))
        return out


def test_stacked_expert_slices_read_only_what_a_device_needs():
    """A plain matmul bank is viewed as stored ``[E, out, in]`` (the store applies the swap, as for a
    GGUF bank); any other transform is applied by the view, which then holds the parameter layout.
    Either way a device's slice reads only its experts' parts."""
    experts = {f"e.{i}.w": np.random.default_rng(i).standard_normal((16, 8)).astype(np.float32) for i in range(4)}
    source = _Dict(experts)
    view = StackedSlices(source, list(experts), Target("experts.w", "matmul", 0, (2, 3)),
                         jax.ShapeDtypeStruct((4, 8, 16), np.float32))
    assert view.store_transform == "matmul" and view.info(view.name).shape == (4, 16, 8)
    part = view.read(view.name, (slice(1, 3), slice(4, 12), slice(0, 8)))
    assert np.array_equal(part, np.stack([experts[f"e.{i}.w"][4:12, :] for i in (1, 2)]))
    assert source.reads == [("e.1.w", (8, 8)), ("e.2.w", (8, 8))]
    assert np.array_equal(view.read(view.name), np.stack(list(experts.values())))

    source.reads.clear()
    view = StackedSlices(source, list(experts), Target("experts.w", "transposed", 0, (2, 3)),
                         jax.ShapeDtypeStruct((4, 8, 16), np.float32))
    assert view.store_transform is None and view.info(view.name).shape == (4, 8, 16)
    part = view.read(view.name, (slice(1, 3), slice(0, 8), slice(4, 12)))
    assert np.array_equal(part, np.stack([experts[f"e.{i}.w"].T[:, 4:12] for i in (1, 2)]))
    assert source.reads == [("e.1.w", (8, 8)), ("e.2.w", (8, 8))]
    assert np.array_equal(view.read(view.name), np.stack([w.T for w in experts.values()]))


def test_fp8_slices_read_only_their_scale_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 300, 260)).astype(ml_dtypes.float8_e4m3fn)
    source = _Dict({"w": w, "w_scale_inv": rng.uniform(0.5, 2.0, (2, 3, 3)).astype(np.float32)})
    fp8 = Fp8Dequantized(source)
    full = fp8.read("w")
    source.reads.clear()
    index = (slice(1, 2), slice(10, 250), slice(129, 260))
    assert np.array_equal(fp8.read("w", index), full[index])
    assert source.reads == [("w", (1, 256, 132)), ("w_scale_inv", (1, 2, 2))]


def test_plan_per_device_bytes_in_each_layout():
    """UD-IQ3_XXS GLM-5.3-Flash on 8 chips: "tp" splits every expert's width (13.84 GB of expert
    planes per chip, ``d`` padding of one-block slices of ``down`` included); "ep" (2 x 4) holds
    half the experts at a quarter of the width: exactly 1/8 of the expert bytes, no padding."""
    tp = zoo.plan("glm53-flash", quant="UD-IQ3_XXS", devices=8, layout="tp")
    ep = zoo.plan("glm53-flash", quant="UD-IQ3_XXS", devices=8, layout="ep")
    experts = {lay.layout: sum(t.per_device_bytes for t in lay.tensors if t.tensor.cls == "routed_experts")
               for lay in (tp, ep)}
    assert experts["ep"] * 8 == ROUTED_EXPERT_BYTES and 13.8e9 < experts["tp"] < 13.9e9
    attention = {lay.layout: sum(t.per_device_bytes for t in lay.tensors if t.tensor.cls == "attention")
                 for lay in (tp, ep)}
    assert 1.8 < attention["ep"] / attention["tp"] <= 2.0                 # split over tp = 4, not 8
    assert tp.fits(16.0e9) and not ep.fits(16.0e9) and tp.total_bytes == ep.total_bytes
    assert "layout ep" in ep.summary() and ep.to_dict()["layout"] == "ep"
    print(f"GLM-5.3-Flash UD-IQ3_XXS per device: tp {tp.per_device_bytes:,} B, ep {ep.per_device_bytes:,} B")
    one = zoo.plan("qwen38-27b", quant="bf16", devices=1, layout="ep")
    float32 = sum(t.nbytes for t in one.tensors if t.tensor.name.endswith(("ssm_a", "ssm_dt.bias")))  # 2 B more
    assert one.per_device_bytes == one.total_bytes + float32       # one device: everything, A_log/dt_bias in f32
    with pytest.raises(ValueError, match="unknown mesh layout"):
        zoo.plan("qwen38-27b", quant="bf16", layout="dp")


def test_glm_latent_cache_and_pooled_keys_split_over_the_sequence():
    """GLM's latent cache and the indexer's pooled keys are shared by all heads: they split over the
    sequence along ``tp`` (1/8 of the slots per chip in "tp" on 8 devices, 1/4 in "ep" 2 x 4)."""
    cfg = load_config(embedded_path("glm53-tiny"))
    model = nnx.eval_shape(lambda: arch(cfg.arch).model_class()(cfg))
    cache = jax.eval_shape(lambda: model.init_cache(2, 256))
    axes = cache_axes(cache)
    latent = {k: a for k, a in axes.items() if k.endswith(".latent")}
    assert latent and all(a == ("batch", "latent_len", "kv_lora") for a in latent.values())
    for layout in ("tp", "ep"):
        mesh = plan_mesh(layout, 8)
        assert partition_spec(("batch", "latent_len", "kv_lora"), (2, 256, 32), mesh) == PartitionSpec(None, "tp", None)
        assert partition_spec(("batch", "pools", "head_dim"), (2, 64, 16), mesh) == PartitionSpec(None, "tp", None)
