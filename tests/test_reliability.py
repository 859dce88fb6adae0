"""Regression tests for issue 14: pinned memory, activation checkpointing with dropout,
``torch.load(map_location=...)``, and several devices. Each compares with PyTorch on
the CPU (or, where the CPU has no counterpart, with what CUDA does)."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torchtpu
from conftest import assert_same, tpu

# Subprocesses import this tree's torchtpu, whatever is installed.
_SRC = os.path.dirname(os.path.dirname(torchtpu.__file__))


def _run(script: str, **env_overrides) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, env.get("PYTHONPATH")]))
    env.pop("TORCHTPU_EAGER_MODE", None)
    env.update(env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"the subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- 1. pinned memory ------------------------------------------------------------------------


def test_pin_memory_copies_and_is_pinned():
    t = torch.arange(12.0).view(3, 4).t()  # not contiguous: strides are kept, as torch does
    assert not t.is_pinned()
    p = t.pin_memory()
    assert p.is_pinned()
    assert torch.equal(p, t) and p.stride() == t.stride() and p.dtype == t.dtype
    assert p._base is None
    assert p.data_ptr() != t.data_ptr()
    assert p[1:].is_pinned()  # a view of pinned memory is pinned
    assert p.pin_memory() is p  # already pinned: returned as is
    assert not t.is_pinned()


def test_a_tpu_tensor_cannot_be_pinned():
    """Only host memory can be pinned: as for a CUDA tensor, pinning a device tensor
    raises (it used to return the tensor itself, silently)."""
    t = torch.ones(3, device="tpu")
    assert not t.is_pinned()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        t.pin_memory()


def test_pinned_memory_is_forgotten_when_freed():
    from torchtpu import pinned

    before = len(pinned._live)
    p = torch.ones(1000).pin_memory()
    assert len(pinned._live) == before + 1
    del p
    gc.collect()
    assert len(pinned._live) == before


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float16, torch.complex64])
def test_pin_memory_dtypes(dtype):
    t = torch.tensor([1, 0, 3]).to(dtype)
    p = t.pin_memory()
    assert p.is_pinned() and p.dtype == dtype and torch.equal(p, t)


def test_pin_memory_keeps_autograd():
    a = torch.randn(3, requires_grad=True)
    (a.pin_memory() * 2).sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_pin_memory(num_workers):
    data = torch.arange(24.0).view(12, 2)
    dataset = torch.utils.data.TensorDataset(data, torch.arange(12))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, pin_memory=True, num_workers=num_workers
    )
    batches = list(loader)
    expected = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    assert len(batches) == len(expected) == 3
    for (x, y), (ex, ey) in zip(batches, expected):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_non_blocking_copy_of_pinned_memory_to_tpu():
    host = torch.arange(6.0).view(2, 3).pin_memory()
    on_tpu = host.to("tpu", non_blocking=True)
    assert on_tpu.device == torch.device("tpu", 0)
    assert torch.equal(on_tpu.cpu(), host)
    assert torch.equal(host.to(torch.device("tpu"), non_blocking=True).cpu(), host)


# A CPU-only program as people write it: a DataLoader with pinning (in the main process
# and with workers), torch.accelerator queries, AMP on the CPU, a few training steps.
_CPU_PROGRAM = textwrap.dedent(
    r"""
    import json, sys, warnings
    import torch

    def main():
        torch.manual_seed(0)
        x = torch.randn(16, 4)
        y = (x.sum(1, keepdim=True) > 0).float()
        dataset = torch.utils.data.TensorDataset(x, y)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        accelerator = torch.accelerator.current_accelerator()
        device = accelerator if accelerator is not None else torch.device("cpu")
        losses, pinned = [], []
        for workers in (0, 2):
            loader = torch.utils.data.DataLoader(
                dataset, batch_size=4, pin_memory=True, num_workers=workers
            )
            for xb, yb in loader:
                pinned.append(xb.is_pinned())
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    pred = model(xb)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(pred.float(), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        results = {
            "losses": losses,
            "weights": [p.detach().tolist() for p in model.parameters()],
            "autocast_dtype": str(pred.dtype),
            # The DataLoaders drew their seeds from the CPU generator: as many draws.
            "next_random": torch.rand(3).tolist(),
        }
        # Training on the CPU never starts JAX (a question about the hardware does).
        jax_loaded = "jax" in sys.modules
        accelerator_info = {
            "available": torch.accelerator.is_available(),
            "type": None if accelerator is None else accelerator.type,
            "device_count": torch.accelerator.device_count(),
            "pinned": pinned,
        }
        return results, accelerator_info, jax_loaded

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, accelerator_info, jax_loaded = main()
    print(json.dumps({
        "torchtpu_loaded": "torchtpu" in sys.modules,
        "jax_loaded": jax_loaded,
        "results": results,
        "accelerator": accelerator_info,
        "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
    }))
    """
)

_NO_ACCELERATOR_WARNING = (
    "UserWarning: 'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)


def test_cpu_program_same_with_and_without_autoload():
    plain = _run(_CPU_PROGRAM, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    loaded = _run(_CPU_PROGRAM, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    assert not plain["torchtpu_loaded"] and loaded["torchtpu_loaded"]
    assert not loaded["jax_loaded"]
    assert loaded["results"] == plain["results"]
    # The one difference by design: with torchtpu there is an accelerator (tpu), so the
    # DataLoader pins for it instead of warning that it cannot.
    assert plain["accelerator"] == {
        "available": False,
        # a CUDA build of torch (torch 2.14.1 here) names CUDA even without a GPU
        "type": None if torch.version.cuda is None else "cuda",
        "device_count": 0,
        "pinned": [False] * 8,
    }
    assert loaded["accelerator"] == {
        "available": True,
        "type": "tpu",
        "device_count": 1,
        "pinned": [True] * 8,
    }
    assert _NO_ACCELERATOR_WARNING in plain["warnings"]
    # On a TPU machine without transparent hugepages, JAX warns about the machine when a
    # question about the hardware starts it: the VM's setup, not the program's.
    loaded_warnings = [w for w in loaded["warnings"] if "Transparent hugepages" not in w]
    assert loaded_warnings == [w for w in plain["warnings"] if w != _NO_ACCELERATOR_WARNING]


# -- 2. activation checkpointing and the RNG --------------------------------------------------


def _grads(device, use_checkpoint, use_reentrant=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)
    ).to(device)
    # One sample: each unit dropout zeroes leaves a zero row in the first weight's grad.
    x = torch.randn(1, 8).to(device).requires_grad_()
    if use_checkpoint:
        out = checkpoint(model, x, use_reentrant=use_reentrant)
    else:
        out = model(x)
    out.sum().backward()
    return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_checkpoint_with_dropout_gives_the_same_gradients(device, use_reentrant):
    plain = _grads(device, False)
    checkpointed = _grads(device, True, use_reentrant)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # Dropout really dropped something (else the test proves nothing).
    assert (plain[0] == 0).all(dim=1).any()


def test_fork_rng_restores_the_tpu_state():
    torch.manual_seed(3)
    before = torch.tpu.get_rng_state()
    with torch.random.fork_rng(device_type="tpu"):
        torch.rand(4, device="tpu")
        assert not torch.equal(torch.tpu.get_rng_state(), before)
    assert torch.equal(torch.tpu.get_rng_state(), before)
    after_fork = torch.rand(4, device="tpu").cpu()
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), after_fork)


def test_device_module_has_what_checkpoint_uses():
    assert torch.tpu._initialized
    with torch.tpu.device(0) as ctx:
        assert torch.tpu.current_device() == 0
        state = torch.tpu.get_rng_state()
    assert ctx.idx == 0
    torch.tpu.set_rng_state(state, 0)
    assert torch.equal(torch.tpu.get_rng_state(0), state)
    with torch.tpu.device(None):
        assert torch.tpu.current_device() == 0


# -- 3. torch.load(map_location=...) ---------------------------------------------------------


def _checkpoint_bytes(device):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    obj = {
        "weight": model.weight.detach().to(device),
        "param": torch.nn.Parameter(torch.arange(4.0).to(device)),
        "int": torch.arange(5).to(device),
        "view": torch.arange(6.0).to(device)[2:],
    }
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue(), {k: v.detach().cpu() for k, v in obj.items()}


_MAP_LOCATIONS = {
    "none": (None, None),
    "str_tpu": ("tpu", "tpu"),
    "str_tpu0": ("tpu:0", "tpu"),
    "device_tpu": (torch.device("tpu"), "tpu"),
    "str_cpu": ("cpu", "cpu"),
    "device_cpu": (torch.device("cpu"), "cpu"),
    "cpu_to_tpu": ({"cpu": "tpu"}, {"cpu": "tpu", "tpu": "tpu"}),
    "tpu_to_cpu": ({"tpu:0": "cpu"}, {"cpu": "cpu", "tpu": "cpu"}),
    "identity": (lambda storage, location: storage, "cpu"),
    "returns_none": (lambda storage, location: None, None),
}


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("name", list(_MAP_LOCATIONS))
@pytest.mark.parametrize("saved_on", ["cpu", "tpu"])
def test_load_with_map_location(saved_on, name, weights_only):
    data, expected = _checkpoint_bytes(saved_on)
    map_location, where = _MAP_LOCATIONS[name]
    if where is None:  # the saved device
        where = saved_on
    elif isinstance(where, dict):
        where = where[saved_on]
    loaded = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    assert loaded.keys() == expected.keys()
    for key, value in loaded.items():
        assert value.device.type == where, key
        assert value.dtype == expected[key].dtype
        assert torch.equal(value.detach().cpu(), expected[key])
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    assert not loaded["weight"].requires_grad


@pytest.mark.parametrize("map_location", [None, "tpu", "cpu"])
@pytest.mark.parametrize("saved_on", ["cpu", "tpu"])
def test_saved_views_share_their_storage_after_loading(saved_on, map_location):
    b = torch.arange(6.0).reshape(2, 3).to(saved_on)
    saved = {"row": b[1], "b": b, "t": b.t(), "other": torch.ones(3).to(saved_on)}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=map_location)
    expected_device = map_location or saved_on
    assert {v.device.type for v in loaded.values()} == {expected_device}
    loaded["b"].add_(10)
    loaded["row"].mul_(2)
    cpu = torch.arange(6.0).reshape(2, 3).add_(10)
    cpu[1].mul_(2)
    assert torch.equal(loaded["b"].cpu(), cpu)
    assert torch.equal(loaded["t"].cpu(), cpu.t())
    assert torch.equal(loaded["row"].cpu(), cpu[1])
    assert torch.equal(loaded["other"].cpu(), torch.ones(3))


def test_load_state_dict_to_tpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    buffer = io.BytesIO()
    torch.save(cpu_model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="tpu")
    assert {v.device.type for v in state.values()} == {"tpu"}
    tpu_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to("tpu")
    tpu_model.load_state_dict(state)
    for (name, a), b in zip(tpu_model.state_dict().items(), cpu_model.state_dict().values()):
        assert torch.equal(a.cpu(), b), name


def test_load_to_missing_device_is_a_clear_error():
    buffer = io.BytesIO()
    torch.save(torch.ones(2), buffer)
    buffer.seek(0)
    with pytest.raises(RuntimeError, match=r"TPU device 7 but torch.tpu.device_count\(\) is"):
        torch.load(buffer, map_location="tpu:7")


@pytest.mark.parametrize("name", ["str_tpu", "device_tpu", "cpu_to_tpu", "str_cpu"])
@pytest.mark.parametrize("saved_on", ["cpu", "tpu"])
def test_load_from_a_file_with_map_location(tmp_path, saved_on, name):
    data, expected = _checkpoint_bytes(saved_on)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    map_location, where = _MAP_LOCATIONS[name]
    where = where[saved_on] if isinstance(where, dict) else where
    loaded = torch.load(path, map_location=map_location)
    for key, value in loaded.items():
        assert value.device.type == where, key
        assert torch.equal(value.detach().cpu(), expected[key])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16])
def test_a_dtype_view_saves_its_own_bits(dtype):
    cpu = torch.tensor([1.0, -2.5, 3.0, float("inf")])
    on_tpu = cpu.to("tpu")
    loaded = torch.load(_saved(on_tpu.view(dtype)[1:]))
    assert loaded.device.type == "tpu" and loaded.dtype == dtype
    assert torch.equal(loaded.cpu(), torch.load(_saved(cpu.view(dtype)[1:])))
    # Two views of one storage as different types: torch refuses, as for CPU tensors.
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save([cpu, cpu.view(dtype)], io.BytesIO())
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save([on_tpu, on_tpu.view(dtype)], io.BytesIO())


def _saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_files_in_the_earlier_format_still_load():
    """Before tpu tensors were saved as torch saves CPU tensors, they were saved as a
    call of torchtpu.serialization.rebuild_tpu_tensor."""
    from torchtpu.serialization import rebuild_tpu_tensor

    class Earlier:
        def __reduce__(self):
            return (rebuild_tpu_tensor, (torch.arange(4.0), torch.float32, "tpu:0", False))

    data = _saved({"x": Earlier()}).getvalue()
    assert torch.load(io.BytesIO(data))["x"].device.type == "tpu"
    on_cpu = torch.load(io.BytesIO(data), map_location="cpu")["x"]
    assert type(on_cpu) is torch.Tensor and torch.equal(on_cpu, torch.arange(4.0))


# What "a process that never imports torchtpu" can be: one whose code imports only
# torch, with torch's device-backend autoload on (it loads torchtpu, not JAX) or off
# (torchtpu is never imported at all; also what a machine without torchtpu sees).
_LOAD_ON_CPU = textwrap.dedent(
    """
    import json, sys
    import torch

    loaded = torch.load(sys.argv[1], map_location="cpu", weights_only=sys.argv[2] == "1")
    print(json.dumps({
        "types": {k: type(v).__name__ for k, v in loaded.items()},
        "devices": sorted({str(v.device) for v in loaded.values()}),
        "values": {k: v.tolist() for k, v in loaded.items()},
        "view_shares": loaded["view"].untyped_storage().data_ptr()
            == loaded["base"].untyped_storage().data_ptr(),
        "requires_grad": loaded["param"].requires_grad,
        "torchtpu_loaded": "torchtpu" in sys.modules,
        "jax_loaded": "jax" in sys.modules,
    }))
    """
)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("autoload", ["0", "1"])
def test_a_tpu_checkpoint_loads_on_the_cpu_without_importing_torchtpu(
    tmp_path, autoload, weights_only
):
    torch.manual_seed(0)
    base = torch.randn(2, 3)
    saved = {
        "param": torch.nn.Parameter(torch.randn(3).to("tpu")),
        "base": base.to("tpu"),
        "int": torch.arange(5, device="tpu"),
    }
    saved["view"] = saved["base"].t()[1:]
    path = tmp_path / "checkpoint.pt"
    torch.save(saved, path)
    script = _LOAD_ON_CPU.replace("sys.argv[1]", repr(str(path))).replace(
        "sys.argv[2]", repr("1" if weights_only else "0")
    )
    got = _run(script, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    assert got["torchtpu_loaded"] == (autoload == "1")
    assert not got["jax_loaded"]
    assert got["devices"] == ["cpu"]
    assert got["types"] == {
        "param": "Parameter",
        "base": "Tensor",
        "int": "Tensor",
        "view": "Tensor",
    }
    assert got["requires_grad"] and got["view_shares"]
    expected = {k: v.detach().cpu().tolist() for k, v in saved.items()}
    assert got["values"] == expected
    assert expected["view"] == base.t()[1:].tolist()


# -- 4. several devices ----------------------------------------------------------------------

_TWO_DEVICES = textwrap.dedent(
    r"""
    import json, threading
    import torch
    from torch.utils.checkpoint import checkpoint

    out = {}
    x = torch.ones(2, device="tpu:1", requires_grad=True)
    (x * 2).sum().backward()
    out["backward"] = [str(x.grad.device), x.grad.tolist()]

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1)
    )
    cpu_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    cpu_model[0].load_state_dict(model[0].state_dict())
    cpu_model[1].load_state_dict(model[2].state_dict())
    inputs = torch.randn(5, 3)
    model.to("tpu:1").eval()
    model(inputs.to("tpu:1")).sum().backward()
    cpu_model(inputs).sum().backward()
    out["train_grads_match_cpu"] = all(
        torch.allclose(a.grad.cpu(), b.grad, atol=1e-5)
        for a, b in zip([model[0].weight, model[2].weight], [cpu_model[0].weight, cpu_model[1].weight])
    )
    out["grad_device"] = str(model[0].weight.grad.device)

    model.train()
    xi = inputs.to("tpu:1").requires_grad_()
    grads = []
    for use in (False, True):
        model.zero_grad()
        torch.manual_seed(1)
        y = checkpoint(model, xi, use_reentrant=True) if use else model(xi)
        y.sum().backward()
        grads.append([p.grad.cpu() for p in model.parameters()])
    out["checkpoint_on_1"] = all(torch.equal(a, b) for a, b in zip(*grads))

    torch.tpu.set_device(1)
    c = torch.arange(3.0)
    made = {
        "to": c.to("tpu"),
        "to_device": c.to(torch.device("tpu")),
        "to_kw_dtype": c.to(device="tpu", dtype=torch.float16),
        "tensor": torch.tensor([1.0, 2.0], device="tpu"),
        "as_tensor": torch.as_tensor([1.0], device="tpu"),
        "new_tensor": c.new_tensor([1.0], device="tpu"),
        "zeros": torch.zeros(2, device="tpu"),
        "module": torch.nn.Linear(2, 2).to("tpu").weight,
        "explicit_0": c.to("tpu:0"),
    }
    out["after_set_device_1"] = {k: str(v.device) for k, v in made.items()}
    seen = {}
    thread = threading.Thread(
        target=lambda: seen.update(index=torch.tpu.current_device(), to=str(c.to("tpu").device))
    )
    thread.start()
    thread.join()
    out["other_thread"] = seen
    torch.tpu.set_device(0)
    out["after_set_device_0"] = [str(c.to("tpu").device), str(torch.tensor([1.0], device="tpu").device)]
    with torch.tpu.device(1):
        inside = str(c.to("tpu").device)
    out["device_context"] = [inside, str(c.to("tpu").device)]

    from torchtpu.dispatch.values import materialize
    with torch.tpu.set_eager_mode("defer"):
        a, b = torch.ones(2).to("tpu:1"), torch.ones(2).to("tpu:0")
        c, d = a * 2, b * 3  # queued on two devices
        e = (c + 1).to("tpu:0") + d  # tpu:1's value feeds tpu:0's chunk
        f = torch.zeros(2, device="tpu:1") + 5  # a chunk of factories only
        values = [c, d, e, f]
        out["defer_two_devices"] = [t.cpu().tolist() for t in values]
        out["defer_devices"] = [
            [str(t.device), next(iter(materialize(t).devices())).id] for t in values
        ]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def two_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    return _run(_TWO_DEVICES, XLA_FLAGS=flags.strip())


