"""The views test matrix: every view op reads correctly and writes through.

Each case is a view op applied to a fresh base tensor. The same sequence of
operations runs on a CPU base and on a tpu copy of it, and every tensor involved
(the base, the view, other views of the base) must end up equal: values, dtype,
shape, and the view metadata (strides, storage offset, contiguity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import torchtpu
from conftest import assert_same, tpu
from torchtpu.dispatch import values

aten = torch.ops.aten


class Case(NamedTuple):
    name: str
    fn: Callable
    shape: tuple = (4, 6)
    dtype: torch.dtype = torch.float32
    # False when elements of the view overlap in memory without a zero stride
    # (overlapping windows): torch neither refuses nor defines an in-place op on
    # such a view, so only reads are compared. (Zero strides, from expand, make
    # torch refuse most writes: the tpu must refuse the same ones.)
    writable: bool = True


def make_base(shape, dtype):
    """Distinct, exactly representable values of ``dtype`` (CPU)."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.float64).reshape(shape) - n // 3
    if dtype.is_complex:
        return torch.complex(values, -2 * values).to(dtype)
    return values.to(dtype)


C3 = (2, 3, 4)

CASES = [
    # view / reshape as a view
    Case("view", lambda x: x.view(6, 4)),
    Case("view_-1", lambda x: x.view(-1)),
    Case("view_as", lambda x: x.view_as(x.t())),
    Case("reshape", lambda x: x.reshape(3, 8)),
    Case("view_0d", lambda x: x.view(())[()], shape=(1,)),
    Case("view_of_t", lambda x: x.t().view(3, 2, 4)),  # splits a dim of a transposed tensor
    # slicing
    Case("slice_rows", lambda x: x[1:3]),
    Case("slice_cols", lambda x: x[:, 2:5]),
    Case("slice_step2", lambda x: x[::2]),
    Case("slice_step3_cols", lambda x: x[:, 1::3]),
    Case("slice_neg", lambda x: x[-3:-1]),
    Case("slice_neg_step", lambda x: x[:, -5:-1:2]),
    Case("slice_past_end", lambda x: x[2:100]),
    Case("slice_empty", lambda x: x[3:1]),
    # select
    Case("select", lambda x: x.select(0, 2)),
    Case("select_neg", lambda x: x.select(1, -2)),
    Case("select_0d", lambda x: x[2][-1]),
    # narrow
    Case("narrow", lambda x: x.narrow(1, 1, 3)),
    Case("narrow_neg", lambda x: x.narrow(0, -3, 2)),
    # transpose / t / permute
    Case("transpose", lambda x: x.transpose(0, 1)),
    Case("t", lambda x: x.t()),
    Case("t_1d", lambda x: x.t(), shape=(5,)),
    Case("T", lambda x: x.T),
    Case("mT", lambda x: x.mT, shape=C3),
    Case("permute", lambda x: x.permute(2, 0, 1), shape=C3),
    Case("movedim", lambda x: x.movedim(0, -1), shape=C3),
    Case("movedim_multi", lambda x: torch.movedim(x, (0, 1), (2, 0)), shape=C3),
    Case("swapaxes", lambda x: x.swapaxes(0, 2), shape=C3),
    # expand (overlapping: in-place ops raise on the CPU, fill_/zero_ do not)
    Case("expand", lambda x: x.expand(3, 4), shape=(1, 4)),
    Case("expand_new_dims", lambda x: x.expand(2, 3, 4), shape=(4,)),
    Case("expand_as", lambda x: x.expand_as(torch.empty(5, 3, device=x.device)), shape=(5, 1)),
    Case("expand_same", lambda x: x.expand(-1, 6)),
    Case("broadcast_to", lambda x: torch.broadcast_to(x, (2, 4, 6))),
    # squeeze / unsqueeze, every overload
    Case("squeeze", lambda x: x.squeeze(), shape=(1, 4, 1, 3)),
    Case("squeeze_dim", lambda x: x.squeeze(2), shape=(1, 4, 1, 3)),
    Case("squeeze_dim_noop", lambda x: x.squeeze(1), shape=(1, 4, 1, 3)),
    Case("squeeze_dims", lambda x: x.squeeze((0, 2)), shape=(1, 4, 1, 3)),
    Case("squeeze_dims_partial", lambda x: x.squeeze((0, 1, -1)), shape=(1, 4, 1, 3)),
    Case("squeeze_0d", lambda x: x.squeeze(), shape=(1,)),
    Case("unsqueeze", lambda x: x.unsqueeze(1)),
    Case("unsqueeze_neg", lambda x: x.unsqueeze(-1)),
    # diagonal
    Case("diagonal", lambda x: x.diagonal()),
    Case("diagonal_offset", lambda x: x.diagonal(2)),
    Case("diagonal_neg_offset", lambda x: x.diagonal(-1)),
    Case("diagonal_dims", lambda x: x.diagonal(1, 1, 2), shape=C3),
    Case("diagonal_dims_neg", lambda x: torch.diagonal(x, -1, -1, 0), shape=C3),
    Case("diagonal_past_end", lambda x: x.diagonal(10)),
    # unfold
    Case("unfold", lambda x: x.unfold(1, 2, 2)),
    Case("unfold_gap", lambda x: x.unfold(1, 2, 3)),
    Case("unfold_dim0", lambda x: x.unfold(0, 3, 1), writable=False),
    Case("unfold_overlap", lambda x: x.unfold(-1, 3, 1), writable=False),
    Case("unfold_0d", lambda x: x[1, 1].unfold(0, 1, 1)),
    # split / chunk / unbind / split_with_sizes / tensor_split
    Case("split_0", lambda x: x.split(2, dim=1)[0]),
    Case("split_last", lambda x: x.split(4)[-1], shape=(10, 3)),
    Case("split_with_sizes", lambda x: x.split([1, 3, 2], dim=1)[1]),
    Case("chunk", lambda x: x.chunk(3, dim=1)[2]),
    Case("chunk_uneven", lambda x: x.chunk(3)[1], shape=(5, 2)),
    Case("unbind", lambda x: x.unbind()[2]),
    Case("unbind_dim", lambda x: x.unbind(1)[-1]),
    Case("tensor_split", lambda x: x.tensor_split([1, 4], dim=1)[1]),
    Case("vsplit", lambda x: torch.vsplit(x, [1])[1]),
    # as_strided
    Case("as_strided", lambda x: x.as_strided((3, 2), (2, 1))),
    Case("as_strided_offset", lambda x: x.as_strided((2, 3), (1, 6), 3)),
    Case("as_strided_transposed", lambda x: x.as_strided((6, 4), (1, 6))),
    Case("as_strided_of_view", lambda x: x[1:].as_strided((2, 2), (6, 2))),
    Case("as_strided_of_offset_view", lambda x: x[2].as_strided((3,), (2,), 1)),
    Case("as_strided_overlap", lambda x: x.as_strided((3, 3), (1, 1)), writable=False),
    Case("as_strided_of_t", lambda x: x.t().as_strided((4,), (7,), 0)),
    # detach / alias / .data
    Case("detach", lambda x: x.detach()),
    Case("alias", lambda x: aten.alias(x)),
    Case("data", lambda x: x.data),
    # complex <-> real
    Case("view_as_real", lambda x: torch.view_as_real(x), shape=(3, 4), dtype=torch.complex64),
    Case("view_as_real_1d", lambda x: torch.view_as_real(x), shape=(5,), dtype=torch.complex128),
    Case("view_as_complex", lambda x: torch.view_as_complex(x), shape=(3, 4, 2)),
    Case("real", lambda x: x.real, shape=(3, 4), dtype=torch.complex64),
    Case("imag", lambda x: x.imag, shape=(3, 4), dtype=torch.complex64),
    Case("real_of_slice", lambda x: x[1:].real, shape=(3, 4), dtype=torch.complex64),
    Case("imag_of_t", lambda x: x.t().imag, shape=(3, 4), dtype=torch.complex64),
    # view(dtype)
    Case("view_dtype_same_size", lambda x: x.view(torch.int32)),
    Case("view_dtype_f2f", lambda x: x.view(torch.float16), shape=(4, 6), dtype=torch.bfloat16),
    Case("view_dtype_smaller", lambda x: x.view(torch.int16)),
    Case("view_dtype_bytes", lambda x: x.view(torch.uint8), shape=(2, 3)),
    Case("view_dtype_larger", lambda x: x.view(torch.int32), shape=(3, 4), dtype=torch.int16),
    # int32 -> float64 through a float64 base: arbitrary int bits would make subnormal
    # floats, which XLA on the CPU flushes to zero in arithmetic
    Case(
        "view_dtype_larger_f",
        lambda x: x.view(torch.int32).view(torch.float64),
        shape=(3, 4),
        dtype=torch.float64,
    ),
    Case(
        "view_dtype_complex", lambda x: x.view(torch.complex64), shape=(3, 4), dtype=torch.float32
    ),
    Case("view_dtype_of_slice", lambda x: x[1:3].view(torch.int32)),
    # flatten / unflatten
    Case("flatten", lambda x: x.flatten()),
    Case("flatten_range", lambda x: x.flatten(1), shape=C3),
    Case("flatten_noncontiguous", lambda x: x.t().flatten()),  # a copy, on the CPU too
    Case("unflatten", lambda x: x.unflatten(1, (2, 3))),
    Case("unflatten_neg", lambda x: x.unflatten(-1, (-1, 2)), shape=C3),
    # basic indexing
    Case("index_int", lambda x: x[1]),
    Case("index_ints", lambda x: x[1, -2, 3], shape=C3),
    Case("index_ellipsis", lambda x: x[...]),
    Case("index_ellipsis_int", lambda x: x[..., 2], shape=C3),
    Case("index_none", lambda x: x[None]),
    Case("index_none_mid", lambda x: x[:, None, 1:]),
    Case("index_mixed", lambda x: x[1, ..., None, ::2], shape=C3),
    Case("index_slices", lambda x: x[-1:, 1:-1:2, None], shape=C3),
    Case("index_tuple_int_slice", lambda x: x[::2, -1]),
    # conj / neg views
    Case("conj", lambda x: x.conj(), shape=(3, 4), dtype=torch.complex64),
    Case("mH", lambda x: x.mH, shape=(3, 4), dtype=torch.complex64),
    Case(
        "imag_of_conj", lambda x: x.conj().imag, shape=(3, 4), dtype=torch.complex64
    ),  # a neg view
    # chains of several views
    Case("chain_t_slice_select", lambda x: x.t()[1:5:2].select(1, -1)),
    Case(
        "chain_permute_view_diag",
        lambda x: x.permute(1, 0, 2).reshape(3, 8)[:, ::2].diagonal(),
        shape=C3,
    ),
    Case("chain_unsqueeze_expand_select", lambda x: x.unsqueeze(0).expand(3, 4, 6)[1]),
    Case("chain_split_t_unfold", lambda x: x.split(3, dim=1)[1].t().unfold(1, 2, 2)),
]

