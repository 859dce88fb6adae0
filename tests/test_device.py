"""The tpu device: registration, autoload, torch.tpu, moving things to and from it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
import torch
import torch.nn as nn

import torchtpu
from conftest import assert_same
from torchtpu.runtime import platform


def _run(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_torch_alone_registers_the_device_without_importing_jax():
    out = _run(
        "import sys, torch\n"
        "print('jax' in sys.modules, torch.device('tpu'), hasattr(torch, 'tpu'))\n"
        "x = torch.randn(4, 4, device='tpu'); print((x @ x).cpu().shape, 'jax' in sys.modules)"
    )
    assert out.split() == ["False", "tpu", "True", "torch.Size([4,", "4])", "True"]


def test_autoload_can_be_disabled():
    out = _run("import torch; print(hasattr(torch, 'tpu'))", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.strip() == "False"


def test_device_module_api():
    assert torch.tpu is torchtpu.device
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    torch.tpu.set_device("tpu:0")
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.tpu.set_device(torch.tpu.device_count())
    torch.tpu.synchronize()
    # JAX's name of the device: "cpu (XLA)" on its CPU backend, "TPU v5 lite" on a v5e
    name = "cpu (XLA)" if platform() == "cpu" else jax.devices()[0].device_kind
    assert torch.tpu.get_device_name() == name
    props = torch.tpu.get_device_properties(0)
    assert props.name == name and props.platform == platform()
    # the memory its arrays live in (the host's here), never 0: libraries divide by it
    assert props.total_memory == torch.tpu.mem_get_info(0)[1] > 0
    assert (props.major, props.minor) == torch.tpu.get_device_capability(0)
    assert torch.tpu.EagerMode.DEFER_NEVER is torchtpu.EagerMode.DEFER_NEVER
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    assert torch.tpu.Precision.HIGHEST.value == "highest"
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]


def test_manual_seed_and_rng_state():
    torch.tpu.manual_seed(123)
    assert torch.tpu.initial_seed() == 123
    state = torch.tpu.get_rng_state()
    a = torch.randn(5, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    b = torch.randn(5, device="tpu").cpu()
    assert torch.equal(a, b)
    torch.manual_seed(7)  # torch's own seeding reaches the tpu generator
    assert torch.tpu.initial_seed() == 7
    torch.tpu.manual_seed_all(7)
    assert torch.equal(
        torch.randn(3, device="tpu").cpu(),
        (torch.manual_seed(7), torch.randn(3, device="tpu").cpu())[1],
    )


@pytest.mark.parametrize("spelling", ["tpu", "tpu:0", torch.device("tpu"), torch.device("tpu", 0)])
def test_tensor_to_tpu_and_back(spelling):
    x = torch.randn(3, 4)
    t = x.to(spelling)
    assert isinstance(t, torchtpu.TPUTensor) and t.device == torch.device("tpu:0")
    assert torch.equal(t.cpu(), x) and torch.equal(t.to("cpu"), x)
    assert torch.equal(x.tpu().cpu(), x)


def test_to_tpu_moves_pytrees_and_modules():
    model = nn.Linear(3, 2)
    batch = {"x": torch.randn(2, 3), "pair": (torch.arange(3), 5), "name": "batch", "none": None}
    moved = torchtpu.to_tpu(batch)
    assert moved["x"].device.type == "tpu" and moved["pair"][0].device.type == "tpu"
    assert moved["pair"][1] == 5 and moved["name"] == "batch" and moved["none"] is None
    assert_same(moved["x"], batch["x"])
    assert torchtpu.to_tpu(model) is model
    assert all(p.device.type == "tpu" and isinstance(p, nn.Parameter) for p in model.parameters())
    with pytest.raises(ValueError, match="tpu device"):
        torchtpu.to_tpu(batch, "cpu")


def test_module_to_tpu_keeps_parameters_trainable():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to("tpu")
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    assert model[1].running_mean.device.type == "tpu"
    model.half()
    assert model[0].weight.dtype == torch.float16 and model[0].weight.device.type == "tpu"
    model.to("cpu")
    assert model[0].weight.device.type == "cpu"


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.zeros(2, 3, device=d),
        lambda d: torch.ones(2, 3, dtype=torch.int32, device=d),
        lambda d: torch.empty(2, 3, device=d).shape,
        lambda d: torch.full((2,), 1.5, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(1, 4, 0.5, device=d),
        lambda d: torch.eye(3, 4, device=d),
        lambda d: torch.linspace(-1, 1, 7, device=d),
        lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        lambda d: torch.tensor(2.5, device=d),
        lambda d: torch.randn(2, 3, device=d).shape,
        lambda d: torch.rand(2, 3, device=d).dtype,
        lambda d: torch.randint(0, 5, (3,), device=d).dtype,
    ],
)
def test_factories(make):
    expected = make("cpu")
    actual = make("tpu")
    if isinstance(expected, torch.Tensor):
        assert_same(actual, expected)
    else:
        assert actual == expected


def test_mixing_cpu_and_tpu_tensors():
    t = torch.ones(3, device="tpu")
    assert_same(t + torch.tensor(2.0), torch.ones(3) + 2)  # 0-d CPU tensors join like scalars
    with pytest.raises(RuntimeError, match="same device"):
        t + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(torch.ones(2, 2, device="tpu"), torch.ones(2, 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.new_empty(2, device="cpu").shape,
        lambda x: x.new_zeros(2, device="cpu"),
        lambda x: x.new_full((2,), 3.0, device="cpu"),
        lambda x: torch.zeros_like(x, device="cpu"),
        lambda x: torch.empty_like(x, device="cpu").shape,
        lambda x: torch.linspace(x[0], 5, 4, device="cpu"),
        lambda x: torch.logspace(x[0], x[1], 3, device="cpu"),
    ],
)
def test_results_asked_for_on_the_cpu_are_cpu_tensors(make):
    """From tpu inputs, an op told ``device="cpu"`` makes a CPU tensor (as from CUDA
    inputs), and that is not the CPU fallback."""
    x = torch.tensor([1.0, 2.0])
    actual = make(x.to("tpu"))
    expected = make(x)
    if isinstance(expected, torch.Tensor):
        assert actual.device.type == "cpu"
        torch.testing.assert_close(actual, expected)
    else:
        assert actual == expected


# -- memory ------------------------------------------------------------------------------


def test_memory_allocated_moves_by_a_tensors_size():
    import gc

    gc.collect()  # arrays of earlier tests, unreferenced, go now rather than mid-test
    # Counted at once, as torch's allocator counts, with no wait: on a v5e the device's
    # own bytes_in_use moved by 0 bytes here (an array's buffer is counted from when its
    # program runs, and a deleted one's until the device is done with it) and by the
    # tensor's bytes plus 49 KiB on a first call (the program loaded for it).
    before = torch.tpu.memory_allocated()
    x = torch.ones(1024, 256, device="tpu")
    assert torch.tpu.memory_allocated() - before == 1024 * 256 * 4
    assert torch.tpu.max_memory_allocated() >= torch.tpu.memory_allocated()
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated()
    stats = torch.tpu.memory_stats()
    assert stats["source"] in ("jax", "live arrays")
    # The keys of CUDA's allocator a training loop's monitor reads (TorchTitan's):
    # every allocated byte is active, reserved keeps its peak, nothing is retried.
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]
    assert stats["active_bytes.all.peak"] == stats["allocated_bytes.all.peak"]
    assert stats["reserved_bytes.all.peak"] >= stats["reserved_bytes.all.current"] >= 1024 * 256 * 4
    assert stats["num_alloc_retries"] == 0
    del x
    assert torch.tpu.memory_allocated() == before
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total
    assert "MiB allocated" in torch.tpu.memory_summary()


def test_a_tpus_program_temporaries_count_in_peak_and_reserved(monkeypatch):
    # A TPU reports compiled programs' temporaries apart from its arrays: on a v5e a
    # program's 512 MiB temporary moved bytes_reserved and peak_bytes_reserved, not
    # peak_bytes_in_use. A whole step's activations are such temporaries.
    import torchtpu.memory as memory

    mib = 1 << 20
    stats = {"bytes_in_use": 100 * mib, "peak_bytes_in_use": 300 * mib, "bytes_limit": 16 << 30,
             "bytes_reserved": 512 * mib, "peak_bytes_reserved": 512 * mib}  # fmt: skip
    monkeypatch.setattr(memory, "_device_stats", lambda chip: stats)
    torch.tpu.reset_peak_memory_stats()
    allocated = torch.tpu.memory_allocated()
    assert torch.tpu.max_memory_allocated() == allocated  # nothing ran since the reset
    assert torch.tpu.memory_reserved() == max(612 * mib, allocated)
    assert torch.tpu.mem_get_info()[0] == (16 << 30) - max(612 * mib, allocated)
    stats.update(peak_bytes_reserved=2048 * mib, bytes_reserved=2048 * mib)  # a step ran
    assert torch.tpu.max_memory_allocated() == 2348 * mib
    monkeypatch.undo()
    torch.tpu.reset_peak_memory_stats()


def test_after_a_reset_a_tpus_step_peak_counts_its_programs(monkeypatch):
    # A TPU's own peak cannot be reset: after reset_peak_memory_stats() a step below the
    # all-time peak moved nothing (on the v5e the peak test below failed for jit and
    # compile). Each chunk's run counts instead: the bytes in use and reserved (loaded
    # programs' temporaries) then, plus its new outputs (XLA's account).
    import torchtpu.memory as memory

    mib = 1 << 20
    stats = {"bytes_in_use": 100 * mib, "peak_bytes_in_use": 4096 * mib, "bytes_limit": 16 << 30,
             "bytes_reserved": 50 * mib, "peak_bytes_reserved": 512 * mib}  # fmt: skip
    monkeypatch.setattr(memory, "_device_stats", lambda chip: stats)
    x = torch.ones(1024, 1024).to("tpu")
    torch.tpu.reset_peak_memory_stats()
    with torchtpu.set_eager_mode("defer"):
        y = (x * 2, x + 1)  # a chunk of 8 MiB of new outputs
        y[0].cpu()
    assert torch.tpu.max_memory_allocated() >= 150 * mib + 8 * mib
    del y


def _step(model, batch):
    """A forward over a batch made on the device; too large a batch runs out of memory."""
    x = torch.ones(batch, 1024, device="tpu") * 0.01
    return model(x).sum().item() / batch


def test_out_of_memory_is_torchs_and_a_smaller_batch_then_runs(mode):
    """The device running out of memory raises torch.OutOfMemoryError, as CUDA does, in
    every mode; after it the process backs off to a smaller batch (the users' loop) and
    gets the CPU's value, with the model's parameters intact."""
    torch.manual_seed(0)
    cpu_model = nn.Linear(1024, 8)
    model = nn.Linear(1024, 8).to("tpu")
    model.load_state_dict(cpu_model.state_dict())
    # Inputs of four times the device's memory (on the CPU backend, the host's).
    too_many = 1 << (4 * torch.tpu.mem_get_info()[1] // 4096).bit_length()
    losses, batch = [], too_many
    ooms = torch.tpu.memory_stats()["num_ooms"]
    while True:
        try:
            losses.append(_step(model, batch))
            break
        except torch.OutOfMemoryError as error:
            message = str(error)
            assert message.startswith("tpu out of memory: ") and " GiB" in message, message
            torch.tpu.empty_cache()
            batch = 16
    assert batch == 16
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    expected = cpu_model(torch.ones(16, 1024) * 0.01).sum().item() / 16
    assert losses == [pytest.approx(expected, rel=1e-5)]
    assert_same(model.weight, cpu_model.weight)


def test_per_process_memory_fraction_is_a_limit(mode):
    """set_per_process_memory_fraction: an op whose output would pass the fraction of the
    device's memory raises torch.OutOfMemoryError naming the op and the limit; smaller
    ones run; 1.0 lifts it. Its argument is checked as torch.cuda checks it."""
    total = torch.tpu.mem_get_info()[1]
    allocated = torch.tpu.memory_allocated()
    try:
        torch.tpu.set_per_process_memory_fraction((allocated + (8 << 20)) / total)
        assert torch.tpu.get_per_process_memory_fraction() < 1
        small = torch.ones(1 << 20, device="tpu")  # 4 MiB
        ooms = torch.tpu.memory_stats()["num_ooms"]
        with pytest.raises(torch.OutOfMemoryError, match=r"aten\.ones\.default tried to allocate 16\.00 MiB.*set_per_process_memory_fraction"):
            torch.ones(4 << 20, device="tpu")
        assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1  # as CUDA's allocator counts
        assert small.sum().item() == 1 << 20
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    assert torch.tpu.get_per_process_memory_fraction() == 1.0
    assert torch.ones(4 << 20, device="tpu").sum().item() == 4 << 20
    with pytest.raises(TypeError, match="must be `float`"):
        torch.tpu.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match="Allowed range"):
        torch.tpu.set_per_process_memory_fraction(1.5)


def test_a_copy_to_tpu_past_the_memory_fraction_is_out_of_memory(mode):
    # As an op's output: the limit is checked before the copy, which then never happens.
    total = torch.tpu.mem_get_info()[1]
    allocated = torch.tpu.memory_allocated()
    kept = torch.arange(4.0, device="tpu")
    try:
        torch.tpu.set_per_process_memory_fraction((allocated + (8 << 20)) / total)
        with pytest.raises(torch.OutOfMemoryError, match=r"a copy of a torch\.float32 tensor of shape \(4194304,\) to tpu tried to allocate 16\.00 MiB"):
            torch.ones(4 << 20).to("tpu")
        assert torch.tpu.memory_allocated() <= allocated + (1 << 20)
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    assert kept.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.ones(4 << 20).to("tpu").sum().item() == 4 << 20


def _mlp_step(path: str, width: int = 1024, batch: int = 512):
    """An MLP's AdamW step on ``path``'s device ("cpu"; "defer": DeferAndFuse, "jit":
    torchtpu.jit, "compile": torch.compile, on tpu), its arguments, the bytes of the
    activations its backward reads (the hidden layers' inputs and outputs of GELU),
    and the model."""
    device = "cpu" if path == "cpu" else "tpu"
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, width).to(device)
    t = torch.randint(0, 8, (batch,)).to(device)

    def step(x, t):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        return loss

    if path == "jit":
        step = torchtpu.jit(step)
    elif path == "compile":
        step = torch.compile(step, backend="tpu")
    return step, (x, t), 4 * batch * width * 4, model


@pytest.mark.parametrize("path", ["defer", "jit", "compile"])
def test_the_peak_inside_a_fused_or_compiled_step_is_seen(path):
    """Issue 33 item 3: max_memory_allocated() after a step exceeds what the step keeps
    by at least its activations, which exist only while it runs (a chunk's or compiled
    program's temporaries and outputs). A TPU's own peak sees them; on the CPU backend,
    which keeps none, torchtpu counts the arrays at each run of a program plus what XLA
    says it adds (Note [A program's memory is known before it runs])."""
    import gc

    with torchtpu.set_eager_mode("defer" if path == "defer" else "strict"):
        step, args, activations, _ = _mlp_step(path)
        for _ in range(3):  # the optimizer's state, then torchtpu.jit's trace, exist
            step(*args).item()
        gc.collect()
        torch.tpu.reset_peak_memory_stats()
        steady = torch.tpu.memory_allocated()
        loss = step(*args).item()
        assert loss == loss  # a number: the step ran
        assert torch.tpu.memory_allocated() <= steady + (1 << 20)
        assert torch.tpu.max_memory_allocated() >= steady + activations


def test_a_chunk_that_cannot_fit_raises_before_it_runs_naming_its_largest_part():
    """Issue 33 item 5: a DeferAndFuse chunk's memory is known before it runs. Past the
    process's limit it raises torch.OutOfMemoryError naming its parts (XLA's account),
    its inputs are untouched, and the same ops at a smaller size then run and match the
    CPU; explain() and metrics() show the programs' bytes."""
    x_cpu = torch.randn(128, 1024)  # 512 KiB: each op's output is under the size an
    total = torch.tpu.mem_get_info()[1]  # op is checked from when it is recorded

    def f(x):
        return [x * i for i in range(40)]  # 20 MiB of outputs: more than allowed

    with torchtpu.set_eager_mode("defer"):
        x = x_cpu.to("tpu")
        try:
            limit = torch.tpu.memory_allocated() + (8 << 20)
            torch.tpu.set_per_process_memory_fraction(limit / total)
            ys = f(x)
            with pytest.raises(
                torch.OutOfMemoryError,
                match=r"a DeferAndFuse chunk of 40 ops \(.*test_device\.py:\d+ .*\) tried to "
                r"allocate 20\.00 MiB.* it needs 20\.00 MiB of new outputs \(the largest\)",
            ) as error:
                ys[0].cpu()
            assert "set_per_process_memory_fraction" in str(error.value)
            with pytest.raises(RuntimeError, match="never computed: OutOfMemoryError"):
                ys[1].cpu()  # a value whose chunk failed holds the error
            del ys
            explained = torchtpu.explain(f, x[:8])
        finally:
            torch.tpu.set_per_process_memory_fraction(1.0)
        assert_same(explained.result, f(x_cpu[:8]))
        assert_same(x, x_cpu)
    (program,) = explained.programs
    assert program["what"] == "a DeferAndFuse chunk of 40 ops"
    assert program["bytes"].outputs - program["bytes"].aliased >= 40 * 8 * 1024 * 4
    assert "programs' memory (XLA: arguments, new outputs, temporaries)" in str(explained)
    assert torchtpu.metrics()["program_bytes"]["chunk outputs"] >= 40 * 8 * 1024 * 4


def test_a_compiled_program_larger_than_the_device_raises_before_it_runs(monkeypatch):
    """On a device that reports its memory, a program whose new outputs and temporaries
    do not fit beside the arrays that exist raises torch.OutOfMemoryError before its
    first run, naming its largest part; the parameters keep their values, and the next
    call, with room, trains on as the CPU does."""
    import torchtpu.memory as memory

    step, args, _, model = _mlp_step("jit", width=512, batch=256)
    step(*args).item()  # the eager first call
    kept = [p.detach().cpu() for p in model.parameters()]
    allocated = torch.tpu.memory_allocated()
    stats = {"bytes_in_use": allocated, "peak_bytes_in_use": allocated, "bytes_limit": allocated + (1 << 20)}
    monkeypatch.setattr(memory, "_device_stats", lambda chip: stats)
    with pytest.raises(torch.OutOfMemoryError, match=r"a compiled step .* it needs .* \(the largest\).* is the device's memory"):
        step(*args)
    for p, before in zip(model.parameters(), kept):
        assert_same(p, before)
    monkeypatch.undo()
    loss = step(*args)
    cpu_step, cpu_args, _, cpu_model = _mlp_step("cpu", width=512, batch=256)
    cpu_step(*cpu_args)
    assert_same(loss, cpu_step(*cpu_args), rtol=1e-4, atol=1e-5)
    for p, expected in zip(model.parameters(), cpu_model.parameters()):
        assert_same(p, expected, rtol=1e-3, atol=1e-4)  # AdamW's steps scale differences up


def test_torch_accelerator_memory_functions_answer_for_tpu():
    # torch's own need a C++ device allocator, which a Python backend has not (an
    # INTERNAL ASSERT); accelerate calls torch.accelerator.empty_cache() after training.
    assert torch.accelerator.current_accelerator().type == "tpu"
    torch.accelerator.empty_cache()
    x = torch.ones(256, device="tpu")
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] >= x.nbytes
    torch.accelerator.reset_peak_memory_stats()


# -- addresses (Note [Storage addresses]) ---------------------------------------------------


def test_each_storage_has_addresses_of_its_own():
    b = torch.arange(12.0, device="tpu").reshape(3, 4)
    row, other = b[1], torch.ones(12, device="tpu")
    assert b.data_ptr() != 0 and other.data_ptr() != b.data_ptr()
    assert row.data_ptr() == b.data_ptr() + 4 * b.element_size()
    assert row.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert b.untyped_storage().nbytes() == 48
    assert other.untyped_storage().data_ptr() >= b.untyped_storage().data_ptr() + 48
    row.add_(1)  # still an alias with an address
    assert torch.equal(b.cpu()[1], torch.arange(4.0, 8.0) + 1)
    b.resize_(2, 2)  # within its storage
    assert b.data_ptr() == row.data_ptr() - 4 * b.element_size()


def test_shared_tensors_are_found_as_on_the_cpu():
    safetensors = pytest.importorskip("safetensors.torch", reason="installed with transformers")
    for device in ("cpu", "tpu"):
        b = torch.arange(6.0, device=device)
        with pytest.raises(RuntimeError, match="share memory"):
            safetensors.save({"b": b, "view": b[2:]})
        assert len(safetensors.save({"b": b, "c": b.clone()})) > 0


def test_torch_tpu_shows_its_api_only():
    names = dir(torch.tpu)
    for internal in ("os", "sys", "torch", "types", "annotations", "register", "rng", "modes"):
        assert internal not in names
    for name in names:
        assert getattr(torch.tpu, name) is not None, name
    for name in ("memory_allocated", "synchronize", "Stream", "get_device_capability"):
        assert name in names
    if torch.tpu.get_device_properties().platform == "cpu":
        assert torch.tpu.get_device_capability() == (0, 0)
