"""Ahead-of-time compilation of the engine's programs for a target chip, on any machine.

    compile_report(name_or_path, quant=..., target="v5e-8", ...) -> dict       (``zoo compile``)

The target's chips come from the real compiler's topology (``libtpu``'s ahead-of-time path:
``jax.experimental.topologies``; no TPU needed). The model is the abstract load
(``zoo.loader.abstract``: every parameter of its stored kind and sharding, no file read) on a mesh
of those chips; the generator's own programs (``Generator.program``: the decode step, plain or with
MTP drafts, and the prefill chunk) are lowered on that mesh with the kernels the *target* uses (the
dispatch policy names the target's backend, not this machine's) and compiled. Per program and per
chip, from the compiler (``memory_analysis``): the argument, output, aliased (donated) and temporary
bytes and the generated code; from the abstract state: the weight bytes resident (every weight,
also those the program does not read) and the batch-state bytes (cache, carry, sampling parameters).

    total   = the compiler's peak HBM per chip for the program (``memory_analysis().peak_memory_in_bytes``)
    sum     = weights resident + batch state + temporaries + (outputs - aliased outputs) + code
              (everything as if live at once: an upper bound, reported beside it)
    margin  = usable HBM - total          (usable HBM: what the compiler itself says it has,
                                           read from its out-of-memory message for an oversized probe)

Also the compile time, the number of Pallas calls in the program (``tpu_custom_call`` in the
compiled HLO) and the XLA cost model's flops and bytes accessed. A program the compiler rejects for
lack of HBM is reported with what it needed (``error``, ``required``, ``fits`` False), not raised.
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zoo.kernels.dispatch import Policy, use_policy
from zoo.loader.abstract import abstract_load, shard_bytes, shard_bytes_of
from zoo.serving.generator import Generator
from zoo.sharding.mesh import get_layout

GiB = 2 ** 30
# the compiler's out-of-memory messages (two forms): what the program needs
_OOM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM|Used ([\d.]+)G of [\d.]+G hbm")


def required_bytes(message: str) -> int | None:
    """What a program needs per chip, from the compiler's out-of-memory message (None: not one)."""
    found = _OOM.search(message)
    return None if found is None else int(float(found.group(1) or found.group(2)) * GiB)


@dataclass(frozen=True)
class Target:
    """A compile target: its topology for ``jax.experimental.topologies`` and the accelerator type
    libtpu expects in the environment."""

    name: str
    platform: str
    topology: str
    accelerator_type: str
    backend: str            # the kernel dispatch backend its programs use (``zoo.kernels.dispatch``)


TARGETS = {t.name: t for t in [
    Target("v5e-1", "tpu", "v5e:1x1", "v5litepod-1", "tpu"),
    Target("v5e-4", "tpu", "v5e:2x2", "v5litepod-4", "tpu"),
    Target("v5e-8", "tpu", "v5e:2x4", "v5litepod-8", "tpu"),
    Target("v6e-8", "tpu", "v6e:2x4", "v6e-8", "tpu"),
    Target("v5p-8", "tpu", "v5p:2x2x1", "v5p-8", "tpu"),
]}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}") from None


def target_devices(target: Target) -> list:
    """The target's abstract devices (libtpu's ahead-of-time topology)."""
    from jax.experimental import topologies

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ["TPU_ACCELERATOR_TYPE"] = target.accelerator_type
    try:
        return list(topologies.get_topology_desc(platform=target.platform, topology_name=target.topology).devices)
    except Exception as e:         # no libtpu, a jax build without the ahead-of-time path, or a busy libtpu
        raise RuntimeError(f"cannot open the {target.name} topology for ahead-of-time compilation ({e}); it needs "
                           f"libtpu (the dev or tpu extra), held by one process at a time") from None


def target_mesh(target: Target, layout: str = "tp") -> Mesh:
    devices = target_devices(target)
    lay = get_layout(layout)
    return Mesh(np.asarray(devices).reshape(lay.mesh_shape(len(devices))), lay.axis_names)


@functools.lru_cache(maxsize=None)
def _usable_hbm(devices: tuple) -> int:
    mesh = Mesh(np.asarray(devices), ("x",))
    probe = jax.ShapeDtypeStruct((len(devices), 2 ** 34), jnp.float32,       # 64 GiB per chip
                                 sharding=NamedSharding(mesh, PartitionSpec("x", None)))
    try:
        jax.jit(lambda a: (a + 1, a * 2)).lower(probe).compile()
    except Exception as e:
        found = re.search(r"available HBM \(([\d.]+)G\)", str(e))
        if found:
            return int(float(found.group(1)) * GiB)
        raise RuntimeError(f"the compiler's out-of-memory message names no available HBM: {str(e)[:300]}") from None
    raise RuntimeError("a 64 GiB-per-chip probe compiled: cannot read the usable HBM")


def usable_hbm(mesh: Mesh) -> int:
    """Bytes of HBM per chip the compiler lets a program use (from its own out-of-memory message)."""
    return _usable_hbm(tuple(mesh.devices.flat))


