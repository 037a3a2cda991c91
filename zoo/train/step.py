"""A jitted optax training step for any zoo model, on one device or on the model's mesh.

    trainer = Trainer(model, optax.adam(1e-3), mtp_weight=0.3)      model: a ``zoo.Model`` (or a module)
    state = trainer.init()                                         TrainState(step, params, opt_state)
    state, metrics = trainer.step(state, Batch(ids, loss_mask))    one optimizer update
    trained = trainer.model(state)                                 a ``zoo.Model`` with the new weights

Objective (``zoo.train.loss`` for the terms and their masks)::

    loss = lm_weight * mean_lm_nll + mtp_weight * mean_mtp_nll      (means over the batch's targets)

``mtp_teacher`` (``zoo.train.loss``): None, the MTP term's targets are the batch's tokens; 0.0 or a
temperature, the main model's own predictions (self-distillation, ``zoo.train.fit_mtp``).

``trainable`` (``zoo.train.select``): globs over parameter paths; only those parameters get gradients
and optimizer state, the rest stay bit-identical (``"mtp.*"``: fit the MTP head to a frozen model,
with ``lm_weight=0, detach_hidden=True``).

Gradient accumulation: ``micro_batches=A`` splits each batch of B rows into A micro-batches of B/A
rows, run one after another in a ``lax.scan`` (one micro-batch's activations live at a time) whose
carry sums the gradients; the update is applied once. Each term is a sum over the micro-batch
divided by the whole batch's target count (known from the masks before any forward), so the summed
gradient is exactly the gradient of the whole batch's mean, however the targets fall between
micro-batches (``optax.MultiSteps`` averages per-call means and spreads one update over A calls).

Parameters are trained as stored: load in float32 (``zoo.load(..., dtype="float32")``); other
dtypes are refused. On a mesh (``Model.mesh``), the step is traced under it like the inference
programs (``zoo.sharding.mesh.on_mesh``): parameters, gradients and optimizer state keep the
parameters' shardings, the batch is replicated. The train state is donated to the step;
``init`` copies the trainable parameters, so the model's own arrays stay valid.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from zoo.sharding.mesh import on_mesh
from zoo.train.loss import TokenStats, batch_stats, default_mask, lm_weights, mtp_weights
from zoo.train.select import Trainable, dotted, split_trainable


class Batch(NamedTuple):
    """ids [B, T] int; loss_mask [B, T] (1: token t is a target); mask [B, T] (1: a token; None: all)."""

    ids: Any
    loss_mask: Any
    mask: Any = None


class TrainState(NamedTuple):
    """step: int32 scalar, updates applied; params: the trainable ``nnx.State``; opt_state: optax's."""

    step: jax.Array
    params: nnx.State
    opt_state: Any