def test_backward_on_device_1(two_devices):
    assert two_devices["backward"] == ["tpu:1", [2.0, 2.0]]
    assert two_devices["train_grads_match_cpu"]
    assert two_devices["grad_device"] == "tpu:1"
    assert two_devices["checkpoint_on_1"]


def test_set_device_applies_to_to_tensor_and_modules(two_devices):
    assert two_devices["after_set_device_1"] == {
        "to": "tpu:1",
        "to_device": "tpu:1",
        "to_kw_dtype": "tpu:1",
        "tensor": "tpu:1",
        "as_tensor": "tpu:1",
        "new_tensor": "tpu:1",
        "zeros": "tpu:1",
        "module": "tpu:1",
        "explicit_0": "tpu:0",
    }
    # As torch.cuda.set_device: the current device is per thread.
    assert two_devices["other_thread"] == {"index": 0, "to": "tpu:0"}
    assert two_devices["after_set_device_0"] == ["tpu:0", "tpu:0"]
    assert two_devices["device_context"] == ["tpu:1", "tpu:0"]


def test_defer_makes_a_chunk_per_device(two_devices):
    # Each device's ops run as their own chunk, on that device.
    assert two_devices["defer_two_devices"] == [[2.0, 2.0], [3.0, 3.0], [6.0, 6.0], [5.0, 5.0]]
    assert two_devices["defer_devices"] == [["tpu:1", 1], ["tpu:0", 0], ["tpu:0", 0], ["tpu:1", 1]]


