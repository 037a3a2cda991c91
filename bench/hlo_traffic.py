"""Where XLA's "bytes accessed" of each compiled program comes from (``zoo.tools.hlo_traffic``): the
groups (prefetch into VMEM, relayout copies, compute, Pallas operands) and the largest contributors,
for the HLO files ``zoo compile --hlo-dir DIR`` writes. From the repo root:

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python bench/hlo_traffic.py DIR [--top 15]
"""

from __future__ import annotations

import argparse
import pathlib

from zoo.tools.hlo_traffic import traffic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", help="directory of .hlo files (zoo compile --hlo-dir)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in sorted(pathlib.Path(args.dir).glob("*.hlo")):
        groups, detail = traffic(path.read_text())
        costed = sum(v for k, v in groups.items() if k != "pallas")
        print(f"{path.stem}: {costed / 1e9:.3f} GB without the Pallas calls (compare XLA's bytes accessed)")
        for group, b in groups.most_common():
            print(f"  {group:12s} {b / 1e9:8.3f} GB")
        for (group, what), b in detail.most_common(args.top):
            print(f"    {b / 1e9:8.3f} GB  {group:10s} {what}")


if __name__ == "__main__":
    main()
