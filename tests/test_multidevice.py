"""Several tpu devices: ``tpu:i`` is JAX's device i.

JAX exposes several CPU devices only when ``XLA_FLAGS`` asks for them before it is
imported, so the checks run in one fresh Python process with two devices; it reports
each check's outcome as JSON and the tests below assert on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import io, json, sys

    import torch
    import torchtpu
    from torchtpu.dispatch.values import materialize

    results = {}


    def check(name):
        def record(fn):
            try:
                results[name] = ["ok", fn()]
            except Exception as exc:  # the outcome is reported, and asserted by the test
                results[name] = [type(exc).__name__, str(exc)]
        return record


    def where(t):
        # (torch's device, the JAX device ids holding the data)
        return [str(t.device), sorted(d.id for d in materialize(t).devices())]


    @check("device_count")
    def _():
        return [torch.tpu.device_count(), torch.tpu.current_device()]


    # name: a factory with device=device (computed), or one that fills torch.empty
    # (random ops, fill_: an in-place op on an uninitialised storage)
    FACTORIES = {
        "zeros": lambda device: torch.zeros(3, device=device),
        "full": lambda device: torch.full((2,), 7.0, device=device),
        "arange": lambda device: torch.arange(4, device=device),
        "eye": lambda device: torch.eye(2, device=device),
        "tensor": lambda device: torch.tensor([1.0, 2.0], device=device),
        "zeros_like": lambda device: torch.zeros_like(torch.ones(2, device=device)),
        "randn": lambda device: torch.randn(3, device=device),
        "randint": lambda device: torch.randint(0, 5, (3,), device=device),
        "empty_fill_": lambda device: torch.empty(2, device=device).fill_(1),
        "empty": lambda device: torch.empty(2, device=device),
    }


    @check("factory_on_1")
    def _():
        made = {name: make(torch.device("tpu", 1)) for name, make in FACTORIES.items()}
        return {name: where(t) + [t.get_device()] for name, t in made.items()}


    @check("to_1")
    def _():
        t = torch.arange(6.0).reshape(2, 3).to("tpu:1")
        return where(t) + [t.cpu().tolist(), repr(t)]


    @check("ops_stay_on_1")
    def _():
        a = torch.arange(6.0).reshape(2, 3).to("tpu:1")
        b = torch.ones(3, 2, device="tpu:1")
        outs = [a + 1, a * a, a @ b, a.sum(), a.t(), a[1], torch.relu(a - 2), a * torch.tensor(2.0)]
        a.add_(1)
        outs.append(a)
        return [where(t) for t in outs] + [(a @ b).cpu().tolist()]


    @check("module_on_1")
    def _():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        x = torch.randn(5, 3)
        expected = model(x).detach()
        model.to("tpu:1")
        out = model(x.to("tpu:1"))
        close = torch.allclose(out.detach().cpu(), expected, atol=1e-5)
        return [where(out), sorted({str(p.device) for p in model.parameters()}), close]


    @check("move_1_to_0")
    def _():
        a = torch.arange(4, device="tpu:1")
        b = a.to("tpu:0")
        c = b.to("tpu:1")
        d = torch.ones(2, device="tpu:0").to(torch.device("tpu", 1))
        return [where(b), where(c), where(d), b.tolist(), a.to("tpu:1") is a]


    @check("copy_across")
    def _():
        dst = torch.zeros(3, device="tpu:1")
        dst.copy_(torch.arange(3.0, device="tpu:0"))
        return where(dst) + [dst.tolist()]


    @check("mix_add")
    def _():
        return torch.ones(2, device="tpu:0") + torch.ones(2, device="tpu:1")


    @check("mix_matmul")
    def _():
        return torch.ones(2, 2, device="tpu:1") @ torch.ones(2, 2, device="tpu:0")


    @check("mix_inplace")
    def _():
        return torch.ones(2, device="tpu:1").add_(torch.ones(2, device="tpu:0"))


    @check("save_load_1")
    def _():
        buffer = io.BytesIO()
        torch.save(torch.arange(3, device="tpu:1"), buffer)
        buffer.seek(0)
        return where(torch.load(buffer))


    @check("bad_index")
    def _():
        return torch.zeros(1, device="tpu:2")


    @check("bad_set_device")
    def _():
        return torch.tpu.set_device(2)


    @check("set_device_factories")
    def _():
        torch.tpu.set_device(1)
        try:
            made = {name: where(make("tpu")) for name, make in FACTORIES.items()}
            with torch.device("tpu"):
                made["device_context"] = where(torch.zeros(2))
            return [torch.tpu.current_device(), made]
        finally:
            torch.tpu.set_device(0)


    @check("set_device_back_to_0")
    def _():
        torch.tpu.set_device(1)
        torch.tpu.set_device("tpu:0")
        return [torch.tpu.current_device(), str(torch.zeros(1, device="tpu").device)]


    @check("set_device_to")
    def _():
        torch.tpu.set_device(1)
        try:
            return where(torch.arange(3).to("tpu"))
        finally:
            torch.tpu.set_device(0)


    # Last: a failure inside autograd's engine must not affect the checks above.
    @check("backward_on_1")
    def _():
        w = torch.ones(3, device="tpu:1", requires_grad=True)
        (w * w).sum().backward()
        return where(w.grad) + [w.grad.tolist()]


    json.dump(results, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env.pop("TORCHTPU_EAGER_MODE", None)  # the default mode, whatever this process runs in
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"the two-device process failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def ok(results, name):
    status, value = results[name]
    assert status == "ok", f"{name} raised {status}: {value}"
    return value


COMPUTED = ["zeros", "full", "arange", "eye", "tensor", "zeros_like"]
FILLED = ["randn", "randint", "empty_fill_", "empty"]


def test_two_devices(results):
    assert ok(results, "device_count") == [2, 0]


@pytest.mark.parametrize("name", COMPUTED + FILLED)
def test_factory_on_device_1(results, name):
    assert ok(results, "factory_on_1")[name] == ["tpu:1", [1], 1]


def test_to_device_1(results):
    device, jax_ids, values, text = ok(results, "to_1")
    assert (device, jax_ids) == ("tpu:1", [1])
    assert values == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert text == "tensor([[0., 1., 2.],\n        [3., 4., 5.]], device='tpu:1')"


def test_ops_stay_on_device_1(results):
    *placements, product = ok(results, "ops_stay_on_1")
    for placement in placements:
        assert placement == ["tpu:1", [1]]
    assert product == [[6.0, 6.0], [15.0, 15.0]]  # after add_(1)


def test_module_on_device_1(results):
    placement, parameter_devices, close = ok(results, "module_on_1")
    assert placement == ["tpu:1", [1]]
    assert parameter_devices == ["tpu:1"]
    assert close


def test_moves_between_devices(results):
    to_0, back_to_1, to_1, values, same = ok(results, "move_1_to_0")
    assert to_0 == ["tpu:0", [0]]
    assert back_to_1 == ["tpu:1", [1]]
    assert to_1 == ["tpu:1", [1]]
    assert values == [0, 1, 2, 3]
    assert same  # .to() of the device a tensor is on returns it


def test_copy_between_devices(results):
    assert ok(results, "copy_across") == ["tpu:1", [1], [0.0, 1.0, 2.0]]


@pytest.mark.parametrize("name", ["mix_add", "mix_matmul", "mix_inplace"])
def test_mixing_devices_raises_like_cuda(results, name):
    status, message = results[name]
    assert status == "RuntimeError"
    assert "Expected all tensors to be on the same device" in message
    assert "tpu:0" in message and "tpu:1" in message


def test_save_load_keeps_device(results):
    assert ok(results, "save_load_1") == ["tpu:1", [1]]


def test_bad_device_index(results):
    for name in ("bad_index", "bad_set_device"):
        status, message = results[name]
        assert status == "RuntimeError", (name, status, message)
        assert "tpu:2" in message


@pytest.mark.parametrize("name", COMPUTED + FILLED + ["device_context"])
def test_set_device_makes_tpu_mean_that_device(results, name):
    current, made = ok(results, "set_device_factories")
    assert current == 1
    assert made[name] == ["tpu:1", [1]]


def test_set_device_back(results):
    assert ok(results, "set_device_back_to_0") == [0, "tpu:0"]


def test_set_device_applies_to_to(results):
    assert ok(results, "set_device_to") == ["tpu:1", [1]]


def test_backward_on_device_1(results):
    assert ok(results, "backward_on_1") == ["tpu:1", [1], [2.0, 2.0, 2.0]]