CASE_IDS = [c.name for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS)


# -- helpers ------------------------------------------------------------------------------


def pair(case: Case):
    """A CPU base and an equal tpu base."""
    cpu = make_base(case.shape, case.dtype)
    return cpu, tpu(cpu)


def same_view(actual, expected):
    """Values and the view metadata torch reports."""
    assert_same(actual, expected)
    assert actual.stride() == expected.stride(), f"stride {actual.stride()} != {expected.stride()}"
    assert actual.storage_offset() == expected.storage_offset()
    assert actual.is_contiguous() == expected.is_contiguous()


def both(fn, cpu_args, tpu_args) -> bool:
    """Run ``fn`` on the CPU arguments, then on the tpu ones: if the CPU raises, the
    tpu must raise the same exception type. Returns whether it ran."""
    try:
        fn(*cpu_args)
    except Exception as exc:  # the CPU decides what is an error
        with pytest.raises(type(exc)):
            fn(*tpu_args)
        return False
    fn(*tpu_args)
    return True


def source_like(v):
    """Distinct values of ``v``'s shape and dtype, on ``v``'s device."""
    cpu = make_base(tuple(v.shape), v.dtype) + 7
    return cpu if v.device.type == "cpu" else tpu(cpu)


# In-place writes through a view.
WRITES = {
    "add_": lambda v: v.add_(1),
    "mul_": lambda v: v.mul_(2),
    "sub_tensor": lambda v: v.sub_(source_like(v)),
    "fill_": lambda v: v.fill_(5),
    "zero_": lambda v: v.zero_(),
    "copy_": lambda v: v.copy_(source_like(v)),
    "setitem_scalar": lambda v: v.__setitem__(Ellipsis, 3),
    "setitem_tensor": lambda v: v.__setitem__(Ellipsis, source_like(v)),
}

