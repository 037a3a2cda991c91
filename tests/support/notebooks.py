"""Executing the example notebooks (``examples/kaggle/``) as a user would: papermill, a fresh kernel.

``run_notebook(path, parameters, cwd)`` injects ``parameters`` after the cell tagged ``parameters``
(papermill's convention), runs every cell top to bottom in a new IPython kernel of this Python, and
returns the executed notebook (``nbformat.NotebookNode``); a cell that raises fails the call with
papermill's ``PapermillExecutionError`` (the cell, the exception and its traceback).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "examples" / "kaggle"


def run_notebook(path: str | Path, parameters: dict, cwd: str | Path, env: dict | None = None,
                 timeout_s: int = 600) -> nbformat.NotebookNode:
    """Run the notebook with ``parameters`` in a fresh kernel started in ``cwd``; ``env`` is added to
    this process's environment for the kernel (and what it starts), the repository first on its path."""
    import papermill

    kernel_env = {**os.environ, **(env or {}),
                  "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(kernel_env)            # papermill's kernel inherits this process's environment
    try:
        out = Path(cwd) / f"executed-{Path(path).name}"
        papermill.execute_notebook(str(path), str(out), parameters=parameters, cwd=str(cwd),
                                   kernel_name="python3", execution_timeout=timeout_s, progress_bar=False,
                                   log_output=False, start_timeout=120)
        return nbformat.read(out, as_version=4)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def outputs_text(nb: nbformat.NotebookNode) -> str:
    """Everything the executed cells printed (stream outputs and text results), in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "data" in out and "text/plain" in out["data"]:
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)

