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

The ``cpu`` target compiles for this machine's CPU devices (all of them, e.g. 8 with
``--xla_force_host_platform_device_count=8``) with the jnp kernels a CPU runs; its "usable HBM" is
this host's RAM shared by those devices, and it has no roofline. It answers whether a model's
programs fit a host: their temporaries (a quantized weight is decoded just before its matmul,
``zoo.ops.matmul.decode_after``) on top of the weights.

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

from zoo.engine.generator import Generator
from zoo.formats.host_arrays import host_memory
from zoo.kernels.census import kernel_census
from zoo.kernels.dispatch import Policy, use_policy
from zoo.loader.abstract import abstract_load, shard_bytes, shard_bytes_of
from zoo.sharding.mesh import get_layout
from zoo.tools.hlo_traffic import traffic
from zoo.tools.roofline import must_read, roofline, state_read
from zoo.tools.targets import TARGETS, Target, get_target  # noqa: F401  (re-exported)

GiB = 2 ** 30
# the compiler's out-of-memory messages (two forms): what the program needs
_OOM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM|Used ([\d.]+)G of [\d.]+G hbm")


def required_bytes(message: str) -> int | None:
    """What a program needs per chip, from the compiler's out-of-memory message (None: not one)."""
    found = _OOM.search(message)
    return None if found is None else int(float(found.group(1) or found.group(2)) * GiB)


def target_devices(target: Target) -> list:
    """The target's abstract devices (libtpu's ahead-of-time topology); for ``cpu``, this host's."""
    if target.platform == "cpu":
        return jax.devices("cpu")
    from jax.experimental import topologies

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ["TPU_ACCELERATOR_TYPE"] = target.accelerator_type
    if jax.default_backend() == "cpu":      # no TPU is driven here: other compiling processes may load libtpu too
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(platform=target.platform, topology_name=target.topology).devices)
    except Exception as e:         # no libtpu, a jax build without the ahead-of-time path, or a busy libtpu
        raise RuntimeError(f"cannot open the {target.name} topology for ahead-of-time compilation ({e}); it needs "
                           f"libtpu (the dev or tpu extra)") from None


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
    """Bytes of HBM per chip the compiler lets a program use (from its own out-of-memory message); on
    CPU devices, this host's RAM divided among them."""
    if mesh.devices.flat[0].platform == "cpu":
        return host_memory() // mesh.devices.size
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
    jax.clear_caches()          # a cached trace would skip the kernel census (zoo.kernels.census)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), use_policy(Policy(backend=backend)), kernel_census() as calls:
        compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    pallas = text.count('custom_call_target="tpu_custom_call"')
    return compiled.memory_analysis(), seconds, pallas, dict(cost), calls, text, compiled.out_info


PREFILL_CHUNKS = (1024, 512, 256, 128)     # tried in this order when the chunk is chosen from memory
DEFAULT_SPEC = 3                           # MTP drafts per step where the model has an MTP layer


