"""What a decode step costs the host before the device starts: the weights passed as an ``nnx.State``
(flattened in Python at every call, one callback per parameter) against a ``FlatState`` (flattened
once; ``zoo.engine.flat_state``), measured in the same run.

    PYTHONPATH=. .venv/bin/python bench/dispatch.py [--steps 300] [--models qwen38-tiny glm53-tiny]
                                                    [--full glm53-flash:UD-IQ3_XXS qwen38-27b]

For each embedded model: a warmed ``Generator`` (4 rows, one stream decoding), its decode program
called alternately with both forms of the same weights; printed, the medians of the call's return
time (dispatch: the arguments flattened and checked, the program enqueued) and of the whole step (to
the tokens on the host), and the ratios. For each full-size model (``--full NAME[:QUANT]``; no
weights read, nothing compiled): its parameter count and the time to flatten its abstract state,
which every step of the old form paid on the host.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo
from zoo.engine.generator import Generator
from zoo.sharding.mesh import host_value


def engine_steps(name: str, steps: int) -> None:
    gen = Generator(zoo.load(name), max_batch=4, context=steps + 64, prefix_cache=0)
    gen.eos_token_ids = frozenset()
    gen.warmup()
    gen.submit(gen.make_request([11, 22, 33, 44], max_new_tokens=steps))
    gen.step()                                         # prefilled, decoding
    active = gen._decoding()
    force, cap = np.full(gen._B, -1, np.int32), np.ones(gen._B, np.int32)
    forms = {"nnx.State": gen._state.state(), "FlatState": gen._state}
    got = {form: ([], []) for form in forms}
    for i in range(steps - 8):
        form = list(forms)[i % 2]
        t0 = time.perf_counter()
        out = gen._step_fn(forms[form], gen._batch, active, force, cap, np.bool_(False))
        t1 = time.perf_counter()
        gen._batch = out[0]
        host_value(out[1])
        got[form][0].append(t1 - t0)
        got[form][1].append(time.perf_counter() - t0)
    med = {form: [statistics.median(x) * 1e3 for x in v] for form, v in got.items()}
    (d0, s0), (d1, s1) = med["nnx.State"], med["FlatState"]
    print(f"{name}: {len(gen._state.leaves)} parameters, {steps - 8} steps alternating")
    print(f"  nnx.State   dispatch {d0:6.3f} ms   step {s0:6.3f} ms")
    print(f"  FlatState   dispatch {d1:6.3f} ms   step {s1:6.3f} ms")
    print(f"  ratio old / new: dispatch {d0 / d1:5.2f}x, step {s0 / s1:5.2f}x")


def full_size(spec: str) -> None:
    from zoo.loader.abstract import abstract_load
    name, _, quant = spec.partition(":")
    module, _ = abstract_load(name, quant or None, jnp.bfloat16, None)
    state = nnx.split(module)[1]
    t0 = time.perf_counter()
    for _ in range(20):
        jax.tree.flatten(state)
    per = (time.perf_counter() - t0) / 20 * 1e3
    print(f"{spec}: {len(jax.tree.leaves(state))} parameters; flattening the nnx.State {per:.2f} ms per call "
          f"(paid by every step of the old form; a FlatState: one node)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", nargs="*", default=["qwen38-tiny", "glm53-tiny"])
    ap.add_argument("--full", nargs="*", default=["glm53-flash:UD-IQ3_XXS", "qwen38-27b"])
    args = ap.parse_args()
    for name in args.models:
        engine_steps(name, args.steps)
    for spec in args.full:
        full_size(spec)


if __name__ == "__main__":
    main()
