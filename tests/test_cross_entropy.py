"""``F.cross_entropy`` of [N, C] logits and class indices on tpu is one op forward
and one backward (ops/cross_entropy.py): losses and gradients as torch's composite on
the CPU, in every reduction, with weights, ignore_index and label smoothing."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same

VARIANTS = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "ignore_index": {"ignore_index": 2},
    "label_smoothing": {"label_smoothing": 0.1},
    "weight": {"weight": torch.rand(7, generator=torch.Generator().manual_seed(3))},
    "all": {
        "weight": torch.rand(7, generator=torch.Generator().manual_seed(4)),
        "label_smoothing": 0.2,
        "ignore_index": 1,
        "reduction": "sum",
    },
}


def _ops_run():
    return torchtpu.metrics().get("ops", {}).get("strict", 0)


def _loss_and_grad(device, logits, target, kwargs, ops=None, autocast=False):
    """The loss and the logits' gradient on ``device``; ``ops``, a list: the tpu ops
    the loss and its backward ran."""
    x = logits.detach().to(device).requires_grad_()
    options = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    target = target.to(device)
    rows = x.shape[0] if kwargs.get("reduction") == "none" else 1
    grad_out = torch.linspace(0.5, 1.5, rows, device=device)
    if kwargs.get("reduction") != "none":
        grad_out = grad_out[0]
    before = _ops_run()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(x, target, **options)
    loss.backward(grad_out)
    if ops is not None:
        ops.append(_ops_run() - before)
    return loss, x.grad


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    logits = torch.randn(6, 7, dtype=dtype)
    target = torch.randint(0, 7, (6,))
    target[0] = 2  # ignored where ignore_index is 2
    target[1] = 1
    return logits, target


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cross_entropy_and_its_gradient_match_the_cpu(variant):
    logits, target = _inputs()
    expected = _loss_and_grad("cpu", logits, target, VARIANTS[variant])
    ops = []
    actual = _loss_and_grad("tpu", logits, target, VARIANTS[variant], ops)
    assert_same(actual, expected)
    assert ops == [2]  # log_softmax, nll_loss and their backward ops run inside two


@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16", "autocast"])
def test_16_bit_logits_match_the_cpu(autocast):
    """bfloat16 logits: the loss in bfloat16, or in float32 under autocast (torch's
    composite casts for log_softmax there); the gradient in the logits' dtype."""
    logits, target = _inputs(torch.bfloat16)
    expected = _loss_and_grad("cpu", logits, target, {}, autocast=autocast)
    actual = _loss_and_grad("tpu", logits, target, {}, autocast=autocast)
    assert_same(actual, expected)


def test_cross_entropy_in_every_mode_matches_the_cpu(mode):
    logits, target = _inputs()
    kwargs = VARIANTS["all"]
    assert_same(
        _loss_and_grad("tpu", logits, target, kwargs), _loss_and_grad("cpu", logits, target, kwargs)
    )


def test_a_target_out_of_range_raises_as_on_the_cpu():
    logits, target = _inputs()
    target[3] = 9
    with pytest.raises(IndexError):
        F.cross_entropy(logits, target)
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(logits.to("tpu"), target.to("tpu")).item()


def test_other_targets_and_shapes_take_torchs_composite():
    """Class probabilities and [N, C, d] logits are not the op's: torch's composite
    runs them, with the CPU's values."""
    torch.manual_seed(0)
    probabilities = torch.softmax(torch.randn(6, 7), 1)
    logits, _ = _inputs()
    images, pixels = torch.randn(2, 7, 3), torch.randint(0, 7, (2, 3))
    for x, t in ((logits, probabilities), (images, pixels)):
        expected = _loss_and_grad("cpu", x, t, {})
        assert_same(_loss_and_grad("tpu", x, t, {}), expected)