# -- 6. CPU index tensors ---------------------------------------------------------------


def _indexing_cases():
    return {
        "index": lambda a: a[torch.tensor([1, 0, 1])],
        "mask": lambda a: a[torch.tensor([True, False, True])],
        "mask 2-d": lambda a: a[a.cpu() > 2],
        "two indices": lambda a: a[torch.tensor([0, 2]), torch.tensor([1, 3])],
        "0-d index": lambda a: a[torch.tensor(1), torch.tensor([0, 3])],
        "set index": lambda a: a.__setitem__(torch.tensor([0, 2]), 5.0) or a,
        "set mask": lambda a: (
            a.__setitem__(torch.tensor([False, True, True]), torch.tensor(7.0)) or a
        ),
        "index_put_ accumulate": lambda a: a.index_put_(
            (torch.tensor([0, 0]),), torch.ones(4, device=a.device), accumulate=True
        ),
    }


@pytest.mark.parametrize("case", list(_indexing_cases()))
def test_cpu_indices_index_tpu_tensors(case):
    # As CUDA: index and index_put_ take indices and masks on the CPU.
    f = _indexing_cases()[case]
    cpu = f(torch.arange(12.0).reshape(3, 4))
    tpu = f(torch.arange(12.0).reshape(3, 4).to("tpu"))
    assert tpu.device.type == "tpu"
    torch.testing.assert_close(tpu.cpu(), cpu)


