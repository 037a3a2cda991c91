"""Ahead-of-time compilation for a real target with the real TPU compiler (libtpu's topology, no TPU):
the engine's programs compile with the target's Pallas kernels, and the planner's per-chip bytes
equal the compiler's argument bytes. The full-size compiles are in ``bench/compile_tpu.py``."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import pytest

from tests.support.random_checkpoints import ONE_OF_EACH, with_layers
from zoo import registry
from zoo.api import resolve
from zoo.models.config import load_config
from zoo.tools import compile_report as aot
from zoo.tools.plan import plan_config

jax.numpy.zeros(1).block_until_ready()          # the CPU backend is in use before the target is opened

GLM_LAYERS = (2, 3)                              # of the preset: a KDA layer (dense MLP), an MLA layer with the MoE


def write_reduced(hf: dict, layers: tuple[int, ...], path):
    """``hf`` (a config.json's dict) with only ``layers`` (``with_layers``), written to ``path``."""
    (path / "config.json").write_text(json.dumps(with_layers(hf, layers)))
    return path


@pytest.fixture(scope="module")
def glm_reduced(tmp_path_factory):
    """GLM-5.3-Flash at full width with two of its layers (KDA with a dense MLP; MLA with the indexer
    and the routed experts) and the MTP layer (a config.json only)."""
    hf = json.loads(registry.preset_path("glm53-flash.json").read_text())
    return write_reduced(hf, GLM_LAYERS, tmp_path_factory.mktemp("glm-reduced"))


@pytest.fixture(scope="module")
def glm_tiny_reduced(tmp_path_factory):
    """glm53-tiny's config with one layer of each kind (``ONE_OF_EACH``: KDA with the dense MLP, MLA
    with the full and with the shared indexer, both with the MoE) and its MTP layer (a config.json
    only): 41 s of CPU for the two programs below against 73 s with all 8 layers, on one core here."""
    return tiny_config("glm53-tiny", tmp_path_factory.mktemp("glm-tiny-reduced"))


def tiny_config(name: str, path):
    """An embedded model's config.json with ``ONE_OF_EACH`` of its layers, written to ``path``."""
    return write_reduced(json.loads((resolve(name) / "config.json").read_text()), ONE_OF_EACH[name], path)


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory):
    """``zoo compile DIR --quant Q8_0 --context 128 --json`` (every default: the whole set), DIR
    qwen38-tiny's config with 2 of its 8 layers (a DeltaNet layer and a gated-attention one, the
    model's alternation, and its MTP layer): 62 s of CPU against 107 s for all 8 on one core here."""
    from zoo.cli import main

    path = tiny_config("qwen38-tiny", tmp_path_factory.mktemp("qwen-tiny-reduced"))
    assert load_config(path).layer_types == ("linear_attention", "full_attention")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["compile", str(path), "--quant", "Q8_0", "--context", "128", "--json"])
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("name", ["glm53-tiny", "qwen38-tiny"])
def test_quantized_tiny_models_compile_for_v5e_8(name, cli_report, glm_tiny_reduced):
    """The server's programs compile for 8 v5e chips, through the Mosaic kernels; each decode and
    prefill program carries its roofline, its kernels counted while it was traced. GLM (glm53-tiny
    with 3 of its layers, one of each kind: ``glm_tiny_reduced``): the decode step with MTP drafts and
    the prefill chunk (the set's other programs differ from these in shapes only); Qwen: ``zoo
    compile``'s whole default set (decode without and with drafts, both prefill widths, the decode
    step split around grammar token masks)."""
    if name == "glm53-tiny":       # the decode step with MTP drafts and the prefill chunk (the other two
        session = aot._open(glm_tiny_reduced, "Q8_0", "v5e-8", "tp", "bfloat16")      # differ only in shapes)
        assert session.model.config.layer_types == ("linear_attention", "indexed_attention", "indexed_attention")
        names = [p[0] for p in session.generator(2, 2, 256, 64).program_set()]
        # 256 tokens of context hold 512 slots (a piece's padding), both prefill widths
        assert names == ["decode B=2 L=512 MTP k=2", "decode B=2 L=512 MTP drafts off",
                         "prefill width=16 L=512 + MTP rows", "prefill width=64 L=512 + MTP rows"]
        report = {"model": name, "quant": "Q8_0", "target": "v5e-8", "layout": "tp",
                  "chips": int(session.model.mesh.devices.size), "usable_hbm": session.usable,
                  "programs": [session.decode(2, 256, 2), session.prefill(64, 256, 2)]}
        report["ok"] = all(p["fits"] for p in report["programs"])
    else:
        report = cli_report[1]
    assert report["chips"] == 8 and report["usable_hbm"] == int(15.75 * 2**30) and report["ok"]
    for program in report["programs"]:
        assert program["fits"] and program["arguments"] >= program["batch_state"] > 0 and program["flops"] > 0
        if "token masks" in program["name"]:      # memory only; the verify part's recurrent states are
            assert "roofline" not in program      # one per verify position (not the batch's shapes)
            assert program["pallas_calls"] > 0 or "settle" in program["name"]     # settle: no weight read
            continue
        assert program["pallas_calls"] > 0
        # the batch state / the prefill row is donated: the outputs beyond it are the logits and tokens
        assert program["aliased"] >= 0.9 * program["batch_state"] > 0, program
        roof = program["roofline"]
        assert roof["pallas"]["calls"] > 0 and roof["pallas"]["grid_steps"] >= roof["pallas"]["calls"]
        assert 0 < roof["pallas"]["weight_bytes"] and roof["must_read"]["total"] > roof["must_read"]["cache"] > 0
        assert roof["floor_s"] == roof["must_read"]["total"] / 819e9 and roof["xla"]["bytes_accessed"] > 0
        assert roof["xla"]["traffic"]["compute"] > 0 and roof["xla"]["traffic"]["pallas"] > 0
    spec = next(p for p in report["programs"] if "MTP k" in p["name"])
    assert spec["roofline"]["must_read"]["mtp"] > 0
    if name == "qwen38-tiny":
        assert report["programs"][0]["roofline"]["must_read"]["mtp"] == 0       # the plain decode step
    text = aot.table(report)
    assert spec["name"] in text and "roofline per chip" in text


