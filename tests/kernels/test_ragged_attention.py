"""The length-aware attention kernel (``zoo.kernels.ragged_attention``): the Pallas body (interpret
mode) equals its jnp reference; each row reads only its own filled blocks, whatever the other rows
hold; Qwen's gated attention and GLM's latent attention through it equal the whole-window
references, on one device and with the cache split over 8 chips by its slots (GLM's split case is
``tests/models/glm53/test_filled_latent_attention.py``'s); the engine through it equals the jnp path;
and the real TPU compiler (Mosaic) accepts it at Qwen3.8-27B's and GLM-5.3-Flash's shapes on a v5e-8."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.qwen38.test_filled_attention import case
from tests.support.helpers import rel_err
from zoo.kernels import ragged_attention as ra
from zoo.kernels.census import kernel_census
from zoo.kernels.dispatch import Policy, use_policy
from zoo.models.qwen38 import gated_attention as ga

TPU_INTERPRET = Policy(backend="tpu", interpret=True)
D = 128                                  # head dims the kernel takes: whole 128-lane rows
TOL = 3e-6                               # against a whole-window softmax: float32 sums over 128-wide heads in
                                         # another order (up to 1.3e-6 seen)


def kernel_inputs(rows, cache_rows, g, per_token, share, d, write_at, t, live, first=0, seed=0):
    """Random q/k/v (``per_token`` query rows per token, token-major); row b's slots filled up to
    ``write_at[b] + t`` (global slots, the share starting at ``first``), slot 3 of every row empty;
    its tokens at its last ``t`` slots."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((rows, g, t * per_token, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((cache_rows, g, share, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((cache_rows, g, share, d)), jnp.float32)
    slot = first + jnp.arange(share)[None, :]
    write_at = jnp.asarray(write_at + [0] * (cache_rows - rows), jnp.int32)
    valid = (slot < write_at[:, None] + t) & (slot != 3)
    query_slot = write_at[:rows, None] + jnp.arange(t)[None, :]
    return q, k, v, valid, query_slot, write_at[:rows], jnp.asarray(live)


@pytest.mark.parametrize("rows,cache_rows,per_token,share,write_at,t,live,first", [
    (3, 3, 2, 1024, [5, 300, 900], 1, [True, True, True], 0),        # decode, three fill levels
    (3, 4, 2, 1024, [5, 600, 900], 3, [True, True, False], 0),       # a verify; an idle row; a wider cache
    (2, 2, 2, 512, [4000, 700], 4, [True, True], 3584),              # a chip's share: one row before it
    (1, 1, 2, 1024, [500], 16, [True], 0),                           # a prefill piece: 2 query blocks of 8
    (2, 2, 3, 1100, [1095, 300], 2, [True, True], 0),                # the last block runs past the share
    (2, 3, 1, 4128, [8250, 4500], 1, [True, True], 4128),            # Qwen3.8-27B's share: 4,128 slots a chip
])
def test_kernel_equals_reference(monkeypatch, rows, cache_rows, per_token, share, write_at, t, live, first):
    monkeypatch.setattr(ra, "Q_ROWS", 16)                            # 16 tokens x 2 rows: 2 blocks of 8 tokens
    q, k, v, valid, qs, w, lv = kernel_inputs(rows, cache_rows, 2, per_token, share, D, write_at, t, live, first)
    n_blocks = ra.token_blocks(w, t, lv, share, 256, first)
    ours = ra.ragged_attention(q, k, v, valid, qs, n_blocks, first, block=256, scale=0.2, interpret=True)
    ref = ra.reference_attention(q, k, v, valid, qs, n_blocks, first, block=256, scale=0.2)
    for a, b, name in zip(ours, ref, ("m", "l", "acc")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-5, err_msg=name)
    # the whole-window softmax for the queries that read a block
    out = np.asarray(ra.finish(*ours))
    scores = jnp.einsum("bgmd,bgsd->bgms", q, k[:rows]) * 0.2
    seen = valid[:rows, None, :] & (first + jnp.arange(share)[None, None, :] <= qs[:, :, None])      # [B, T, S]
    visible = jnp.repeat(seen, per_token, axis=1)
    whole = jnp.einsum("bgms,bgsd->bgmd", jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), -1),
                       v[:rows])
    reads = np.repeat(np.asarray(n_blocks) > 0, per_token, axis=1)                                  # [B, M]
    assert reads.any()
    assert rel_err(out.transpose(0, 2, 1, 3)[reads], np.asarray(whole).transpose(0, 2, 1, 3)[reads]) <= TOL
    assert (out.transpose(0, 2, 1, 3)[~reads] == 0).all()             # a query that reads nothing: zeros


