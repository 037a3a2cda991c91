"""Print the `uv pip install` flags that give uv the package sources pip is configured with here.

`scripts/bootstrap.sh` installs with uv (about 5x faster than pip for the test extra's ~7 GB) and
falls back to pip. uv reads neither pip.conf nor PIP_* variables, so this reads pip's merged
configuration (`pip config list`: files and environment) and turns its index, extra indexes, find-links
and constraint files into uv flags, one per line. pip considers every index for every package; so does
uv with `--index-strategy unsafe-best-match`. A file:// source that does not exist is left out (pip
only warns about it). Run with the virtualenv's python.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def pip_config() -> dict[str, list[str]]:
    """pip's settings by name (the last scope wins, as in pip: environment over files), values split."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        if name in FLAGS:
            found[name] = ast.literal_eval(value).split()
    return found


def reachable(source: str) -> bool:
    """A remote URL, or a local path or file:// URL that exists."""
    if "://" in source and not source.startswith("file://"):
        return True
    return os.path.exists(source.removeprefix("file://"))


def main() -> None:
    config = pip_config()
    print("--index-strategy\nunsafe-best-match")
    for name, flag in FLAGS.items():
        for source in config.get(name, []):
            if reachable(source):
                print(f"{flag}\n{source}")


if __name__ == "__main__":
    main()
