"""Qwen3.8 submodules vs transformers' own submodules (PyTorch, CPU, float32), same weights.

Each test takes one layer of the tiny checkpoints of ``test_parity.py`` (our side through
``zoo.load``), feeds our submodule and the matching ``Qwen3_5*`` submodule the same random
float32 input and compares with ``rel_err`` (<= 1e-4, the end-to-end bound), so an end-to-end
failure points at its layer: gated DeltaNet and gated attention, each in one call and through our
cache (prefill, then one token at a time), against transformers' one-call forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.masking_utils import create_causal_mask

import zoo
from tests.models.qwen38 import reference as ref
from tests.support.helpers import rel_err
from zoo.models.qwen38.gated_attention import empty_slot_meta

B, SEQ, PREFIX = 2, 80, 37     # 80 > 64: crosses a delta-rule chunk boundary
TOL = 1e-4


def jitted(fn_module):
    graphdef, state = nnx.split(fn_module)
    fn = jax.jit(lambda s, *args: nnx.merge(graphdef, s)(*args))
    return lambda *args: fn(state, *args)


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module", params=["L4", "L8"])
def qwen(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"qwen-layers-{name}")
    torch_model = ref.write_checkpoint(path, name, seed=7 if name == "L4" else 11, nested=(name == "L8"))
    return dict(name=name, cfg=torch_model.config, torch=torch_model, model=zoo.load(path, dtype="float32").module)


def _calls():
    return [(0, PREFIX)] + [(t, t + 1) for t in range(PREFIX, SEQ)]


def test_gated_deltanet_matches_transformers(qwen):
    i = qwen["cfg"].layer_types.index("linear_attention")
    x = _rand((B, SEQ, qwen["cfg"].hidden_size), 21)
    with torch.no_grad():
        # The text model passes create_recurrent_attention_mask's result: None without padding.
        theirs = qwen["torch"].model.layers[i].linear_attn(hidden_states=torch.as_tensor(x), cache_params=None,
                                                           attention_mask=None).numpy()
    gdn = qwen["model"].layers[i].linear_attn
    fwd = jitted(gdn)
    ours, _ = fwd(jnp.asarray(x), jnp.ones((B, SEQ), bool), gdn.init_cache(B))
    err = rel_err(np.asarray(ours), theirs)
    cache, steps = gdn.init_cache(B), []
    for t0, t1 in _calls():
        y, cache = fwd(jnp.asarray(x[:, t0:t1]), jnp.ones((B, t1 - t0), bool), cache)
        steps.append(np.asarray(y))
    err_cached = rel_err(np.concatenate(steps, axis=1), theirs)
    print(f"[{qwen['name']}] layer {i} gated DeltaNet rel err {err:.2e}, prefill+decode {err_cached:.2e}")
    assert np.abs(theirs).max() > 0.1
    assert err <= TOL and err_cached <= TOL


def _torch_attention(qwen, i, x):
    """transformers' gated attention on x [B, S, D] from position 0, with the rotary tables and
    causal mask built as ``Qwen3_5TextModel.forward`` builds them (glue copied from there)."""
    tm = qwen["torch"].model
    inputs = torch.as_tensor(x)
    position_ids = torch.arange(x.shape[1]).view(1, 1, -1).expand(4, x.shape[0], -1)
    text_position_ids, position_ids = position_ids[0], position_ids[1:]
    mask = create_causal_mask(config=qwen["cfg"], inputs_embeds=inputs, attention_mask=None, past_key_values=None,
                              position_ids=text_position_ids)
    with torch.no_grad():
        position_embeddings = tm.rotary_emb(inputs, position_ids)
        y, _ = tm.layers[i].self_attn(hidden_states=inputs, position_embeddings=position_embeddings,
                                      attention_mask=mask, position_ids=text_position_ids)
    return y.numpy()


def test_gated_attention_matches_transformers(qwen):
    i = qwen["cfg"].layer_types.index("full_attention")
    x = _rand((B, SEQ, qwen["cfg"].hidden_size), 22)
    theirs = _torch_attention(qwen, i, x)
    attn = qwen["model"].layers[i].self_attn
    fwd = jitted(attn)
    advance = jax.jit(qwen["model"].advance)

    def run(calls):
        meta, cache, out = empty_slot_meta(B, SEQ), attn.init_cache(B, SEQ), []
        for t0, t1 in calls:
            slots, meta = advance(meta, jnp.ones((B, t1 - t0), bool))
            y, cache = fwd(jnp.asarray(x[:, t0:t1]), slots, cache)
            out.append(np.asarray(y))
        return np.concatenate(out, axis=1)

    err, err_cached = rel_err(run([(0, SEQ)]), theirs), rel_err(run(_calls()), theirs)
    print(f"[{qwen['name']}] layer {i} gated attention rel err {err:.2e}, prefill+decode {err_cached:.2e} "
          f"(rotary dim {qwen['model'].config.rotary_dim})")
    assert np.abs(theirs).max() > 0.1
    assert err <= TOL and err_cached <= TOL
