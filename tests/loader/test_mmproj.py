"""Vision towers from llama.cpp mmproj files (``zoo.loader.mmproj``) vs the HF tower, both families.

Fixtures (``tests/data/mmproj/{qwen38,glm53}/``, ``scripts/make_mmproj_fixtures.py``): llama.cpp's own
converter (``convert_hf_to_gguf.py --mmproj``) run on a tiny random HF checkpoint, as f32, f16 and
q8_0; the HF tower's tensors (``tower.safetensors``) and ``config.json`` as the reference.

Oracles:
* f32 file: the tower equals the HF-loaded tower on two images of different grids, max |diff| <=
  1e-6 * max |ref| (measured: 0, every tensor is the same float32);
* f16 / q8_0 files: each parameter equals ``gguf.quants.dequantize`` of the file's bytes (after the
  name map's layout transform) bit-exactly; the tower's output within F16_TOL / Q8_TOL of the HF
  tower's (measured max |diff| / max |ref|: f16 3.9e-4 (qwen38), 5.7e-4 (glm53); q8_0 9.8e-3, 1.3e-2);
* the config read from each file equals ``VisionConfig.from_hf`` of the HF ``vision_config``;
* a corrupt, foreign or mismatched mmproj is a ``SourceError`` naming the file and the problem.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

import zoo.configs
import zoo.models.glm53.vision as glm_vision
import zoo.models.qwen38.vision as qwen_vision
from zoo.loader.fill import fill_from_source
from zoo.loader.mmproj import find_mmproj, load_vision_tower, mmproj_names, open_mmproj, vision_config_from_mmproj
from zoo.loader.open import open_checkpoint
from zoo.models.architectures import architecture
from zoo.quant.qarray import QArray
from zoo.sources.base import SourceError
from zoo.sources.names import apply_transform
from zoo.sources.safetensors import SafetensorsSource

DATA = Path(__file__).resolve().parents[1] / "data"
MMPROJ = DATA / "mmproj"
FAMILIES = ("qwen38", "glm53")
TYPES = ("f32", "f16", "q8_0")
GRIDS = ((1, 4, 6), (1, 8, 4))
F32_TOL, F16_TOL, Q8_TOL = 1e-6, 2e-3, 3e-2
TOL = {"f32": F32_TOL, "f16": F16_TOL, "q8_0": Q8_TOL}
# the tensors the converter really quantizes in mmproj-q8_0.gguf (rows of 32, 64, 128); the rest of the
# matrices have rows of 48 or 40 and fall back to F16; norms, biases, the patch kernel, the position
# table and GLM's patch merger (Conv2d) stay F32
Q8_0 = {
    "qwen38": {f"v.blk.{i}.{n}.weight" for i in (0, 1) for n in ("attn_qkv", "attn_out", "ffn_up")}
    | {"mm.0.weight", "mm.2.weight"},
    "glm53": {f"v.blk.{i}.{n}.weight" for i in (0, 1) for n in ("attn_qkv", "attn_out", "ffn_gate", "ffn_up")}
    | {"mm.model.fc.weight", "mm.gate.weight", "mm.up.weight"},
}
F16_FALLBACK = {"qwen38": {"v.blk.0.ffn_down.weight", "v.blk.1.ffn_down.weight"},
                "glm53": {"v.blk.0.ffn_down.weight", "v.blk.1.ffn_down.weight", "mm.down.weight"}}


def _module(family):
    return qwen_vision if family == "qwen38" else glm_vision


def _hf_config(family):
    return json.loads((MMPROJ / family / "config.json").read_text())


def _outputs(tower, patches):
    out = tower(jnp.asarray(patches), GRIDS)
    return np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=FAMILIES)
def ref(request):
    """(family, HF VisionConfig, HF-loaded tower, patches, its output)."""
    family = request.param
    mod = _module(family)
    cfg = mod.VisionConfig.from_hf(_hf_config(family))
    names = mod.hf_name_map(cfg) if family == "qwen38" else mod.hf_names(cfg)
    abstract = nnx.eval_shape(lambda: mod.VisionTower(cfg, dtype=jnp.float32))
    tower, unused = fill_from_source(abstract, SafetensorsSource(MMPROJ / family), names)
    assert unused == []
    patches = np.random.default_rng(0).standard_normal(
        (sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim)).astype(np.float32)
    return family, cfg, tower, patches, _outputs(tower, patches)


@pytest.mark.parametrize("kind", TYPES)
def test_tower_matches_hf(ref, kind):
    family, cfg, _, patches, want = ref
    tower, got_cfg, unused = load_vision_tower(MMPROJ / family / f"mmproj-{kind}.gguf")
    assert got_cfg == cfg
    assert unused == []
    err = _rel(_outputs(tower, patches), want)
    assert err <= TOL[kind], f"{family} {kind}: {err:.3g}"
    if kind == "f32":
        assert err == 0.0


def test_config_from_file(ref):
    """Every file's config equals HF's; the fields the file carries are HF's values."""
    family, cfg, *_ = ref
    hf = _hf_config(family)["vision_config"]
    for kind in TYPES:
        src, arch = open_mmproj(MMPROJ / family / f"mmproj-{kind}.gguf")
        assert arch == family
        assert vision_config_from_mmproj(src, arch) == cfg
        carried = architecture(family).part("mmproj_fields")(src)
        for k, v in carried.items():
            if k in hf:
                assert v == hf[k], k


