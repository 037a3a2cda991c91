"""The repacked-weight cache (Orbax) and its Kaggle datasets.

    zoo.weight_cache.build(name_or_path, *, quant=None, dtype="bfloat16", root, progress=True) -> Path
        write a model's cache entry one parameter group at a time (``zoo.weight_cache.build``)
    zoo.weight_cache.store        the entry layout, saving, finding and restoring
"""

from zoo.weight_cache.build import build

__all__ = ["build"]
