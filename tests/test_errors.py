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