# In-place writes to the base, with views taken before read afterwards.
BASE_WRITES = {
    "add_": lambda x: x.add_(1),
    "copy_": lambda x: x.copy_(source_like(x)),
    "setitem_last": lambda x: x.__setitem__((Ellipsis, -1), 9),
}

# Views of a view.
INNER_VIEWS = {
    "select": lambda v: v.select(0, -1),
    "slice_step": lambda v: v[::2],
    "transpose": lambda v: v.transpose(0, -1),
    "view_-1": lambda v: v.view(-1),
    "unsqueeze_expand": lambda v: v.unsqueeze(0).expand(2, *v.shape),
    "diagonal": lambda v: v.diagonal(),
    "real": lambda v: torch.view_as_real(v) if v.is_complex() else v.real,
}

# Each new (write, view) pair costs a compilation (~50 ms on the CPU), so the full
# product of cases and writes runs for these cases only; each other case gets one of
# the writes, in turn.
FULL_WRITES = {
    "slice_neg_step",
    "expand_new_dims",
    "diagonal_dims",
    "as_strided_offset",
    "view_dtype_complex",
    "imag_of_conj",
    "chain_unsqueeze_expand_select",
}
assert FULL_WRITES <= set(CASE_IDS)


def write_params():
    params = []
    names = list(WRITES)
    writable = [c for c in CASES if c.writable]
    for i, case in enumerate(writable):
        for name in names if case.name in FULL_WRITES else [names[i % len(names)]]:
            params.append(pytest.param(case, WRITES[name], id=f"{case.name}-{name}"))
    return params


