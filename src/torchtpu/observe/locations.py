"""How errors name the aten op and point at the user's line."""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # torchtpu/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LIBRARY_DIRS = (_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)
# Python's standard library (contextlib's __exit__ runs the end of a `with` block), but
# not packages installed inside it (site-packages of an interpreter without a venv).
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


# filename -> whether it belongs to torch, torchtpu, JAX or the standard library. Asked for every frame of a
# stack walk (a DeferAndFuse flush walks one), so each file is judged once.
_LIBRARY_FILES: dict[str, bool] = {}


def _is_library(filename: str) -> bool:
    """Whether ``filename`` is torch's, torchtpu's, JAX's or Python's own: never the
    user's line."""
    known = _LIBRARY_FILES.get(filename)
    if known is None:
        path = filename if filename.startswith("<") else os.path.abspath(filename)
        known = _LIBRARY_FILES[filename] = (
            path.startswith(_LIBRARY_DIRS)
            or "/site-packages/jax" in path
            or path.startswith("<frozen")
            or (path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path)
        )
    return known


def user_frame(frame=None) -> str:
    """``file:line in function`` of the innermost caller outside torch, torchtpu, JAX and
    the standard library (from ``frame`` outwards; the caller's by default)."""
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        code = frame.f_code
        if not _is_library(code.co_filename) and not _generated_by_library(frame):
            return location(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return "<unknown>"


def read_by_torch() -> str | None:
    """The user's line of a read of values that torch's own code asked for (``mask.any()``
    in the rejection loop of ``nn.init.trunc_normal_``), or None where code outside torch
    asked (a user's ``.item()``): the caller's first frame outside torchtpu decides."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_TORCH_DIR + os.sep):
        return None
    return user_frame(frame)


def _generated_by_library(frame) -> bool:
    """Whether ``frame`` runs code compiled from a string (a ``<...>`` file name) that a
    library called: torch writes some wrappers that way (AOTAutograd's
    ``<subclass_wrapper>`` in torch 2.12, FX's ``<eval_with_key>.N``). Code a user
    ``exec``s is called from the user's own frame, and stays theirs."""
    while frame is not None and frame.f_code.co_filename.startswith("<"):
        frame = frame.f_back
    return frame is not None and _is_library(frame.f_code.co_filename)


def location(filename: str, line: int, function: str) -> str:
    """``file:line in function``; a notebook cell as IPython names it (``Cell In[3], line 4``)."""
    return f"{place(filename, line)} in {function}"


def place(filename: str, line: int) -> str:
    """``file:line``, or ``Cell In[3], line 4`` for code a notebook cell ran."""
    cell = _notebook_cell(filename)
    if cell is not None:
        return f"Cell In[{cell}], line {line}"
    return f"{filename}:{line}"


def _notebook_cell(filename: str) -> int | None:
    """The execution count of the cell whose code IPython compiled as ``filename``.

    IPython runs a cell as code from a temporary file (``/tmp/ipykernel_123/456.py``)
    and keeps the map from those names to execution counts in its compiler
    (IPython/core/compilerop.py, ``_filename_map``). Only an IPython already imported
    is asked: outside a kernel this costs one dict lookup."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython().compile._filename_map.get(filename)
    except AttributeError:  # no running shell, or an IPython without the map
        return None


def op_location() -> str:
    """The user's line of the op running now; in backward, the forward line that made
    the autograd node (from the forward traceback anomaly mode keeps)."""
    node = torch._C._current_autograd_node()
    if node is not None:
        stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
        if stack:
            frames = _user_lines(stack)
            if frames:
                return f"{frames[-1]} (backward of the op created there)"
        return f"backward of {node.name()}"
    return user_frame()


def _user_lines(stack) -> list[str]:
    """The user's frames in a forward traceback anomaly mode kept (a list of strings)."""
    lines = []
    for entry in stack:
        for line in str(entry).splitlines():
            line = line.strip()
            if line.startswith('File "'):
                filename = line.split('"')[1]
                if not _is_library(filename):
                    number = line.split("line ")[1].split(",")[0]
                    function = line.rsplit(" in ", 1)[-1]
                    lines.append(location(filename, int(number), function))
    return lines


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by our caller point at user code."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None:
        if not _is_library(frame.f_code.co_filename):
            return level
        frame = frame.f_back
        level += 1
    return 2


def describe(values) -> str:
    """Shapes and dtypes of an op's tensor arguments, e.g. ``(f32[2, 3], f32[4, 5], 1)``."""

    def one(v):
        if isinstance(v, torch.Tensor):
            where = "" if v.device.type == "tpu" else f"@{v.device}"
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}{where}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(one(x) for x in v) + "]"
        return repr(v)

    return "(" + ", ".join(one(v) for v in values) + ")"


def name_op(exc: BaseException, op) -> BaseException:
    """Name the op in a note on the exception (PEP 678), keeping torch's message as torch
    words it: tests and users match it (``assertRaisesRegex("^Integer division")``)."""
    note = f"torchtpu: raised by {op}"
    if not any(n.startswith(note) for n in getattr(exc, "__notes__", ())):
        exc.add_note(note)
    return exc


def add_context(exc: BaseException, op, values) -> BaseException:
    """Note the op, its inputs and the user's line on the exception."""
    note = f"torchtpu: raised by {op}"
    notes = getattr(exc, "__notes__", [])
    if any(n.startswith(note + "(") for n in notes):
        return exc
    if note in notes:  # name_op's: replaced by this fuller one
        notes.remove(note)
    exc.add_note(f"{note}{describe(values)} called from {user_frame()}")
    return exc
