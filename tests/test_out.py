"""``out=`` arguments and ``resize_``: the same results, resizes, casts and exception
types as on the CPU, in every eager mode."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import assert_same


def _empty(*shape, dtype=torch.float32, device="cpu"):
    return torch.empty(shape, dtype=dtype, device=device)


# name -> fn(x, device): each call makes its own out tensors on ``device``
CASES = {
    "add": lambda x, d: torch.add(x, x, out=_empty(3, 4, device=d)),
    "add_scalar_into_float64": lambda x, d: torch.add(
        x, 1, out=_empty(3, 4, dtype=torch.float64, device=d)
    ),
    "add_float_into_int64": lambda x, d: torch.add(
        x, x, out=_empty(3, 4, dtype=torch.int64, device=d)
    ),
    "exp_into_float16": lambda x, d: torch.exp(x, out=_empty(3, 4, dtype=torch.float16, device=d)),
    "mm": lambda x, d: torch.mm(x, x.T, out=_empty(3, 3, device=d)),
    "mm_into_float64": lambda x, d: torch.mm(
        x, x.T, out=_empty(3, 3, dtype=torch.float64, device=d)
    ),
    "matmul": lambda x, d: torch.matmul(x, x.T, out=_empty(3, 3, device=d)),
    "addmm": lambda x, d: torch.addmm(x[:, :3], x, x.T, out=_empty(3, 3, device=d)),
    "sum_dim_into_float64": lambda x, d: torch.sum(
        x, 1, out=_empty(3, dtype=torch.float64, device=d)
    ),
    "vector_norm": lambda x, d: torch.linalg.vector_norm(x, out=_empty(device=d)),
    "clamp": lambda x, d: torch.clamp(x, min=0, out=_empty(3, 4, device=d)),
    "cat_resizes_out": lambda x, d: torch.cat([x, x], out=_empty(1, device=d)),
    "add_resizes_empty_out": lambda x, d: torch.add(x, x, out=_empty(0, device=d)),
    "add_resizes_wrong_shape": lambda x, d: torch.add(x, x, out=_empty(2, 2, device=d)),
    "arange": lambda x, d: torch.arange(5, out=_empty(2, device=d)),
    "into_itself": lambda x, d: torch.add(x, x, out=x),
    "into_strided_view": lambda x, d: _into_view(x, d),
    "resized_within_its_storage": lambda x, d: _resized_within_storage(d),
    "resized_onto_an_input": lambda x, d: _resized_onto_input(d),
    "max_dim_two_outs": lambda x, d: torch.max(
        x, 1, out=(_empty(0, device=d), _empty(0, dtype=torch.int64, device=d))
    ),
    "sort_two_outs": lambda x, d: torch.sort(
        x, 1, out=(_empty(0, device=d), _empty(0, dtype=torch.int64, device=d))
    ),
}


def _into_view(x, device):
    base = torch.zeros(3, 8, device=device)
    torch.mul(x, 2, out=base[:, ::2])
    return base


def _resized_within_storage(device):
    # out grows within its base's storage, as on the CPU: the base sees the values.
    base = torch.zeros(6, dtype=torch.int64, device=device)
    index = torch.tensor([1, 0, 2], device=device)
    torch.gather(torch.arange(3, device=device), 0, index, out=base[2:3])
    return base


def _resized_onto_input(device):
    # out = index[:1] grows to index[:2], overlapping index[1:]: the CPU refuses it.
    index = torch.tensor([2, 1, 0], device=device)
    return torch.gather(index.clone(), 0, index[1:], out=index[:1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_out_argument_matches_cpu(name, mode):
    fn = CASES[name]
    x = torch.randn(3, 4)
    y = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation warning of resizing a full out
        try:
            expected = fn(x, "cpu")
        except Exception as exc:
            with pytest.raises(type(exc)):
                fn(y, "tpu")
                torch.tpu.synchronize()
            return
        actual = fn(y, "tpu")
    assert_same(actual, expected)
    assert_same(y, x)  # the input, written where the out tensor is the input


def test_out_is_the_returned_tensor_and_keeps_its_identity():
    out = torch.empty(3, device="tpu")
    result = torch.add(torch.ones(3, device="tpu"), 1, out=out)
    assert result is out
    assert_same(out, torch.full((3,), 2.0))


def test_resizing_a_full_out_warns_as_torch_does():
    with pytest.warns(UserWarning, match="was resized"):
        torch.add(torch.ones(3, device="tpu"), 1, out=torch.empty(2, device="tpu"))


@pytest.mark.parametrize("shape", [(3, 4), (2, 2), (0,), (5,)])
def test_resize_keeps_leading_values(shape):
    x = torch.arange(6.0).view(2, 3)
    y = x.to("tpu")
    x.resize_(shape)
    y.resize_(shape)
    assert y.shape == x.shape and y.stride() == x.stride()
    keep = min(6, x.numel())
    assert_same(y.reshape(-1)[:keep], x.reshape(-1)[:keep])
    y.fill_(7)  # the grown tensor is writable as a whole
    assert_same(y, torch.full(shape, 7.0))


def test_inplace_with_arguments_in_another_order():
    """polygamma_(self, n) is computed by polygamma(n, self), with no CPU fallback."""
    x = torch.rand(4) + 0.5
    y = x.to("tpu")
    x.polygamma_(2)
    y.polygamma_(2)
    assert_same(y, x)


def test_inplace_result_that_self_cannot_hold_raises():
    with pytest.raises(RuntimeError):
        torch.arange(3).polygamma_(1)
    with pytest.raises(RuntimeError, match="polygamma_"):
        torch.arange(3, device="tpu").polygamma_(1)


@pytest.mark.parametrize("given", [(5, 5), (0,)])
def test_out_of_a_data_dependent_size_is_resized(given):
    results, caught = [], []
    for device in ("cpu", "tpu"):
        out = torch.empty(given, dtype=torch.int64, device=device)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            torch.nonzero(torch.tensor([1, 0, 1], device=device), out=out)
        results.append(out.cpu())
        caught.append([w for w in warned if "was resized" in str(w.message)])
    assert torch.equal(results[1], results[0])
    assert len(caught[1]) == len(caught[0]) == (1 if given == (5, 5) else 0)
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype torch.float32"):
        x = torch.arange(4.0, device="tpu")
        torch.masked_select(x, x > 1, out=torch.empty(0, dtype=torch.float64, device="tpu"))


def test_resize_as_():
    for device in ("cpu", "tpu"):
        x = torch.arange(6.0, device=device).reshape(3, 2)
        assert x.resize_as_(torch.ones(2, 3, device=device)).shape == (2, 3)
        assert torch.equal(x.cpu(), torch.arange(6.0).reshape(2, 3))
