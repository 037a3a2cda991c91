"""Every notebook in ``examples/kaggle/`` is stored clean: valid nbformat v4, exactly one cell
tagged ``parameters`` (papermill's convention: the one a user, or a test, sets), no outputs and no
execution counts (outputs are stripped before they go into git)."""

from __future__ import annotations

import nbformat
import pytest

from tests.support.notebooks import NOTEBOOKS

PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    assert PATHS, f"no notebook in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert nb.nbformat == 4, f"{path.name}: nbformat {nb.nbformat}"
    nbformat.validate(nb)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: cells tagged 'parameters': {tagged}"
    assert nb.cells[tagged[0]].cell_type == "code", f"{path.name}: the parameters cell is not code"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.get("outputs") == [], f"{path.name}: cell {i} has stored outputs"
            assert cell.get("execution_count") is None, f"{path.name}: cell {i} has an execution count"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{path.name}: kernelspec"