def inner_params():
    """One view of each case's view, in turn among those that apply to its shape."""
    params = []
    for i, case in enumerate(CASES):
        outer = case.fn(make_base(case.shape, case.dtype))
        applicable = []
        for name, inner in INNER_VIEWS.items():
            try:
                inner(outer)
            except (RuntimeError, IndexError):
                continue  # e.g. select of a 0-d tensor
            applicable.append((name, inner))
        name, inner = applicable[i % len(applicable)]
        params.append(pytest.param(case, inner, id=f"{case.name}-{name}"))
    return params


# -- the matrix --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_read(case, mode):
    cpu, dev = pair(case)
    d_v, c_v = case.fn(dev), case.fn(cpu)
    same_view(d_v, c_v)
    assert (d_v._base is dev) == (c_v._base is cpu)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_read_on_the_device(case, monkeypatch):
    """Views of a large base are read by a program on the device (Note [Views read on
    the host]): the same values, each view's reader compiled once."""
    monkeypatch.setattr(values, "_HOST_VIEW_BYTES", 0)
    cpu, dev = pair(case)
    torchtpu.reset_metrics()
    d_v = case.fn(dev)
    same_view(d_v, case.fn(cpu))
    reads = torchtpu.metrics().get("compiles", {}).get("read", 0)
    assert reads <= (1 if d_v._chain else 0)


def test_reading_views_of_a_small_base_compiles_nothing():
    cpu = torch.randn(6, 5, dtype=torch.float64)
    x = tpu(cpu)
    torchtpu.reset_metrics()
    items = [x[i, j].item() for i in range(6) for j in range(5)]
    rows = [x[i].tolist() for i in range(6)]
    views = [x.t(), x[1:5:2, ::2], x.view(torch.int64)[2], x.as_strided((3, 3), (4, 1), 2)]
    assert items == [cpu[i, j].item() for i in range(6) for j in range(5)]
    assert rows == cpu.tolist()
    expected = [
        cpu.t(),
        cpu[1:5:2, ::2],
        cpu.view(torch.int64)[2],
        cpu.as_strided((3, 3), (4, 1), 2),
    ]
    for view, want in zip(views, expected):
        host = view.cpu()
        assert torch.equal(host, want)
        assert host.stride() == want.clone(memory_format=torch.preserve_format).stride()
    assert "compiles" not in torchtpu.metrics()
    c = tpu(torch.randn(3, 2, dtype=torch.complex64))
    assert torch.equal(c.conj().imag.cpu(), c.cpu().conj().imag)


@pytest.mark.parametrize("case,write", write_params())
def test_write_through_view(case, write, mode):
    cpu, dev = pair(case)
    tensors = []
    for x in (cpu, dev):
        v = case.fn(x)
        sibling = case.fn(x)  # another view, taken before the write
        flat = x.view(-1)
        tensors.append((x, v, sibling, flat))
    (c_x, c_v, c_s, c_f), (d_x, d_v, d_s, d_f) = tensors
    both(write, (c_v,), (d_v,))
    assert_same(d_x, c_x)
    assert_same(d_v, c_v)
    assert_same(d_s, c_s)
    assert_same(d_f, c_f)
    assert_same(case.fn(d_x), case.fn(c_x))
    assert d_x._version == c_x._version


