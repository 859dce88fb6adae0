"""Bad input gets the exception type PyTorch raises on the CPU, with the op named;
never a silent wrong answer or a hang."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BAD_CALLS = {
    "matmul shape mismatch": lambda d: torch.ones(2, 3, device=d) @ torch.ones(4, 5, device=d),
    "mm of a vector": lambda d: torch.mm(torch.ones(3, device=d), torch.ones(3, 3, device=d)),
    "add shape mismatch": lambda d: torch.ones(2, 3, device=d) + torch.ones(4, device=d),
    "impossible view": lambda d: torch.ones(6, device=d).view(4, 2),
    "view of a non-contiguous tensor": lambda d: torch.ones(3, 4, device=d).t().view(12),
    "select out of range": lambda d: torch.ones(3, device=d)[5],
    "dim out of range": lambda d: torch.ones(3, device=d).sum(2),
    "index tensor out of range": lambda d: torch.ones(3, device=d)[
        torch.tensor([3], device=d)
    ].cpu(),
    "negative index tensor out of range": lambda d: torch.ones(3, device=d)[
        torch.tensor([-4], device=d)
    ].cpu(),
    "index_select out of range": lambda d: (
        torch.ones(3, device=d).index_select(0, torch.tensor([7], device=d)).cpu()
    ),
    "embedding out of range": lambda d: F.embedding(
        torch.tensor([9], device=d), torch.ones(3, 2, device=d)
    ).cpu(),
    "gather out of range": lambda d: (
        torch.ones(2, 2, device=d).gather(1, torch.tensor([[0, 5]], device=d)).cpu()
    ),
    "cross_entropy target out of range": lambda d: F.cross_entropy(
        torch.ones(2, 3, device=d), torch.tensor([0, 3], device=d)
    ).cpu(),
    "integer division by zero": lambda d: (
        torch.ones(2, dtype=torch.int64, device=d) // torch.zeros(2, dtype=torch.int64, device=d)
    ).cpu(),
    "in-place result cannot be cast": lambda d: torch.ones(2, dtype=torch.int64, device=d).add_(
        1.5
    ),
    "bool negation": lambda d: -torch.ones(2, dtype=torch.bool, device=d),
    "cat of mismatched shapes": lambda d: torch.cat(
        [torch.ones(2, 3, device=d), torch.ones(2, 4, device=d)]
    ),
    "conv weight mismatch": lambda d: F.conv2d(
        torch.ones(1, 3, 5, 5, device=d), torch.ones(4, 2, 3, 3, device=d)
    ),
    "reshape of wrong size": lambda d: torch.ones(5, device=d).reshape(2, 3),
    "expand to a smaller size": lambda d: torch.ones(3, device=d).expand(2),
    "mean of an integer tensor": lambda d: torch.ones(3, dtype=torch.int64, device=d).mean(),
    "item of a multi-element tensor": lambda d: torch.ones(3, device=d).item(),
    "assert_async of zero": lambda d: (
        torch._assert_async(torch.zeros((), device=d), "not positive"),
        torch.ones(1, device=d).cpu(),
    ),
    "assert_async of several values": lambda d: torch._assert_async(torch.ones(2, device=d)),
    "backward of a non-scalar": lambda d: (
        torch.ones(3, device=d, requires_grad=True).mul(2).backward()
    ),
}


def _raised(fn, device):
    try:
        fn(device)
    except Exception as exc:  # noqa: BLE001 - the type is the result
        return exc
    return None


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_same_exception_type_as_cpu(name, mode):
    fn = BAD_CALLS[name]
    expected = _raised(fn, "cpu")
    assert expected is not None, "the CPU call is supposed to fail"
    actual = _raised(fn, "tpu")
    assert actual is not None, (
        f"tpu gave a result where the CPU raised {type(expected).__name__}: {expected}"
    )
    assert type(actual) is type(expected), (
        f"tpu raised {type(actual).__name__}: {actual}; CPU raised {type(expected).__name__}: {expected}"
    )
    torch.tpu.synchronize()


def test_errors_name_the_op():
    with pytest.raises(RuntimeError, match=r"aten\.view\.default"):
        torch.ones(6, device="tpu").view(4, 2)
    with pytest.raises(IndexError, match=r"aten\.index\.Tensor"):
        torch.ones(3, device="tpu")[torch.tensor([3], device="tpu")].cpu()


def test_a_failed_check_does_not_poison_later_work():
    x = torch.ones(3, device="tpu")
    with pytest.raises(IndexError):
        x[torch.tensor([3], device="tpu")].cpu()
    assert torch.equal((x * 2).cpu(), torch.full((3,), 2.0))


# -- dtype checks that only torch's CPU kernels make ------------------------------------------
#
# Every OpInfo's float32 samples, first with one other float argument recast to float64,
# then with a float64 out= tensor: where the CPU raises RuntimeError, tpu must too (Note
# [Dtype checks only the CPU kernels make] in dispatch/meta.py).

_MIXED_DTYPES_ACCEPTED = {
    # torch_nn's chunked op is computed by its own Python implementation.
    ("nn.functional.linear_cross_entropy", "chunked", "mix"): "torch_nn op, not aten",
    ("nn.functional.linear_cross_entropy", "chunked_none", "mix"): "torch_nn op, not aten",
}


def _opinfos():
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def _float_variants(op):
    """The first samples of ``op``, flattened, with a variant: "mix" and the position of
    a float32 argument to recast, or "out"."""
    from torch.utils._pytree import tree_flatten

    for sample in list(op.sample_inputs("cpu", torch.float32))[:4]:
        flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        floats = [
            k
            for k, v in enumerate(flat)
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32
        ]
        for k in floats[1:]:
            yield flat, spec, "mix", k
        if op.supports_out:
            yield flat, spec, "out", None


def _call(op, flat, spec, kind, k, device):
    from torch.utils._pytree import tree_unflatten

    flat = [v.to(device) if isinstance(v, torch.Tensor) else v for v in flat]
    if kind == "mix":
        flat[k] = flat[k].double()
    inp, args, kwargs = tree_unflatten(flat, spec)
    if kind == "out":
        result = op(inp, *args, **kwargs)
        if not isinstance(result, torch.Tensor) or result.dtype != torch.float32:
            return
        kwargs = {**kwargs, "out": torch.empty(result.shape, dtype=torch.float64, device=device)}
    result = op(inp, *args, **kwargs)
    torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, result)


@pytest.mark.allow_fallback  # ops without a lowering: the CPU kernel checks for itself
@pytest.mark.parametrize("op", _opinfos(), ids=lambda op: f"{op.name}.{op.variant_test_name}")
def test_mixed_dtypes_refused_as_on_cpu(op):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for flat, spec, kind, k in _float_variants(op):
            if (op.name, op.variant_test_name, kind) in _MIXED_DTYPES_ACCEPTED:
                continue
            try:
                _call(op, flat, spec, kind, k, "cpu")
            except RuntimeError as cpu_error:
                with pytest.raises(RuntimeError):
                    _call(op, flat, spec, kind, k, "tpu")
                    pytest.fail(f"{kind} {k}: tpu gave a result where the CPU raised {cpu_error}")
            except Exception:
                continue


def test_what_the_cpu_accepts_of_mixed_dtypes_still_works():
    x = torch.randn(4, 8)
    weight, bias = torch.randn(8), torch.randn(8)
    # A bfloat16 input with float32 norm parameters, as autocast makes them.
    expected = F.layer_norm(x.bfloat16(), (8,), weight, bias)
    actual = F.layer_norm(x.bfloat16().to("tpu"), (8,), weight.to("tpu"), bias.to("tpu"))
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, atol=2e-2, rtol=2e-2)
    # int64 indices into float tensors, and a float64 out= of an op that casts.
    target = torch.zeros(5, 8)
    expected = target.index_add(0, torch.tensor([1, 3, 1, 0]), x)
    actual = target.to("tpu").index_add(0, torch.tensor([1, 3, 1, 0], device="tpu"), x.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected)
    out = torch.empty(4, 8, dtype=torch.float64, device="tpu")
    torch.sin(x.to("tpu"), out=out)
    torch.testing.assert_close(out.cpu(), x.sin().double())


def test_mixed_dtype_errors_name_the_op():
    # torch's message as torch words it; the op in a note (pytest matches notes too).
    target = torch.zeros(3, 2, device="tpu")
    with pytest.raises(RuntimeError, match=r"^index_add_\(\): .*same scalar type") as info:
        target.index_add_(
            0, torch.tensor([0], device="tpu"), torch.ones(1, 2, device="tpu").double()
        )
    assert any("aten.index_add_.default" in n for n in info.value.__notes__)
    with pytest.raises(RuntimeError, match=r"same dtype(.|\n)*aten\.mm\.default"):
        torch.mm(target, torch.ones(2, 2, dtype=torch.float64, device="tpu"))
