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

# The test extra installs these (CI runs every notebook); a machine without them, such
# as the lent TPU machine with its own package index, skips saying which is missing.
for _module in ("nbformat", "nbclient", "ipykernel"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e .[test])")


def _run_all():
    spec = importlib.util.spec_from_file_location("notebooks_run_all", NOTEBOOKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_all = _run_all()


def test_there_are_notebooks():
    assert len(run_all.notebooks()) >= 7


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


# -- locations in notebooks ---------------------------------------------------------------

# Each cell's code; the test asserts that the messages its output shows name the cell as
# IPython does (``Cell In[n], line k``), never the kernel's temporary file.
_LOCATION_CELLS = [
    # In[1]
    """\
import dataclasses
import warnings

import torch

import torchtpu
from torchtpu.dispatch import core
from torchtpu.ops import TABLE

torchtpu.config.recompile_warn_after = 2
torchtpu.config.small_ops_on_cpu = False  # the cells below recompile small tensors on purpose
torchtpu.config.flush_warn_after = 3
aten = torch.ops.aten
table = torch.randn(10, 4, device="tpu")


def report(exc):
    print(f"{type(exc).__name__}: {exc}")
    for note in getattr(exc, "__notes__", []):
        print(note)


def messages(caught):
    for w in caught:
        print(f"{w.category.__name__}: {w.message}")
""",
    # In[2]: an error in Debug mode (the note), and one found at the next read in Strict
    """\
with torch.tpu.set_eager_mode("debug"):
    try:
        torch.nn.functional.embedding(torch.tensor([10], device="tpu"), table)
    except IndexError as exc:
        report(exc)
rows = torch.nn.functional.embedding(torch.tensor([10], device="tpu"), table)
try:
    rows.cpu()
except IndexError as exc:
    report(exc)
""",
    # In[3]: an error inside a DeferAndFuse chunk names the recording line
    """\
with torch.tpu.set_eager_mode("defer"):
    rows = torch.nn.functional.embedding(torch.tensor([10], device="tpu"), table)
    try:
        rows.cpu()
    except IndexError as exc:
        report(exc)
""",
    # In[4]: the CPU fallback's warning
    """\
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.poisson(torch.ones(3, device="tpu"))
messages(caught)
""",
    # In[5]: a line that keeps recompiling
    """\
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for n in range(1, 6):
        torch.ones(n, device="tpu").exp().sum().item()
messages(caught)
""",
    # In[6]: a line that keeps flushing DeferAndFuse's queue
    """\
with warnings.catch_warnings(record=True) as caught, torch.tpu.set_eager_mode("defer"):
    warnings.simplefilter("always")
    x = torch.ones(3, device="tpu")
    for _ in range(4):
        x = x * 2
        x.sum().item()
messages(caught)
""",
    # In[7]: explain
    """\
def step(x):
    y = (x * 2).sum()
    return y.item()

with torch.tpu.set_eager_mode("defer"):
    print(torchtpu.explain(step, torch.ones(3, device="tpu")))
""",
    # In[8]: the divergence finder, forward and backward (a planted wrong lowering)
    """\
for op in (aten.tanh.default, aten.tanh_backward.default):
    right = TABLE[op]
    TABLE[op] = dataclasses.replace(right, fn=lambda *a, right=right: right.fn(*a) + 0.01)
    core._HANDLERS.pop(op, None)
w = torch.randn(4, device="tpu", requires_grad=True)
with torchtpu.check_against_cpu(action="warn"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = torch.tanh(w)
    y.sum().backward()
messages(caught)
""",
    # In[9]: the NaN finder, forward and backward
    """\
with torchtpu.detect_nonfinite(action="warn"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.log(torch.tensor([-1.0, 1.0], device="tpu"))
    z = torch.zeros(3, device="tpu", requires_grad=True)
    torch.sqrt(z).sum().backward()
    z.grad.sum().item()
messages(caught)
""",
    # In[10]: a @torchtpu.jax_op function that JAX refuses names where it is defined
    """\
import jax.numpy as jnp

@torchtpu.jax_op
def matmul(a, b):
    return jnp.dot(a, b)

try:
    matmul(torch.ones(2, 3, device="tpu"), torch.ones(2, 3, device="tpu"))
except TypeError as exc:
    report(exc)
""",
    # In[11]: the profiler's trace names the op's line
    """\
import gzip, json, tempfile

with torchtpu.profile(tempfile.mkdtemp()) as prof:
    torch.ones(3, device="tpu").exp().cpu()
with gzip.open(prof.trace_file) as f:
    names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
print([n for n in names if n.startswith("aten.exp.default")])
""",
]

# (cell, text its output must contain)
_EXPECTED_LOCATIONS = [
    (2, "called from Cell In[2], line 3 in <module>"),
    (2, "called from Cell In[2], line 6 in <module>"),
    (3, "called from Cell In[3], line 2 in <module>"),
    (4, "aten.poisson.default (called from Cell In[4], line 3 in <module>)"),
    (5, "Cell In[5], line 4 in <module> keeps compiling"),
    (6, "Cell In[6], line 6 in <module> has flushed the DeferAndFuse queue"),
    (7, "value read at Cell In[7], line 3 in step"),
    (8, "aten.tanh.default at Cell In[8], line 8 in <module> differs"),
    (8, "at Cell In[8], line 8 in <module> (backward of the op created there)"),
    (9, "aten.log.default at Cell In[9], line 3 in <module> made NaN"),
    (9, "at Cell In[9], line 5 in <module> (backward of the op created there)"),
    (10, "jax_op matmul (defined at Cell In[10], line 3)"),
    (10, "called from Cell In[10], line 8 in <module>"),
    (11, "aten.exp.default (Cell In[11], line 4 in <module>)"),
]


def test_messages_name_notebook_cells(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in _LOCATION_CELLS]
    path = tmp_path / "locations.ipynb"
    nbformat.write(nb, path)
    executed = run_all.execute(path, timeout=300)
    shown = {}
    for number, cell in enumerate(executed.cells, start=1):
        assert cell.execution_count == number
        texts = []
        for output in cell.get("outputs", []):
            assert output.output_type != "error", output
            if output.output_type == "stream" and output.name == "stdout":
                texts.append(output.text)
        shown[number] = "".join(texts)
    for number, expected in _EXPECTED_LOCATIONS:
        assert expected in shown[number], (number, shown[number])
    everything = "".join(shown.values())
    assert "ipykernel_" not in everything, everything