@pytest.mark.parametrize("quant", ["UD-IQ3_XXS", "int8"])
def test_planner_equals_the_compiler(glm_reduced, quant):
    """Per chip: planner bytes == the abstract load's weight shards == the compiler's argument bytes
    for the weights, within 1% (the compiler pads small arrays to its tiles). The compiler's side is
    a program that takes every weight and reads none: its arguments are the weights as any program
    of the set holds them (the same abstract arrays and shardings; the full-width decode step itself
    compiles in ``bench/compile_tpu.py``, the tiny models' whole set below)."""
    import jax.numpy as jnp

    session = aot._open(glm_reduced, quant, "v5e-8", "tp", "bfloat16")
    weights = session.generator(1, 1, 2048).weights
    with jax.set_mesh(session.model.mesh):
        compiled = jax.jit(lambda w: jnp.zeros(()), keep_unused=True).lower(weights).compile()
    planner = plan_config(load_config(glm_reduced), quant, 8).per_device_bytes
    compiler = compiled.memory_analysis().argument_size_in_bytes
    print(f"{quant}: planner {planner:,} B, compiler {compiler:,} B per chip")
    assert planner == session.weights
    assert abs(compiler - planner) <= 0.01 * planner


def test_cli_defaults_and_errors(cli_report):
    """``zoo compile`` without options compiles the serving set: 3 rows, MTP k=3 where the model has
    an MTP layer (decode with and without drafts), the largest prefill chunk that leaves the margin
    and the small width, and the masked step's parts (draft, verify, settle with k drafts)."""
    code, doc = cli_report
    assert code == 0 and doc["target"] == "v5e-8" and doc["spec_tokens"] == 3 and doc["prefill_chunk"] == 128
    assert doc["ok"]
    assert [p["name"] for p in doc["programs"]] == [          # the largest chunk the 128-token context holds
        "decode B=3 L=256", "decode B=3 L=256 MTP k=3", "decode B=3 L=256 MTP drafts off",
        "prefill width=128 L=256 + MTP rows",
        "prefill width=16 L=256 + MTP rows", "decode with token masks: draft B=3 L=256 k=3",
        "decode with token masks: verify B=3 L=256 k=3", "decode with token masks: settle B=3 L=256 k=3"]
    too_long = aot.compile_report("qwen38-tiny", quant="int8", batch=32, context=2**24, programs=("decode",))
    decode = too_long["programs"][0]                 # 32 rows x 16M slots: the compiler says it needs more
    assert decode["fits"] is False and decode["required"] > decode["usable"] and "CompileTimeHbmOom" in decode["error"]
    assert "DOES NOT FIT" in aot.table(too_long) and not too_long["ok"]
    with pytest.raises(ValueError, match="unknown compile target 'v9'"):
        aot.compile_report("qwen38-tiny", target="v9")
    with pytest.raises(ValueError, match="unknown program 'train'"):
        aot.compile_report("qwen38-tiny", programs=("train",))
    with pytest.raises(ValueError, match="a prefill chunk of 512 tokens does not fit a cache of 256 slots"):
        aot.compile_report("qwen38-tiny", context=256, prefill_chunk=512, programs=("prefill",))


