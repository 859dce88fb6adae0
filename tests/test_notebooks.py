"""Every notebook in notebooks/ runs top to bottom in a fresh kernel without an error.

The kernel is this interpreter (notebooks/run_all.py makes a kernel spec pointing at
``sys.executable``), so the test needs no ``ipykernel install``. The outputs are
not compared (timings differ from run to run); ``python notebooks/run_all.py``
re-executes the notebooks and saves their outputs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _run_all():
    spec = importlib.util.spec_from_file_location("notebooks_run_all", NOTEBOOKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_all = _run_all()


def test_there_are_notebooks():
    assert len(run_all.notebooks()) >= 6


@pytest.mark.parametrize("path", run_all.notebooks(), ids=lambda p: p.stem)
def test_notebook_runs_without_error(path):
    nb = run_all.execute(path, timeout=600)
    errors = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    assert not errors, errors
