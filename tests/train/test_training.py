"""Training both embedded tiny models with ``zoo.train`` (float32, CPU).

- A few Adam steps on a fixed batch (a repeated 7-token pattern) lower the LM loss and the MTP loss.
- Training only ``mtp.*`` leaves every other parameter bit-identical and lowers the MTP loss.
- The MTP loss trains what the speculative decoder uses: after training, the real decoder
  (``Generator(model, spec_tokens=2)``) accepts more of the MTP head's drafts than before.
- Orbax save / restore of the train state is exact (a resumed step equals the uninterrupted one),
  and the safetensors export reloads with ``zoo.load`` to the trained model's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from tests.support.random_checkpoints import random_tiny_checkpoint
from zoo.engine.generator import Generator
from zoo.sources.safetensors import SafetensorsSource
from zoo.train import checkpoint
from zoo.train.export import export_hf
from zoo.train.step import Batch, Trainer

MODELS = ("qwen38-tiny", "glm53-tiny")
PATTERN = np.array([57, 311, 140, 402, 23, 268, 99])        # no special tokens (all ids < 20)
ROWS, LENGTH, PROMPT = 4, 32, 4
STEPS = 10


def pattern_batch() -> Batch:
    """Each row the pattern from another phase; the first PROMPT tokens are not targets."""
    ids = np.stack([np.tile(PATTERN, LENGTH)[i:i + LENGTH] for i in range(ROWS)])
    loss_mask = np.ones(ids.shape, bool)
    loss_mask[:, :PROMPT] = False
    return Batch(ids, loss_mask)


def flat(module) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def run(trainer: Trainer, steps: int):
    """``steps`` updates on the pattern batch -> (state, metrics of each step: before its update)."""
    state, history = trainer.init(), []
    for _ in range(steps):
        state, metrics = trainer.step(state, pattern_batch())
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each demo model's config (one layer of each kind) and tokenizer with random weights (the shipped
    ones are trained: their MTP heads already agree, and their loss on these batches is not a fresh
    model's)."""
    return {name: random_tiny_checkpoint(tmp_path_factory.mktemp(name), name, template=None) for name in MODELS}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: zoo.load(path, dtype="float32") for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def trained(models):
    """Every parameter trained on LM + MTP loss: {name: (trainer, state, history)}."""
    out = {}
    for name, model in models.items():
        trainer = Trainer(model, optax.adam(3e-3), mtp_weight=1.0)
        state, history = run(trainer, STEPS)
        out[name] = (trainer, state, history)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_steps_lower_lm_and_mtp_loss(trained, name):
    _, state, history = trained[name]
    first, last = history[0], history[-1]
    print(f"[{name}] lm {first['lm_loss']:.3f} -> {last['lm_loss']:.4f}, "
          f"mtp {first['mtp_loss']:.3f} -> {last['mtp_loss']:.4f} in {STEPS} steps")
    assert int(state.step) == STEPS
    assert first["lm_targets"] == ROWS * (LENGTH - PROMPT) and first["mtp_targets"] == ROWS * (LENGTH - PROMPT)
    assert last["lm_loss"] < 0.25 * first["lm_loss"] and last["mtp_loss"] < 0.25 * first["mtp_loss"]
    assert last["lm_accuracy"] > 0.9 and np.isfinite(last["grad_norm"])


@pytest.mark.parametrize("name", MODELS)
def test_training_only_mtp_freezes_the_rest(models, name):
    model = models[name]
    before = flat(model.module)
    trainer = Trainer(model, optax.adam(1e-2), trainable="mtp.*", lm_weight=0.0, mtp_weight=1.0,
                      detach_hidden=True)
    state, history = run(trainer, 8)
    print(f"[{name}] mtp only: mtp {history[0]['mtp_loss']:.3f} -> {history[-1]['mtp_loss']:.4f}")
    assert history[-1]["mtp_loss"] < 0.5 * history[0]["mtp_loss"]
    after = flat(trainer.merged(state))
    assert set(after) == set(before)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.startswith("mtp.") for k in changed), sorted(changed)[:5]
    assert all(np.array_equal(before[k], v) for k, v in flat(model.module).items())   # the model's own arrays


def acceptance(model, prompt) -> tuple[float, list[int]]:
    out = Generator(model, spec_tokens=2, spec_policy="fixed").generate([prompt], max_new_tokens=16)[0]
    return out.stats["accepted"] / out.stats["drafted"], out.stats["accepted_by_position"]


@pytest.mark.parametrize("name", MODELS)
def test_trained_mtp_drafts_are_accepted_by_the_speculative_decoder(models, trained, name):
    trainer, state, _ = trained[name]
    prompt = list(np.tile(PATTERN, 2)[3:15])
    before, by_pos_before = acceptance(models[name], prompt)
    after, by_pos_after = acceptance(trainer.model(state), prompt)
    print(f"[{name}] draft acceptance (k=2) {before:.2f} {by_pos_before} -> {after:.2f} {by_pos_after}")
    assert after > before and after >= 0.5 and by_pos_after[0] > by_pos_before[0]


@pytest.mark.parametrize("name", MODELS)
def test_orbax_round_trip_and_safetensors_export(trained, checkpoints, name, tmp_path):
    trainer, state, _ = trained[name]
    path = checkpoint.save_step(tmp_path / "steps", state)
    assert checkpoint.latest(tmp_path / "steps") == path and path.name == f"step_{STEPS}"
    restored = checkpoint.restore(path, trainer.abstract_state())
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)))

    report = export_hf(trainer.merged(state), checkpoints[name], tmp_path / "export")
    source, exported = SafetensorsSource(checkpoints[name]), SafetensorsSource(tmp_path / "export")
    assert sorted(exported.keys()) == sorted(source.keys()) and not report["copied"]
    assert all(exported.info(k).shape == source.info(k).shape for k in source.keys())
    reloaded = zoo.load(tmp_path / "export", dtype="float32")
    trained_params, reloaded_params = flat(trainer.merged(state)), flat(reloaded.module)
    assert trained_params.keys() == reloaded_params.keys()
    assert all(np.array_equal(v, reloaded_params[k]) for k, v in trained_params.items())     # MTP head included
    ids = pattern_batch().ids[:2]
    assert np.array_equal(reloaded.logits(ids), trainer.model(state).logits(ids))

    resumed, m1 = trainer.step(restored, pattern_batch())      # a resumed run continues exactly
    uninterrupted, m2 = trainer.step(jax.tree.map(jnp.copy, state), pattern_batch())   # the step donates
    assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)))


def test_trainer_refuses_what_it_cannot_train(models):
    model = models["qwen38-tiny"]
    with pytest.raises(ValueError, match="no parameter path matches"):
        Trainer(model, optax.adam(1e-3), trainable="decoder.*")
    with pytest.raises(ValueError, match="float32"):
        Trainer(zoo.load("qwen38-tiny"), optax.adam(1e-3))                 # bfloat16 as stored
    with pytest.raises(ValueError, match="micro-batches"):
        Trainer(model, optax.adam(1e-3), micro_batches=3).step(None, pattern_batch())