@dataclass
class _Session:
    """One target, one abstract model: generators per MTP draft count, the programs compiled so far."""

    model: "_AbstractModel"
    target: Target
    usable: int
    weights: int
    hlo_dir: str | None = None
    fill: int | None = None

    def generator(self, spec_tokens: int, batch: int, context: int, chunk: int = 1024) -> Generator:
        return Generator(self.model, spec_tokens=spec_tokens, max_batch=batch, context=context, prefill_chunk=chunk,
                         memory_budget=1 << 62, prefix_cache=0, spec_policy="auto")

    def decode(self, batch: int, context: int, spec_tokens: int, drafts_off: bool = False) -> dict:
        """The server's decode step (``Generator.program_set``) at ``batch`` rows of ``context`` tokens;
        ``drafts_off``: a speculative generator's step with drafting off (the MTP catch-up, one token
        per row: what the auto speculation policy runs when drafts do not pay)."""
        gen = self.generator(spec_tokens, batch, context)
        label, fn, args = gen.program_set(keep_unused=True)[1 if drafts_off else 0]
        tokens = 1 if drafts_off else spec_tokens + 1
        read = must_read(self.model.module, self.model.config, rows=batch * tokens,
                         mtp_calls=1 if drafts_off else spec_tokens, mtp_rows=batch * (spec_tokens + 1))
        return self._report(label, fn, args, args[1], read)

    def prefill(self, chunk: int, context: int, spec_tokens: int, width: int | None = None) -> dict:
        """The server's prefill program of ``width`` tokens (None: the chunk) into a row of ``context``."""
        gen = self.generator(spec_tokens, 1, context, chunk)
        width = width or chunk
        label, fn, args = next(p for p in gen.program_set(keep_unused=True)[1:] if f"width={width} " in p[0])
        read = must_read(self.model.module, self.model.config, rows=width, mtp_calls=1 if spec_tokens else 0,
                         mtp_rows=width)
        return self._report(label, fn, args, args[6], read)

    def masked(self, batch: int, context: int, spec_tokens: int) -> list[dict]:
        """The decode step split around grammar token masks (``Generator.masked_chain``), compiled
        part by part, each from the abstract outputs of the parts before it; memory only (no
        roofline: the parts share one step's reads). A part that does not fit ends the chain."""
        gen = self.generator(spec_tokens, batch, context)
        outs, reports = {}, []
        for part, label, fn, args_from in gen.masked_chain(keep_unused=True):
            args = args_from(outs)
            batch_state = next(a for a in args if isinstance(a, dict) and "cache" in a)
            reports.append(self._report(label, fn, args, batch_state, None,
                                        on_outputs=lambda o, part=part: outs.__setitem__(part, o)))
            if "error" in reports[-1]:
                break
        return reports

    def _report(self, label: str, fn, args: tuple, state, read: dict | None, on_outputs=None) -> dict:
        """Compile ``fn`` on ``args``: its memory report (``state``: the batch state among them; ``read``:
        the roofline's must-read bytes, None: no roofline); ``on_outputs(abstract outputs)`` is called
        with the compiled program's outputs (their shardings, no layouts) when it compiled."""
        try:
            memory, seconds, pallas, cost, calls, text, out_info = _compile(fn, args, self.model.mesh,
                                                                            self.target.backend)
        except Exception as e:
            required = required_bytes(str(e))
            if required is None:
                raise
            return {"name": label, "error": str(e).splitlines()[0][:500], "required": required,
                    "usable": self.usable, "margin": self.usable - required, "fits": False}
        if on_outputs is not None:
            on_outputs(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), out_info))
        if self.hlo_dir:
            os.makedirs(self.hlo_dir, exist_ok=True)
            with open(os.path.join(self.hlo_dir, re.sub(r"[^\w.=-]+", "_", label) + ".hlo"), "w") as f:
                f.write(text)
        batch_state = shard_bytes_of(state)
        report = ProgramReport(
            name=label, arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
            aliased=memory.alias_size_in_bytes, temporaries=memory.temp_size_in_bytes,
            code=memory.generated_code_size_in_bytes, peak=int(getattr(memory, "peak_memory_in_bytes", 0) or 0),
            weights_resident=self.weights, batch_state=batch_state, usable=self.usable, compile_s=seconds,
            pallas_calls=pallas, flops=float(cost.get("flops", -1)),
            bytes_accessed=float(cost.get("bytes accessed", -1))).to_dict()
        if self.target.platform == "tpu" and read is not None:     # HBM bandwidths are known for TPU chips only
            report["roofline"] = roofline(read, state_read(state, self.fill), calls, cost,
                                          self.target.name.split("-")[0], self.fill)
            report["roofline"]["xla"]["traffic"] = dict(traffic(text)[0])
        return report


def _open(name_or_path, quant, target: str, layout: str, dtype: str, hlo_dir: str | None = None) -> _Session:
    tgt = get_target(target)
    mesh = target_mesh(tgt, layout)
    module, cfg = abstract_load(name_or_path, quant, jnp.dtype(dtype), mesh)
    return _Session(_AbstractModel(module, cfg, mesh), tgt, usable_hbm(mesh), shard_bytes(module), hlo_dir)