def test_maml_differentiates_the_backward():
    """``create_graph=True`` through the loss (MAML's inner step): the backward runs as
    torch's composite, which autograd records."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 5), torch.randn(7, 5) * 0.5
    target = torch.randint(0, 7, (6,))
    results = {}
    for device in ("cpu", "tpu"):
        ws = w.detach().to(device).requires_grad_()
        loss = F.cross_entropy(x.to(device) @ ws.t(), target.to(device), label_smoothing=0.1)
        (grad_w,) = torch.autograd.grad(loss, ws, create_graph=True)
        adapted = ws - 0.5 * grad_w
        F.cross_entropy(x.to(device) @ adapted.t(), target.to(device)).backward()
        results[device] = (grad_w, ws.grad)
    assert_same(results["tpu"], results["cpu"], rtol=1e-4, atol=1e-5)


def _float_of_16_bit_logits(device, logits, target, write_after=None, create_graph=False):
    """``F.cross_entropy(h.reshape(...).float(), target)`` of 16-bit ``h``, as language
    models upcast their logits: the loss, the gradient of ``logits``, and on tpu whether
    the float32 copy outlived the loss's forward."""
    x = logits.detach().to(device).requires_grad_()
    h = (x * 2).to(torch.bfloat16).reshape(-1, logits.shape[-1])  # the model's output
    copy = h.float()
    alive = weakref.ref(copy._storage) if device == "tpu" else None
    loss = F.cross_entropy(copy, target.to(device), label_smoothing=0.1)
    if write_after == "copy":
        copy.mul_(3)  # allowed on the CPU: torch's loss saves log_softmax's result
    elif write_after == "logits":
        h.mul_(3)
    del copy
    freed = alive is not None and alive() is None
    if create_graph:
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (grad.square().sum() + loss).backward()
    else:
        loss.backward()
    return (loss, x.grad), freed


def test_the_float32_copy_of_16_bit_logits_is_not_kept_for_the_backward(mode):
    """Note [Saving the logits' values]: the loss keeps the 16-bit logits (alive anyway)
    saved in place of their float32 copy, which is freed after the forward; values and
    gradients as the CPU's."""
    torch.manual_seed(0)
    logits, target = torch.randn(2, 6, 7), torch.randint(0, 7, (12,))
    expected, _ = _float_of_16_bit_logits("cpu", logits, target)
    actual, freed = _float_of_16_bit_logits("tpu", logits, target)
    assert_same(actual, expected)
    assert freed


@pytest.mark.parametrize("write_after", ["copy", "logits"])
def test_writing_into_the_logits_after_the_loss_changes_nothing_as_on_the_cpu(write_after):
    """The CPU's loss saves ``log_softmax``'s result, so writing into its input (or into
    what the input was copied from) after the loss is allowed and changes no gradient;
    the tpu loss saves the input's values, with the same effect."""
    torch.manual_seed(0)
    logits, target = torch.randn(2, 6, 7), torch.randint(0, 7, (12,))
    expected, _ = _float_of_16_bit_logits("cpu", logits, target, write_after)
    actual, _ = _float_of_16_bit_logits("tpu", logits, target, write_after)
    assert_same(actual, expected)


def test_a_second_order_gradient_through_upcast_logits_matches_the_cpu():
    """``create_graph=True`` with the 16-bit logits saved: the backward gets float32
    values in the input's place in the graph, so the cast is differentiated too."""
    torch.manual_seed(0)
    logits, target = torch.randn(2, 6, 7), torch.randint(0, 7, (12,))
    expected, _ = _float_of_16_bit_logits("cpu", logits, target, create_graph=True)
    actual, _ = _float_of_16_bit_logits("tpu", logits, target, create_graph=True)
    assert_same(actual, expected)


def test_logits_written_between_the_cast_and_the_loss_are_not_taken_for_the_copy():
    """The float32 copy holds the values the 16-bit logits had when copied: written
    since, the logits no longer hold them, and the copy itself stays saved."""
    torch.manual_seed(0)
    logits, target = torch.randn(12, 7), torch.randint(0, 7, (12,))
    results = {}
    for device in ("cpu", "tpu"):
        x = logits.detach().to(device).requires_grad_()
        h = (x * 2).to(torch.bfloat16)
        copy = h.float()
        with torch.no_grad():
            h.mul_(3)
        loss = F.cross_entropy(copy, target.to(device))
        loss.backward()
        results[device] = (loss, x.grad)
    assert_same(results["tpu"], results["cpu"])


def test_the_loss_under_the_callers_saved_tensor_hooks_matches_the_cpu():
    """Activation checkpointing and ``save_on_cpu`` install saved-tensor hooks of their
    own; they then decide how the loss's input is kept, and the loss trains as on the
    CPU."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    logits, target = torch.randn(12, 7), torch.randint(0, 7, (12,))
    results = {}
    for device in ("cpu", "tpu"):
        x, t = logits.detach().to(device).requires_grad_(), target.to(device)

        def loss_of(x):
            return F.cross_entropy((x * 2).to(torch.bfloat16).float(), t)  # noqa: B023

        checkpointed = checkpoint(loss_of, x, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(lambda a: a, lambda a: a):
            hooked = loss_of(x)
        (checkpointed + hooked).backward()
        results[device] = (checkpointed, hooked, x.grad)
    assert_same(results["tpu"], results["cpu"])
