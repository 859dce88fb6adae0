"""torchtpu.profile(): a trace TensorBoard and Perfetto open, naming aten ops, chunks and lines."""

from __future__ import annotations

import gzip
import json
import sys

import pytest
import torch

import torchtpu
from conftest import assert_same
from torchtpu.dispatch import defer


def _line() -> int:
    return sys._getframe(1).f_lineno


def _events(prof) -> list[dict]:
    with gzip.open(prof.trace_file) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("mode", ["strict", "debug", "defer"])
def test_the_trace_names_ops_with_the_users_line(tmp_path, mode):
    cpu_model = _model()
    model = _model().to("tpu")
    x = torch.randn(3, 4)
    with torch.tpu.set_eager_mode(mode), torchtpu.profile(tmp_path) as prof:
        line = _line() + 1
        loss = model(x.to("tpu")).tanh().sum()
        loss.backward()
    expected = cpu_model(x).tanh().sum()
    expected.backward()
    assert_same(loss.detach(), expected.detach())
    assert_same(model[0].weight.grad, cpu_model[0].weight.grad)

    assert prof.xplane_file and prof.trace_file and prof.perfetto_file
    assert all(f.startswith(str(tmp_path / "plugins" / "profile")) for f in prof.files)
    events = _events(prof)
    names = [e["name"] for e in events]
    here = f"{__file__}:{line} in test_the_trace_names_ops_with_the_users_line"
    assert f"aten.tanh.default ({here})" in names
    assert f"torchtpu_nn.linear.default ({here})" in names  # nn.Linear: ops/linear.py
    assert "aten.tanh_backward.default (backward of TanhBackward0)" in names
    with open(prof.xplane_file, "rb") as f:
        xplane = f.read()
    if mode == "defer":
        chunks = [e for e in events if e["name"].startswith("DeferAndFuse chunk: ")]
        # The last chunk runs as the block ends (contextlib's __exit__): named by its line.
        assert chunks and f"(sync at {__file__}:" in chunks[-1]["name"]
        assert chunks[0]["args"]["compiled"] in ("yes", "no")
        queued = {e["name"]: e.get("args", {}).get("queued") for e in events}
        position = queued[f"torchtpu_nn.linear.default ({here})"]  # where it is in the chunk
        assert position.startswith("op")
        # On the device, the chunk's instructions carry the op and that position.
        assert f"jit(chunk)/{position}/torchtpu_nn.linear.default/".encode() in xplane
    else:
        # Each op's program is named for it (XLA:CPU's trace events say so in an
        # "hlo_module" argument; a TPU's device plane names its modules in the xplane).
        assert b"jit_torchtpu_nn.linear.default" in xplane and b"jit_aten.tanh.default" in xplane
        assert b"jit(aten.tanh.default)/aten.tanh.default/" in xplane


def test_the_perfetto_file_is_the_trace_without_metadata(tmp_path):
    with torchtpu.profile(tmp_path) as prof:
        torch.ones(3, device="tpu").exp().cpu()
    with gzip.open(prof.perfetto_file) as f:
        perfetto = json.load(f)
    assert "metadata" not in perfetto
    assert any(e.get("name", "").startswith("aten.exp.default (") for e in perfetto["traceEvents"])


def test_profiling_compiles_nothing_and_leaves_nothing_behind(tmp_path):
    model = _model().to("tpu")
    x = torch.randn(3, 4, device="tpu")
    for _ in range(2):  # compiles the step's programs (the second accumulates grads)
        model(x).sum().backward()
    torchtpu.reset_metrics()
    with torchtpu.profile(tmp_path, perfetto=False) as prof:
        model(x).sum().backward()
    assert "compiles" not in torchtpu.metrics()  # the names were in the programs already
    assert prof.perfetto_file is None and prof.trace_file
    assert defer.annotate_run is defer._no_annotation
    assert torch._C._len_torch_dispatch_stack() == 0


def test_an_error_in_the_block_ends_the_trace(tmp_path):
    with pytest.raises(ValueError, match="planted"):
        with torchtpu.profile(tmp_path / "a"):
            torch.ones(2, device="tpu").cpu()
            raise ValueError("planted")
    with torchtpu.profile(tmp_path / "b") as prof:  # a new trace may start
        torch.ones(2, device="tpu").neg().cpu()
    assert prof.trace_file and defer.annotate_run is defer._no_annotation


def test_compiled_code_stays_compiled_inside_the_block(tmp_path):
    cpu_model = _model()
    model = torch.compile(_model().to("tpu"), backend="tpu")
    x = torch.randn(3, 4)
    model(x.to("tpu"))  # compiles
    torchtpu.reset_metrics()
    with torchtpu.profile(tmp_path) as prof:
        out = model(x.to("tpu"))
    assert_same(out.detach(), cpu_model(x).detach())
    assert "compiles" not in torchtpu.metrics()
    names = [e["name"] for e in _events(prof)]
    op_by_op = ("aten.addmm.default", "torchtpu_nn.linear.default")
    assert not any(n.startswith(op_by_op) for n in names)  # not run op by op
    assert any(n.startswith("PjitFunction(") for n in names)


def test_a_flush_of_one_op_is_named_too(tmp_path):
    x = torch.arange(3.0, device="tpu")
    with torch.tpu.set_eager_mode("defer"), torchtpu.profile(tmp_path) as prof:
        line = _line() + 1
        value = x.exp().cpu()  # a queue of one op runs as that op's own program
    torch.testing.assert_close(value, torch.arange(3.0).exp())
    names = [e["name"] for e in _events(prof)]
    here = f"{__file__}:{line} in test_a_flush_of_one_op_is_named_too"
    assert f"DeferAndFuse chunk: 1 ops (value read at {here})" in names
