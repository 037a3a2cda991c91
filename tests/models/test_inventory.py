"""Each architecture's tensor inventory (the planner's, in GGUF names) agrees with its abstract model
through its own GGUF name map: every inventory tensor lands on a parameter (joined parts through
their join), every parameter is covered, and the element counts are equal. So the inventory is
not a third hand-kept copy of facts the model and the map already state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flax import nnx

from zoo.loader.abstract import inventory_targets
from zoo.models.architectures import ARCHITECTURES
from zoo.models.config import config_from_hf
from zoo.registry import REGISTRY, preset_path

PRESETS = sorted(name for name, spec in REGISTRY.items() if spec.preset)


def abstract_params(cfg) -> dict[str, tuple[int, ...]]:
    model_class = ARCHITECTURES[cfg.arch].model_class()
    state = nnx.state(nnx.eval_shape(lambda: model_class(cfg, dtype=np.float32)))
    return {".".join(map(str, p)): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("name", PRESETS)
def test_inventory_covers_the_abstract_model(name):
    path = preset_path(REGISTRY[name].preset)
    cfg = config_from_hf(json.loads(path.read_text()), source=str(path))
    params = abstract_params(cfg)
    counted: dict[str, int] = {}
    for t, target in inventory_targets(cfg):       # through the GGUF map; a join part through its join
        assert target.path in params, f"{name}: {t.name} -> {target} is not a parameter"
        counted[target.path] = counted.get(target.path, 0) + math.prod(t.shape)
    missing = sorted(set(params) - set(counted))
    assert not missing, f"{name}: parameters no inventory tensor covers: {missing[:8]}"
    wrong = {p: (n, math.prod(params[p])) for p, n in counted.items() if n != math.prod(params[p])}
    assert not wrong, f"{name}: element counts differ (inventory, parameter): {dict(list(wrong.items())[:8])}"


def test_the_check_catches_a_wrong_inventory():
    """A tensor dropped from the inventory is found (the check above can fail)."""
    path = preset_path(REGISTRY["qwen38-tiny"].preset)
    cfg = config_from_hf(json.loads(path.read_text()), source=str(path))
    arch = ARCHITECTURES[cfg.arch]
    inventory = arch.part("inventory")(cfg)
    params = abstract_params(cfg)
    names = arch.gguf_name_map(cfg)
    covered = {names.resolve(t.name).path for t in inventory[:-1]}
    assert set(params) - covered, "dropping the last inventory tensor must leave a parameter uncovered"