def test_token_blocks():
    live = jnp.asarray([True] * 5)
    assert ra.token_blocks(jnp.asarray([0, 511, 512, 4000, 9000]), 1, live, 8192, 512, 0)[:, 0].tolist() == [
        1, 1, 2, 8, 16]
    assert ra.token_blocks(jnp.asarray([510]), 3, live[:1], 8192, 512, 0).tolist() == [[1, 1, 2]]   # per token
    assert ra.token_blocks(jnp.asarray([4000, 4000]), 1, jnp.asarray([True, False]), 4096, 512, 0).tolist() == [
        [8], [0]]
    # a chip's share from slot 4096: a row that ends before it reads nothing, one past it reads its part
    assert ra.token_blocks(jnp.asarray([100, 4096, 5000, 9000]), 1, live[:4], 4096, 512, 4096)[:, 0].tolist() == [
        0, 1, 2, 8]
    # an interleaved share (chip 3 of 8 holds slots 3, 11, 19, ...): a row filled to f tokens has about
    # f / 8 of them here, so chip 3 reads 1 block of 512 for rows of 100 and 4,000 tokens and 2 for 4,200
    assert ra.token_blocks(jnp.asarray([2, 99, 3999, 4199]), 1, live[:4], 4128, 512, 3, 8)[:, 0].tolist() == [
        0, 1, 1, 2]
    # the key block each grid step brings in: past the count, the last block again (no new DMA)
    assert [int(ra.block_read(j, 3)) for j in range(6)] == [0, 1, 2, 2, 2, 2]
    assert [int(ra.block_read(j, 0)) for j in range(3)] == [0, 0, 0]
    # query blocks of whole tokens: Qwen3.8-27B's 1,024-token piece (6 rows a token) in blocks of 128
    # tokens, GLM's (64 heads) of 16, a decode step whole
    assert [ra.tokens_per_block(t, p) for t, p in [(1, 6), (4, 64), (1024, 6), (1024, 64), (1500, 1)]] == [
        1, 4, 128, 16, 1500]


def test_each_row_reads_only_its_own_blocks():
    """Keys and values past each row's filled blocks are NaN: the kernel's result is finite and equal
    to the one with clean values, so no row computed with a block past its own fill, although the
    other row reaches 6 blocks further. The jnp blocks visit the longest row's blocks for every row,
    so the same input gives the short row NaN there."""
    q, k, v, valid, qs, w, lv = kernel_inputs(2, 2, 2, 2, 4096, D, [60, 3000], 1, [True, True])
    n_blocks = ra.token_blocks(w, 1, lv, 4096, 512, 0)
    assert n_blocks[:, 0].tolist() == [1, 6]
    past = jnp.arange(4096)[None, None, :, None] >= (n_blocks[:, 0] * 512)[:, None, None, None]
    k_nan, v_nan = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
    run = functools.partial(ra.ragged_attention, block=512, scale=0.2, interpret=True)
    clean = ra.finish(*run(q, k, v, valid, qs, n_blocks, 0))
    dirty = ra.finish(*run(q, k_nan, v_nan, valid, qs, n_blocks, 0))
    assert np.isfinite(np.asarray(dirty)).all()
    assert np.array_equal(np.asarray(dirty), np.asarray(clean))
    with_jnp = ra.reference_attention(q, k_nan, v_nan, valid, qs, jnp.maximum(n_blocks, 6), 0, block=512, scale=0.2)
    assert np.isnan(np.asarray(ra.finish(*with_jnp))[0]).all()


