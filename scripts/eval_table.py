"""The README's quantization-quality table: ``zoo eval`` on the tiny q256 models, each ggml type the
fixtures hold against the float32 model, with llama.cpp's own figures beside zoo's.

For each family (``tests/data/{qwen38,glm53}-q256-udmix.gguf``):

1. the float32 reference: every tensor of the fixture dequantized by gguf and written as F32 (the
   fixtures' own float32 source is not shipped; these values are a model of the same shapes);
2. an importance matrix of that reference (``llama-imatrix``) on the evaluation text; where llama.cpp
   cannot run the model (0.3.36's ``glm5-next`` graph: ``llama-imatrix`` segfaults, and
   ``llama-perplexity`` ends without its figures), a uniform one (every input column weighted 1,
   i.e. plain least squares) written here, and no llama.cpp column;
3. one GGUF per ggml type the fixture holds, by llama.cpp's quantizer (``llama-quantize --pure
   --imatrix``: every matrix in that type), plus zoo's at-load recipes ``int8`` and ``Q8_0`` and the
   reference computed in bfloat16;
4. ``zoo eval base`` on the reference, ``zoo eval kld`` on each candidate; and llama.cpp's
   ``llama-perplexity --kl-divergence-base`` / ``--kl-divergence`` on the same GGUFs and text.

The text is seeded English words (the models are random: any text scores alike). Random weights
quantize worse than trained ones, so the figures rank the types rather than predict a real model's.

    .venv/bin/python scripts/eval_table.py [--llama-cpp DIR] [--out bench/results/eval-q256]

DIR is a llama.cpp tree built with ``llama-quantize``, ``llama-imatrix`` and ``llama-perplexity``
under ``build/bin`` (default: the tree vendored in the llama-cpp-python 0.3.36 sdist, unpacked at
/tmp/lcp; ``cmake -B build && cmake --build build --target llama-quantize llama-imatrix
llama-perplexity``). Writes ``table.md``, ``figures.json`` and the two plots to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.support.gguf_files import write_requantized  # noqa: E402
from zoo.formats.ggml import QType  # noqa: E402
from zoo.sources.gguf import GGUFSource  # noqa: E402

LLAMA_CPP = Path("/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
FAMILIES = {"qwen38": "qwen38-q256-udmix.gguf", "glm53": "glm53-q256-udmix.gguf"}
CTX, CHUNKS = 128, 16
WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not but which they "
         "his all model weights layer token quant block scale expert attention cache").split()


def evaluation_text() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(12 * CTX * CHUNKS))


def fixture_types(path: Path) -> list[str]:
    src = GGUFSource(path)
    return sorted({src.info(k).qtype.name for k in src.keys() if src.info(k).quantized})


def llama(bin_dir: Path, tool: str, *args) -> str:
    """Run a llama.cpp tool; its stdout and stderr. (Into a file: read through a pipe, llama.cpp's
    asynchronous logger was seen to lose its last lines at exit.)"""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out:
        done = subprocess.run([str(bin_dir / tool), *map(str, args)], stdout=out, stderr=subprocess.STDOUT)
        out.seek(0)
        log = out.read()
    if done.returncode:
        raise RuntimeError(f"{tool} failed:\n{log[-3000:]}")
    return log


def llama_figures(log: str) -> dict:
    """KLD mean ± stderr, top-1 ± stderr and PPL(base) from ``llama-perplexity --kl-divergence``'s log."""
    num = r"([-0-9.e+]+)"
    kld = re.search(rf"Mean\s+KLD:\s+{num}\s+±\s+{num}", log)
    top = re.search(rf"Same top p:\s+{num}\s+±\s+{num}", log)
    ppl = re.search(rf"Mean PPL\(base\)\s+:\s+{num}", log)
    if not (kld and top and ppl):
        raise RuntimeError(f"llama-perplexity printed no KL divergence figures:\n{log[-3000:]}")
    return {"kld": float(kld[1]), "kld_stderr": float(kld[2]), "top1": float(top[1]) / 100,
            "top1_stderr": float(top[2]) / 100, "ppl_base": float(ppl[1])}


