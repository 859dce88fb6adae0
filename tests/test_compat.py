"""Torch releases (torchtpu/_compat.py): one clear error outside the supported range,
raised when the device is first used; never a half-registered op table; ops a release
lacks are simply not lowered there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torchtpu import _compat
from torchtpu.ops import TABLE


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ
    )


@pytest.mark.parametrize("release", [(2, 10), (2, 16), (3, 0)])
def test_an_unsupported_release_is_one_clear_error_at_first_use(release):
    run = _python(
        "import torchtpu._compat as c\n"
        f"c._TORCH = {release}\n"
        "import torch\n"  # never breaks
        "x = torch.ones(2)\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        torch.ones(1, device='tpu')\n"
        "    except RuntimeError as e:\n"
        "        print('ERR', e)\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [line for line in run.stdout.splitlines() if line.startswith("ERR")]
    assert len(errors) == 2 and errors[0] == errors[1]  # the same error each time
    assert "torchtpu supports torch 2.11 up to (not including) 2.16" in errors[0]


def test_a_failed_start_leaves_no_half_table():
    run = _python(
        "import torchtpu._compat as c\n"
        "real = c.op\n"
        "def broken(name):\n"
        "    raise ImportError('simulated: ' + name)\n"
        "c.op = broken\n"
        "import torch\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        torch.ones(1, device='tpu')\n"
        "    except ImportError as e:\n"
        "        print('ERR', e)\n"
        "c.op = real\n"
        "print('OK', (torch.ones(2, device='tpu') + 1).cpu().tolist())\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[:2] == [lines[0]] * 2 and lines[0].startswith("ERR simulated: ")
    # (the same error again, not "lowered twice")
    assert lines[2] == "OK [2.0, 2.0]"


def test_ops_a_release_lacks_are_not_lowered_there():
    for name, why in _compat.VARYING_OPS.items():
        op = _compat.op(name)
        namespace, packet, overload = name.split(".")
        exists = hasattr(getattr(torch.ops, namespace), packet)
        assert (op is not None) == exists, (name, why)
        assert (op in TABLE) == exists
    with pytest.raises(KeyError, match="VARYING_OPS"):
        _compat.op("aten.add.Tensor")  # an op every release has is named directly
