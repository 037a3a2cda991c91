"""zoo: a Flax NNX model zoo with one loader for quantized weights.

Nothing heavy happens at import: ``load`` and friends import JAX/Flax on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load", "list_models", "plan", "Model"]


def load(name_or_path, *, quant=None, mesh=None, cache=None, dtype="bfloat16", weights=True, mtp=None, vision=True,
         mmproj=None):
    """Load a model (see ``zoo.api.load``; ``weights=False``: the abstract model, no file read;
    ``mtp``: an MTP overlay directory written by ``zoo fit-mtp``, applied after the load;
    ``vision=False``: without a multimodal checkpoint's vision tower; ``mmproj``: a llama.cpp
    multimodal projector GGUF with the tower of a GGUF-loaded model)."""
    from zoo.api import load as _load
    return _load(name_or_path, quant=quant, mesh=mesh, cache=cache, dtype=dtype, weights=weights, mtp=mtp,
                 vision=vision, mmproj=mmproj)


def plan(name, *, quant, devices=8, layout="tp"):
    """Memory plan of a registry model under a quantization recipe on ``devices`` chips in a mesh
    layout ("tp" or "ep"; see ``zoo.tools.plan.plan``)."""
    from zoo.tools.plan import plan as _plan
    return _plan(name, quant=quant, devices=devices, layout=layout)


def list_models() -> list[str]:
    from zoo.registry import list_models as _list
    return _list()


def __getattr__(name):
    if name == "Model":
        from zoo.api import Model
        return Model
    if name == "eval":                       # zoo.eval: the output-quality evaluation (a subpackage)
        import importlib
        return importlib.import_module("zoo.eval")
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