def uniform_imatrix(model: Path, out: Path) -> None:
    """An importance matrix (llama.cpp's GGUF layout) weighting every input column of every matrix 1."""
    from gguf import GGUFReader, GGUFWriter

    writer = GGUFWriter(out, "imatrix")
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["uniform"])            # the metadata llama-quantize requires
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", 1)
    for t in GGUFReader(model).tensors:
        ne = [int(d) for d in t.shape]                       # ggml order: ne0 (input width) first
        if len(ne) < 2 or not t.name.endswith(".weight"):
            continue
        mats = ne[2] if len(ne) == 3 else 1
        writer.add_tensor(f"{t.name}.in_sum2", np.ones((mats, ne[0]), np.float32))
        writer.add_tensor(f"{t.name}.counts", np.ones(mats, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def family_rows(family: str, bin_dir: Path, work: Path, text_file: Path) -> tuple[list[dict], dict]:
    import zoo
    import zoo.eval

    fixture = ROOT / "tests" / "data" / FAMILIES[family]
    ref = write_requantized(fixture, work / f"{family}-f32.gguf", lambda name, info: QType.F32)
    imatrix = work / f"{family}-imatrix.gguf"
    try:
        llama(bin_dir, "llama-imatrix", "-m", ref, "-f", text_file, "-o", imatrix, "-c", CTX, "--chunks", CHUNKS,
              "-b", CTX)
        runs_in_llama = True
    except RuntimeError as e:
        print(f"{family}: llama.cpp cannot run this model ({str(e).splitlines()[0]}): a uniform importance "
              f"matrix, no llama.cpp figures", file=sys.stderr)
        uniform_imatrix(ref, imatrix)
        runs_in_llama = False
    text = text_file.read_text()
    base = zoo.eval.base(zoo.load(ref, dtype="float32"), work / f"{family}-base.npz", text=text, ctx=CTX,
                         chunks=CHUNKS, progress=False)
    llama_base = work / f"{family}-llama-base.bin"
    if runs_in_llama:
        llama(bin_dir, "llama-perplexity", "-m", ref, "-f", text_file, "-c", CTX, "--chunks", CHUNKS, "-b", CTX,
              "--kl-divergence-base", llama_base)
    candidates = []
    for qtype in fixture_types(fixture):
        path = work / f"{family}-{qtype}.gguf"
        llama(bin_dir, "llama-quantize", "--pure", "--imatrix", imatrix, ref, path, qtype)
        candidates.append((f"{qtype} (llama.cpp)", path, None, "float32", path.stat().st_size))
    candidates += [("int8 (zoo recipe)", ref, "int8", "float32", None),
                   ("Q8_0 (zoo recipe)", ref, "Q8_0", "float32", None),
                   ("bfloat16 compute", ref, None, "bfloat16", None)]
    rows, per_token = [], {}
    for label, path, quant, dtype, size in candidates:
        report = zoo.eval.kld(zoo.load(path, quant=quant, dtype=dtype), base, progress=False)
        row = {"family": family, "candidate": label, "bytes": size, "zoo": report.figures}
        if runs_in_llama and quant is None and dtype == "float32":
            row["llama.cpp"] = llama_figures(llama(
                bin_dir, "llama-perplexity", "-m", path, "-f", text_file, "-c", CTX, "--chunks", CHUNKS, "-b", CTX,
                "--kl-divergence-base", llama_base, "--kl-divergence"))
        rows.append(row)
        per_token[label] = report.per_token["kld"]
        print(f"{family} {label}: KLD {report.figures['kld']['mean']:.5f}", file=sys.stderr)
    return rows, per_token


def markdown(rows: list[dict]) -> str:
    out = ["| model | candidate | mean KLD (zoo) | p99 KLD | top-1 | PPL(Q)/PPL(ref) | mean KLD (llama.cpp) | "
           "top-1 (llama.cpp) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        z, lc = r["zoo"], r.get("llama.cpp")
        theirs = (f"{lc['kld']:.5f} ± {lc['kld_stderr']:.5f} | {100 * lc['top1']:.1f} ± {100 * lc['top1_stderr']:.1f}%"
                  if lc else "- | -")
        out.append(f"| {r['family']}-q256 | {r['candidate']} | {z['kld']['mean']:.5f} ± {z['kld']['stderr']:.5f} | "
                   f"{z['kld']['p99']:.5f} | {100 * z['top1']['mean']:.1f} ± {100 * z['top1']['stderr']:.1f}% | "
                   f"{z['ppl_ratio']['mean']:.4f} ± {z['ppl_ratio']['stderr']:.4f} | {theirs} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eval-q256")
    args = p.parse_args()
    from zoo.tools.plots import kld_distribution_figure, kld_figure

    bin_dir = args.llama_cpp / "build" / "bin"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text_file = work / "text.txt"
        text_file.write_text(evaluation_text())
        for family in FAMILIES:
            family_rows_, per_token = family_rows(family, bin_dir, work, text_file)
            rows += family_rows_
            kld_figure({r["candidate"]: r["zoo"] for r in family_rows_}).savefig(args.out / f"{family}-kld.png")
            kld_distribution_figure(per_token).savefig(args.out / f"{family}-kld-per-token.png")
            np.savez(args.out / f"{family}-per-token-kld.npz", **per_token)
    table = markdown(rows)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "figures.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