def test_prefill_chunk_from_the_memory_left():
    """A margin no chunk leaves: every chunk size is tried, largest first, and none is chosen."""
    report = aot.compile_report("qwen38-tiny", quant="int8", context=256, prefill_chunk=None,
                                programs=("prefill",), min_margin=16 * 2**30)
    tried = [c for c in aot.PREFILL_CHUNKS if c <= 256]          # those a 256-token context holds
    assert tried == [256, 128]
    assert [p["name"] for p in report["programs"]] == [f"prefill width={c} L=512" for c in tried]
    assert all(p["rejected"] for p in report["programs"]) and report["prefill_chunk"] is None and not report["ok"]
    assert "(chunk not chosen)" in aot.table(report)


def test_largest_batch_is_bracketed_by_the_compiler():
    """The largest decode batch at a long context: it compiles with the margin, one row more does not."""
    # 32M slots: qwen38-tiny's KV cache (2 KV heads) splits over the 8 chips by its slots, a row costs a
    # chip 1/8 of it; 2 rows fit. Rows 1 and 2 give the growth per row, which predicts 2: one more
    # compile (3 rows) brackets it (at 16M slots 4 rows fit and the search took 5 compiles; at 2M some
    # 30 rows fit, and it stepped through them one compile each)
    found = aot.largest_batch("qwen38-tiny", quant="int8", context=2**25, min_margin=2**30)
    assert found["batch"] == 2 and found["margin"] >= 2**30 and found["compiles"] == 3
    assert found["next_margin"] is not None and found["next_margin"] < 2**30
    assert found["program"] == f"decode B=2 L={2**25 + 256}"


