"""Sharding checks on 8 virtual CPU devices, each run in its own process by ``tests/test_sharding.py``
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax is imported, and must
not leak into other test modules)::

    python -m tests.support.sharding_checks CHECK '{"path": ...}'

A check asserts what it tests and prints one JSON line of its measurements (errors, bytes, RSS).
Oracle (docs/reference.md, "Design: test oracles"): the same computation on one device, <= 1e-5 relative.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

import zoo
from tests.support.helpers import CountingSource, rel_err, rss
from zoo.sharding.cache_axes import cache_shardings
from zoo.sharding.mesh import make_mesh, state_shardings

TOL = 1e-5
PROMPT, NEW = 12, 5
# tensor-parallel layout: parameters whose every shard must be 1/8 of the whole on 8 devices
TP_SPLIT = re.compile(r".*(mlp\.experts\.\w+_kernel|self_attn\.(q_proj|k_proj|v_proj|o_proj|q_b_proj|kv_b)"
                      r"(\.kernel)?|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.kernel|lm_head\.kernel)$")


def params(model) -> dict[str, object]:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model.module))}


def shard_fractions(model) -> dict[str, float]:
    """Per parameter: the largest fraction of its bytes one device holds."""
    out = {}
    for path, value in params(model).items():
        leaves = jax.tree.leaves(value)
        full = sum(x.nbytes for x in leaves)
        per_device: dict = {}
        for x in leaves:
            for s in x.addressable_shards:
                per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
        out[path] = max(per_device.values()) / full
    return out


def check_placement(model) -> None:
    """Every parameter's leaves carry the shardings their logical axes give on the model's mesh."""
    want = state_shardings(model.module, model.mesh)
    for path, value in params(model).items():
        got = [leaf.sharding for leaf in jax.tree.leaves(value)]
        assert got == want[path], (path, got, want[path])


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, PROMPT).tolist() for _ in range(2)]


def generate_and_check(model, reference_logits_fn, vocab: int, spec_tokens: int) -> dict:
    """Prefill + decode through the Generator on the model's mesh: its batch cache keeps the layout
    of every leaf, and its greedy tokens are the argmax of the single-device forward (teacher forced);
    speculative decoding with ``spec_tokens`` drafts (MTP verify + rollback on the mesh) gives them too."""
    ps = prompts(vocab)
    gen = model.generator()
    tokens = [g.tokens for g in gen.generate(ps, max_new_tokens=NEW)]
    cache = gen._batch["cache"]
    want = cache_shardings(cache, model.mesh)
    split = 0
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(cache)[0], jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (where, leaf.sharding, sharding)
        split += any(a is not None for a in sharding.spec)
    assert split, "no cache leaf is split"
    # admission counts one device's share of the batch state (its memory budget is one device's)
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(gen._batch):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    rest = sum(x.nbytes for k, v in gen._batch.items() if k != "cache" for x in jax.tree.leaves(v))
    counted, total = gen.cache_bytes(gen._B, gen._L), sum(x.nbytes for x in jax.tree.leaves(gen._batch))
    assert max(per_device.values()) <= counted <= max(per_device.values()) + rest < total, (counted, per_device, total)
    ids = np.array([p + t[:NEW - 1] for p, t in zip(ps, tokens)])
    logits = reference_logits_fn(ids)
    argmax = logits[:, PROMPT - 1:].argmax(-1).tolist()
    assert argmax == tokens, (argmax, tokens)
    spec = [g.tokens for g in model.generate(ps, max_new_tokens=NEW, spec_tokens=spec_tokens, spec_policy="fixed")]
    assert spec == tokens, (spec, tokens)
    return {"ids": ids, "tokens": tokens, "cache_leaves_split": split}


def glm(path: str) -> dict:
    """GLM f32 in "tp" (forward, Generator, shard shapes), f32 and int8 in "ep" (forward)."""
    vocab = 256
    ref = zoo.load(path, dtype="float32")
    tp = zoo.load(path, dtype="float32", mesh="tp")
    check_placement(tp)
    gen = generate_and_check(tp, ref.logits, vocab, spec_tokens=2)
    ids = gen["ids"]
    out = {"tp_err": rel_err(tp.logits(ids), ref.logits(ids)), "tp_cache_split": gen["cache_leaves_split"]}
    fractions = shard_fractions(tp)
    split = {p: f for p, f in fractions.items() if TP_SPLIT.match(p)}
    assert len(split) >= 15 and all(f == 1 / 8 for f in split.values()), split
    out["tp_split_params"] = len(split)
    ep = zoo.load(path, dtype="float32", mesh="ep")
    out["ep_err"] = rel_err(ep.logits(ids), ref.logits(ids))
    ref8 = zoo.load(path, dtype="float32", quant="int8")
    ep8 = zoo.load(path, dtype="float32", quant="int8", mesh="ep")
    check_placement(ep8)
    bank = params(ep8)["layers.1.mlp.experts.down_kernel"]
    assert bank.q.addressable_shards[0].data.shape == (4, 8, 64)
    assert bank.scale.sharding.spec == PartitionSpec("ep", None)
    out["ep_int8_err"] = rel_err(ep8.logits(ids), ref8.logits(ids))
    assert max(out["tp_err"], out["ep_err"], out["ep_int8_err"]) <= TOL, out
    return out


def qwen(path: str) -> dict:
    """Qwen f32 in "tp" and "ep" (forward), Generator in "ep"."""
    vocab = 256
    ref = zoo.load(path, dtype="float32")
    ep = zoo.load(path, dtype="float32", mesh="ep")
    check_placement(ep)
    gen = generate_and_check(ep, ref.logits, vocab, spec_tokens=3)
    ids = gen["ids"]
    tp = zoo.load(path, dtype="float32", mesh=make_mesh("tp"))
    split = {p: f for p, f in shard_fractions(tp).items() if TP_SPLIT.match(p)}
    assert len(split) >= 8 and all(f == 1 / 8 for f in split.values()), split
    out = {"ep_err": rel_err(ep.logits(ids), ref.logits(ids)), "tp_err": rel_err(tp.logits(ids), ref.logits(ids)),
           "ep_cache_split": gen["cache_leaves_split"], "tp_split_params": len(split)}
    assert max(out["ep_err"], out["tp_err"]) <= TOL, out
    return out


def quantized(path: str) -> dict:
    """A GLM GGUF with Q8_0 expert banks (8 input blocks per row of ``down``) in "tp" on 8 devices:
    gate/up split by output rows, down by input blocks (one block per device, its ``d`` word padded)."""
    ref = zoo.load(path, dtype="float32")
    tp = zoo.load(path, dtype="float32", mesh="tp")
    check_placement(tp)
    banks = {k: v for k, v in params(tp).items() if "mlp.experts." in k}
    for name, bank in banks.items():
        assert type(bank).__name__ == "QArray" and bank.qtype.name == "Q8_0", (name, bank)
        d = bank.planes["d"].addressable_shards[0].data.shape
        if name.endswith("down_kernel"):
            assert bank.in_splits == 8 and d == (8, 1, 256), (name, bank.in_splits, d)
        else:
            assert bank.in_splits == 1 and d == (8, 4, 32), (name, d)
    ids = np.random.default_rng(3).integers(0, ref.config.vocab_size, (2, 20))
    out = {"tp_err": rel_err(tp.logits(ids), ref.logits(ids)), "banks": len(banks),
           "max_bank_fraction": max(f for p, f in shard_fractions(tp).items() if p in banks),
           "tpu_kernels": tpu_kernel_calls(tp, ids)}
    assert out["tp_err"] <= TOL and out["max_bank_fraction"] == 1 / 8 and out["tpu_kernels"] > 0, out
    return out


def tpu_kernel_calls(model, ids) -> int:
    """Mosaic kernel calls in the sharded forward lowered for TPU (no TPU needed): XLA cannot
    partition them, so this only lowers when every one runs inside ``shard_map``."""
    from zoo.api import _full_forward
    from zoo.kernels.dispatch import Policy, use_policy

    graphdef, state = nnx.split(model.module)
    with use_policy(Policy(backend="tpu")), jax.set_mesh(model.mesh):
        lowered = jax.jit(_full_forward, static_argnums=0).trace(
            graphdef, state, jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, bool)).lower(lowering_platforms=("tpu",))
    return lowered.as_text().count("tpu_custom_call")


def memory(path: str, budget: int) -> dict:
    """Loading a float32 model onto 8 devices: host memory beyond the placed weights stays under
    ``budget`` (well under the model), and a column-parallel weight is read 1/8 at a time."""
    from zoo.loader.fill import fill_from_source
    from zoo.models.architectures import architecture as arch
    from zoo.models.config import load_config
    from zoo.quant.storage import dense_store
    from zoo.sources.safetensors import SafetensorsSource

    mesh = make_mesh("tp")
    zoo.load("qwen38-tiny", dtype="float32", mesh=mesh)                     # imports and runtime up first
    files = SafetensorsSource(path)
    nbytes = {k: files.info(k).dtype.itemsize * int(np.prod(files.info(k).shape)) for k in files.keys()}
    model_bytes = sum(nbytes.values())
    Path("/proc/self/clear_refs").write_text("5")                          # reset the peak (VmHWM)
    before, _ = rss()
    model = zoo.load(path, dtype="float32", mesh=mesh)
    after, peak = rss()
    placed = sum(s.data.nbytes for v in params(model).values() for x in jax.tree.leaves(v)
                 for s in x.addressable_shards)
    out = {"model_bytes": model_bytes, "placed_bytes": placed, "rss_before": before, "rss_after": after,
           "rss_peak": peak, "transient": peak - after, "growth": peak - before, "budget": budget}
    assert budget < model_bytes / 2 and out["transient"] < budget and out["growth"] < placed + budget, out
    cfg = load_config(Path(path))
    abstract = nnx.eval_shape(lambda: arch(cfg.arch).model_class()(cfg, dtype=np.float32))
    source = CountingSource(SafetensorsSource(path))
    fill_from_source(abstract, source, arch(cfg.arch).hf_name_map(cfg), dense_store, mesh=mesh)
    gate = "model.layers.0.mlp.gate_proj.weight"             # column-parallel: read by output rows
    gate_reads = [n for k, _, n in source.reads if k == gate]
    out.update(largest_read=max(n for _, _, n in source.reads), largest_tensor=max(nbytes.values()),
               gate_proj_reads=gate_reads)
    assert len(gate_reads) == 8 and all(n * 8 == nbytes[gate] for n in gate_reads), gate_reads
    return out


def abstract() -> dict:
    """The abstract load on a mesh has the leaves and the shardings of the real load (both tiny models,
    plain / Q8_0 / int8, "tp" and "ep")."""
    from tests.support.abstract_checks import differences
    from zoo.loader.abstract import shard_bytes

    out = {}
    for name in ("qwen38-tiny", "glm53-tiny"):
        for quant in (None, "Q8_0", "int8"):
            for layout in ("tp", "ep"):
                mesh = make_mesh(layout)
                real = zoo.load(name, quant=quant, dtype="float32", mesh=mesh)
                ghost = zoo.load(name, quant=quant, dtype="float32", mesh=mesh, weights=False)
                diff = differences(ghost, real, shardings=True)
                assert not diff, f"{name} {quant} {layout}: " + "\n".join(diff[:5])
                assert shard_bytes(ghost.module) == shard_bytes(real.module)
                out[f"{name}/{quant}/{layout}"] = shard_bytes(real.module)
    return out


def prefix_cache(paths: dict, layouts: dict[str, list[str]], drafts: dict[str, list[int]] | None = None) -> dict:
    """Prefix caching on the mesh, each model in its ``layouts`` with each of its MTP draft counts
    ``drafts[name]`` (default plain and k=2): a three-turn conversation whose turns 2 and 3 restore
    the cached prefix (blocks written into a sharded row, state leaves, the MTP slots) gives the
    tokens and logprobs of the single-device run without the cache."""
    from zoo.engine.generator import Generator
    from zoo.engine.prefix_cache import PrefixCache

    rng = np.random.default_rng(3)
    turns = [rng.integers(3, 250, n).tolist() for n in (45, 9, 14)]

    def converse(gen):
        prompt, outs = [], []
        for extra in turns:
            prompt = prompt + (outs[-1].tokens if outs else []) + extra
            outs.append(gen.generate([prompt], max_new_tokens=NEW + 3, logprobs=2)[0])
        return outs

    out = {}
    for name, path in paths.items():
        ref = zoo.load(path, dtype="float32")
        for k in (drafts or {}).get(name, (0, 2)):
            shape = {"prefill_chunk": 32, "context": 256, "max_batch": 2}
            want = converse(Generator(ref, spec_tokens=k, spec_policy="fixed", prefix_cache=0, **shape))
            for layout in layouts[name]:
                sharded = zoo.load(path, dtype="float32", mesh=layout)
                gen = Generator(sharded, spec_tokens=k, spec_policy="fixed", prefix_cache=PrefixCache(2**30, 2**30, 16),
                                **shape)
                got = converse(gen)
                err = 0.0
                for g, w in zip(got, want):
                    assert g.tokens == w.tokens, (name, layout, k, g.tokens, w.tokens)
                    a = np.array([r.logprob for r in g.logprobs])
                    b = np.array([r.logprob for r in w.logprobs])
                    err = max(err, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1.0))))
                hits = [g.stats["cached_tokens"] for g in got]
                assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1], hits
                assert err <= TOL, (name, layout, k, err)
                out[f"{name}/{layout}/k{k}"] = {"hits": hits, "logprob_err": err}
    return out


CHECKS = {"glm": glm, "qwen": qwen, "quantized": quantized, "memory": memory, "abstract": abstract,
          "prefix_cache": prefix_cache}

if __name__ == "__main__":
    assert jax.device_count() == 8, f"expected 8 virtual devices, got {jax.device_count()} (XLA_FLAGS)"
    result = CHECKS[sys.argv[1]](**json.loads(sys.argv[2]))
    print(json.dumps(result, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))
