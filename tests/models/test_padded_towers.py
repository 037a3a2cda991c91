"""The vision towers' fixed-shape path (``model.image_geometry`` + ``model.encode_images_padded``) against
their reference path (``model.encode_images``, which the parity tests hold against transformers), on the
tiny multimodal checkpoints of both architectures (float32, 2-block towers, merge 2).

Oracle: on the image's rows the padded path equals ``encode_images`` (||a - b|| / ||b|| <= 1e-5) for
square, non-square, two-frame (t = 2) and two-image grids, each padded into a bucket larger than
itself (and one exactly its size); the padding's rows are finite; one compiled program serves
every grid padded to the same size (``CompileCounter``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from tests.support.multimodal_checkpoints import glm_mm_checkpoint, qwen_mm_checkpoint
from zoo.engine.compile_cache import CompileCounter
from zoo.models.shared.vision import PatchGeometry

GRIDS = [((1, 2, 2),), ((1, 4, 4),), ((1, 4, 6),), ((1, 8, 2),), ((1, 6, 10),), ((2, 4, 4),),
         ((1, 4, 6), (1, 2, 8))]
N = 256                        # patch rows every grid above is padded to (64 merged rows)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["qwen", "glm"])
def tower(request, tmp_path_factory):
    make = {"qwen": qwen_mm_checkpoint, "glm": glm_mm_checkpoint}[request.param]
    model = zoo.load(make(tmp_path_factory.mktemp(request.param)), dtype="float32")
    graphdef, state = nnx.split(model.module)
    reference = jax.jit(lambda s, p, grid: nnx.merge(graphdef, s).encode_images(p, grid), static_argnums=2)
    padded = jax.jit(lambda s, p, geo: nnx.merge(graphdef, s).encode_images_padded(p, geo))
    return dict(model=model, arch=request.param, reference=lambda p, g: reference(state, p, g),
                padded=lambda p, geo: padded(state, p, geo))


def patches_of(grid, dim: int, seed: int) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grid)
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def run_padded(tower, patches: np.ndarray, grid, n: int) -> np.ndarray:
    padded = np.zeros((n, patches.shape[1]), np.float32)
    padded[:len(patches)] = patches
    return np.asarray(tower["padded"](padded, tower["model"].module.image_geometry(grid, n)))


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "+".join("x".join(map(str, x)) for x in g))
def test_the_padded_tower_equals_the_reference_on_the_images_rows(tower, grid):
    dim = tower["model"].config.vision.patch_dim
    patches = patches_of(grid, dim, seed=sum(map(sum, grid)))
    want = np.asarray(tower["reference"](patches, grid))
    got = run_padded(tower, patches, grid, N)
    assert got.shape == (N // 4, want.shape[1])
    assert rel(got[:len(want)], want) <= 1e-5, rel(got[:len(want)], want)
    assert np.isfinite(got).all()                    # padding attends only to padding: nothing is NaN
    exact = run_padded(tower, patches, grid, len(patches))      # no padding at all
    assert rel(exact, want) <= 1e-5


def test_one_program_serves_every_grid_of_a_size(tower):
    dim = tower["model"].config.vision.patch_dim
    run_padded(tower, patches_of(GRIDS[0], dim, 0), GRIDS[0], N)         # compiles the size's program
    with CompileCounter() as counter:
        for k, grid in enumerate(GRIDS[1:]):
            run_padded(tower, patches_of(grid, dim, k), grid, N)
    assert counter.compiled == 0, counter.compiled


def test_the_geometry_per_patch(tower):
    module = tower["model"].module
    geo = module.image_geometry(((2, 4, 4),), 48)
    assert isinstance(geo, PatchGeometry)
    assert geo.segments.dtype == np.int32 and geo.positions.dtype == np.int32
    np.testing.assert_array_equal(geo.segments, [0] * 16 + [1] * 16 + [-1] * 16)     # a segment per frame
    assert geo.positions.shape == (48, 2) and not geo.positions[32:].any()
    np.testing.assert_array_equal(geo.positions[:16], geo.positions[16:32])          # the frames' positions
    if tower["arch"] == "qwen":                                                       # the table's taps
        assert geo.taps.shape == (48, 4) and geo.tap_weights.shape == (48, 4)
        assert not geo.tap_weights[32:].any()
        np.testing.assert_allclose(geo.tap_weights[:32].sum(axis=1), 1.0, rtol=1e-6)
    else:
        assert geo.taps is None and geo.tap_weights is None
    with pytest.raises(ValueError, match="do not fit"):
        module.image_geometry(((1, 8, 8),), 60)
    with pytest.raises(ValueError, match="multiple of 4"):
        module.image_geometry(((1, 2, 2),), 6)


def test_the_padded_tower_refuses_a_geometry_of_another_size(tower):
    module = tower["model"].module
    dim = tower["model"].config.vision.patch_dim
    with pytest.raises(ValueError, match="expected"):
        module.encode_images_padded(jnp.zeros((16, dim)), module.image_geometry(((1, 2, 2),), 8))
