"""Execute the notebooks top to bottom in a fresh kernel and save their outputs in place.

    python notebooks/run_all.py                    # every notebooks/*.ipynb
    python notebooks/run_all.py 03_training.ipynb  # some of them
    python notebooks/run_all.py --check            # run, but do not write (what the test does)

The kernel is the Python running this script (a kernel spec made on the fly that
points at ``sys.executable``), so a fresh virtual environment needs no
``ipykernel install``. Each notebook runs with its own folder as the working
directory. The script stops at the first cell that raises and prints its error.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_NAME = "torchtpu-notebooks"


def notebooks() -> list[Path]:
    return sorted(HERE.glob("[0-9]*.ipynb"))


def _kernel_spec_manager(folder: str):
    """A kernel spec manager that knows one kernel: this interpreter's ipykernel."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = Path(folder) / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        # No GUI event loop, and one inline figure format: outputs stay reproducible.
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[folder], ensure_native_kernel=False)


def execute(path: Path, *, timeout: int = 600):
    """Run the notebook at ``path`` in a fresh kernel; return the executed notebook.
    Raises ``nbclient.exceptions.CellExecutionError`` at the first failing cell."""
    import nbformat
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as folder:
        km = AsyncKernelManager(
            kernel_name=KERNEL_NAME, kernel_spec_manager=_kernel_spec_manager(folder)
        )
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            record_timing=False,  # no timestamps in the saved notebook
            resources={"metadata": {"path": str(path.parent)}},
        )
        # Shut the kernel down afterwards: given a kernel manager, nbclient leaves the
        # kernel running by default (a test run's worker held one per notebook).
        client.execute(cleanup_kc=True)
    # Saved notebooks name the standard kernel, so Jupyter opens them with "python3".
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    return nb


def main(argv: list[str]) -> int:
    import nbformat

    check = "--check" in argv
    names = [a for a in argv if not a.startswith("--")]
    paths = [HERE / n if not os.path.isabs(n) and not os.path.exists(n) else Path(n) for n in names]
    for path in paths or notebooks():
        start = time.perf_counter()
        nb = execute(path)
        if not check:
            nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