def test_a_prefill_pieces_first_tokens_skip_the_last_ones_blocks(monkeypatch):
    """A 32-token piece from slot 500 in query blocks of 8 tokens: the first block's tokens (slots
    500..507) read 1 block of 512, the last block's (524..531) 2. Values past each query block's
    own reach are NaN for the first block only, and its rows stay finite and exact."""
    monkeypatch.setattr(ra, "Q_ROWS", 16)
    q, k, v, valid, qs, w, lv = kernel_inputs(1, 1, 1, 2, 2048, D, [500], 32, [True])
    n_blocks = ra.token_blocks(w, 32, lv, 2048, 512, 0)
    assert n_blocks[0, :12].tolist() == [1] * 12 and n_blocks[0, 12:].tolist() == [2] * 20
    run = functools.partial(ra.ragged_attention, block=512, scale=0.2, interpret=True)
    clean = np.asarray(ra.finish(*run(q, k, v, valid, qs, n_blocks, 0)))
    v_nan = v.at[:, :, 512:].set(jnp.nan)
    dirty = np.asarray(ra.finish(*run(q, k, v_nan, valid, qs, n_blocks, 0)))
    assert np.array_equal(dirty[:, :, :16], clean[:, :, :16])         # the first 8 tokens: block 0 only
    assert np.isnan(dirty[:, :, 16:]).any()                          # the others read block 1


@pytest.mark.parametrize("length,filled,t,live", [(1024, [300, 40], 1, (True, True)),
                                                  (1024, [511, 3], 2, (True, True)),
                                                  (4096, [1500, 20], 64, (True, True)),
                                                  (768, [700, 10], 4, (True, True)),
                                                  (4096, [60, 3000], 1, (True, False)),
                                                  # windows no block width divides: the last block runs past
                                                  (1100, [1000, 1090], 5, (True, True)),
                                                  (4128, [4100, 3000], 20, (True, True))])
def test_gated_attention_through_the_kernel(length, filled, t, live):
    """``filled_attention`` under the TPU policy (the kernel, interpret mode) equals the whole-window
    reference for every live row, and is finite for an idle one."""
    q, k, v, slots = case(length, filled, t, live=live, d=D)
    with use_policy(TPU_INTERPRET), kernel_census() as calls:
        ours = jax.jit(ga.filled_attention, static_argnums=4)(q, k, v, slots, D ** -0.5)
    assert [c.kernel for c in calls] == ["ragged_attention"]
    ref = ga.grouped_attention(q, k, v, ga.attention_mask(slots), D ** -0.5)
    rows = np.asarray(live)
    assert rel_err(np.asarray(ours)[rows], np.asarray(ref)[rows]) <= TOL
    assert np.isfinite(np.asarray(ours)).all()


@pytest.mark.parametrize("length,filled,t,live", [(8 * 1024, [5000, 1200], 3, (True, True)),
                                                  (8 * 512, [600, 30], 1, (True, False)),
                                                  (8 * 128, [0, 100], 40, (True, True)),
                                                  (8 * 1100, [5000, 1200], 2, (True, True))])