def compile_report(name_or_path, *, quant: str | None = None, target: str = "v5e-8", layout: str = "tp",
                   batch: int = 1, context: int = 4096, spec_tokens: int | None = 0,
                   prefill_chunk: int | None = 512, dtype: str = "bfloat16",
                   programs: tuple[str, ...] = ("decode", "prefill", "masked"), min_margin: int = 0,
                   hlo_dir: str | None = None, fill: int | None = None) -> dict:
    """Compile the engine's programs for ``target`` (see the module docstring); a JSON-ready report.

    ``programs``: "decode" compiles the decode step at ``batch`` x ``context`` without drafts and,
    when ``spec_tokens`` k > 0, with k MTP drafts and with drafting off (the auto speculation policy's
    two programs; None: ``DEFAULT_SPEC`` where the model has an MTP layer, else 0); "prefill" the
    prefill chunk (with the chunk's MTP rows when k > 0); "masked" the decode step split around
    grammar token masks (``Generator.masked_chain``: with k drafts when k > 0), the programs a batch
    with a constrained row runs.
    ``prefill_chunk`` None chooses the chunk from the memory left: the first of ``PREFILL_CHUNKS``
    (those up to ``context``) that compiles with ``min_margin`` bytes to spare (``prefill_chunk`` in the
    report; the larger ones tried are reported too, marked ``rejected``). ``ok``: every program not
    rejected fits with ``min_margin`` to spare (and a chunk was found). ``hlo_dir``: also write each
    compiled program's HLO text there (``bench/hlo_traffic.py`` reads it). ``fill``: the roofline's
    must-read counts the cache at this many tokens per row (``roofline.state_read``), not the whole
    window (the programs are the same: one program serves every fill level)."""
    for program in programs:
        if program not in ("decode", "prefill", "masked"):
            raise ValueError(f"unknown program {program!r}; known: decode, prefill, masked")
    if fill is not None and not 1 <= fill <= context:
        raise ValueError(f"fill must be 1..{context} (the context), got {fill}")
    t0 = time.perf_counter()
    session = _open(name_or_path, quant, target, layout, dtype, hlo_dir)
    session.fill = fill
    if spec_tokens is None:
        spec_tokens = DEFAULT_SPEC if getattr(session.model.module, "mtp", None) is not None else 0
    reports, chosen = [], prefill_chunk
    for program in programs:
        if program == "decode":
            reports += [session.decode(batch, context, k) for k in sorted({0, spec_tokens})]
            if spec_tokens:
                reports.append(session.decode(batch, context, spec_tokens, drafts_off=True))
            continue
        if program == "masked":
            reports += session.masked(batch, context, spec_tokens)
            continue
        if prefill_chunk is not None and prefill_chunk > context:
            raise ValueError(f"a prefill chunk of {prefill_chunk} tokens does not fit a cache of {context} slots")
        for chunk in [c for c in PREFILL_CHUNKS if c <= context] if prefill_chunk is None else (prefill_chunk,):
            reports.append(session.prefill(chunk, context, spec_tokens))
            if prefill_chunk is not None or reports[-1]["margin"] >= min_margin:
                chosen = chunk
                small = session.generator(spec_tokens, 1, context, chunk).prefill_small
                if small < chunk:                     # the server's other prefill width
                    reports.append(session.prefill(chunk, context, spec_tokens, small))
                break
            reports[-1]["rejected"] = True          # tried for the chunk size, left too little
        else:
            chosen = None
    return {"model": str(name_or_path), "quant": quant, "target": session.target.name, "layout": layout,
            "chips": int(session.model.mesh.devices.size), "dtype": dtype, "usable_hbm": session.usable,
            "weights_per_chip": session.weights, "spec_tokens": spec_tokens, "min_margin": min_margin,
            "prefill_chunk": chosen, "fill": fill, "seconds": time.perf_counter() - t0, "programs": reports,
            "ok": all(p["fits"] and p["margin"] >= min_margin for p in reports if not p.get("rejected"))
            and ("prefill" not in programs or chosen is not None)}