@pytest.mark.parametrize("kind", ("f16", "q8_0"))
def test_parameters_bit_exact(ref, kind):
    """Each parameter = the name map's transform of ``gguf.quants.dequantize`` of the file's bytes."""
    family = ref[0]
    path = MMPROJ / family / f"mmproj-{kind}.gguf"
    tower, cfg, _ = load_vision_tower(path)
    names = mmproj_names(cfg, family)
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(tower))}
    reader = GGUFReader(path)
    stored = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    if kind == "q8_0":
        assert {n for n, t in types.items() if t == "Q8_0"} == Q8_0[family]
        assert {n for n, t in types.items() if t == "F16"} == F16_FALLBACK[family]
    else:
        matrices = {n for n in types if stored[n].ndim >= 2 and n != "v.position_embd.weight"}
        assert {n for n, t in types.items() if t == "F16"} == matrices        # both patch slices too
    stored["v.patch_embd.frames.weight"] = np.stack(
        [stored.pop("v.patch_embd.weight"), stored.pop("v.patch_embd.weight.1")], axis=2)
    assert len(stored) == len(params)
    for name, array in stored.items():
        target = names.resolve(name)
        value = params[target.path]
        assert isinstance(value, QArray) == (types.get(name) == "Q8_0"), name     # Q8_0 kept as blocks
        if isinstance(value, QArray):
            value = value.dequantize()
        want = apply_transform(target.transform, array)
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)


# -- errors ---------------------------------------------------------------------------------------


def _write_clip(path: Path, projector: str, tensors: dict[str, np.ndarray]) -> Path:
    w = GGUFWriter(str(path), "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", projector)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_corrupt_file(tmp_path):
    bad = tmp_path / "mmproj-cut.gguf"
    bad.write_bytes((MMPROJ / "qwen38" / "mmproj-f32.gguf").read_bytes()[:5000])
    with pytest.raises(SourceError, match="mmproj-cut.gguf"):
        load_vision_tower(bad)
    junk = tmp_path / "mmproj-junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(SourceError, match="mmproj-junk.gguf"):
        load_vision_tower(junk)