@pytest.mark.parametrize("write", BASE_WRITES.values(), ids=BASE_WRITES.keys())
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_write_base_read_view(case, write, mode):
    cpu, dev = pair(case)
    c_v, d_v = case.fn(cpu), case.fn(dev)
    both(write, (cpu,), (dev,))
    same_view(d_v, c_v)
    assert d_v._version == c_v._version


@pytest.mark.parametrize("case,inner", inner_params())
def test_view_of_view(case, inner, mode):
    cpu, dev = pair(case)
    c_o, d_o = case.fn(cpu), case.fn(dev)
    c_i, d_i = inner(c_o), inner(d_o)
    same_view(d_i, c_i)
    if case.writable:
        both(lambda v: v.add_(1), (c_i,), (d_i,))
    assert_same(dev, cpu)
    same_view(d_o, c_o)
    same_view(d_i, c_i)


MULTI_OUTPUT = {
    "split": lambda x: x.split(4, dim=1),
    "split_sizes": lambda x: x.split([2, 1, 3], dim=1),
    "split_with_sizes": lambda x: x.split_with_sizes([1, 3]),
    "chunk": lambda x: x.chunk(3),
    "unbind": lambda x: x.unbind(),
    "unbind_neg": lambda x: x.unbind(-1),
    "tensor_split": lambda x: x.tensor_split(3, dim=1),
    "hsplit": lambda x: x.hsplit([1, 5]),
}


@pytest.mark.parametrize("split", MULTI_OUTPUT.values(), ids=MULTI_OUTPUT.keys())
def test_multi_output_views(split, mode):
    """Every output of a multi-output view reads its part, and writes through."""
    cpu = make_base((4, 6), torch.float32)
    dev = tpu(cpu)
    c_parts, d_parts = split(cpu), split(dev)
    assert len(d_parts) == len(c_parts)
    for d, c in zip(d_parts, c_parts):
        same_view(d, c)
    for k, (d, c) in enumerate(zip(d_parts, c_parts)):
        c.mul_(k + 2)
        d.mul_(k + 2)
    assert_same(dev, cpu)
    for d, c in zip(d_parts, c_parts):
        assert_same(d, c)


# -- aliasing in everyday code -----------------------------------------------------------


def test_inplace_on_view_bumps_version_for_autograd(mode):
    for modify in (lambda y: y[0].add_(1), lambda y: y.view(-1).add_(1), lambda y: y.t().mul_(2)):
        for device in ("cpu", "tpu"):
            x = torch.randn(3, 4, device=device, requires_grad=True)
            y = x.sigmoid()
            modify(y)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


def test_inplace_on_base_bumps_version_of_views(mode):
    x_cpu = torch.randn(3, 4)
    x = tpu(x_cpu)
    views = [x[1], x.t(), x.view(-1), x.detach()]
    before = [v._version for v in views]
    x.add_(1)
    assert [v._version for v in views] == [b + 1 for b in before]
    w = torch.randn(3, 4, device="tpu", requires_grad=True)
    y = w.exp()  # exp saves its result for backward
    y.detach().zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_detach_and_data_alias(mode):
    p_cpu = make_base((3, 4), torch.float32)
    p = tpu(p_cpu).requires_grad_()
    p_cpu.requires_grad_()
    for t in (p_cpu, p):
        t.detach().mul_(2)
        t.data.add_(1)
        t.data[0] = -1
    assert_same(p, p_cpu)
    assert p.requires_grad


def test_data_assignment(mode):
    tensors = []
    for to in (lambda t: t, tpu):
        p = torch.nn.Parameter(to(torch.zeros(3, 4)))
        other = to(make_base((3, 4), torch.float32))
        p.data = other
        tensors.append((p, other))
    (c_p, c_other), (d_p, d_other) = tensors
    assert_same(d_p, c_p)
    # p now shares other's storage
    for p, other in tensors:
        other.add_(1)
        p.data.mul_(3)
    assert_same(d_p, c_p)
    assert_same(d_other, c_other)
    assert isinstance(d_p, torch.nn.Parameter) and d_p.requires_grad


def test_setitem(mode):
    c_x = make_base((4, 6), torch.float32)
    c_y = make_base((4, 2), torch.float32) * 10
    d_x, d_y = tpu(c_x), tpu(c_y)
    for x, y in ((c_x, c_y), (d_x, d_y)):
        row = x[1]
        x[0] = 1
        x[:, 1:3] = y
        x[-1, ::2] = y[0, 0]
        x[..., -1] += 100
        x[None, 2, None] *= -1
        row.sub_(0.5)
    assert_same(d_x, c_x)


