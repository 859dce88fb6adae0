"""A view's position is an input of the program, not a constant (Note [Positions are
inputs], dispatch/signature.py): ``cache[:, :, t] = k``, ``x[t]`` and ``x.narrow(0, t, n)``
with a new ``t`` run the program compiled for the first one, with torch's values."""

from __future__ import annotations

import pytest
import torch

import torchtpu
from conftest import assert_same, tpu


def _compiles():
    m = torchtpu.metrics()
    return sum(m.get("compiles", {}).values())


def _decode(device, steps):
    """A decoding loop's cache writes and reads, as a user writes them."""
    cache = torch.zeros(1, 2, steps + 4, 8, device=device)
    x = torch.arange(64.0, device=device)
    outs = []
    for t in range(steps):
        cache[:, :, t] = torch.full((1, 2, 8), t + 1.0, device=device) * x[t]
        cache[:, :, t + 1 : t + 3].mul_(0.5)
        outs.append(x[t] + x.narrow(0, t + 1, 4).sum() + cache[0, 1, t].sum())
    return cache, torch.stack(outs)


def test_a_decoding_loop_compiles_nothing_after_its_first_steps(mode):
    expected = _decode("cpu", 16)
    _decode("tpu", 2)  # the first position of a kind compiles; the next ones may not
    torchtpu.reset_metrics()
    assert_same(_decode("tpu", 16), expected)
    # 16 more positions of every view: only the first steps' positions 0 (static) and
    # the cache's larger size compile
    assert _compiles() <= 8


def test_a_view_of_a_base_of_another_shape_is_a_program_of_its_own(mode, xla_compiles):
    """Note [A view's base is in its key]: ``ids[:, -1:].view(1, 1, 1)`` of ids one
    longer each step (Transformers' end-of-sequence check) has the same meta every step;
    its program takes the base, so JAX compiled it anew for each length, unseen by
    torchtpu's count (in Strict a cache hit). Now each base shape is a plan of its own,
    and every compile XLA makes is counted."""
    torch.tpu.synchronize()
    torchtpu.reset_metrics()
    xla_compiles[0] = 0
    for n in range(7, 12):
        cpu = torch.arange(n)[None]
        ids = tpu(cpu)
        assert_same(ids[:, -1:].view(1, 1, 1) == 9, cpu[:, -1:].view(1, 1, 1) == 9)
    torch.tpu.synchronize()
    assert xla_compiles[0] == _compiles()


@pytest.mark.parametrize(
    "view",
    [
        lambda x, t: x[t],
        lambda x, t: x[-1 - t],
        lambda x, t: x[:, t],
        lambda x, t: x[t + 1 : t + 3],
        lambda x, t: x[t + 1 : 100],  # clamped to the end: its length changes with t
        lambda x, t: x.narrow(1, t + 1, 2),
        lambda x, t: x.narrow(0, -2 - t, 2),
        lambda x, t: x[t].t(),
        lambda x, t: x[t + 1 :, t],
        lambda x, t: x[t][t + 1 : t + 3],
    ],
    ids=[
        "select", "negative", "select_dim1", "slice", "clamped_slice", "narrow",
        "negative_narrow", "select_then_t", "slice_then_select", "select_then_slice",
    ],
)  # fmt: skip
def test_reads_and_writes_through_positioned_views_match_the_cpu(mode, view):
    base = torch.arange(30.0).reshape(5, 6)
    for t in range(3):
        cpu, ours = base.clone(), tpu(base)
        assert_same((view(ours, t) * 2).sum(0), (view(cpu, t) * 2).sum(0))
        view(cpu, t).mul_(-1)
        view(ours, t).mul_(-1)
        view(cpu, t).copy_(view(cpu, t) + 100)
        view(ours, t).copy_(view(ours, t) + 100)
        assert_same(ours, cpu)


def _same_outcome(fn, cpu, ours):
    """``fn`` on the CPU tensor and on ours: both raise torch's error, or neither."""
    try:
        fn(cpu)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match="single memory location"):
            fn(ours)
        assert "single memory location" in str(e)
    else:
        fn(ours)
    assert_same(ours, cpu)


def test_two_views_of_one_storage_keep_torchs_overlap_rules(mode):
    # Whether two views of one storage overlap depends on their positions: such calls
    # keep the positions in their key, and torch's checks run for each.
    pairs = [(slice(0, 3), slice(3, 6)), (slice(1, 4), slice(0, 3)), (slice(2, 5), slice(2, 5))]
    for a, b in pairs:
        cpu, ours = torch.arange(8.0), tpu(torch.arange(8.0))

        def add_out(x, a=a, b=b):
            torch.add(x[b], 1, out=x[a])

        def add_in_place(x, a=a, b=b):
            x[a] += x[b]

        _same_outcome(add_out, cpu, ours)
        _same_outcome(add_in_place, cpu, ours)


@pytest.mark.parametrize("path", ["compile", "jit"])
def test_positions_in_compiled_code_stay_constants(path):
    def make_step(cache):  # the cache is state, as a model's buffer is
        def step(x, t: int):
            cache[:, t] = x * t
            return cache[:, t].sum() + cache.narrow(1, t, 2).sum()

        return step

    cpu_cache, ours = torch.zeros(3, 8), tpu(torch.zeros(3, 8))
    expected_step = make_step(cpu_cache)
    if path == "compile":
        fn = torch.compile(make_step(ours), backend="tpu")
    else:  # a Python number is a 0-d tensor to torchtpu.jit unless it is static
        fn = torchtpu.jit(make_step(ours), static_argnums=(1,))
    for t in range(4):
        x = torch.full((3,), t + 0.5)
        assert_same(fn(tpu(x), t), expected_step(x, t))
    assert_same(ours, cpu_cache)


def test_reading_a_large_tensors_rows_compiles_one_reader():
    # a base over 1 MiB is read on the device (Note [Views read on the host]), and its
    # rows' positions are the reader's arguments
    base = torch.randn(1024, 512)
    x = tpu(base)
    torchtpu.reset_metrics()
    for t in range(5):
        assert torch.equal(x[t].cpu(), base[t])
        assert torch.equal(x[t + 1 : t + 3].cpu(), base[t + 1 : t + 3])
    assert torchtpu.metrics()["compiles"] == {"read": 2}


def test_one_program_for_views_of_bases_of_different_shapes(mode):
    # The key fixes the view (a row of 6), not its base: a base keeps its own shape
    # (DeferAndFuse gave the second base the first one's and failed at the next view).
    columns = {"strict": 2, "debug": 3, "defer": 6}[mode]  # a program new in each mode
    for rows in (5, 4):
        base = torch.arange(rows * 6.0).reshape(rows, 6)
        cpu, ours = base.clone(), tpu(base)
        for x in (cpu, ours):
            x[3].mul_(-1)
            x.view(rows * 6 // columns, columns).neg_()
        assert_same(ours, cpu)