def test_split_over_chips_through_the_kernel(length, filled, t, live):
    """The cache split over 8 chips by its slots (``vmap`` over a named axis, the collectives as under
    ``shard_map``): each chip's kernel reads its share's filled blocks for each row, the partial sums
    are combined, and every chip holds the whole-window result."""
    n = 8
    q, k, v, slots = case(length, filled, t, seed=4, live=live, d=D)
    share = length // n
    # chip c holds slots c, c + n, ... (the interleaved layout, ``slot_layout``): [n, ..., share, ...]
    shares = lambda a, axis: jnp.moveaxis(a.reshape(*a.shape[:axis], share, n, *a.shape[axis + 1:]), axis + 1, 0)  # noqa: E731
    chip = jax.vmap(lambda k, v: ga.kernel_attention_share(
        q, k, v, slots.key_valid, slots.query_slot, slots.write_at, slots.live, axis="tp", scale=D ** -0.5,
        interpret=True, interleaved=True), axis_name="tp")
    out = jax.jit(chip)(shares(k, 2), shares(v, 2))
    ref = ga.grouped_attention(q, k, v, ga.attention_mask(slots), D ** -0.5)
    rows = np.asarray(live)
    for c in range(n):
        assert rel_err(np.asarray(out[c])[rows], np.asarray(ref)[rows]) <= TOL, c
    assert np.isfinite(np.asarray(out)).all()


