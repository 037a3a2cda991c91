"""GLM-5.3 submodules vs transformers' own submodules (PyTorch, CPU, float32), same weights.

Each test takes one layer of the tiny checkpoints of ``test_parity.py`` (our side through
``zoo.load``, so the real loader and name maps), feeds our submodule and the matching
``Glm5NextText*`` submodule the same random float32 input, and compares with ``rel_err``
(<= 1e-4, the bound of the end-to-end tests), so an end-to-end failure points at its layer:
MLA with its full k-pool indexer (output and the token selection, full forward and
prefill-then-decode through our cache), the shared-indexer MLA layer, KDA (full forward and
prefill-then-decode), the mHC hyper-connections, and the MoE router (ids exactly, weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import zoo
from tests.models.glm53 import reference as ref
from tests.support.helpers import rel_err
from zoo.models.glm53.mla import advance_positions, empty_positions

B, SEQ, PREFIX = 2, 64, 22     # 22: not a multiple of either pool size (4, 8): the cache carries a tail pool
TOL = 1e-4
MARGIN = 1e-5                  # smallest allowed gap at the reference's top-k boundaries


def jitted(module):
    """``f(*args)`` = ``module(*args)``, jitted (args: arrays and cache / position pytrees)."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, *args: nnx.merge(graphdef, s)(*args))
    return lambda *args: fn(state, *args)


@pytest.fixture(scope="module", params=["A", "B"])
def glm(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"glm-layers-{name}")
    torch_model = ref.write_checkpoint(path, name, seed=5, flat=(name == "B"))
    cfg = torch_model.config.text_config
    return dict(name=name, cfg=cfg, torch_layers=torch_model.model.language_model.layers,
                layers=zoo.load(path, dtype="float32").module.layers)


def _rand(shape, seed):
    """Fixed float32 N(0, 1) inputs per test (independent of which tests run)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _full_then_shared(cfg) -> int:
    """The first indexed layer with a full indexer whose next layer shares its selection."""
    for i, (lt, it) in enumerate(zip(cfg.layer_types, cfg.indexer_types)):
        if lt == "indexed_attention" and it == "full" and cfg.indexer_types[i + 1] == "shared":
            return i
    raise AssertionError("config has no full -> shared indexer pair")


def _torch_mla(attn, x, prev_topk=None):
    """transformers' MLA on x [B, S, D] without a cache (the padding mask the text model builds
    when none is given: all True) -> (y, token indices or None, indexer margin)."""
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    with torch.no_grad(), ref.record_margins(attn) as margins:
        y, _, topk = attn(hidden_states=torch.as_tensor(x), attention_mask=mask, past_key_values=None,
                          prev_topk_indices=prev_topk)
    return y.numpy(), topk, margins["indexer"]


def _torch_visible(attn, topk, x) -> np.ndarray:
    """transformers' own token indices -> its own additive mask -> visible [B, S, L] (bool)."""
    dummy = torch.zeros(x.shape[0], 1, x.shape[1], 1)
    mask = attn.build_attention_mask_from_topk(topk_indices=topk, query_states=dummy, kv_length=x.shape[1])
    return (mask[:, 0] == 0).numpy()


def _ours_mla(attn, x, cache_len, chunks, selection=None):
    """Our MLA over x [B, S, D] in calls of the given lengths through one cache (a shared layer
    takes the full layer's per-call selections) -> (y [B, S, D], [selected pools per call],
    [visible slots [B, T, L] per call, from those pools])."""
    from zoo.models.glm53.mla import pool_visibility
    fwd = jitted(attn)
    meta, cache = empty_positions(B, cache_len), attn.init_cache(B, cache_len)
    ys, sels, masks, t = [], [], [], 0
    for k, n in enumerate(chunks):
        pos, meta = advance_positions(meta, jnp.ones((B, n), bool))
        y, cache, sel = fwd(jnp.asarray(x[:, t:t + n]), pos, cache, None if selection is None else selection[k])
        ys.append(np.asarray(y))
        sels.append(sel)
        masks.append(np.asarray(pool_visibility(sel, pos.key_pos, pos.query_pos, attn.pool, attn.select_tail)))
        t += n
    return np.concatenate(ys, axis=1), sels, masks


