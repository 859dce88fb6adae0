"""torchvision and timm on tpu, unmodified, against the same code on the CPU: v2 detection
transforms on tv_tensors, a resnet18 training step, a timm EfficientNet's SGD steps.

PyPI's torchvision does not import beside the CPU build of torch 2.13.0 (its compiled
ops were built for another torch: "operator torchvision::nms does not exist"), so these
tests need the ``vision`` extra, which pins the torchvision release matching torch
2.14.1. CI runs them in its torch 2.14.1 venv (.ci/run); elsewhere they skip."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import torchtpu
from torchtpu.observe import perf_warnings

try:
    import torchvision
    from torchvision import tv_tensors
    from torchvision.transforms import v2
    from torchvision.transforms.v2.functional import _geometry
# ImportError, or the RuntimeError of a torchvision built for another torch
except Exception as exc:
    pytest.skip(
        "torchvision does not import here; these tests run in CI's torch 2.14.1 venv "
        '(pip install torch==2.14.1 torchvision==0.29.1 -e ".[test,vision]"): '
        f"{type(exc).__name__}: {exc}",
        allow_module_level=True,
    )


# -- torchvision's v2 transforms on tv_tensors ----------------------------------------------


def _detection_sample(device, dtype):
    """An image (uint8, or float in [0, 1]) with its target, as a detection dataset
    gives them: boxes, one mask per box, labels."""
    generator = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8, generator=generator)
    if dtype.is_floating_point:
        image = image.to(dtype) / 255
    boxes = torch.tensor([[2, 3, 20, 30], [10, 5, 40, 35], [30, 20, 47, 39], [44, 1, 46, 3]])
    masks = torch.zeros(len(boxes), 40, 48, dtype=torch.uint8)
    for mask, (x1, y1, x2, y2) in zip(masks, boxes.tolist()):
        mask[y1:y2, x1:x2] = 1
    target = {
        "boxes": tv_tensors.BoundingBoxes(
            boxes.float().to(device), format="XYXY", canvas_size=(40, 48)
        ),
        "masks": tv_tensors.Mask(masks.to(device)),
        "labels": torch.arange(1, len(boxes) + 1).to(device),
    }
    return tv_tensors.Image(image.to(device)), target


def _detection_transforms():
    """torchvision's detection recipe, shortened (its references/detection/presets.py)."""
    return v2.Compose([
        v2.RandomHorizontalFlip(p=1),
        v2.RandomIoUCrop(),  # draws crops on the CPU's generator, checks their IoU with the boxes
        v2.Resize((32, 36), antialias=True),
        v2.SanitizeBoundingBoxes(),  # drops a box the crop left empty, its mask and label
        v2.ConvertBoundingBoxFormat("CXCYWH"),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])  # fmt: skip


def _plain(t):
    """A tv_tensor's values as a plain CPU tensor."""
    return t.detach().cpu().as_subclass(torch.Tensor)


@pytest.mark.parametrize("mode", ["strict", "defer"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32], ids=["uint8", "float32"])
def test_detection_transforms_on_tv_tensors_match_cpu(dtype, mode, monkeypatch):
    torch.manual_seed(0)
    with torch.tpu.set_eager_mode(mode):
        image, target = _detection_transforms()(*_detection_sample("tpu", dtype))
    assert "fallback" not in torchtpu.metrics()  # the antialiased resize is lowered
    # torchvision resizes a uint8 image natively only on the CPU (its fixed-point
    # kernel); on any other device (cuda, tpu) it resizes in float32 and rounds. The
    # CPU reference takes that path too: the same code on both.
    monkeypatch.setattr(_geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    torch.manual_seed(0)
    cpu_image, cpu_target = _detection_transforms()(*_detection_sample("cpu", dtype))

    assert type(cpu_image) is tv_tensors.Image and isinstance(image, tv_tensors.Image)
    assert image.device.type == "tpu" and image.dtype == torch.float32
    # Rounding to uint8 may go the other way where the float32 resize lands within an
    # ulp of .5 (a few values), each then a step of 1/255/std after Normalize.
    atol = 1 / 255 / 0.224 + 1e-5 if dtype == torch.uint8 else 1e-5
    torch.testing.assert_close(_plain(image), _plain(cpu_image), rtol=0, atol=atol)
    assert torch.isclose(_plain(image), _plain(cpu_image), rtol=0, atol=1e-5).float().mean() > 0.99

    boxes, cpu_boxes = target["boxes"], cpu_target["boxes"]
    assert isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.device.type == "tpu"
    assert boxes.canvas_size == cpu_boxes.canvas_size == (32, 36)
    assert boxes.format == cpu_boxes.format == tv_tensors.BoundingBoxFormat.CXCYWH
    assert len(cpu_boxes) == 3  # the crop emptied the fourth box, and Sanitize dropped it
    torch.testing.assert_close(_plain(boxes), _plain(cpu_boxes))

    masks, cpu_masks = target["masks"], cpu_target["masks"]
    assert isinstance(masks, tv_tensors.Mask) and masks.device.type == "tpu"
    assert masks.dtype == torch.uint8 and masks.shape == (3, 32, 36)
    assert torch.equal(_plain(masks), _plain(cpu_masks))
    assert target["labels"].cpu().tolist() == cpu_target["labels"].tolist()


def test_antialiased_uint8_resize_matches_cpu_kernel():
    # torchtpu's lowering of the uint8 resize reproduces the CPU's fixed-point kernel.
    generator = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (1, 3, 40, 48), dtype=torch.uint8, generator=generator)
    resize = functools.partial(
        torch.nn.functional.interpolate, size=(32, 36), mode="bilinear", antialias=True
    )
    assert torch.equal(resize(image.to("tpu")).cpu(), resize(image))


