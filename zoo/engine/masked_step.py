"""The decode step split around the host's token bitmasks, for batches where some row is constrained.

A plain step is one program (``step_programs.decode_step``). When a row has a ``Constraint``, its mask
for this step depends on every token it emitted, and the host computes it with llguidance; so the
step is cut where the logits exist, the host fills the masks while the device runs the first part
(JAX dispatches asynchronously), and the second part masks and samples::

    plain:  logits(state, batch, active)                  -> batch (cache advanced), logits [B, 1, V]
            host: masks [B, 1, W] from the constraints    (overlaps the forward)
            pick(batch, logits, active, force, masks)     -> batch, tokens [B, 1], n [B]
    MTP:    draft(state, batch, active, plan)             -> batch, drafts [B, k], x_m [B]
            host: reads the drafts (small)
            verify(state, batch, x_m, drafts, active, plan) -> batch, p_logits [B, k+1, V], h, before
            host: masks [B, k+1, W], drafts consumed tentatively (overlaps the verify forward)
            settle(state, batch, before, p_logits, h, drafts, active, force, cap, masks, want, plan)
                                                          -> batch, tokens [B, k+1], n [B]

The parts compute exactly what the fused step computes (same keys, same order); with all-ones
masks the tokens are the fused step's. ``plan``: the speculation policy's per-row draft lengths and
host drafts (``zoo.engine.speculative``). As there, a row whose logits are not finite comes back
with n = -1 (``sampling.flag_nonfinite``). Each program that produces tokens also returns their
``maybe_token_logprobs`` (``zoo.engine.logprobs``, from the unmasked target logits; computed where
the traced flag ``want_lp`` holds). Rows without a constraint get all-ones masks; a batch without
any constrained row never comes here. ``Generator.warmup`` compiles these parts once with the rest.

With narrow rows (``Generator(narrow_rows=N)``) a batch whose decoding rows all lie below N runs the
same parts on its first N rows: ``split`` takes them apart (their slot buffers whole, as the narrow
decode step does: ``rows.split_rows``), the parts run at N rows (their second shapes), and ``join``
writes them back (``rows.join_rows``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.engine import speculative
from zoo.engine.flat_state import as_state
from zoo.engine.logprobs import maybe_token_logprobs
from zoo.engine.rows import join_rows, split_rows
from zoo.engine.sampling import flag_nonfinite, position_keys, row_keys, sample
from zoo.engine.token_mask import apply_token_mask
from zoo.sharding.cache_axes import shard_cache
from zoo.sharding.mesh import on_mesh


def pick_next(tok: jax.Array, params: dict, logits: jax.Array, active: jax.Array, force: jax.Array,
              masks: jax.Array | None = None):
    """A plain decode step's sampling: the next token [B] from ``logits`` [B, V] (masked by ``masks``
    [B, W] if given), ``force`` >= 0 overriding it; inactive rows keep ``tok`` as their carry.
    Returns (carry ``{"tok": [B]}``, new [B])."""
    if masks is not None:
        logits = apply_token_mask(logits, masks)
    new = sample(logits, row_keys(params), params["temperature"], params["top_k"], params["top_p"])
    new = jnp.where(force >= 0, force, new)
    return {"tok": jnp.where(active, new, tok)}, new


class MaskedPrograms:
    """The jitted parts (see the module doc) for a model split into ``graphdef`` + state, with
    ``k`` MTP drafts per step (0: plain). The batch is donated to each part, and to ``split(batch,
    width) -> (rows, others)`` and ``join(rows, others) -> batch`` (the narrow rows, width static)."""

    def __init__(self, graphdef, k: int, mesh=None):
        self._graphdef, self.k = graphdef, k
        for name in ("logits", "draft", "verify", "pick", "settle"):
            setattr(self, name, on_mesh(self.jitted(name), mesh))
        self.split = on_mesh(jax.jit(split_rows, static_argnums=(1,), donate_argnums=(0,)), mesh)
        self.join = on_mesh(jax.jit(join_rows, donate_argnums=(0, 1)), mesh)

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts a masked step runs, in order: ("logits", "pick"), or with drafts ("draft",
        "verify", "settle")."""
        return ("draft", "verify", "settle") if self.k else ("logits", "pick")

    def jitted(self, name: str, keep_unused: bool = False):
        """Part ``name`` jitted, the batch donated, not wrapped in a mesh (``zoo compile`` lowers it
        under ``jax.set_mesh``)."""
        return jax.jit(getattr(self, "_" + name), donate_argnums=(0,) if name == "pick" else (1,),
                       keep_unused=keep_unused)

    def _model(self, state):
        return nnx.merge(self._graphdef, as_state(state))

    def _logits(self, state, batch, active):
        logits, _, cache = self._model(state)(batch["carry"]["tok"][:, None], active[:, None], batch["cache"])
        return {**batch, "cache": shard_cache(cache)}, logits

    @staticmethod
    def _pick(batch, logits, active, force, masks, want_lp):
        params = batch["params"]
        carry, new = pick_next(batch["carry"]["tok"], params, logits[:, 0], active, force, masks[:, 0])
        batch = {**batch, "carry": carry, "params": {**params, "step": params["step"] + active.astype(jnp.int32)}}
        return (batch, new[:, None], flag_nonfinite(active.astype(jnp.int32), logits),
                maybe_token_logprobs(want_lp, logits, new[:, None]))

    def _draft(self, state, batch, active, plan=None):
        params = batch["params"]
        cache, drafts, x_m = speculative.draft(self._model(state), batch["cache"], batch["carry"], active,
                                               position_keys(params, self.k + 1), params, self.k, plan)
        return {**batch, "cache": shard_cache(cache)}, drafts, x_m

    def _verify(self, state, batch, x_m, drafts, active, plan=None):
        lengths = None if plan is None else plan["len"]
        p_logits, h, cache, before = speculative.verify(self._model(state), batch["cache"], x_m, drafts, active,
                                                        lengths)
        # not pinned: the recurrent layers keep one state per verify position here ([B, k+1, ...], not
        # the cache's declared axes) until ``settle`` rolls back to one
        return {**batch, "cache": cache}, p_logits, h, before

    def _settle(self, state, batch, before, p_logits, h, drafts, active, force, cap, masks, want_lp, plan=None):
        params, carry = batch["params"], batch["carry"]
        cache, pending, tokens, n = speculative.settle(self._model(state), batch["cache"], before, p_logits, h,
                                                       drafts, active, position_keys(params, self.k + 1), params,
                                                       force, cap, masks, None if plan is None else plan["len"])
        pending = speculative.keep_inactive(carry, {**pending, "h": pending["h"].astype(carry["h"].dtype)}, active)
        batch = {"cache": shard_cache(cache), "carry": pending,
                 "params": {**params, "step": params["step"] + n}}          # the output position of the next token
        return batch, tokens, flag_nonfinite(n, p_logits), maybe_token_logprobs(want_lp, p_logits, tokens)