def test_mla_full_indexer_matches_transformers(glm):
    """MLA + full k-pool indexer, one call over SEQ tokens: the output and the token selection
    (ours: the selected pools made slots by ``pool_visibility``; theirs: the indices turned into a mask
    by transformers itself)."""
    i = _full_then_shared(glm["cfg"])
    x = _rand((B, SEQ, glm["cfg"].hidden_size), 11)
    theirs, topk, margin = _torch_mla(glm["torch_layers"][i].self_attn, x)
    ours, _, (sel,) = _ours_mla(glm["layers"][i].self_attn, x, SEQ, [SEQ])
    err = rel_err(ours, theirs)
    print(f"[{glm['name']}] layer {i} MLA+indexer rel err {err:.2e} (indexer margin {margin:.2e})")
    assert margin > MARGIN, "reference indexer top-k near a tie: pick another seed"
    visible = _torch_visible(glm["torch_layers"][i].self_attn, topk, x)
    assert visible.sum(-1).min() >= 1 and (visible.sum(-1) < np.arange(1, SEQ + 1)).any(), "indexer must drop tokens"
    np.testing.assert_array_equal(np.asarray(sel), visible)
    assert err <= TOL


def test_mla_full_indexer_prefill_then_decode_matches_transformers(glm):
    """Our cache path (prefill PREFIX tokens, then one token at a time: pooled keys + tail pool)
    against transformers' one-call forward of the whole sequence."""
    i = _full_then_shared(glm["cfg"])
    x = _rand((B, SEQ, glm["cfg"].hidden_size), 11)
    theirs, topk, margin = _torch_mla(glm["torch_layers"][i].self_attn, x)
    ours, _, sels = _ours_mla(glm["layers"][i].self_attn, x, SEQ, [PREFIX] + [1] * (SEQ - PREFIX))
    err = rel_err(ours, theirs)
    print(f"[{glm['name']}] layer {i} MLA+indexer prefill+decode rel err {err:.2e} (indexer margin {margin:.2e})")
    assert margin > MARGIN, "reference indexer top-k near a tie: pick another seed"
    visible = _torch_visible(glm["torch_layers"][i].self_attn, topk, x)
    np.testing.assert_array_equal(np.concatenate([np.asarray(s) for s in sels], axis=1), visible)
    assert err <= TOL


def test_mla_shared_indexer_matches_transformers(glm):
    """The "shared" layer after a full one, given that layer's selection (ours: its selected pools;
    theirs: its token indices, as the text model passes them)."""
    i = _full_then_shared(glm["cfg"])
    x = _rand((B, SEQ, glm["cfg"].hidden_size), 11)
    _, topk, margin = _torch_mla(glm["torch_layers"][i].self_attn, x)
    _, sels, _ = _ours_mla(glm["layers"][i].self_attn, x, SEQ, [SEQ])
    x2 = _rand(x.shape, 12)
    theirs, _, _ = _torch_mla(glm["torch_layers"][i + 1].self_attn, x2, prev_topk=topk)
    assert glm["layers"][i + 1].self_attn.indexer is None
    ours, _, _ = _ours_mla(glm["layers"][i + 1].self_attn, x2, SEQ, [SEQ], selection=sels)
    err = rel_err(ours, theirs)
    print(f"[{glm['name']}] layer {i + 1} shared-indexer MLA rel err {err:.2e}")
    assert margin > MARGIN
    assert err <= TOL


def _linear_layer(cfg) -> int:
    return cfg.layer_types.index("linear_attention")


def test_kda_matches_transformers(glm):
    """KDA over SEQ tokens (chunked delta rule) in one call, and through our cache (prefill, then
    one token at a time: recurrent form, conv state), against transformers' one-call forward."""
    i = _linear_layer(glm["cfg"])
    x = _rand((B, SEQ, glm["cfg"].hidden_size), 13)
    with torch.no_grad():
        theirs = glm["torch_layers"][i].self_attn(hidden_states=torch.as_tensor(x), cache_params=None,
                                                  attention_mask=torch.ones(B, SEQ, dtype=torch.bool)).numpy()
    kda = glm["layers"][i].self_attn
    fwd = jitted(kda)
    ours, _ = fwd(jnp.asarray(x), jnp.ones((B, SEQ), bool), kda.init_cache(B))
    err = rel_err(np.asarray(ours), theirs)
    cache, steps = kda.init_cache(B), []
    for t0, t1 in [(0, PREFIX)] + [(t, t + 1) for t in range(PREFIX, SEQ)]:
        y, cache = fwd(jnp.asarray(x[:, t0:t1]), jnp.ones((B, t1 - t0), bool), cache)
        steps.append(np.asarray(y))
    err_cached = rel_err(np.concatenate(steps, axis=1), theirs)
    print(f"[{glm['name']}] layer {i} KDA rel err {err:.2e}, prefill+decode {err_cached:.2e} "
          f"(lower bound {glm['cfg'].linear_lower_bound})")
    assert err <= TOL and err_cached <= TOL