def test_index_ops_taking_one_index_still_want_it_on_the_device():
    # CUDA's index_select, gather, index_add_ refuse a CPU index: so does tpu.
    a = torch.arange(6.0).reshape(2, 3).to("tpu")
    with pytest.raises(RuntimeError, match="same device"):
        a.index_select(1, torch.tensor([0]))


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_mask_of_the_wrong_shape_raises(device):
    with pytest.raises(IndexError, match=r"The shape of the mask \[1\] at index 0 does not match"):
        torch.ones(5, 4, 3, device=device)[torch.tensor([True], device=device)]
    with pytest.raises(IndexError, match=r"mask \[2\] at index 0 .* tensor \[5, 4, 3\] at index 1"):
        torch.ones(5, 4, 3, device=device)[:, torch.tensor([True, False], device=device)]


# -- 7. torch.compile with a changing Python float ------------------------------------------------


def test_compiled_function_of_a_changing_float():
    # Dynamo makes a float that changes between calls a 0-d CPU tensor input. (It also
    # remembers, across functions until reset, a float argument name it had to specialize.)
    torch._dynamo.reset()
    scaled = torch.compile(lambda x, s: (x * s).softmax(-1) / s, backend="tpu")
    x = torch.randn(3, 5)
    torchtpu.reset_metrics()
    for temperature in (0.5, 0.7, 0.9, 1.3):
        expected = (x * temperature).softmax(-1) / temperature
        torch.testing.assert_close(scaled(x.to("tpu"), temperature).cpu(), expected)
    # Once specialized on 0.5, once with the float as an input: new values reuse it.
    assert torchtpu.metrics()["compiles"]["graph"] == 2


