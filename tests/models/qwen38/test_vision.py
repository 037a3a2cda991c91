"""The Qwen3.8 vision tower (``zoo.models.qwen38.vision``) vs transformers' ``Qwen3_5VisionModel``
(PyTorch, CPU, float32), same weights: a tiny random tower written as ``model.visual.*`` safetensors
and loaded through the name map by ``zoo.loader.fill.fill_from_source``.

Oracle: ||zoo - torch|| / ||torch|| <= 1e-4 on the merged output and the pre-merge hidden state.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from tests.models.qwen38 import reference as qwen_ref
from zoo.loader.fill import fill_from_source
from zoo.models.qwen38.vision import (
    VisionConfig,
    VisionTower,
    as_grid,
    frame_segments,
    hf_name_map,
    interpolation_taps,
    jit_tower,
    merged_lengths,
    rotary_positions,
)
from zoo.sources.safetensors import SafetensorsSource

TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16)
PAIR = ((1, 4, 6), (1, 8, 4))
VIDEO = ((2, 4, 4), (1, 2, 2))        # two frames (two attention segments), and a grid below the 4 x 4 table


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """(torch tower, zoo tower loaded from a safetensors file, the fill's unused keys)."""
    hf_cfg = Qwen3_5VisionConfig(**TINY)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = Qwen3_5VisionModel(hf_cfg).eval()
    qwen_ref.redraw_vision_(theirs, seed=5)
    tensors = {f"model.visual.{k}": v.numpy() for k, v in theirs.state_dict().items()}
    # a few tensors of the rest of a qwen3_5 checkpoint: the tower's map ignores them
    tensors["model.language_model.embed_tokens.weight"] = np.zeros((8, 48), np.float32)
    tensors["lm_head.weight"] = np.zeros((8, 48), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((48, 96), np.float32)
    path = tmp_path_factory.mktemp("qwen-vision") / "model.safetensors"
    save_file(tensors, str(path))
    cfg = VisionConfig.from_hf({"model_type": "qwen3_5", "vision_config": hf_cfg.to_dict()})
    abstract = nnx.eval_shape(lambda: VisionTower(cfg, dtype=jnp.float32))
    ours, unused = fill_from_source(abstract, SafetensorsSource(path), hf_name_map(cfg))
    return theirs, ours, unused


def pixels(grid, patch_dim: int, seed: int) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grid)
    return np.random.default_rng(seed).standard_normal((n, patch_dim)).astype(np.float32)


def torch_tower(model, pv: np.ndarray, grid):
    with torch.no_grad():
        out = model(torch.from_numpy(pv), grid_thw=torch.tensor(grid, dtype=torch.long))
    return out.pooler_output.numpy(), out.last_hidden_state.numpy()


def test_loader_fills_every_parameter_and_ignores_the_rest(towers):
    _, ours, unused = towers
    assert unused == []
    assert ours.patch_embed.weight[...].shape == (32, 3, 2, 4, 4)
    axes = {var.get_metadata()["axes"] for _, var in nnx.to_flat_state(nnx.state(ours, nnx.Param))}
    assert all(a and all(n is None or n.startswith("vision_") for n in a) for a in axes)


@pytest.mark.parametrize("grid", [PAIR, VIDEO], ids=["pair", "video"])
def test_matches_transformers(towers, grid):
    theirs, ours, _ = towers
    pv = pixels(grid, ours.config.patch_dim, seed=1)
    want_merged, want_hidden = torch_tower(theirs, pv, grid)
    merged, hidden = jit_tower(ours)(pv, grid)
    n_merged = sum(merged_lengths(grid, 2))
    assert merged.shape == want_merged.shape == (n_merged, 48) and merged.dtype == jnp.float32
    assert hidden.shape == want_hidden.shape
    e_merged, e_hidden = rel(merged, want_merged), rel(hidden, want_hidden)
    print(f"[{grid}] rel err merged {e_merged:.2e}, hidden {e_hidden:.2e}")
    assert e_merged <= 1e-4 and e_hidden <= 1e-4
    assert np.std(want_merged) > 0.3, "weights too small to exercise the tower"


def test_one_image_alone_gives_its_rows_of_the_pair(towers):
    """Attention stays within each image: image 2 alone = its rows when packed after image 1."""
    _, ours, _ = towers
    pv = pixels(PAIR, ours.config.patch_dim, seed=2)
    fwd = jit_tower(ours)
    merged, hidden = fwd(pv, PAIR)
    n0 = 4 * 6
    alone_merged, alone_hidden = fwd(pv[n0:], PAIR[1:])
    m0 = merged_lengths(PAIR, 2)[0]
    assert rel(merged[m0:], alone_merged) <= 1e-6
    assert rel(hidden[n0:], alone_hidden) <= 1e-6
    first_merged, _ = fwd(pv[:n0], PAIR[:1])
    assert rel(merged[:m0], first_merged) <= 1e-6


@pytest.mark.parametrize("grid", [PAIR, VIDEO, ((1, 6, 10), (3, 2, 8))])
def test_host_tables_equal_transformers(grid):
    g = torch.tensor(grid, dtype=torch.long)
    idx, w = get_vision_interpolation_indices_and_weights(g, num_grid_per_side=4, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=2)
    ours_idx, ours_w = interpolation_taps(as_grid(grid, 2), 4, 2)
    np.testing.assert_array_equal(ours_idx, idx.numpy())
    np.testing.assert_array_equal(ours_w, w.numpy())
    np.testing.assert_array_equal(rotary_positions(as_grid(grid, 2), 2), get_vision_position_ids(g, 2).numpy())
    cu = get_vision_cu_seqlens(g).tolist()
    assert frame_segments(as_grid(grid, 2)) == tuple((a, b - a) for a, b in zip(cu[:-1], cu[1:]))


def test_config_defaults_are_transformers_defaults():
    ours = VisionConfig.from_hf(Qwen3_5VisionConfig().to_dict())
    assert ours == VisionConfig()
    hf = Qwen3_5VisionConfig()
    assert (ours.depth, ours.hidden_size, ours.num_heads, ours.out_hidden_size, ours.grid_side) == (
        hf.depth, hf.hidden_size, hf.num_heads, hf.out_hidden_size, int(hf.num_position_embeddings ** 0.5))
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]


def test_bad_inputs_are_refused(towers):
    _, ours, _ = towers
    with pytest.raises(ValueError, match="multiples of 2"):
        as_grid(((1, 3, 4),), 2)
    with pytest.raises(ValueError, match="patches have shape"):
        ours(jnp.zeros((10, ours.config.patch_dim)), PAIR)
