"""GLM-5.3 vision tower (``zoo.models.glm53.vision``) vs transformers' ``Glm5NextVisionModel``
(PyTorch, CPU, float32): random weights saved as safetensors under the on-disk prefix
``model.visual.`` and loaded through the tower's name map; the output compared is the
``pooler_output`` that ``Glm5NextModel.get_image_features`` hands to the language model.

Oracle: ||zoo - torch|| / ||torch|| <= 1e-4, with the SwiGLU clamps active in the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file
from transformers import Glm5NextForConditionalGeneration, Glm5NextVisionConfig, Glm5NextVisionModel

from tests.models.glm53 import reference as glm_ref
from zoo.loader.fill import fill_from_source
from zoo.models.glm53.vision import (
    VisionConfig,
    abstract_vision_tower,
    hf_names,
    merged_lengths,
)
from zoo.quant.storage import dense_store
from zoo.sources.safetensors import SafetensorsSource

VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24, projection_intermediate_size=40,
              swiglu_limit=1.5, rms_norm_eps=1e-5, rope_parameters={"rope_type": "axial", "rope_theta": 500.0})
PAIR = ((1, 4, 6), (1, 8, 4))                    # two images, different grids (24 + 32 patches)
VIDEO = ((2, 4, 4), (1, 4, 6))                   # a 2-frame entry (per-frame attention) and an image
AXES = {"vision_embed", "vision_heads", "vision_mlp", "vision_merger_mlp", "head_dim", "embed", "embed_in", None}


def load_vision_tower(path, cfg: VisionConfig, dtype=jnp.float32):
    """The tower alone filled from a safetensors file through its name map; (tower, unused names)."""
    return fill_from_source(abstract_vision_tower(cfg, dtype), SafetensorsSource(path), hf_names(cfg),
                            store=dense_store)


def norm_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, state, patches, grid):
    return nnx.merge(graphdef, state)(patches, grid)


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    hf_cfg = Glm5NextVisionConfig(**VISION)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Glm5NextVisionModel(hf_cfg).eval()
    glm_ref.redraw_vision_(ref, seed=1)
    path = tmp_path_factory.mktemp("glm-vision") / "model.safetensors"
    save_file({f"model.visual.{k}": v.numpy() for k, v in ref.state_dict().items()}, str(path))
    cfg = VisionConfig.from_hf(hf_cfg.to_dict())
    module, unused = load_vision_tower(path, cfg, dtype=jnp.float32)
    graphdef, state = nnx.split(module)
    run = lambda patches, grid: np.asarray(_forward(graphdef, state, jnp.asarray(patches), grid))
    return dict(ref=ref, cfg=cfg, module=module, unused=unused, run=run)


def _patches(cfg: VisionConfig, grid, seed: int) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grid)
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim)).astype(np.float32)


def _reference(ref: torch.nn.Module, patches: np.ndarray, grid) -> tuple[np.ndarray, dict[str, float]]:
    """pooler_output, and the fraction of clamped up-projection values (block 0, merger)."""
    clamped = {}

    def probe(name, limit):
        return lambda _m, _i, out: clamped.__setitem__(name, float((out.abs() > limit).float().mean()))

    hooks = [ref.blocks[0].mlp.up_proj.register_forward_hook(probe("block", ref.config.swiglu_limit)),
             ref.merger.up_proj.register_forward_hook(probe("merger", ref.config.swiglu_limit))]
    with torch.no_grad():
        out = ref(torch.from_numpy(patches), grid_thw=torch.tensor(grid)).pooler_output.numpy()
    for h in hooks:
        h.remove()
    return out, clamped


@pytest.mark.parametrize("grid", [PAIR, VIDEO], ids=["two-images", "video-and-image"])
def test_matches_transformers(tower, grid):
    cfg = tower["cfg"]
    patches = _patches(cfg, grid, seed=2)
    theirs, clamped = _reference(tower["ref"], patches, grid)
    ours = tower["run"](patches, grid)
    assert ours.shape == theirs.shape == (sum(merged_lengths(grid, 2)), VISION["out_hidden_size"])
    err = norm_err(ours, theirs)
    print(f"{grid}: rel err {err:.2e} (max-abs rel {np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}), "
          f"clamped fractions {clamped}")
    assert min(clamped.values()) > 0.01, "the SwiGLU clamps are not exercised"
    assert np.std(theirs) > 0.1
    assert err <= 1e-4


def test_image_alone_equals_its_rows_in_the_pair(tower):
    cfg, run = tower["cfg"], tower["run"]
    patches = _patches(cfg, PAIR, seed=3)
    pair = run(patches, PAIR)
    split = np.cumsum([t * h * w for t, h, w in PAIR])[:-1]
    rows = np.cumsum(merged_lengths(PAIR, cfg.spatial_merge_size))[:-1]
    for alone_patches, grid, expect in zip(np.split(patches, split), PAIR, np.split(pair, rows)):
        alone = run(alone_patches, (grid,))
        assert norm_err(alone, expect) <= 1e-6
    # a 2-frame entry is its frames as separate images
    video = _patches(cfg, ((2, 4, 4),), seed=4)
    assert norm_err(run(video, ((2, 4, 4),)), run(video, ((1, 4, 4), (1, 4, 4)))) <= 1e-6


def test_config_weights_and_axes(tower):
    cfg, module = tower["cfg"], tower["module"]
    assert tower["unused"] == []
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.patch_dim, cfg.rope_theta) == (
        2, 32, 2, 16, 96, 500.0)
    assert VisionConfig.from_hf({}) == VisionConfig()          # transformers' defaults
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        axes = var.get_metadata()["axes"]
        assert len(axes) == var.get_value().ndim and set(axes) <= AXES, (path, axes)
    # the qkv kernel's columns are head-major [H, 3, hd]: head 1's q columns are HF rows 16..31
    hf_qkv = tower["ref"].blocks[0].attn.qkv.weight.detach().numpy()
    ours = np.asarray(module.blocks[0].attn.qkv.kernel.get_value()).reshape(32, 2, 3, 16)
    np.testing.assert_array_equal(ours[:, 1, 0], hf_qkv[16:32].T)
    np.testing.assert_array_equal(ours[:, 0, 2], hf_qkv[64:80].T)


def test_name_map_covers_the_full_checkpoint():
    """Every ``model.visual.*`` tensor of ``Glm5NextForConditionalGeneration`` maps to a parameter of
    the tower (and all parameters are covered); the text model's tensors are ignored."""
    hf_cfg = glm_ref.hf_config("A")
    with torch.device("meta"):
        keys = list(Glm5NextForConditionalGeneration(hf_cfg).state_dict())
    cfg = VisionConfig.from_hf(hf_cfg.to_dict())
    names = hf_names(cfg)
    params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(abstract_vision_tower(cfg), nnx.Param))}
    visual = [k for k in keys if k.startswith("model.visual.")]
    assert visual and all(names.ignored(k) for k in keys if k not in visual)
    assert not any(names.ignored(k) for k in visual)
    targets = [names.lookup(k) for k in visual]
    assert None not in targets
    assert {t[0] for t in targets} == params and len(targets) == len(params)