def test_tpu_compiler_takes_it_at_full_size():
    """Qwen3.8-27B's attention at 3 rows in its 33,024-slot window on a v5e-8 (24 query heads, 4 KV
    heads of 256, the slots split over the 8 chips: 4,128 each): the real TPU compiler builds the
    kernel inside ``shard_map``; per chip it is 3 x 9 grid steps of 512 slots of the 4 KV heads (the
    ninth runs past the share), 54 MiB of keys and values at the most, and the program holds no copy of the cache
    (temporaries under 1 MiB)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zoo.tools.compile_report import target_devices
    from zoo.tools.targets import get_target
    mesh = Mesh(np.asarray(target_devices(get_target("v5e-8"))), ("tp",))
    b, t, h, g, d, length = 3, 1, 24, 4, 256, 33024
    spec = P(None, None, "tp", None)

    def arg(shape, dtype, s=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))

    def attend(q, k, v, key_valid, query_slot, write_at, live):
        slots = ga.Slots(write_at, key_valid, query_slot, live, None, None)
        return ga.kernel_attention(q, k, v, slots, d ** -0.5, spec)

    args = (arg((b, t, h, d), jnp.bfloat16), arg((b, g, length, d), jnp.bfloat16, spec),
            arg((b, g, length, d), jnp.bfloat16, spec), arg((b, length), jnp.bool_),
            arg((b, t), jnp.int32), arg((b,), jnp.int32), arg((b,), jnp.bool_))
    with jax.set_mesh(mesh), kernel_census() as calls:
        compiled = jax.jit(attend).lower(*args).compile()
    assert [(c.kernel, c.steps, c.weight_bytes) for c in calls] == [("ragged_attention", 3 * 9, 54 << 20)]
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20


@pytest.mark.parametrize("t", [1, 4, 64])
def test_tpu_compiler_takes_the_latent_variant_at_full_size(t):
    """GLM-5.3-Flash's absorbed MLA for a decode step, a k=3 verify (4 tokens) and a 64-token piece at
    3 rows in a 33,024-slot window on a v5e-8 (64 heads over a 512-dim latent, the latent split over
    the 8 chips; the pool flags of the indexer's pools of 4 looked up in the kernel): the real TPU
    compiler builds it; per chip and query block 3 x 9 steps of 512 latent slots, read once as keys
    and values (13.5 MiB at the most); the 64-token piece is 4 query blocks of 16 tokens."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zoo.models.glm53 import mla
    from zoo.tools.compile_report import target_devices
    from zoo.tools.targets import get_target
    mesh = Mesh(np.asarray(target_devices(get_target("v5e-8"))), ("tp",))
    b, h, c, length = 3, 64, 512, 33024
    spec = P(None, "tp", None)

    def arg(shape, dtype, s=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))

    def attend(q, latent, pools, key_pos, query_pos, write_at, live):
        return mla.kernel_latent_attention(q, latent, pools, key_pos, query_pos, write_at, live, c ** -0.5, spec,
                                           pool=4, select_tail=True)

    args = (arg((b, t, h, c), jnp.bfloat16), arg((b, length, c), jnp.bfloat16, spec),
            arg((b, t, length // 4), jnp.bool_), arg((b, length), jnp.int32, P(None, "tp")), arg((b, t), jnp.int32),
            arg((b,), jnp.int32), arg((b,), jnp.bool_))
    with jax.set_mesh(mesh), kernel_census() as calls:
        compiled = jax.jit(attend).lower(*args).compile()
    n_q = 1 if t < 16 else t // 16
    assert [(c.kernel, c.steps, c.weight_bytes) for c in calls] == [("ragged_attention", 3 * 9 * n_q, 27 * n_q << 19)]
    assert compiled.memory_analysis().temp_size_in_bytes < 32 << 20


def test_shared_values_and_pool_selection_equal_the_reference():
    """The latent variant: values are the keys (one array, read once); the slots each token sees come
    from its pool flags, looked up per block in the kernel, equal to ``pool_visibility``'s mask. Row 0
    holds positions from 2,000 (its pool windows start past lane 0) with empty slots between; row 1
    from 0; row 2 reads nothing. A last block runs past the share."""
    from zoo.models.glm53.mla import pool_visibility
    rng = np.random.default_rng(3)
    b, t, h, share, d, pool = 3, 3, 8, 1100, D, 4
    key_pos = np.full((b, share), -1, np.int32)
    key_pos[0, :1050] = 2000 + np.arange(1050)
    key_pos[0, 10:13] = -1                                            # padding slots: positions go on after
    key_pos[0, 13:1050] = 2010 + np.arange(1037)
    key_pos[1, :300] = np.arange(300)
    query_pos = np.stack([key_pos[0, 1047:1050], key_pos[1, 297:300], [0, 1, 2]]).astype(np.int32)
    n_pools = 4096 // pool
    pools = jnp.asarray(rng.random((b, t, n_pools)) < 0.4)
    sel = ra.PoolSelection(pools, jnp.asarray(key_pos), jnp.asarray(query_pos), pool, True)
    q = jnp.asarray(rng.standard_normal((b, 1, t * h, d)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((b, 1, share, d)), jnp.float32)
    n_blocks = jnp.asarray([[5] * t, [2] * t, [0] * t], jnp.int32)
    ours = ra.ragged_attention(q, c, None, None, None, n_blocks, 0, block=256, scale=0.1, selection=sel,
                               interpret=True)
    mask = pool_visibility(pools, jnp.asarray(key_pos), jnp.asarray(query_pos), pool, True)      # [B, T, S]
    ref = ra.reference_attention(q, c, None, None, None, n_blocks, 0, block=256, scale=0.1, token_mask=mask)
    for a, r, name in zip(ours, ref, ("m", "l", "acc")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-6, atol=2e-5, err_msg=name)
    out = np.asarray(ra.finish(*ours))
    assert np.isfinite(out).all() and (out[2] == 0).all()
    assert int(np.asarray(mask[0]).sum()) > 100
    # the lanes a block's window needs: its pools (positions 3..514 span pools 0..128) after up to 127
    # lanes of alignment
    assert [ra.pool_window(p, b) for p, b in [(4, 256), (4, 512), (128, 128), (2, 512)]] == [256, 256, 256, 384]
    assert ra.window_starts(jnp.asarray(key_pos), 2, pool, 256, 5).reshape(2, 5)[0].tolist() == [
        384, 512, 512, 640, 640]                  # each block's first pool (500, 563, 627, 691, 755), to 128s
    # row 0 reads every block: the whole-window softmax of each token over the slots it sees
    scores = jnp.einsum("md,sd->ms", q[0, 0], c[0, 0]) * 0.1
    seen = jnp.repeat(mask[0], h, axis=0)
    whole = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), -1) @ c[0, 0]
    assert rel_err(out[0, 0], whole) <= TOL


@pytest.mark.parametrize("length,filled,t", [(1024, [300, 40], 1), (1100, [1000, 1090], 5), (4096, [60, 3000], 2),
                                             (4096, [1500, 1500], 64)])
def test_latent_attention_through_the_kernel(monkeypatch, length, filled, t):
    """GLM's ``filled_latent_attention`` under the TPU policy: the kernel (interpret mode) for decode,
    verify and prefill-sized calls (64 tokens in query blocks of 16), equal to the whole-window
    reference."""
    from tests.models.glm53.test_filled_latent_attention import POOL, reference
    from tests.models.glm53.test_filled_latent_attention import case as latent_case
    from zoo.models.glm53.mla import filled_latent_attention
    monkeypatch.setattr(ra, "Q_ROWS", 48)                          # 3 heads a token: 16 tokens a query block
    q, c, pools, key_pos, query_pos, write_at = latent_case(length, filled, t, width=D)
    attend = jax.jit(functools.partial(filled_latent_attention, pool=POOL, select_tail=True), static_argnums=6)
    with use_policy(TPU_INTERPRET), kernel_census() as calls:
        ours = attend(q, c, pools, key_pos, query_pos, write_at, D ** -0.5)
    assert [c.kernel for c in calls] == ["ragged_attention"]
    assert rel_err(ours, reference(q, c, pools, key_pos, query_pos, D ** -0.5)) <= TOL


@pytest.fixture(scope="module")
def random_qwen(tmp_path_factory):
    """qwen38-tiny with random weights, one DeltaNet and one gated-attention layer, its attention heads
    128 wide (the kernel takes whole-lane heads), float32."""
    import zoo
    from tests.support.random_checkpoints import random_tiny_checkpoint
    path = random_tiny_checkpoint(tmp_path_factory.mktemp("random-qwen"), overrides={"head_dim": D})
    return zoo.load(path, dtype="float32")


@pytest.fixture(scope="module")
def random_glm(tmp_path_factory):
    """glm53-tiny with random weights, one layer of each kind (KDA; MLA with its indexer; MLA sharing
    it), its latent 128 wide (the kernel takes whole-lane latents), float32."""
    import zoo
    from tests.support.random_checkpoints import random_tiny_checkpoint
    path = random_tiny_checkpoint(tmp_path_factory.mktemp("random-glm"), "glm53-tiny", overrides={"kv_lora_rank": D})
    return zoo.load(path, dtype="float32")


@pytest.mark.parametrize("name", ["qwen38", "glm53"])
def test_engine_on_the_kernel_equals_the_jnp_path(name, request):
    """The engine in a 1,024-token window, two requests of 40 and 700 prompt tokens (prefill pieces),
    then decoding side by side, verifying 2 MTP drafts a step: its programs traced under the TPU
    policy run the kernel (interpret mode) in every decode and verify attention call (Qwen's gated
    attention; GLM's latent attention, whose prefill pieces keep the jnp blocks), and the greedy
    tokens and their logprobs equal the jnp path's. (A plain decode step is the T=1 case above.)"""
    model = request.getfixturevalue({"qwen38": "random_qwen", "glm53": "random_glm"}[name])
    spec_tokens = 2
    from zoo.engine.generator import Generator
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 200, n).tolist() for n in (40, 700)]
    opts = dict(max_new_tokens=6, logprobs=0)
    make = functools.partial(Generator, model, context=1024, max_batch=2, spec_tokens=spec_tokens,
                             spec_policy="fixed", prefix_cache=0, narrow_rows=0)
    plain = make().generate(prompts, **opts)
    jax.clear_caches()              # the engine's jitted programs keep the policy they were traced with
    try:
        with use_policy(TPU_INTERPRET), kernel_census() as calls:
            ours = make().generate(prompts, **opts)
    finally:
        jax.clear_caches()
    assert calls and {c.kernel for c in calls} == {"ragged_attention"}
    for a, b in zip(ours, plain):
        assert a.tokens == b.tokens
        np.testing.assert_allclose([r.logprob for r in a.logprobs], [r.logprob for r in b.logprobs], atol=1e-5)