def test_roofline_arithmetic():
    from zoo.kernels.census import KernelCall
    from zoo.tools.roofline import STEP_OVERHEAD_S, roofline, xla_seconds

    assert xla_seconds({"optimal_seconds": -84.75}) == (0.25, 85)       # 85 uncosted ops, 0.25 s estimate
    assert xla_seconds({"optimal_seconds": 0.003}) == (0.003, 0)
    calls = [KernelCall("a", 4, 1000, 4000), KernelCall("a", 4, 1000, 4000), KernelCall("b", 2, 500, 1000)]
    r = roofline({"weights": 6000, "experts": 3000}, 1000, calls, {"optimal_seconds": 0.5, "bytes accessed": 7}, "v5e")
    assert r["must_read"]["total"] == 10_000 and r["floor_s"] == 10_000 / 819e9
    assert r["pallas"]["grid_steps"] == 10 and r["pallas"]["weight_bytes"] == 9000
    assert r["pallas"]["estimate_s"] == 10 * STEP_OVERHEAD_S + 9000 / 819e9
    assert r["pallas"]["by_kernel"]["a"] == {"calls": 2, "steps": 8, "weight_bytes": 8000}
    # the attention kernel over a cache: 9 blocks of 512 a row (the last runs past 4,128 slots); at a fill
    # it moves the blocks up to the fill (at least one), a weight kernel the same at every fill
    attention = KernelCall("ragged_attention", 108, 1 << 19, 108 << 19, slots=4128, block=512)
    assert [attention.bytes_at(f) for f in (None, 1, 512, 513, 4096, 5000)] == [
        108 << 19, 12 << 19, 12 << 19, 24 << 19, 96 << 19, 108 << 19]
    assert calls[0].bytes_at(100) == 4000
    # the same share interleaved over 8 chips (Qwen's KV cache): a row at f tokens has f / 8 here
    spread = KernelCall("ragged_attention", 108, 1 << 19, 108 << 19, slots=4128, block=512, stride=8)
    assert [spread.bytes_at(f) for f in (None, 1, 4096, 4097, 32768, 40000)] == [
        108 << 19, 12 << 19, 12 << 19, 24 << 19, 96 << 19, 108 << 19]
    r = roofline({"weights": 6000}, 1000, [attention, calls[0]], {"optimal_seconds": 0.5}, "v5e", fill=1000)
    assert r["pallas"]["weight_bytes"] == (24 << 19) + 4000 and r["pallas"]["grid_steps"] == 112


