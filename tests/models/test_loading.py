"""Loading a Hugging Face model onto tpu: ``from_pretrained(device_map="tpu")``, ``.to``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from torchtpu.zoo import BY_NAME  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    arch = BY_NAME["llama"]
    model = arch.build()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return arch, model, directory


def _assert_on_tpu_and_equal(loaded, original):
    expected = original.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.device.type == "tpu", f"{name} is on {tensor.device}"
        torch.testing.assert_close(tensor.cpu(), expected[name], rtol=0, atol=0)


def test_from_pretrained_device_map(saved):
    arch, model, directory = saved
    loaded = type(model).from_pretrained(directory, device_map="tpu")
    _assert_on_tpu_and_equal(loaded, model)
    batch = arch.batch(model.config)
    logits = loaded(**{k: v.to("tpu") for k, v in batch.items()}).logits
    torch.testing.assert_close(logits.cpu(), model(**batch).logits, rtol=1e-4, atol=1e-4)


def test_from_pretrained_then_to(saved):
    _, model, directory = saved
    loaded = type(model).from_pretrained(directory).to("tpu")
    _assert_on_tpu_and_equal(loaded, model)
    assert loaded.device.type == "tpu"
