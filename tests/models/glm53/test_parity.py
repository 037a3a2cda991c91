"""GLM-5.3 in zoo vs transformers' Glm5NextForConditionalGeneration (PyTorch, CPU, float32), same
weights; plus cache paths, left padding, the MTP layer, FP8 / int8 loading and bad checkpoints.

Oracle (docs/reference.md, "Design: test oracles"): max |zoo - torch| <= 1e-4 * max |torch logit|. The
reference's discrete choices (router top-k, indexer top-k pools) are checked to have margins, so agreement is not luck.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import zoo
from tests.models.glm53 import reference as ref
from tests.support.helpers import rel_err
from zoo.sources.base import SourceError

SEQ = 80          # > 64: crosses the delta-rule chunks of both implementations and many indexer pools
PREFIX = 38       # prefill length: not a multiple of either pool size, so the cache carries a tail pool
MARGIN = 1e-5     # smallest allowed gap at the reference's top-k boundaries


def _step_impl(graphdef, state, ids, mask, cache):
    module = nnx.merge(graphdef, state)
    logits, _, cache = module(ids, mask, cache)
    return logits, cache


_step_jit = jax.jit(_step_impl, static_argnums=0)


def step(parts, ids, mask, cache):
    """One forward of ``parts = nnx.split(module)`` through the cache (jitted; compiled once per
    shape and parameter layout)."""
    graphdef, state = parts
    logits, cache = _step_jit(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), cache)
    return np.asarray(logits), cache


def prefix_logits(parts, ids):
    """Logits of a fresh forward of ``ids [2, PREFIX]`` (the prefill shape, cache of SEQ slots)."""
    module = nnx.merge(*parts)
    return step(parts, ids, np.ones(ids.shape, bool), module.init_cache(ids.shape[0], SEQ))[0]


def _build(name: str, tmp_path_factory) -> dict:
    """Write config ``name`` (A: nested multimodal layout; B: flat text-only), load it, run torch."""
    path = tmp_path_factory.mktemp(f"glm-{name}")
    torch_model = ref.write_checkpoint(path, name, seed=5, flat=(name == "B"))
    model = zoo.load(path, dtype="float32")
    ids = np.random.default_rng(3).integers(0, torch_model.config.text_config.vocab_size, size=(2, SEQ))
    logits, hidden, margins = ref.torch_forward(torch_model, ids)
    return dict(name=name, path=path, torch=torch_model, model=model, parts=nnx.split(model.module), ids=ids,
                logits=logits, hidden=hidden, margins=margins)


@pytest.fixture(scope="module")
def glm_a(tmp_path_factory):
    return _build("A", tmp_path_factory)


@pytest.fixture(scope="module")
def glm_b(tmp_path_factory):
    return _build("B", tmp_path_factory)


@pytest.fixture(scope="module", params=["A", "B"])
def checkpoint(request):
    return request.getfixturevalue(f"glm_{request.param.lower()}")


def test_logits_match_transformers(checkpoint):
    c = checkpoint
    theirs, ours = c["logits"], c["model"].logits(c["ids"])
    assert ours.shape == theirs.shape == (2, SEQ, c["torch"].config.text_config.vocab_size)
    assert ours.dtype == np.float32
    err = rel_err(ours, theirs)
    print(f"[{c['name']}] logits rel err vs transformers: {err:.2e} (max |logit| {np.abs(theirs).max():.2f}, "
          f"margins {c['margins']})")
    assert min(c["margins"].values()) > MARGIN, "reference top-k near a tie: pick another seed"
    assert np.std(theirs) > 0.5, "weights too small to exercise the model"
    assert err <= 1e-4


def test_config_and_weights_layout(checkpoint):
    c = checkpoint
    raw = json.loads((c["path"] / "config.json").read_text())
    cfg, tcfg = c["model"].config, c["torch"].config.text_config
    assert ("text_config" in raw) == (c["name"] == "A")
    assert cfg.layer_types == tuple(tcfg.layer_types) and cfg.indexer_types == tuple(tcfg.indexer_types)
    assert cfg.mlp_layer_types == tuple(tcfg.mlp_layer_types)
    assert cfg.mtp_num_hidden_layers == 1         # A: declared in config.json; B: found in the weights
    assert c["model"].load_info["unused_tensors"] == []
    bank = c["model"].module.layers[1].mlp.experts.gate_kernel
    assert bank.get_value().shape == (tcfg.n_routed_experts, tcfg.hidden_size, tcfg.moe_intermediate_size)
    assert bank.get_metadata()["axes"] == ("experts", "embed", "mlp")


def test_prefill_then_decode_equals_full_forward(checkpoint):
    """Prefill PREFIX tokens (chunked KDA, pooled indexer keys + tail), then one token at a time
    (recurrent KDA) across many indexer pool boundaries."""
    c = checkpoint
    model, ids = c["model"], c["ids"]
    cache = model.module.init_cache(2, SEQ)
    logits, cache = step(c["parts"], ids[:, :PREFIX], np.ones((2, PREFIX), bool), cache)
    out = [logits]
    for t in range(PREFIX, SEQ):
        logits, cache = step(c["parts"], ids[:, t:t + 1], np.ones((2, 1), bool), cache)
        out.append(logits)
    err = rel_err(np.concatenate(out, axis=1), c["logits"])
    print(f"[{c['name']}] prefill + decode vs transformers full forward: {err:.2e}")
    assert err <= 1e-4


def test_verify_chunks_equal_full_forward(glm_b):
    """Prefill, then blocks of 3 tokens (the speculative-verify shape) through the same cache."""
    c = glm_b
    model, ids = c["model"], c["ids"]
    cache = model.module.init_cache(2, SEQ)
    logits, cache = step(c["parts"], ids[:, :PREFIX], np.ones((2, PREFIX), bool), cache)
    out = [logits]
    for t in range(PREFIX, SEQ - 3 + 1, 3):
        logits, cache = step(c["parts"], ids[:, t:t + 3], np.ones((2, 3), bool), cache)
        out.append(logits)
    stepped = np.concatenate(out, axis=1)
    assert rel_err(stepped, c["logits"][:, :stepped.shape[1]]) <= 1e-4


def test_left_padded_batch_gives_each_row_its_own_logits(checkpoint):
    c = checkpoint
    model, ids, tm = c["model"], c["ids"], c["torch"]
    short = 53
    batch, mask = np.zeros((2, SEQ), np.int64), np.zeros((2, SEQ), bool)
    batch[0], mask[0] = ids[0], True
    batch[1, SEQ - short:], mask[1, SEQ - short:] = ids[1, :short], True
    ours = model.logits(batch, attention_mask=mask)
    assert rel_err(ours[0], c["logits"][0]) <= 1e-4
    theirs_short = ref.torch_forward(tm, ids[1:2, :short])[0][0]
    err = rel_err(ours[1, SEQ - short:], theirs_short)
    print(f"[{c['name']}] padded row vs its own unpadded reference: {err:.2e}")
    assert err <= 1e-4
    # The padded cache path: prefill a left-padded batch, then decode both rows.
    n0, n1 = PREFIX, 25
    batch, mask = np.zeros((2, PREFIX), np.int64), np.zeros((2, PREFIX), bool)
    batch[0], mask[0] = ids[0, :n0], True
    batch[1, PREFIX - n1:], mask[1, PREFIX - n1:] = ids[1, :n1], True
    cache = model.module.init_cache(2, SEQ)
    _, cache = step(c["parts"], batch, mask, cache)
    steps = []
    for t in range(2):
        nxt = np.stack([ids[0, n0 + t], ids[1, n1 + t]])[:, None]
        logits, cache = step(c["parts"], nxt, np.ones((2, 1), bool), cache)
        steps.append(logits[:, 0])
    row0 = c["logits"][0, n0:n0 + 2]
    row1 = ref.torch_forward(tm, ids[1:2, :n1 + 2])[0][0, n1:n1 + 2]
    assert rel_err(np.stack(steps)[:, 0], row0) <= 1e-4
    assert rel_err(np.stack(steps)[:, 1], row1) <= 1e-4


def test_mtp_matches_numpy_reference(glm_a):
    c = glm_a
    tm, ids = c["torch"], c["ids"]
    mtp_layer = f".layers.{tm.config.text_config.num_hidden_layers}."
    mtp = {k: v for k, v in ref.read_all(c["path"]).items() if mtp_layer in k}
    sd = tm.state_dict()
    theirs, margins = ref.numpy_mtp_logits(ids, c["hidden"], sd["model.language_model.embed_tokens.weight"].numpy(),
                                           sd["lm_head.weight"].numpy(), mtp, tm.config.text_config)
    ours = c["model"].mtp_logits(ids)
    assert ours.shape == (2, SEQ - 1, tm.config.text_config.vocab_size)
    err = rel_err(ours, theirs)
    print(f"[A] MTP logits rel err vs numpy reference: {err:.2e} (margins {margins})")
    assert min(margins.values()) > MARGIN
    assert err <= 1e-4


def test_bfloat16_load_tracks_float32(glm_a):
    """The default dtype (bfloat16) stays close to the float32 reference (sanity, not parity)."""
    c = glm_a
    bf16 = zoo.load(c["path"])
    assert bf16.load_info["dtype"] == "bfloat16"
    ours = bf16.logits(c["ids"][:, :32])
    assert np.isfinite(ours).all()
    assert np.mean(np.argmax(ours, -1) == np.argmax(c["logits"][:, :32], -1)) > 0.8

# -- FP8 / int8 -----------------------------------------------------------------------------------
def _fp8_blocks(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Real e4m3 bytes + 128x128 block scales (f32) for w [rows, cols] (any shape)."""
    rows, cols = w.shape
    scale = np.empty((-(-rows // 128), -(-cols // 128)), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(block).max() / 448.0 * rng.uniform(1.0, 1.5)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _dequant_reference(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = np.indices(q.shape)
    return q.astype(np.float32) * scale[rows // 128, cols // 128]


@pytest.fixture(scope="module")
def fp8_checkpoints(glm_b, tmp_path_factory):
    """(fp8 dir, dequantised f32 dir) from config B (widths above 128, not multiples of it): every
    2-D projection weight and the head as e4m3 + 128x128 block scales."""
    rng = np.random.default_rng(0)
    tensors = ref.read_all(glm_b["path"])
    fp8, deq = {}, {}
    for k, w in tensors.items():
        if w.ndim == 2 and (k.endswith("proj.weight") or k == "lm_head.weight"):
            q, s = _fp8_blocks(w, rng)
            fp8[k], fp8[k + "_scale_inv"], deq[k] = q, s, _dequant_reference(q, s)
        else:
            fp8[k] = deq[k] = w
    assert any(max(v.shape) > 128 and max(v.shape) % 128 for v in fp8.values() if v.dtype == ml_dtypes.float8_e4m3fn)
    dirs = []
    for tag, ts in (("fp8", fp8), ("deq", deq)):
        d = tmp_path_factory.mktemp(f"glm-B-{tag}")
        save_file(ts, str(d / "model.safetensors"))
        shutil.copy(glm_b["path"] / "config.json", d / "config.json")
        dirs.append(d)
    return dirs


def test_fp8_checkpoint_loads_as_its_dequantised_weights(fp8_checkpoints):
    fp8_dir, deq_dir = fp8_checkpoints
    a, b = zoo.load(fp8_dir, dtype="float32"), zoo.load(deq_dir, dtype="float32")
    sa, sb = nnx.to_flat_state(nnx.state(a.module)), nnx.to_flat_state(nnx.state(b.module))
    for (pa, va), (pb, vb) in zip(sa, sb):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()), err_msg=str(pa))
    assert a.load_info["unused_tensors"] == []          # the *_scale_inv tensors are consumed, not left over


def test_int8_option_stays_close(glm_b, fp8_checkpoints):
    """quant="int8" keeps every matmul weight (linears, expert banks) as int8 + per-channel scales:
    the forward equals the dense model holding exactly those weights, and the weights stay within
    ~1% of the FP8-dequantised ones (logits then drift a little, and a few top-k choices flip)."""
    from zoo.quant.int8 import Int8Weight

    fp8_dir, _ = fp8_checkpoints
    a, q = zoo.load(fp8_dir, dtype="float32"), zoo.load(fp8_dir, dtype="float32", quant="int8")
    graphdef, state = nnx.split(q.module)
    is_int8 = lambda x: isinstance(x, Int8Weight)
    assert isinstance(q.module.layers[1].mlp.experts.down_kernel.get_value(), Int8Weight)
    assert isinstance(q.module.layers[0].self_attn.q_proj.kernel.get_value(), Int8Weight)
    assert not is_int8(q.module.layers[1].mlp.router.weight.get_value())
    dense = jax.tree_util.tree_map(lambda x: x.dequantize(jnp.float32) if is_int8(x) else x, state, is_leaf=is_int8)
    for (path, w8), (_, w) in zip(nnx.to_flat_state(dense), nnx.to_flat_state(nnx.state(a.module))):
        err = np.linalg.norm(np.asarray(w8.get_value()) - np.asarray(w.get_value())) / np.linalg.norm(w.get_value())
        assert err < 0.01, (path, err)
    ids = glm_b["ids"][:, :PREFIX]
    int8_logits = prefix_logits((graphdef, state), ids)
    exact = rel_err(int8_logits, prefix_logits((graphdef, dense), ids))
    fp8_logits = prefix_logits(nnx.split(a.module), ids)
    per_token = np.abs(int8_logits - fp8_logits).max(-1) / np.abs(fp8_logits).max()
    agree = np.mean(np.argmax(int8_logits, -1) == np.argmax(fp8_logits, -1))
    print(f"[B] int8 vs its own dequantised weights {exact:.2e}; vs FP8-dequantised: median token "
          f"{np.median(per_token):.2e}, worst {per_token.max():.2e}, argmax agreement {agree:.3f}")
    assert exact <= 1e-4
    assert np.median(per_token) < 0.1 and agree > 0.75


# -- bad checkpoints ------------------------------------------------------------------------------
def _broken_copy(checkpoint, tmp_path, edit) -> None:
    tensors = ref.read_all(checkpoint["path"])
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(checkpoint["path"] / "config.json", tmp_path / "config.json")


def test_missing_or_misshapen_expert_is_named(glm_b, tmp_path):
    victim = "model.layers.2.mlp.experts.5.up_proj.weight"
    _broken_copy(glm_b, tmp_path, lambda t: t.pop(victim))
    with pytest.raises(SourceError, match=r"no tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        zoo.load(tmp_path, dtype="float32")

    def reshape(t):
        t[victim] = t[victim][:, :-1].copy()
    _broken_copy(glm_b, tmp_path, reshape)
    with pytest.raises(SourceError, match=r"tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight' has shape"):
        zoo.load(tmp_path, dtype="float32")