def test_kda_left_padding_matches_transformers(glm):
    """A left-padded row gives the unpadded row's outputs at its tokens (ours and theirs each with
    the same padding mask; transformers zeroes padding the same way its text model does)."""
    i = _linear_layer(glm["cfg"])
    x = _rand((B, SEQ, glm["cfg"].hidden_size), 14)
    mask = np.ones((B, SEQ), bool)
    mask[1, :13] = False
    with torch.no_grad():
        theirs = glm["torch_layers"][i].self_attn(hidden_states=torch.as_tensor(x), cache_params=None,
                                                  attention_mask=torch.as_tensor(mask)).numpy()
    kda = glm["layers"][i].self_attn
    ours, _ = jitted(kda)(jnp.asarray(x), jnp.asarray(mask), kda.init_cache(B))
    err = rel_err(np.asarray(ours)[mask], theirs[mask])
    print(f"[{glm['name']}] layer {i} KDA left-padded rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("which", ["attn_hc", "ffn_hc"])
def test_hyper_connection_matches_transformers(glm, which):
    """mHC around a fixed block f = tanh: the collapsed block input, post, comb and the new
    streams. transformers' hc returns (post, comb, collapsed); the expand + mix after the block is
    the glue of ``Glm5NextTextDecoderLayer.forward``, copied here."""
    i = 1
    n, d = glm["cfg"].hc_mult, glm["cfg"].hidden_size
    streams = _rand((B, SEQ, n, d), 15)
    hc_t = getattr(glm["torch_layers"][i], which)
    with torch.no_grad():
        residual = torch.as_tensor(streams)
        post, comb, collapsed = hc_t(residual)
        y = torch.tanh(collapsed)
        theirs = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), residual)  # decoder glue
    hc = getattr(glm["layers"][i], which)
    ours, h = hc(jnp.asarray(streams), lambda h: (jnp.tanh(h), h))
    _, post_o, comb_o = hc.weights(jnp.asarray(streams))
    errs = {"collapsed": rel_err(h, collapsed.numpy()), "post": rel_err(post_o, post.numpy()),
            "comb": rel_err(comb_o, comb.numpy()), "streams": rel_err(ours, theirs.numpy())}
    print(f"[{glm['name']}] layer {i} {which} rel errs " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert np.abs(theirs.numpy() - streams).max() > 0.1, "the block must change the streams"
    assert max(errs.values()) <= TOL


def test_router_matches_transformers(glm):
    """Sigmoid top-k router (+ correction bias; config B: 2 groups, best group only, unnormalised):
    the chosen expert ids exactly (as sets per token) and their weights."""
    cfg = glm["cfg"]
    i = cfg.mlp_layer_types.index("sparse")
    x = _rand((B * SEQ, cfg.hidden_size), 16)
    gate = glm["torch_layers"][i].mlp.gate
    with torch.no_grad(), ref.record_margins(gate) as margins:
        _, w_t, ids_t = gate(torch.as_tensor(x))
    w_o, ids_o = glm["layers"][i].mlp.router(jnp.asarray(x))
    order_t, order_o = np.argsort(ids_t.numpy(), -1), np.argsort(np.asarray(ids_o), -1)
    ids_t, w_t = np.take_along_axis(ids_t.numpy(), order_t, -1), np.take_along_axis(w_t.numpy(), order_t, -1)
    ids_o, w_o = np.take_along_axis(np.asarray(ids_o), order_o, -1), np.take_along_axis(np.asarray(w_o), order_o, -1)
    err = rel_err(w_o, w_t)
    print(f"[{glm['name']}] layer {i} router weights rel err {err:.2e} (router margin {margins['router']:.2e}, "
          f"groups {cfg.n_group}/{cfg.topk_group}, norm {cfg.norm_topk_prob})")
    assert margins["router"] > MARGIN, "reference router top-k near a tie: pick another seed"
    assert ids_o.shape == (B * SEQ, cfg.num_experts_per_tok)
    assert len(np.unique(ids_t)) > cfg.num_experts_per_tok, "the tokens must route to varied experts"
    np.testing.assert_array_equal(ids_o, ids_t)
    assert err <= TOL