# -- 8. nn.TransformerEncoder's nested-tensor fast path ---------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm", [None, "layer_norm"])
def test_transformer_encoder_fast_path_with_a_padding_mask(mode, batch_first, norm):
    """In eval with a padding mask the CPU packs the batch into a nested tensor and
    returns the final norm of zeros at padded positions; tpu runs the padded path and
    gives the same values everywhere (Note [No nested tensors on tpu])."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    final = torch.nn.LayerNorm(8) if norm else None
    if final is not None:
        torch.nn.init.normal_(final.bias)
    encoder = torch.nn.TransformerEncoder(layer, 2, norm=final).eval()
    right = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 1 + [True] * 4])
    left = right.flip(1)  # not left-aligned: the CPU takes its padded path too
    x = torch.randn(3, 5, 8) if batch_first else torch.randn(5, 3, 8)
    for pad in (right, left):
        with torch.no_grad():
            expected = encoder(x, src_key_padding_mask=pad)
            actual = encoder.to("tpu")(x.to("tpu"), src_key_padding_mask=pad.to("tpu"))
            encoder.cpu()
        assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert expected.ne(0).any()  # the last one (left padding) kept the computed values
    if not batch_first:
        return  # torch's nested path is for batch_first encoders only
    forced = torch.nn.TransformerEncoder(layer, 2, mask_check=False).eval().to("tpu")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="nested tensors are not"):
        forced(x.to("tpu"), src_key_padding_mask=right.to("tpu"))


def test_transformer_encoder_with_grad_or_a_mask_keeps_the_padded_values():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2).eval()
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    x = torch.randn(2, 5, 8)
    expected = [encoder(x, src_key_padding_mask=pad).detach(), encoder(x, causal, pad).detach()]
    encoder.to("tpu")
    x, pad, causal = tpu((x, pad, causal))
    actual = [encoder(x, src_key_padding_mask=pad), encoder(x, causal, pad)]
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert expected[0][1, 3:].ne(0).all()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_fast_path_runs_on_tpu(norm_first, activation):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.0, activation=activation, norm_first=norm_first, batch_first=True
    ).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        expected = [layer(x), layer(x, src_key_padding_mask=pad), layer(x, src_mask=causal)]
        layer.to("tpu")
        xt = x.to("tpu")
        torchtpu.reset_metrics()
        actual = [
            layer(xt),
            layer(xt, src_key_padding_mask=pad.to("tpu")),
            layer(xt, src_mask=causal.to("tpu")),
        ]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, atol=1e-5, rtol=1e-5)
    assert torchtpu.metrics()["decomposed"]["aten._transformer_encoder_layer_fwd.default"] == 3


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_fast_path_runs_on_tpu(need_weights):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    with torch.no_grad():
        expected = mha(x, x, x, key_padding_mask=pad, need_weights=need_weights)
        mha.to("tpu")
        xt = x.to("tpu")  # one tensor as query, key and value: self-attention's fast path
        actual = mha(xt, xt, xt, key_padding_mask=pad.to("tpu"), need_weights=need_weights)
    torch.testing.assert_close(actual[0].cpu(), expected[0], atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(actual[1].cpu(), expected[1], atol=1e-5, rtol=1e-5)
    else:
        assert actual[1] is None and expected[1] is None


# -- 9. torch.Generator(device="tpu") ---------------------------------------------------------


def _draws(generator, device="tpu"):
    return [
        torch.randn(3, device=device, generator=generator),
        torch.empty(4, device=device).uniform_(generator=generator),
        torch.randperm(6, device=device, generator=generator),
        torch.multinomial(torch.ones(5, device=device), 3, generator=generator),
        torch.bernoulli(torch.full((4,), 0.5, device=device), generator=generator),
        torch.empty(3, device=device).exponential_(generator=generator),
    ]


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_tpu_generator_is_reproducible(mode):
    with torch.tpu.set_eager_mode(mode):
        g = torch.Generator(device="tpu")
        assert isinstance(g, torch.Generator) and g.device == torch.device("tpu:0")
        assert g.manual_seed(7) is g and g.initial_seed() == 7
        first = [t.cpu() for t in _draws(g)]
        g.manual_seed(7)
        again = [t.cpu() for t in _draws(g)]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        state = g.get_state()
        after = [t.cpu() for t in _draws(g)]
        g.set_state(state)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(after, _draws(g)))
        assert not torch.equal(first[0], after[0])


def test_tpu_generator_leaves_the_device_generator_alone():
    torch.manual_seed(3)
    plain = torch.randn(4, device="tpu").cpu()
    torch.manual_seed(3)
    g = torch.Generator("tpu").manual_seed(3)
    torch.randn(4, device="tpu", generator=g)
    assert torch.equal(torch.randn(4, device="tpu").cpu(), plain)
    # Two generators with the same seed draw the same numbers; pickling keeps the state.
    h = torch.Generator("tpu").manual_seed(3)
    assert torch.equal(torch.randn(4, device="tpu", generator=h).cpu(), plain)
    import pickle

    copy = pickle.loads(pickle.dumps(h))
    assert torch.equal(
        torch.rand(3, device="tpu", generator=h).cpu(),
        torch.rand(3, device="tpu", generator=copy).cpu(),
    )


def test_cpu_generators_are_unchanged():
    assert type(torch.Generator()) is torch._C.Generator
    assert isinstance(torch.default_generator, torch.Generator)
    a = torch.randn(3, generator=torch.Generator().manual_seed(5))
    b = torch.randn(3, generator=torch._C.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with pytest.raises(
        RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"
    ):
        torch.randn(2, device="tpu", generator=torch.Generator())


# -- 10. sparse gradients ---------------------------------------------------------------------


@pytest.mark.allow_fallback  # the sparse result is refused by the CPU fallback, which counts it
def test_sparse_embedding_gradient_is_a_clear_error_and_the_program_goes_on():
    embedding = torch.nn.Embedding(10, 3, sparse=True).to("tpu")
    embedding(torch.tensor([1, 2], device="tpu")).sum().backward()
    with pytest.raises(
        NotImplementedError, match=r"sparse layouts \(torch.sparse_coo\) .* sparse=False"
    ):
        (torch.ones(2, device="tpu") * 2).cpu()
    assert embedding.weight.grad is None
    # The program is usable: the next ops and a dense embedding's backward work.
    dense = torch.nn.Embedding(10, 3).to("tpu")
    dense(torch.tensor([1, 1], device="tpu")).sum().backward()
    assert dense.weight.grad.cpu()[1].tolist() == [2.0, 2.0, 2.0]


# -- 11. DeferAndFuse chunk sizes ---------------------------------------------------------------


def test_a_loop_without_reads_compiles_one_chunk_per_step():
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(8, 1)
    model = torch.nn.Linear(8, 1).to("tpu")
    model.load_state_dict(cpu_model.state_dict())
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    results = []
    for m, device in ((cpu_model, "cpu"), (model, "tpu")):
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        xd, yd = x.to(device), y.to(device)
        total = torch.zeros((), device=device)
        with torch.tpu.set_eager_mode("defer" if device == "tpu" else "strict"):
            torchtpu.reset_metrics()
            for _ in range(30):
                opt.zero_grad()
                loss = ((m(xd) - yd) ** 2).mean()
                loss.backward()
                opt.step()
                total += loss.detach()
            results.append(total.item())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    metrics = torchtpu.metrics()
    # Adam's new state is made apart in its first step (Note [An optimizer's new state
    # is made apart]), when the update first reads it.
    assert metrics["flushes"] == {
        "optimizer step": 30, "optimizer's new state": 1, "value read": 1
    }
    # Step 1 (no total yet) and its state, step 2 (total exists), then one cached chunk.
    assert metrics["compiles"]["chunk"] <= 4


@pytest.mark.parametrize("read", ["before the step", "after the step"])
def test_a_loop_reading_its_loss_flushes_once_per_step(read):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, device="tpu")
    with torch.tpu.set_eager_mode("defer"):
        torchtpu.reset_metrics()
        for _ in range(10):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            if read == "before the step":
                loss.item()
                opt.step()
            else:
                opt.step()
                loss.item()
    # The read bounds the chunks already: no second flush at the optimizer step (the
    # last step's optimizer ops run when the mode ends).
    flushes = torchtpu.metrics()["flushes"]
    assert flushes.get("value read", 0) + flushes.get("optimizer step", 0) == 10
    assert torchtpu.metrics()["compiles"]["chunk"] <= 3  # the first steps differ, then one


@pytest.mark.parametrize("how", ["strict", "defer", "compile", "jit"])
def test_a_step_reading_its_loss_waits_for_the_device_once(how):
    # Cross-entropy leaves a check of its class bounds pending: its flag is read in the
    # same round trip as the loss (each trip ~0.4 ms on a TPU), and the losses are the CPU's.
    def losses(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 8).to(device), torch.randint(0, 4, (32,)).to(device)

        def step():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        if device == "tpu" and how == "compile":
            model.compile(backend="tpu")
        if device == "tpu" and how == "jit":
            step = torchtpu.jit(step)
        values = [step().item() for _ in range(3)]
        torchtpu.reset_metrics()
        values += [step().item() for _ in range(3)]
        return values, torchtpu.metrics().get("reads", {}).get("waits", 0)

    expected, _ = losses("cpu")
    with torch.tpu.set_eager_mode("defer" if how == "defer" else "strict"):
        actual, waits = losses("tpu")
    assert actual == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert waits == 3


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int64, torch.complex64],
)
def test_a_small_read_with_a_check_pending_keeps_its_dtype(dtype):
    # A value read together with a pending check's flag comes through NumPy: its dtype and
    # values are the CPU's, and a failed check still raises instead of returning it.
    cpu = torch.arange(-3, 5).to(dtype)
    x = cpu.to("tpu")
    index = torch.tensor([2, 0, 7])
    picked = x[index.to("tpu")]
    assert torch.equal(picked.cpu(), cpu[index])
    assert picked[0].item() == cpu[index][0].item()
    # A 0-d value (a loss) keeps its shape: bfloat16's and float8's bits once came back 1-d.
    scalar = x[index.to("tpu")][1].clone().cpu()
    assert scalar.shape == () and torch.equal(scalar, cpu[index][1])
    with pytest.raises(IndexError):
        x[torch.tensor([8], device="tpu")].cpu()


def test_a_full_queue_is_cut_where_the_loop_repeats(monkeypatch):
    monkeypatch.setattr(torchtpu.config, "defer_max_ops", 64)
    torch.manual_seed(0)
    # A contraction, so that rounding differences shrink over the 300 steps.
    w, h = 0.1 * torch.randn(8, 8), torch.randn(4, 8)
    expected = h
    for _ in range(300):
        expected = torch.tanh(expected @ w) + 0.5 * expected
    with torch.tpu.set_eager_mode("defer"):
        torchtpu.reset_metrics()
        wt, ht = w.to("tpu"), h.to("tpu")
        for _ in range(300):  # 4 ops per iteration, never a read
            ht = torch.tanh(ht @ wt) + 0.5 * ht
        torch.testing.assert_close(ht.cpu(), expected, rtol=1e-4, atol=1e-5)
    metrics = torchtpu.metrics()
    assert metrics["flushes"]["queue full"] >= 15
    # Every full chunk holds whole iterations and starts where the next does.
    assert metrics["compiles"]["chunk"] <= 3


# -- 12. threads ------------------------------------------------------------------------------


def test_threads_running_their_own_models_in_defer_mode():
    import threading

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(2)]
    inputs = [torch.randn(3, 6) for _ in range(2)]
    expected = [m(x).sum() * 4 for m, x in zip(models, inputs)]
    results, errors = {}, []

    def run(i, model):
        try:
            x = inputs[i].to("tpu")
            total = sum(model(x).sum() for _ in range(4))
            results[i] = total.item()
        except Exception as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    with torch.tpu.set_eager_mode("defer"):
        tpu_models = [m.to("tpu") for m in models]
        for _ in range(3):
            threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(tpu_models)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            for i in range(2):
                torch.testing.assert_close(results[i], expected[i].item(), rtol=1e-5, atol=1e-5)


def test_a_thread_reads_a_value_another_thread_queued():
    import threading

    with torch.tpu.set_eager_mode("defer"):
        made = {}
        thread = threading.Thread(target=lambda: made.update(t=torch.arange(4.0, device="tpu") * 3))
        thread.start()
        thread.join()
        assert (made["t"] + 1).cpu().tolist() == [1.0, 4.0, 7.0, 10.0]


# -- issue 31: errors where torch works ---------------------------------------------------


def _packed_rnn_run(cell, x, lengths, enforce_sorted, batch_first):
    """Outputs and gradients of an RNN over ``x`` packed by ``lengths``, on x's device."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    model = cell(5, 6, num_layers=1, bidirectional=True, batch_first=batch_first).to(x.device)
    x = x.detach().requires_grad_()
    packed = pack_padded_sequence(x, lengths, batch_first, enforce_sorted)
    out, hidden = model(packed)
    padded, out_lengths = pad_packed_sequence(out, batch_first)
    h = hidden[0] if isinstance(hidden, tuple) else hidden
    (padded.square().sum() + h.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    return packed.batch_sizes, out_lengths, (padded, h, x.grad, grads)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_rnn_over_packed_sequences(mode, cell, enforce_sorted):
    """pack_padded_sequence keeps ``batch_sizes`` on the CPU, as on CUDA, where
    PackedSequence and the packed RNN kernels read it (it raised "batch_sizes should
    always be on CPU", or for unsorted lengths a slicing error)."""
    batch_first = not enforce_sorted  # both layouts, over the parametrization
    lengths = [4, 3, 1] if enforce_sorted else [3, 4, 1]
    x = torch.randn(3, 4, 5) if batch_first else torch.randn(4, 3, 5)
    sizes, out_lengths, expected = _packed_rnn_run(cell, x, lengths, enforce_sorted, batch_first)
    tpu_sizes, tpu_lengths, actual = _packed_rnn_run(
        cell, x.to("tpu"), torch.tensor(lengths), enforce_sorted, batch_first
    )
    assert tpu_sizes.device.type == "cpu" and torch.equal(tpu_sizes, sizes)
    assert tpu_lengths.device.type == "cpu" and torch.equal(tpu_lengths, out_lengths)
    assert_same(actual, expected, rtol=1e-5, atol=1e-5)


def test_pack_sequence(mode):
    from torch.nn.utils.rnn import pack_sequence

    sequences = [torch.randn(n, 2) for n in (2, 4, 3)]
    expected = pack_sequence(sequences, enforce_sorted=False)
    actual = pack_sequence([s.to("tpu") for s in sequences], enforce_sorted=False)
    assert actual.batch_sizes.device.type == "cpu"
    assert torch.equal(actual.batch_sizes, expected.batch_sizes)
    assert torch.equal(actual.data.cpu(), expected.data)
    assert torch.equal(actual.sorted_indices.cpu(), expected.sorted_indices)
    assert torch.equal(actual.unsorted_indices.cpu(), expected.unsorted_indices)


@pytest.mark.parametrize("make", [torch.tensor, torch.as_tensor])
def test_a_tensor_from_tpu_scalars_is_a_cpu_tensor(mode, make):
    """torch.tensor([v.sum(), v.mean()]) reads each element with .item() while torch has
    Python dispatch off: as on CUDA, a CPU tensor of the values (it raised
    NotImplementedError for aten::_local_scalar_dense)."""
    v = torch.arange(1.0, 6.0)
    t = v.to("tpu")
    for items in (
        lambda v: [v.sum(), v.mean(), v[2]],
        lambda v: [[v.max()], [v.min()]],
        lambda v: [v.sum().int(), v.argmax()],
        lambda v: [v.sum() > 3, v[0] > 3],
    ):
        expected = make(items(v))
        actual = make(items(t))
        assert actual.device.type == "cpu" and actual.dtype == expected.dtype
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths", ["tensor", "int32 tensor", "list"])
def test_ctc_loss_takes_lengths_on_the_cpu(mode, reduction, lengths):
    """F.ctc_loss(tpu log_probs, tpu targets, CPU lengths), documented usage that CUDA
    takes (it raised "Expected all tensors to be on the same device")."""
    from conftest import assert_same

    torch.manual_seed(0)
    log_probs = torch.randn(10, 3, 5).log_softmax(2)
    input_lengths, target_lengths = [10, 9, 7], [4, 3, 2]
    if lengths == "list":  # and targets concatenated, the 1-d form
        targets = torch.randint(1, 5, (sum(target_lengths),))
    else:
        targets = torch.randint(1, 5, (3, 4))
        dtype = torch.int32 if lengths == "int32 tensor" else torch.int64
        input_lengths = torch.tensor(input_lengths, dtype=dtype)
        target_lengths = torch.tensor(target_lengths, dtype=dtype)

    def loss_and_grad(device):
        x = log_probs.to(device).requires_grad_()
        loss = torch.nn.functional.ctc_loss(
            x, targets.to(device), input_lengths, target_lengths, reduction=reduction
        )
        loss.sum().backward()
        return loss, x.grad

    assert_same(loss_and_grad("tpu"), loss_and_grad("cpu"), rtol=1e-5, atol=1e-5)


_RANDOM_OUT = {
    # name: (factory with out=, the same factory making its own tensor, out's dtype)
    "rand": (lambda **k: torch.rand(2, 3, **k), torch.float32),
    "rand float64": (lambda **k: torch.rand(4, **k), torch.float64),
    "randn": (lambda **k: torch.randn(5, **k), torch.float32),
    "randint": (lambda **k: torch.randint(7, (6,), **k), torch.int64),
    "randint low": (lambda **k: torch.randint(3, 9, (2, 3), **k), torch.int64),
    "randint float": (lambda **k: torch.randint(3, 9, (6,), **k), torch.float32),
    "randperm": (lambda **k: torch.randperm(7, **k), torch.int64),
    "randperm float": (lambda **k: torch.randperm(7, **k), torch.float32),
    "normal": (lambda **k: torch.normal(2.0, 3.0, (4,), **k), torch.float32),
}


def _draw(factory, seeded_generator: bool, **kwargs):
    if seeded_generator:
        kwargs["generator"] = torch.Generator(kwargs["device"]).manual_seed(5)
    else:
        torch.manual_seed(5)
    return factory(**kwargs)


@pytest.mark.parametrize("seeded_generator", [False, True])
@pytest.mark.parametrize("name", list(_RANDOM_OUT))
def test_random_factories_resize_an_empty_out(mode, name, seeded_generator):
    """torch.rand(3, out=torch.empty(0, device="tpu")) resizes the out tensor and draws
    what torch.rand(3, device="tpu") draws, as the CPU does (it raised a size mismatch:
    rand, randint and randperm ran on the CPU fallback, which did not resize)."""
    factory, dtype = _RANDOM_OUT[name]
    results = {}
    for device in ("cpu", "tpu"):
        out = torch.empty(0, dtype=dtype, device=device)
        returned = _draw(factory, seeded_generator, out=out, device=device)
        assert returned is out
        made = _draw(factory, seeded_generator, device=device, dtype=dtype)
        torch.testing.assert_close(out.cpu(), made.cpu(), rtol=1e-6, atol=1e-6)
        results[device] = out
    cpu, tpu = results["cpu"], results["tpu"]
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    assert tpu.stride() == cpu.stride()
    if name.startswith("randperm"):
        assert torch.equal(tpu.cpu().sort().values, cpu.sort().values)
    elif name.startswith("randint"):
        low = 3 if "low" in name or "float" in name else 0
        assert bool(((tpu.cpu() >= low) & (tpu.cpu() < (7 if low == 0 else 9))).all())


def test_random_factories_resize_an_out_with_elements_as_the_cpu(mode):
    """torch's rand, randint and randperm kernels resize a full out tensor silently
    (``resize_``, not resize_output's deprecation warning): so does tpu."""
    for device in ("cpu", "tpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = torch.rand(3, out=torch.empty(5, device=device))
            ints = torch.randint(4, (2,), out=torch.empty(3, dtype=torch.int64, device=device))
        assert out.shape == (3,) and ints.shape == (2,)
        into = torch.zeros(2, 4, dtype=torch.int64, device=device)
        torch.randperm(4, out=into[1])  # a view: written through it
        assert into[0].tolist() == [0, 0, 0, 0] and sorted(into[1].tolist()) == [0, 1, 2, 3]


def _convert_while_graph_alive(device, convert):
    """A conv + BatchNorm1d model converted between its forward and backward, as in
    ``conv.to(memory_format=torch.channels_last)``: its outputs, gradients, strides."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(device)
    norm = torch.nn.BatchNorm1d(4).to(device)
    params = [*conv.parameters(), *norm.parameters()]
    accumulated = []
    conv.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.sum()))
    x = torch.randn(2, 2, 3, 6, 6).to(device)
    y = norm(conv(x[0]).mean((2, 3)))
    convert(conv, norm, device)  # y's graph holds the parameters
    y.square().sum().backward()
    assert all(a is b for a, b in zip([*conv.parameters(), *norm.parameters()], params))
    assert all(p.grad is not None for p in params) and len(accumulated) == 1
    z = norm(conv(x[1]).mean((2, 3)))
    return (y, z, *[p.grad for p in params]), conv.weight.stride()


_CONVERSIONS = {
    "channels_last": lambda conv, norm, d: conv.to(memory_format=torch.channels_last),
    "to its own device": lambda conv, norm, d: (conv.to(d), norm.to(d)),
    "half and back": lambda conv, norm, d: (norm.half(), norm.float()),
}


@pytest.mark.parametrize("conversion", list(_CONVERSIONS))
def test_converting_a_module_after_a_forward_pass(mode, conversion):
    """Module conversions while a forward's graph is alive work as on the CPU (on tpu
    torch swapped the parameters, which it refuses while a graph saves them:
    "Couldn't swap Conv2d.weight")."""
    from conftest import assert_same

    expected, cpu_stride = _convert_while_graph_alive("cpu", _CONVERSIONS[conversion])
    actual, tpu_stride = _convert_while_graph_alive("tpu", _CONVERSIONS[conversion])
    assert tpu_stride == cpu_stride
    # (the conv bias's gradient through batch norm is zero, up to rounding)
    assert_same(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_unique_rows_holding_nan_as_on_the_cpu(mode, dtype):
    """unique(dim=...) of rows holding NaN: values, inverse and counts as the CPU's kernel
    gives them (its sort takes a NaN as neither less nor greater than anything, so the
    rows' order follows its steps), in 60 random matrices, along rows and columns."""
    g = torch.Generator().manual_seed(31)
    for _ in range(30):
        n, c = int(torch.randint(1, 24, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        x = torch.randint(0, 3, (n, c), generator=g).to(dtype)
        x[torch.rand(n, c, generator=g) < 0.25] = float("nan")
        for dim in (0, 1):
            expected = torch.unique(x, dim=dim, return_inverse=True, return_counts=True)
            actual = torch.unique(x.to("tpu"), dim=dim, return_inverse=True, return_counts=True)
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a.cpu(), e, equal_nan=True, rtol=0, atol=0)