def test_kv_cache_writes(mode):
    batch, heads, steps, dim = 2, 3, 5, 4
    caches = []
    for to in (lambda t: t, tpu):
        cache = to(torch.zeros(batch, heads, steps, dim))
        window = cache[:, :, 1:]  # a view read while the cache fills
        for i in range(steps):
            k = to(make_base((batch, heads, dim), torch.float32) + i)
            cache[:, :, i] = k
        cache[:, :, -1, ::2] = to(torch.ones(batch, heads, dim // 2))
        caches.append((cache, window))
    (c_cache, c_window), (d_cache, d_window) = caches
    assert_same(d_cache, c_cache)
    assert_same(d_window, c_window)


def test_write_through_view_of_view_of_view(mode):
    cpu = make_base((4, 6, 5), torch.float32)
    results = []
    for base in (cpu, tpu(cpu)):
        a = base[1:]  # (3, 6, 5)
        b = a.transpose(0, 2)  # (5, 6, 3)
        c = b[::2, 1:5].select(2, -1)  # (3, 4)
        d = c.t().unsqueeze(0)  # (1, 4, 3)
        d.add_(1)
        c[1:, 0] = -7
        b.mul_(2)
        results.append((base, a, b, c, d))
    for c, d in zip(*results):
        same_view(d, c)


EXPANDED_WRITES = {
    "add_": lambda e: e.add_(1),
    "copy_": lambda e: e.copy_(torch.ones(3, 4, device=e.device)),
    "setitem": lambda e: e.__setitem__(Ellipsis, 2),
    "t_mul_": lambda e: e.t().mul_(2),
    "slice_sub_": lambda e: e[1:].sub_(1),
}


@pytest.mark.parametrize("write", EXPANDED_WRITES.values(), ids=EXPANDED_WRITES.keys())
def test_write_into_expanded_raises(write, mode):
    # From torch 2.15 ``e[...] = 2`` is a fill_ with a number, which the CPU allows on
    # an expanded tensor (every write is the same value): tpu refuses what the CPU does.
    refuses = not (EXPANDED_WRITES["setitem"] is write and torch.__version__ >= (2, 15))
    for device in ("cpu", "tpu"):
        x = torch.zeros(1, 4, device=device)
        e = x.expand(3, 4)
        if refuses:
            with pytest.raises(RuntimeError, match="single memory location"):
                write(e)
            assert x.cpu().eq(0).all()
        else:
            write(e)
            assert x.cpu().eq(2).all()
            x.zero_()
        e[1].add_(1)  # a view holding one copy of each element can be written
        assert x.cpu().eq(1).all()


def test_as_strided_out_of_bounds_raises(mode):
    x = torch.arange(10.0)
    with pytest.raises(RuntimeError, match="out of bounds"):
        x.as_strided((2, 2), (1, 2), 10)
    with pytest.raises(RuntimeError, match="out of bounds"):
        tpu(x).as_strided((2, 2), (1, 2), 10)


INPLACE_VIEW_OPS = {
    "transpose_": lambda x: x.transpose_(0, 1),
    "t_": lambda x: x.t_(),
    "swapdims_": lambda x: x.swapdims_(0, 1),
    "squeeze_": lambda x: x.unsqueeze(1).squeeze_(),
    "squeeze_dim": lambda x: x.unsqueeze(1).squeeze_(1),
    "squeeze_dims": lambda x: x.unsqueeze(1).squeeze_((0, 1)),
    "unsqueeze_": lambda x: x.unsqueeze_(1),
    "as_strided_": lambda x: x.as_strided_((2, 3), (1, 4), 1),
    "as_strided_of_view": lambda x: x[1:].as_strided_((2, 2), (2, 1)),
}


@pytest.mark.parametrize("op", INPLACE_VIEW_OPS.values(), ids=INPLACE_VIEW_OPS.keys())
def test_inplace_view_ops_keep_aliasing(op, mode):
    c_base = make_base((4, 6), torch.float32)
    d_base = tpu(c_base)
    results = []
    for base in (c_base, d_base):
        x = base.view(4, 6)  # x aliases base
        row = base[1]  # an earlier view of the same storage
        y = op(x)
        results.append((base, x, y, row))
    for c, d in zip(*results):
        same_view(d, c)
    for base, x, y, _row in results:
        y.add_(1)  # through the tensor changed in place
        base[2].mul_(-1)  # through the base
        x.neg_()  # through the tensor the op was called on (if it differs from y)
    for c, d in zip(*results):
        same_view(d, c)
