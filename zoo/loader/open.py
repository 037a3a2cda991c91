"""Opening a checkpoint the way ``zoo.load`` does: resolve a name or path, then its weight source,
config, name map, tokenizer and storage function under a recipe.

    resolve(name_or_path) -> Path                    a local checkpoint directory or .gguf file
    open_checkpoint(ckpt, quant, dtype, vision=True, mmproj=None) -> (source, config, name map,
                                            tokenizer, storage function, "gguf" | "safetensors")
                                                     (a whole GGUF + an mmproj: ``zoo.loader.mmproj``)
    without_vision(config) -> config                 the text model only (``config.vision`` None: the
                                                     tower's tensors are then ignored)
    check_recipe(name_or_path, quant)                an unknown recipe of a registry model fails
                                                     before any download

Shared by ``zoo.load`` (``zoo.api``) and the streamed cache build (``zoo.weight_cache.build``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from zoo import registry
from zoo.loader.apply_recipe import recipe_of, sources_for, storage_at_load, whole_gguf
from zoo.loader.gguf_model import gguf_architecture, open_gguf
from zoo.loader.mmproj import find_mmproj, with_mmproj
from zoo.models.architectures import BY_MODEL_NAME, architecture
from zoo.models.config import load_config
from zoo.sources.fp8 import Fp8Dequantized
from zoo.sources.gguf import GGUFSource
from zoo.sources.names import NameMap
from zoo.sources.safetensors import SafetensorsSource
from zoo.text.tokenizer import Tokenizer

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def dtype_of(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve(name_or_path: str | Path) -> Path:
    """A local checkpoint directory (or ``.gguf`` file) for a registry name or a path."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return path                     # a GGUF file, or the first of a split set
        if not path.is_dir():
            raise ValueError(f"{path}: expected a checkpoint directory (config.json + *.safetensors)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json in this checkpoint directory")
        return path
    return registry.resolve_checkpoint(registry.get_spec(str(name_or_path)))


def has_tensors_for(source, name_map: NameMap, prefix: str) -> bool:
    """Some source tensor maps to a parameter under ``prefix`` (``"mtp."``, ``"visual."``)."""
    return any((hit := name_map.resolve(k)) is not None and hit.path.startswith(prefix) for k in source.keys())


def without_vision(cfg):
    """``cfg`` without its vision tower (``vision=None``), or ``cfg`` itself if it has none."""
    return dataclasses.replace(cfg, vision=None) if getattr(cfg, "vision", None) is not None else cfg


def open_checkpoint(ckpt: Path, quant: str | None, dtype: str, vision: bool = True,
                    mmproj: str | Path | None = None):
    """``(source, config, name map, tokenizer, storage function, format)`` for a resolved checkpoint
    directory or GGUF file under the recipe ``quant`` names for its architecture; ``vision=False``
    leaves a multimodal checkpoint's vision tower out (its tensors are ignored).

    A whole GGUF (a ``.gguf`` path, or a whole-GGUF recipe) gets its vision tower from a llama.cpp
    mmproj file (``zoo.loader.mmproj``): ``mmproj`` when given, else the one ``mmproj*.gguf`` beside
    the model GGUF (or, for a whole-GGUF recipe, in the checkpoint directory), if any
    (``find_mmproj``); the config's ``vision`` then comes from the mmproj and the source joins both
    files. ``vision=False`` ignores any mmproj."""
    if mmproj is not None and not vision:
        raise ValueError("mmproj= loads a vision tower; it cannot be combined with vision=False")
    if ckpt.suffix == ".gguf":
        gguf = GGUFSource(ckpt)
        store = storage_at_load(quant, gguf_architecture(gguf), dtype, gguf=True)   # the recipe checked first
        source, cfg, name_map, tokenizer = open_gguf(gguf)   # config, names, vocab: from the file
        mm = _mmproj_for(mmproj, vision, ckpt.parent)
        if mm is not None:
            source, cfg, name_map = with_mmproj(source, cfg, name_map, mm)
        return source, cfg, name_map, tokenizer, store, "gguf"
    cfg = load_config(ckpt)
    if not vision:
        cfg = without_vision(cfg)
    recipe = recipe_of(quant, cfg.arch)
    tokenizer = Tokenizer.from_dir(ckpt)
    gguf = whole_gguf(recipe, ckpt)
    if gguf is not None:                                     # the recipe is a whole GGUF in the directory
        hf_vision = getattr(cfg, "vision", None)
        source, cfg, name_map, gguf_tokenizer = open_gguf(gguf)
        mm = _mmproj_for(mmproj, vision, gguf.parent, ckpt)
        if mm is not None:
            source, cfg, name_map = with_mmproj(source, cfg, name_map, mm, base=hf_vision)
        store = storage_at_load(None, cfg.arch, dtype, gguf=True)        # every tensor as stored
        return source, cfg, name_map, tokenizer or gguf_tokenizer, store, "gguf"
    if mmproj is not None:
        raise ValueError(f"mmproj= gives the vision tower of a GGUF model; {ckpt} loads from safetensors "
                         f"(its tower, if any, from the checkpoint)")
    source = Fp8Dequantized(SafetensorsSource(ckpt))
    arch = architecture(cfg.arch)
    if not cfg.mtp_num_hidden_layers and has_tensors_for(source, arch.hf_name_map(cfg), "mtp."):
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)   # MTP weights present, config silent
    if getattr(cfg, "vision", None) is not None and not has_tensors_for(source, arch.hf_name_map(cfg), "visual."):
        cfg = without_vision(cfg)           # a config naming a tower whose weights the checkpoint lacks
    source, name_map = sources_for(recipe, ckpt, cfg, source, arch.hf_name_map(cfg))   # recipes mixing in a GGUF
    return source, cfg, name_map, tokenizer, storage_at_load(quant, cfg.arch, dtype), "safetensors"


def _mmproj_for(mmproj, vision: bool, *directories: Path) -> Path | None:
    """The mmproj file to load with a whole GGUF: ``mmproj`` itself, else the discovered one
    (``zoo.loader.mmproj.find_mmproj`` over ``directories``); None with ``vision=False``."""
    if not vision:
        return None
    if mmproj is not None:
        return Path(mmproj).expanduser()
    return find_mmproj(*directories)


def check_recipe(name_or_path, quant: str | None) -> None:
    """An unknown recipe of a registry model fails here, before any download."""
    known = BY_MODEL_NAME.get(str(name_or_path))
    if known is not None and not Path(name_or_path).expanduser().exists():
        recipe_of(quant, known.id)