def largest_batch(name_or_path, *, quant: str | None = None, target: str = "v5e-8", layout: str = "tp",
                  context: int = 32768, spec_tokens: int = 0, min_margin: int = 0, dtype: str = "bfloat16",
                  limit: int = 256) -> dict:
    """The most decode rows at ``context`` slots whose step compiles with ``min_margin`` to spare.

    Two compiles (1 and 2 rows) give the peak's growth per row; the prediction is then compiled and
    moved down (or up) one row at a time until the largest fitting count is bracketed by a compile
    that fits and one that does not. Returns ``{"context", "batch", "margin", "compiles",
    "next_margin"}`` (batch 0: not even one row fits; ``next_margin``: one row more, None at ``limit``)."""
    session = _open(name_or_path, quant, target, layout, dtype)
    results: dict[int, dict] = {}

    def margin(rows: int) -> int:
        if rows not in results:
            results[rows] = session.decode(rows, context, spec_tokens)
        return results[rows]["margin"] - min_margin

    if margin(1) < 0:
        return {"context": context, "batch": 0, "margin": results[1]["margin"], "compiles": len(results)}
    per_row = max(1, results[1]["margin"] - results[2]["margin"]) if margin(2) >= 0 else None
    rows = 1 if per_row is None else min(limit, 1 + margin(1) // per_row)
    while margin(rows) < 0:
        rows -= 1
    while rows < limit and margin(rows + 1) >= 0:
        rows += 1
    above = results.get(rows + 1)
    return {"context": context, "batch": rows, "margin": results[rows]["margin"], "compiles": len(results),
            "program": results[rows]["name"], "next_margin": None if above is None else above["margin"]}


@dataclass(frozen=True)
class _AbstractModel:
    """What ``Generator`` reads of a ``zoo.Model``, for an abstract module."""

    module: object
    config: object
    mesh: Mesh
    tokenizer: None = None


def table(report: dict) -> str:
    """The report as text: memory per chip (GiB), then the roofline of each program."""
    g = lambda n: f"{n / GiB:7.2f}"                                       # noqa: E731
    floor = report.get("min_margin", 0)
    n = max([38] + [len(p["name"]) for p in report["programs"]])          # the program column's width
    rows = [f"{report['model']} / {report['quant']} on {report['target']} ({report['chips']} chips, layout "
            f"{report['layout']}): usable HBM {report['usable_hbm'] / GiB:.2f} GiB per chip"
            + (f", margin wanted {floor / GiB:.2f}" if floor else ""),
            f"{'program':{n}s} {'weights':>7s} {'batch':>7s} {'temps':>7s} {'out-alias':>9s} {'sum':>7s} {'peak':>7s} "
            f"{'margin':>7s} {'pallas':>6s} {'compile':>8s}"]
    for p in report["programs"]:
        if "error" in p:
            rows.append(f"{p['name']:{n}s} DOES NOT FIT: the compiler needs {p['required'] / GiB:.2f} GiB "
                        f"(margin {p['margin'] / GiB:.2f})" + ("  (chunk not chosen)" if p.get("rejected") else ""))
            continue
        verdict = "  DOES NOT FIT" if not p["fits"] else ("  margin too small" if p["margin"] < floor else "")
        verdict += "  (chunk not chosen)" if p.get("rejected") else ""
        rows.append(f"{p['name']:{n}s} {g(p['weights_resident'])} {g(p['batch_state'])} {g(p['temporaries'])} "
                    f"{g(p['outputs'] - p['aliased']):>9s} {g(p['sum'])} {g(p['total'])} {g(p['margin'])} "
                    f"{p['pallas_calls']:6d} {p['compile_s']:7.1f}s" + verdict)
    if report.get("prefill_chunk") is not None:
        rows.append(f"prefill chunk chosen: {report['prefill_chunk']} tokens")
    if not any("roofline" in p for p in report["programs"]):
        return "\n".join(rows)
    at = f"; the cache read at {report['fill']} tokens per row" if report.get("fill") else ""
    rows += ["", f"roofline per chip (ms; Pallas grid step overhead {1e6 * _overhead(report):.2f} us assumed{at}; "
             "xla acc = XLA's bytes accessed, of which prefetch into VMEM (counted ~4x) and relayout copies)",
             f"{'program':{n}s} {'must read':>9s} {'floor':>7s} {'steps':>7s} {'kernels':>8s} {'k/floor':>7s} "
             f"{'xla est':>7s} {'xla acc':>8s} {'prefetch':>8s} {'relayout':>8s}"]
    for p in report["programs"]:
        if "roofline" not in p:
            continue
        r, k = p["roofline"], p["roofline"]["pallas"]
        ratio = f"{k['ratio']:7.2f}" if k["ratio"] else f"{'-':>7s}"
        rows.append(f"{p['name']:{n}s} {r['must_read']['total'] / GiB:7.2f}Gi {1e3 * r['floor_s']:7.3f} "
                    f"{k['grid_steps']:7d} {1e3 * k['estimate_s']:8.3f} {ratio} {1e3 * r['xla']['estimate_s']:7.3f} "
                    f"{r['xla']['bytes_accessed'] / GiB:6.2f}Gi {r['xla']['traffic'].get('prefetch', 0) / GiB:6.2f}Gi "
                    f"{r['xla']['traffic'].get('relayout', 0) / GiB:6.2f}Gi")
    return "\n".join(rows)


def _overhead(report: dict) -> float:
    found = [p["roofline"]["pallas"]["step_overhead_s"] for p in report["programs"] if "roofline" in p]
    return found[0] if found else 0.0
