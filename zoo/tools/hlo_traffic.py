"""Where XLA's "bytes accessed" of a compiled program comes from, from its HLO text.

    traffic(hlo_text) -> (groups: Counter[str, bytes], detail: Counter[(group, op), bytes])

XLA's cost analysis reports one total per program. This re-derives it the way ``HloCostAnalysis``
counts (every top-level instruction: operand bytes read + output bytes written; a fusion reads of a
parameter only the slices / gathers its body takes; an async copy or slice into another memory space
reads and writes the bytes it moves) and groups it by what moves the bytes:

    prefetch   ``slice-start`` / ``copy-start`` into VMEM (``S(1)``) and the ``ConcatBitcast`` joining
               the slices: memory-space assignment moving a weight on chip before its consumer. HBM is
               read once; the same bytes count again as VMEM writes, as the concat's read and write,
               and as the consumer's read, so a prefetched weight counts ~4x its size
    relayout   ``copy`` / copy fusions: a layout change of an operand (real extra traffic)
    compute    fusions and everything else
    pallas     Pallas calls (XLA cannot cost them; counted here by their whole operands)

``zoo compile`` reports the groups beside XLA's total (``roofline.xla.traffic``); ``bench/hlo_traffic.py``
prints the detail for HLO files written by ``zoo compile --hlo-dir``.
"""

from __future__ import annotations

import collections
import re

ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
        "s64": 8, "u64": 8, "f64": 8}
SHAPE = re.compile(r"\b(" + "|".join(ITEM) + r")\[([0-9,]*)\]")
HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
        "opt-barrier", "after-all", "partition-id", "replica-id", "copy-done", "slice-done", "all-gather-done",
        "all-reduce-done", "collective-permute-done"}


def nbytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * ITEM[dtype]
    return total


def top_level_items(text: str) -> list[str]:
    """``"a, (b, c), d"`` -> ``["a", " (b, c)", " d"]``."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur.strip() else [])


def parse(text: str) -> dict[str, list[dict]]:
    """``{computation: [instruction]}``; an instruction: name, result shape, opcode, operand names, attributes."""
    comps, cur = {}, None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            cur = header.group(2)
            comps[cur] = []
            continue
        if line.startswith("}"):
            cur = None
            continue
        found = INSTRUCTION.match(line) if cur else None
        if not found:
            continue
        name, result, op, tail = found.groups()
        depth, i = 1, 0
        while i < len(tail) and depth:
            depth += (tail[i] == "(") - (tail[i] == ")")
            i += 1
        comps[cur].append({"name": name, "result": result, "op": op, "attrs": tail[i:], "line": line,
                           "operands": re.findall(r"%([\w.\-]+)", tail[:i - 1])})
    return comps


def traffic(text: str) -> tuple[collections.Counter, collections.Counter]:
    """Bytes by group and by (group, op name of the instruction's metadata)."""
    comps = parse(text)
    size = {i["name"]: nbytes(i["result"]) for insts in comps.values() for i in insts}
    fused = {re.search(r"calls=%([\w.\-]+)", i["attrs"]).group(1)
             for insts in comps.values() for i in insts if i["op"] == "fusion"}

    def fusion_reads(inst: dict) -> int:
        body = comps.get(re.search(r"calls=%([\w.\-]+)", inst["attrs"]).group(1), [])
        users = collections.defaultdict(list)
        for b in body:
            for o in b["operands"]:
                users[o].append(b)
        params = {int(re.search(r"parameter\((\d+)\)", b["line"]).group(1)): b for b in body if b["op"] == "parameter"}
        total = 0
        for k, operand in enumerate(inst["operands"]):
            uses = users[params[k]["name"]] if k in params else []
            sliced = uses and all(u["op"] in ("dynamic-slice", "slice", "gather") for u in uses)
            total += sum(size[u["name"]] for u in uses) if sliced else size.get(operand, 0)
        return total

    groups, detail = collections.Counter(), collections.Counter()
    for comp, insts in comps.items():
        if comp in fused:
            continue
        for inst in insts:
            op, out = inst["op"], size[inst["name"]]
            if op in FREE:
                continue
            if op in ("copy-start", "slice-start"):
                moved = nbytes(top_level_items(inst["result"][1:-1])[0 if op == "copy-start" else 1])
                group, b = ("prefetch" if "S(1)" in inst["result"] else "copy to HBM"), 2 * moved
            elif op == "custom-call" and "ConcatBitcast" in inst["attrs"]:
                group, b = "prefetch", 2 * out
            elif op == "custom-call" and "tpu_custom_call" in inst["attrs"]:
                group, b = "pallas", out + sum(size.get(o, 0) for o in inst["operands"])
            elif op == "copy" or (op == "fusion" and "copy_fusion" in inst["attrs"]):
                group, b = "relayout", 2 * out
            elif op == "fusion":
                group, b = "compute", fusion_reads(inst) + out
            elif op in ("dynamic-slice", "slice", "gather"):
                group, b = "compute", 2 * out
            elif op == "dynamic-update-slice":
                group, b = "compute", 2 * size.get(inst["operands"][1], 0)
            else:
                group, b = "compute", out + sum(size.get(o, 0) for o in inst["operands"])
            meta = re.search(r'op_name="([^"]+)"', inst["attrs"])
            groups[group] += b
            detail[group, f"{op} {meta.group(1).split('/')[-1] if meta else ''}".strip()] += b
    return groups, detail