class Trainer:
    """The training programs of one model and one optimizer (see the module docstring).

    model: a ``zoo.Model`` (its mesh is used) or an NNX module; optimizer: any optax transformation;
    trainable: globs over parameter paths (None: all); lm_weight, mtp_weight: the objective's terms;
    detach_hidden: the MTP term trains the MTP head's own parameters only (``zoo.train.loss``);
    micro_batches: rows of a batch per accumulation step = B / micro_batches; mtp_teacher: the MTP
    term's targets (see the module docstring).
    """

    def __init__(self, model, optimizer: optax.GradientTransformation, *, trainable: Trainable = None,
                 lm_weight: float = 1.0, mtp_weight: float = 0.0, detach_hidden: bool = False,
                 micro_batches: int = 1, mtp_teacher: float | None = None):
        self.zoo_model = model if hasattr(model, "module") else None
        self.module = getattr(model, "module", model)
        self.mesh = getattr(model, "mesh", None)
        if mtp_weight and getattr(self.module, "mtp", None) is None:
            raise ValueError("mtp_weight > 0 needs a model with an MTP layer")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.optimizer = optimizer
        self.lm_weight, self.mtp_weight = float(lm_weight), float(mtp_weight)
        self.detach_hidden = bool(detach_hidden)
        self.mtp_teacher = None if mtp_teacher is None else float(mtp_teacher)
        self.micro_batches = int(micro_batches)
        self.graphdef, self._params, self.frozen = split_trainable(self.module, trainable)
        bad = [dotted(p) for p, v in nnx.to_flat_state(self._params) if v.get_value().dtype != jnp.float32]
        if bad:
            raise ValueError(f"trainable parameters must be float32 (load with dtype='float32'): {bad[:3]}")
        self.has_mtp = getattr(self.module, "mtp", None) is not None
        shardings = self._state_shardings()
        out = None if self.mesh is None else (shardings, NamedSharding(self.mesh, PartitionSpec()))
        self._step = on_mesh(jax.jit(self._step_impl, donate_argnums=(0,), out_shardings=out), self.mesh)
        self._eval = on_mesh(jax.jit(self._eval_impl), self.mesh)
        self._init = on_mesh(jax.jit(self._init_impl, out_shardings=shardings), self.mesh)

    # -- public -----------------------------------------------------------------------------------
    def init(self) -> TrainState:
        """A fresh state: a copy of the model's trainable parameters and the optimizer's init."""
        return self._init(jax.tree.map(jnp.copy, self._params))

    def abstract_state(self) -> TrainState:
        """What ``init`` returns, as ShapeDtypeStructs with their shardings on the mesh (nothing is
        allocated): the target of ``zoo.train.checkpoint.restore``."""
        shapes = jax.eval_shape(self._init_impl, self._params)
        shardings = self._state_shardings()
        if self.mesh is None:
            shardings = jax.tree.map(lambda _: shardings, shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One optimizer update on ``batch`` (``state`` is donated) -> (new state, metrics of the
        parameters before the update): loss, grad_norm, lm_loss, lm_accuracy, lm_targets, and
        mtp_loss, mtp_accuracy, mtp_targets when ``mtp_weight`` > 0."""
        return self._step(state, self.frozen, self._device_batch(batch))

    def evaluate(self, state: TrainState, batch: Batch) -> dict:
        """Losses and accuracies of ``state``'s parameters on ``batch`` (mtp_* when the model has an
        MTP layer), no update."""
        return self._eval(state.params, self.frozen, self._device_batch(batch))

    def merged(self, state: TrainState) -> nnx.Module:
        """The NNX module with ``state``'s parameters (the frozen ones shared with the model)."""
        return nnx.merge(self.graphdef, state.params, self.frozen)

    def model(self, state: TrainState):
        """A ``zoo.Model`` (config, tokenizer, mesh of the trained one) with ``state``'s parameters."""
        from zoo.api import Model
        if self.zoo_model is None:
            raise ValueError("the trainer was built on a bare module; use merged()")
        m = self.zoo_model
        return Model(self.merged(state), m.config, m.tokenizer, dict(m.load_info), mesh=m.mesh)

    # -- programs ---------------------------------------------------------------------------------
    def _init_impl(self, params) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    def _state_shardings(self):
        """The state's shardings on the mesh: every subtree of the optimizer state shaped like the
        parameters (Adam's moments, ...) is split like them, anything else (counts) replicated
        (XLA would otherwise place the zeros ``optimizer.init`` makes on one device). Without a mesh,
        the parameters' device: the state is committed to it like a restored one, so a step after
        a restore runs the same compiled program."""
        if self.mesh is None:
            return jax.tree.leaves(self._params)[0].sharding
        shapes = jax.eval_shape(self._init_impl, self._params)
        param_def = jax.tree.structure(self._params)
        param_shardings = jax.tree.map(lambda x: x.sharding, self._params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        like_params = lambda x: jax.tree.structure(x) == param_def           # noqa: E731
        return jax.tree.map(lambda x: param_shardings if like_params(x) else jax.tree.map(lambda _: replicated, x),
                            shapes, is_leaf=like_params)

    def _device_batch(self, batch: Batch) -> Batch:
        ids = np.asarray(batch.ids, np.int32)
        mask = np.ones(ids.shape, bool) if batch.mask is None else np.asarray(batch.mask, bool)
        loss_mask = np.asarray(batch.loss_mask, bool)
        if ids.ndim != 2 or loss_mask.shape != ids.shape or mask.shape != ids.shape:
            raise ValueError(f"ids, loss_mask, mask must be [B, T] alike: {ids.shape}, {loss_mask.shape}, "
                             f"{mask.shape}")
        if ids.shape[0] % self.micro_batches:
            raise ValueError(f"{ids.shape[0]} rows do not split into {self.micro_batches} micro-batches")
        out = Batch(ids, loss_mask, mask)
        if self.mesh is not None:
            return jax.device_put(out, NamedSharding(self.mesh, PartitionSpec()))
        return jax.tree.map(jnp.asarray, out)

    def _stats(self, params, frozen, batch: Batch, mtp: bool) -> dict[str, TokenStats]:
        model = nnx.merge(self.graphdef, params, frozen)
        return batch_stats(model, batch.ids, batch.loss_mask, batch.mask, mtp=mtp, detach_hidden=self.detach_hidden,
                           teacher=self.mtp_teacher)

    def _objective(self, params, frozen, batch: Batch, counts: dict):
        stats = self._stats(params, frozen, batch, mtp=bool(self.mtp_weight))
        loss = self.lm_weight * stats["lm"].nll / jnp.maximum(counts["lm"], 1.0)
        if self.mtp_weight:
            loss = loss + self.mtp_weight * stats["mtp"].nll / jnp.maximum(counts["mtp"], 1.0)
        return loss, stats

    def _step_impl(self, state: TrainState, frozen, batch: Batch):
        mask = default_mask(batch.ids, batch.mask)
        counts = {"lm": jnp.sum(lm_weights(batch.loss_mask, mask), dtype=jnp.float32),
                  "mtp": jnp.sum(mtp_weights(batch.loss_mask, mask), dtype=jnp.float32)}
        grad_fn = jax.value_and_grad(self._objective, has_aux=True)
        if self.micro_batches == 1:
            (loss, stats), grads = grad_fn(state.params, frozen, batch, counts)
        else:
            micro = jax.tree.map(lambda x: x.reshape(self.micro_batches, -1, *x.shape[1:]), batch)

            def one(carry, mb):
                (loss, stats), g = grad_fn(state.params, frozen, Batch(*mb), counts)
                return jax.tree.map(jnp.add, carry, (loss, stats, g)), None
            zero = jnp.zeros((), jnp.float32)
            terms = ("lm", "mtp") if self.mtp_weight else ("lm",)
            init = (zero, {k: TokenStats(zero, zero, zero) for k in terms}, jax.tree.map(jnp.zeros_like, state.params))
            (loss, stats, grads), _ = jax.lax.scan(one, init, tuple(micro))
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **_summary(stats)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def _eval_impl(self, params, frozen, batch: Batch) -> dict:
        return _summary(self._stats(params, frozen, batch, mtp=self.has_mtp))


def _summary(stats: dict[str, TokenStats]) -> dict:
    out = {}
    for name, s in stats.items():
        out.update({f"{name}_loss": s.mean, f"{name}_accuracy": s.accuracy, f"{name}_targets": s.count})
    return out