@pytest.mark.xfail(
    strict=True,
    reason="type() of a tv_tensor on tpu is torchtpu's subclass of it (torchtpu.tensor.Image, "
    "deriving from tv_tensors.Image and TPUTensor: Note [Subclasses of tpu tensors] in "
    "tensor.py), not tv_tensors.Image; v2.ToDtype's dict form looks the dtype up by "
    "type(inpt), finds none, and leaves the image uint8",
)
def test_to_dtype_keyed_by_tv_tensor_type():
    image = tv_tensors.Image(torch.zeros(3, 4, 4, dtype=torch.uint8, device="tpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scale was set to True but no dtype was specified"
        out = v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True)(image)
    assert out.dtype == torch.float32


# -- torchvision's resnet18 -------------------------------------------------------------------


def _resnet18_step(device):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)  # train mode
    x = torch.randn(2, 3, 64, 64).to(device)
    out = model(x)
    torch.nn.functional.cross_entropy(out, torch.tensor([3, 8]).to(device)).backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    return out.detach().cpu(), grads, {name: b.cpu() for name, b in model.named_buffers()}


def test_resnet18_forward_and_gradients_match_cpu():
    out, grads, buffers = _resnet18_step("tpu")
    cpu_out, cpu_grads, cpu_buffers = _resnet18_step("cpu")
    torch.testing.assert_close(out, cpu_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == cpu_grads.keys()
    # float32 sums over the batch and the image, in another order: each gradient within
    # 1e-4 of its largest value (they differ by 2e-5 of it at most here)
    for name, grad in grads.items():
        scale = cpu_grads[name].abs().max().item()
        torch.testing.assert_close(
            grad, cpu_grads[name], rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    # BatchNorm's running statistics, updated in train mode (and its batch count)
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, cpu_buffers[name], msg=lambda m, n=name: f"{n}: {m}")


# -- timm ---------------------------------------------------------------------------------------


def _timm_steps(device, after_step=lambda: None, steps=3):
    """SGD steps of timm's test_efficientnet (MobileNetV3's blocks and BatchNormAct2d,
    13 batch norms, at a fraction of the size); (losses, parameters after)."""
    timm = pytest.importorskip("timm", reason="timm is in the vision extra")
    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(2, 3, 64, 64).to(device), torch.tensor([1, 7]).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        after_step()
    return losses, [p.detach().cpu() for p in model.parameters()]


def _norm_act_compiles() -> dict[str, int]:
    """Programs compiled so far from each line of timm's norm_act.py (its batch norms)."""
    by_line = torchtpu.metrics().get("compiles_by_line", {})
    return {line: n for line, n in by_line.items() if "timm/layers/norm_act.py" in line}


def test_timm_sgd_steps_match_cpu_and_the_first_step_does_not_warn():
    cpu_losses, cpu_params = _timm_steps("cpu")
    perf_warnings.reset()  # lines other tests compiled from count afresh
    after_steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params = _timm_steps("tpu", lambda: after_steps.append(_norm_act_compiles()))
    # The loss falls to ~0.05 by the third step: float32's rounding, carried through
    # two updates with momentum, shows at 2e-5 of it.
    assert losses == pytest.approx(cpu_losses, rel=1e-4)
    for a, b in zip(params, cpu_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # The first step compiles each of timm's batch norms once (Strict: a program per
    # shape), many from one line of norm_act.py; later steps compile none of them. That
    # is a first step warming up, not a line that keeps compiling (Note [What counts as
    # recompiling]): no TPURecompileWarning, though the line compiled more programs than
    # config.recompile_warn_after.
    assert after_steps[0] == after_steps[-1]
    assert max(after_steps[0].values(), default=0) >= torchtpu.config.recompile_warn_after
    assert [str(w.message) for w in caught if w.category is torchtpu.TPURecompileWarning] == []