def test_state_read_at_a_fill_level():
    """``zoo compile --fill``: a cache split over its slots costs the busiest chip its share up to the
    fill: GLM's pools (chip 0 holds the first slots) the fill, Qwen's KV (``kv_len``: interleaved,
    every chip 1/8 of the tokens) fill / 8; a cache whole on every chip, or split by heads, fill / L
    of its shard; pools count by the tokens they hold; what is not a cache leaf is read whole."""
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zoo.models.glm53.mla import IndexerCache
    from zoo.models.qwen38.gated_attention import KVCache, SlotMeta
    from zoo.models.shared.cache import ModelCache
    from zoo.tools.roofline import state_read

    mesh = AbstractMesh((8,), ("tp",))
    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
    L = 32768
    by_slots = KVCache(k=sds((3, 4, L, 256), jnp.bfloat16, None, None, "tp"),
                       v=sds((3, 4, L, 256), jnp.bfloat16, None, None, "tp"))
    by_heads = KVCache(k=sds((3, 8, L, 256), jnp.bfloat16, None, "tp"), v=sds((3, 8, L, 256), jnp.bfloat16, None, "tp"))
    meta = SlotMeta(index=sds((3,), jnp.int32), pos=sds((3,), jnp.int32), valid=sds((3, L), jnp.bool_))
    pools = IndexerCache(pool_k=sds((3, L // 4, 128), jnp.bfloat16, None, "tp"),
                         tail_k=sds((3, 4, 128), jnp.bfloat16), tail_gate=sds((3, 4, 128), jnp.bfloat16))
    state = {"cache": ModelCache(slots=meta, layers=(by_slots, by_heads, pools)), "step": sds((3,), jnp.int32)}
    kv_shard, head_shard = 3 * 4 * (L // 8) * 256 * 2, 3 * L * 256 * 2    # one chip's k (or v): by slots, by heads
    pool_shard, tails = 3 * (L // 32) * 128 * 2, 2 * 3 * 4 * 128 * 2
    whole = 2 * kv_shard + 2 * head_shard + 3 * L + pool_shard + tails + 2 * 3 * 4 + 3 * 4
    assert state_read(state) == state_read(state, L) == whole
    for fill in (1024, 4096):
        slots = 2 * kv_shard * (fill // 8) / (L // 8)           # every chip: 1 / 8 of the fill
        heads = 2 * head_shard * fill / L
        pooled = pool_shard * min(fill // 4, L // 32) / (L // 32)
        want = slots + heads + 3 * L * fill / L + pooled + tails + 2 * 3 * 4 + 3 * 4
        assert state_read(state, fill) == int(want), fill
    # at 4096 tokens chip 0 of the pools reads all of its share; the interleaved KV 1/8 of it
    assert state_read(state, 4096) == whole - 2 * kv_shard * 7 / 8 - 2 * head_shard * 7 / 8 - 3 * L * 7 / 8


def test_must_read_counts_each_weight_by_what_a_step_touches():
    """With rows enough to use every expert and every embedding row, and one MTP call, a step reads
    every weight exactly once; one decode row reads top_k / E of each routed-expert bank."""
    import jax.numpy as jnp

    from zoo.loader.abstract import abstract_load, shard_bytes
    from zoo.tools.roofline import must_read

    module, cfg = abstract_load("glm53-tiny", "Q8_0", jnp.bfloat16, None)
    everything = must_read(module, cfg, rows=10**6, mtp_calls=1, mtp_rows=10**6)
    assert sum(everything.values()) == shard_bytes(module) and min(everything.values()) > 0
    one = must_read(module, cfg, rows=1)
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    assert one["mtp"] == 0 and abs(one["experts"] - everything["experts"] * share) <= 1
    assert one["weights"] == everything["weights"] and one["embedding"] < everything["embedding"]


def test_both_forms_of_the_compilers_out_of_memory_message():
    temporaries = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
                   "for HLO temporaries (15.97G) exceeds available HBM (15.75G). HLO module: jit__step_impl.")
    capacity = ("Ran out of memory in memory space hbm. Used 15.78G of 15.75G hbm. Exceeded hbm capacity by 31.36M.")
    assert aot.required_bytes(temporaries) == int(15.97 * 2**30)
    assert aot.required_bytes(capacity) == int(15.78 * 2**30)
    assert aot.required_bytes("INVALID_ARGUMENT: something else") is None


def test_hlo_traffic_accounts_for_xlas_bytes_accessed():
    """An int8 matvec with a scale, compiled for one v5e chip: the per-instruction estimate equals
    XLA's own total within 5%, and the 80 MB weight is read once (no relayout)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from zoo.tools.hlo_traffic import traffic

    mesh = Mesh(np.asarray(aot.target_devices(aot.get_target("v5e-8"))[:1]), ("x",))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    compiled = jax.jit(lambda x, w, s: jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32) * s).lower(
        spec((1, 4096), jnp.bfloat16), spec((4096, 19360), jnp.int8), spec((19360,), jnp.float32)).compile()
    groups, _ = traffic(compiled.as_text())
    accessed = compiled.cost_analysis()
    accessed = (accessed[0] if isinstance(accessed, (list, tuple)) else accessed)["bytes accessed"]
    ours = sum(v for k, v in groups.items() if k != "pallas")
    assert abs(ours - accessed) <= 0.05 * accessed and accessed >= 4096 * 19360
    assert groups.get("relayout", 0) == 0


@pytest.mark.parametrize("qtype,d_in,splits", [("Q8_0", 2176, 1), ("Q6_K", 4352, 1), ("IQ4_XS", 2304, 1),
                                               ("Q8_0", 192, 2)])
def test_decode_kernel_compiles_for_v5e_at_awkward_widths(qtype, d_in, splits):
    """The decode kernel for one matrix whose input axis is no power of two (a chip's share of
    Qwen3.8-27B's MLP in "tp"; two parts of 96 inputs, chunks off the lane grid), compiled by the
    real Mosaic compiler for a v5e chip."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from zoo.formats import planes as P
    from zoo.formats.ggml import BLOCK_LAYOUTS, QType
    from zoo.kernels import dequant_matvec as mv
    from zoo.quant.qarray import QArray

    qt = QType[qtype]
    mesh = Mesh(np.asarray(aot.target_devices(aot.get_target("v5e-8"))[:1]), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    shapes = P.plane_shapes(qt, (), 640, d_in // BLOCK_LAYOUTS[qt].block_size, splits)
    w = QArray({n: jax.ShapeDtypeStruct(s, jnp.uint32, sharding=sharding) for n, s in shapes.items()}, qt, (d_in, 640),
               in_splits=splits)
    x = jax.ShapeDtypeStruct((4, d_in), jnp.bfloat16, sharding=sharding)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda x, w: mv.linear_matvec(x, w, jnp.bfloat16)).lower(x, w).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