def test_wrong_projector(tmp_path):
    ldp = _write_clip(tmp_path / "mmproj-ldp.gguf", "ldp", {"mm.0.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(SourceError, match=r"mmproj-ldp\.gguf.*projector type 'ldp' is not supported"):
        load_vision_tower(ldp)
    qwen = MMPROJ / "qwen38" / "mmproj-f32.gguf"
    with pytest.raises(SourceError, match=r"mmproj-f32\.gguf.*'qwen3vl_merger' is a qwen38 vision tower.*glm53"):
        load_vision_tower(qwen, arch="glm53")
    with pytest.raises(SourceError, match=r"qwen38-tiny-mtp-f32\.gguf: not an mmproj file"):
        load_vision_tower(DATA / "qwen38-tiny-mtp-f32.gguf")


def test_missing_tensor(tmp_path):
    src = GGUFReader(MMPROJ / "glm53" / "mmproj-f32.gguf")
    w = GGUFWriter(str(tmp_path / "mmproj-part.gguf"), "clip")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for t in src.tensors:
        if t.name != "v.blk.1.attn_out.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed([int(d) for d in t.shape])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"blocks\.1\.attn\.proj\.kernel"):
        load_vision_tower(tmp_path / "mmproj-part.gguf")


# -- a whole model: text GGUF + mmproj (open_checkpoint) -------------------------------------------


def test_open_checkpoint_with_mmproj(tmp_path):
    """GLM: the tiny text GGUF (hidden 64) + the glm53 q8_0 mmproj beside it (discovered), and the
    same with ``mmproj=``: the config's ``vision`` is the file's, the tower is filled from it."""
    model = tmp_path / "glm53-tiny.gguf"
    shutil.copy(DATA / "glm53-tiny-mtp-f32.gguf", model)
    mm = MMPROJ / "glm53" / "mmproj-q8_0.gguf"
    source, cfg, names, *_ = open_checkpoint(model, None, "float32", mmproj=mm)
    want = glm_vision.VisionConfig.from_hf(_hf_config("glm53"))
    assert cfg.vision == want
    assert {names.resolve(k).path for k in source.keys() if k.startswith(("v.", "mm."))} >= {
        "visual.patch_embed", "visual.merger.proj.kernel"}
    assert "token_embd.weight" in source and names.resolve("token_embd.weight").path == "embed_tokens.embedding"

    assert open_checkpoint(model, None, "float32")[1].vision is None          # nothing beside it yet
    shutil.copy(mm, tmp_path / "mmproj-glm53-Q8_0.gguf")
    assert find_mmproj(tmp_path) == tmp_path / "mmproj-glm53-Q8_0.gguf"
    assert open_checkpoint(model, None, "float32")[1].vision == want          # discovered
    assert open_checkpoint(model, None, "float32", vision=False)[1].vision is None

    import zoo
    loaded = zoo.load(model, dtype="float32")
    tower, _, _ = load_vision_tower(mm)
    rng = np.random.default_rng(1)
    patches = rng.standard_normal((sum(t * h * w for t, h, w in GRIDS), want.patch_dim)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.module.encode_images(jnp.asarray(patches), GRIDS)),
                                  _outputs(tower, patches).astype(np.float32))

    shutil.copy(mm, tmp_path / "mmproj-glm53-F16.gguf")
    with pytest.raises(ValueError, match="several mmproj files"):
        open_checkpoint(model, None, "float32")


def test_mmproj_of_another_model(tmp_path):
    """The qwen38 mmproj (out_hidden 32) beside the tiny qwen38 text GGUF (hidden 64), and the glm53
    mmproj given to a qwen38 model: clear errors naming the file."""
    model = tmp_path / "qwen38-tiny.gguf"
    shutil.copy(DATA / "qwen38-tiny-mtp-f32.gguf", model)
    with pytest.raises(SourceError, match=r"mmproj-f32\.gguf.*out_hidden_size.*hidden_size is 64"):
        open_checkpoint(model, None, "float32", mmproj=MMPROJ / "qwen38" / "mmproj-f32.gguf")
    with pytest.raises(SourceError, match=r"'glm5v' is a glm53 vision tower; the model is qwen38"):
        open_checkpoint(model, None, "float32", mmproj=MMPROJ / "glm53" / "mmproj-f32.gguf")


def test_mmproj_loaded_as_a_model():
    with pytest.raises(SourceError, match=r"mmproj-f32\.gguf: a llama.cpp multimodal projector"):
        open_checkpoint(MMPROJ / "glm53" / "mmproj-f32.gguf", None, "float32")


def test_whole_gguf_recipe_discovers_mmproj(tmp_path):
    """A checkpoint directory with a whole-GGUF recipe (qwen38 ``UD-IQ3_XXS``): the mmproj in the
    directory is found and checked against the model (here the qwen38 fixture's out_hidden 32 does
    not fit the tiny text GGUF's 64: the error names the discovered file)."""
    shutil.copy(Path(zoo.configs.__file__).parent / "qwen38-tiny.json", tmp_path / "config.json")
    (tmp_path / "gguf").mkdir()
    shutil.copy(DATA / "qwen38-tiny-mtp-f32.gguf", tmp_path / "gguf" / "m-UD-IQ3_XXS.gguf")
    assert open_checkpoint(tmp_path, "UD-IQ3_XXS", "float32")[1].vision is None
    shutil.copy(MMPROJ / "qwen38" / "mmproj-f32.gguf", tmp_path / "mmproj-BF16.gguf")
    with pytest.raises(SourceError, match=r"mmproj-BF16\.gguf.*out_hidden_size"):
        open_checkpoint(tmp_path, "UD-IQ3_XXS", "float32")
    assert open_checkpoint(tmp_path, "UD-IQ3_XXS", "float32", vision=False)[1].vision is None
    with pytest.raises(ValueError, match="mmproj= gives the vision tower of a GGUF model"):
        open_checkpoint(tmp_path, None, "float32", mmproj=tmp_path / "mmproj-BF16.gguf")


def test_zoo_load_takes_an_mmproj_and_the_cache_tells_it_apart(tmp_path):
    """``zoo.load(gguf, mmproj=PATH)`` loads the tower from a file elsewhere; the weight cache's
    fingerprint names that file, so the entry of the text model alone is not reused for it."""
    import zoo
    gguf = shutil.copy(DATA / "glm53-tiny-mtp-f32.gguf", tmp_path / "model.gguf")
    mmproj = DATA / "mmproj" / "glm53" / "mmproj-f32.gguf"
    cache = tmp_path / "cache"
    text = zoo.load(gguf, dtype="float32", cache=cache)
    assert text.config.vision is None
    both = zoo.load(gguf, dtype="float32", cache=cache, mmproj=mmproj)
    assert both.load_info["source"] == "source" and both.config.vision is not None
    again = zoo.load(gguf, dtype="float32", cache=cache, mmproj=mmproj)
    assert again.load_info["source"] == "cache" and again.config == both.config