@dataclass(frozen=True)
class ProgramReport:
    name: str
    arguments: int          # compiler: argument bytes per chip (what the program keeps)
    outputs: int
    aliased: int            # donated arguments reused as outputs
    temporaries: int
    code: int
    peak: int               # compiler: peak HBM of the program per chip (0 where it reports none)
    weights_resident: int   # every weight's shard, read or not
    batch_state: int        # the program's non-weight arguments (cache, carry, sampling parameters)
    usable: int
    compile_s: float
    pallas_calls: int
    flops: float
    bytes_accessed: float

    @property
    def sum(self) -> int:
        """Everything as if live at once: weights + batch state + temporaries + unaliased outputs + code."""
        return self.weights_resident + self.batch_state + self.temporaries + self.outputs - self.aliased + self.code

    @property
    def total(self) -> int:
        """The compiler's peak HBM per chip (it knows what is live at once); ``sum`` where it gives none."""
        return self.peak or self.sum

    @property
    def margin(self) -> int:
        return self.usable - self.total

    def to_dict(self) -> dict:
        return {**self.__dict__, "sum": self.sum, "total": self.total, "margin": self.margin, "fits": self.margin >= 0}


def _compile(fn, args: tuple, mesh: Mesh, backend: str) -> tuple:
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), use_policy(Policy(backend=backend)):
        compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    pallas = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    flops, accessed = float(cost.get("flops", -1)), float(cost.get("bytes accessed", -1))
    return compiled.memory_analysis(), seconds, pallas, flops, accessed


def compile_report(name_or_path, *, quant: str | None = None, target: str = "v5e-8", layout: str = "tp",
                   batch: int = 1, context: int = 4096, spec_tokens: int = 0, prefill_chunk: int = 512,
                   dtype: str = "bfloat16", programs: tuple[str, ...] = ("decode", "prefill")) -> dict:
    """Compile the engine's programs for ``target`` (see the module docstring); a JSON-ready report."""
    tgt = get_target(target)
    mesh = target_mesh(tgt, layout)
    t0 = time.perf_counter()
    module, cfg = abstract_load(name_or_path, quant, jnp.dtype(dtype), mesh)
    model = _AbstractModel(module, cfg, mesh)
    gen = Generator(model, spec_tokens=spec_tokens, max_batch=batch, memory_budget=1 << 62)
    weights = shard_bytes(module)
    usable = usable_hbm(mesh)
    reports = []
    for program in programs:
        if program == "decode":
            state = gen.abstract_batch(batch, context)
            rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
            active = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=rows.sharding)
            args = (gen.weights, state, active, rows, rows)
            label = f"decode B={batch} L={context}" + (f" MTP k={spec_tokens}" if spec_tokens else "")
        elif program == "prefill":
            state = gen.abstract_batch(1, context)["cache"]
            ids = jax.ShapeDtypeStruct((1, prefill_chunk), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
            mask = jax.ShapeDtypeStruct((1, prefill_chunk), jnp.bool_, sharding=ids.sharding)
            args = (gen.weights, ids, mask, ids, mask, state)
            label = f"prefill chunk={prefill_chunk} L={context}" + (" + MTP rows" if spec_tokens else "")
        else:
            raise ValueError(f"unknown program {program!r}; known: decode, prefill")
        try:
            memory, seconds, pallas, flops, accessed = _compile(gen.program(program, keep_unused=True), args, mesh,
                                                                tgt.backend)
        except Exception as e:
            required = required_bytes(str(e))
            if required is None:
                raise
            reports.append({"name": label, "error": str(e).splitlines()[0][:500], "required": required,
                            "usable": usable, "margin": usable - required, "fits": False})
            continue
        reports.append(ProgramReport(
            name=label, arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
            aliased=memory.alias_size_in_bytes, temporaries=memory.temp_size_in_bytes,
            code=memory.generated_code_size_in_bytes, peak=int(getattr(memory, "peak_memory_in_bytes", 0) or 0),
            weights_resident=weights, batch_state=shard_bytes_of(state),
            usable=usable, compile_s=seconds, pallas_calls=pallas, flops=flops, bytes_accessed=accessed).to_dict())
    return {"model": str(name_or_path), "quant": quant, "target": tgt.name, "layout": layout,
            "chips": int(mesh.devices.size), "dtype": dtype, "usable_hbm": usable, "weights_per_chip": weights,
            "seconds": time.perf_counter() - t0, "programs": reports}


@dataclass(frozen=True)
class _AbstractModel:
    """What ``Generator`` reads of a ``zoo.Model``, for an abstract module."""

    module: object
    config: object
    mesh: Mesh
    tokenizer: None = None


def table(report: dict) -> str:
    """The report as a text table (GiB per chip)."""
    g = lambda n: f"{n / GiB:7.2f}"                                       # noqa: E731
    rows = [f"{report['model']} / {report['quant']} on {report['target']} ({report['chips']} chips, layout "
            f"{report['layout']}): usable HBM {report['usable_hbm'] / GiB:.2f} GiB per chip",
            f"{'program':34s} {'weights':>7s} {'batch':>7s} {'temps':>7s} {'out-alias':>9s} {'sum':>7s} {'peak':>7s} "
            f"{'margin':>7s} {'pallas':>6s} {'compile':>8s}"]
    for p in report["programs"]:
        if "error" in p:
            rows.append(f"{p['name']:34s} DOES NOT FIT: the compiler needs {p['required'] / GiB:.2f} GiB "
                        f"(margin {p['margin'] / GiB:.2f})")
            continue
        rows.append(f"{p['name']:34s} {g(p['weights_resident'])} {g(p['batch_state'])} {g(p['temporaries'])} "
                    f"{g(p['outputs'] - p['aliased']):>9s} {g(p['sum'])} {g(p['total'])} {g(p['margin'])} "
                    f"{p['pallas_calls']:6d} "
                    f"{p['compile_s']:7.1f}s" + ("" if p["fits"] else "  DOES NOT FIT"))
    return "\n".join(rows)
