"""Failure classes found by PyTorch's device-generic tests (docs/upstream-tests.md)."""

import warnings

import pytest
import torch

from torchtpu.conformance import upstream


def test_messages_are_torchs_and_the_op_is_a_note():
    # PyTorch's tests anchor messages: assertRaisesRegex(RuntimeError, "^Integer division")
    a = torch.ones(3, dtype=torch.int64)
    for device in ("cpu", "tpu"):
        x = a.to(device)
        with pytest.raises(RuntimeError) as info:
            torch.addcdiv(x, x, x)
        assert str(info.value).startswith("Integer division with addcdiv is no longer supported")
        if device == "tpu":
            assert any("aten.addcdiv.default" in n for n in info.value.__notes__)


def test_a_failed_value_check_keeps_torchs_wording():
    x = torch.arange(3.0, device="tpu")
    with pytest.raises(IndexError) as info:
        x[torch.tensor([5], device="tpu")].cpu()
    assert not str(info.value).startswith("aten.")
    assert any(n.startswith("torchtpu: raised by aten.index.Tensor") for n in info.value.__notes__)


def test_tests_match_across_devices_by_name():
    cpu = upstream.test_key("test_indexing.TestIndexingCPU", "test_take_cpu_float32")
    tpu = upstream.test_key("test_indexing.TestIndexingPRIVATEUSE1", "test_take_tpu_float32")
    assert cpu == tpu == "test_indexing.TestIndexing::test_take_float32"
    assert upstream.test_key("m.TestTPU", "test_cpu_only_tpu") == "m.Test::test_cpu_only"


def test_failures_are_classified():
    def cls(message, text=""):
        return upstream.classify(upstream.Outcome("fail", message, text))

    assert cls("AssertionError: RuntimeError not raised by <lambda>").startswith("invalid input")
    assert cls('AssertionError: "^Integer" does not match "aten.x: Integer"') == (
        "error message differs"
    )
    assert cls("Failed: Timeout (>120.0s) from pytest-timeout.") == "timeout"
    assert cls("KeyError: 3") == "other KeyError"


def _raised(fn):
    """(exception type, message) of ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize(
    "call",
    [
        # add/sub's alpha_check: made by the CPU kernels, not the meta kernels
        lambda d: torch.add(torch.tensor([True, False], device=d), True, alpha=1.1),
        lambda d: torch.add(torch.tensor([1, 2], device=d), 3, alpha=1.0),
        lambda d: torch.sub(torch.tensor([1.0], device=d), 2.0, alpha=True),
        lambda d: torch.rsub(torch.tensor([1.0], device=d), 2.0, alpha=1j),
        # a JAX TypeError where the CPU kernel raises its own (NotImplementedError)
        lambda d: torch.floor(torch.ones(2, dtype=torch.complex64, device=d)),
        lambda d: torch.ceil(
            torch.ones(2, dtype=torch.complex64, device=d),
            out=torch.empty(2, dtype=torch.complex64, device=d),
        ),
        # nonzero's out= must be int64, whatever its shape
        lambda d: torch.nonzero(
            torch.tensor([0, 1, 1], device=d), out=torch.empty([], dtype=torch.float, device=d)
        ),
    ],
)
def test_invalid_input_is_refused_as_on_the_cpu(call):
    expected = _raised(lambda: call("cpu"))
    assert expected is not None
    assert _raised(lambda: call("tpu")) == expected


def test_what_the_alpha_check_lets_through_still_works():
    for device in ("cpu", "tpu"):
        x = torch.tensor([1, 2], device=device)
        assert torch.add(x, x, alpha=3).tolist() == [4, 8]
        assert torch.add(x.float(), x, alpha=0.5).tolist() == [1.5, 3.0]
        assert torch.add(torch.tensor([True], device=device), True, alpha=True).tolist() == [True]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64, torch.int16])
def test_zero_element_complex_dtype_views(dtype):
    """A view of an empty complex tensor as another dtype: its last dim scales with
    the element size, and nothing divides by the number of elements."""
    for device in ("cpu", "tpu"):
        e = torch.empty(0, 5, 64, dtype=torch.bool, device=device)
        view = e.view(torch.complex128).view(dtype)
        if device == "cpu":
            expected = view
        else:
            assert view.shape == expected.shape and view.dtype == expected.dtype
            assert (view == view).shape == expected.shape


def test_uint8_masks_warn_as_on_the_cpu():
    import warnings

    counts = {}
    for device in ("cpu", "tpu"):
        v = torch.randn(5, 7, 3, device=device)
        mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            v[mask]
            v[mask, :, torch.tensor([1, 1, 1], dtype=torch.uint8, device=device)]
            v.index_put_((mask,), torch.zeros(3, 7, 3, device=device), accumulate=True)
        mine = [w for w in caught if "uint8" in str(w.message)]
        assert all(w.filename == __file__ for w in mine)  # pointing at the user's line
        assert all(str(w.message).startswith("indexing with dtype torch.uint8") for w in mine)
        counts[device] = len(mine)
    assert counts["tpu"] == counts["cpu"] == 4


def test_out_cast_errors_are_worded_as_the_cpu_words_them():
    # test_type_promotion's test_alternate_result matches "can't be cast to": the CPU
    # kernel's wording, where the meta kernel says "Attempting to cast from ...".
    def call(d):
        x = torch.ones(3, device=d)
        return torch.add(x, x, out=torch.empty(3, dtype=torch.int64, device=d))

    expected = _raised(lambda: call("cpu"))
    assert expected is not None and "can't be cast to" in expected[1]
    assert _raised(lambda: call("tpu")) == expected


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_resize_as_preserves_the_templates_memory_format(memory_format):
    strides = {}
    for device in ("cpu", "tpu"):
        template = torch.randn(2, 3, 4, 5, device=device).contiguous(memory_format=memory_format)
        flat = torch.randn(template.numel(), device=device)
        flat.resize_as_(template, memory_format=torch.preserve_format)
        strides[device] = flat.stride()
    assert strides["tpu"] == strides["cpu"]


def test_set_to_a_storage_makes_a_view_of_it():
    results = {}
    for device in ("cpu", "tpu"):
        reference = torch.arange(10.0, device=device)
        strided = torch.tensor((), device=device)
        strided.set_(reference.untyped_storage(), 1, (2, 2), (4, 1))
        typed = torch.tensor((), device=device).set_(reference.storage(), 6, (4,), (1,))
        read = strided.clone()
        strided.mul_(-1)  # writes into reference, as on the CPU
        results[device] = (
            strided.stride(),
            strided.storage_offset(),
            strided.data_ptr() - reference.data_ptr(),
            read.tolist(),
            typed.tolist(),
            reference.tolist(),
        )
    assert results["tpu"] == results["cpu"]


def test_set_to_a_storage_is_checked_as_on_the_cpu():
    x = torch.arange(4.0, device="tpu")
    # Beyond its end the CPU grows the storage; a tpu storage keeps its size.
    y = torch.tensor((), device="tpu")
    with pytest.raises(RuntimeError, match="not resizable"):
        y.set_(x.untyped_storage(), 2, (3,), (1,))
    assert y.shape == (0,) and y.tolist() == []
    with pytest.raises(RuntimeError, match="devices must match"):
        torch.tensor((), device="tpu").set_(torch.arange(4.0).untyped_storage(), 0, (4,), (1,))


def test_a_quantized_fallback_result_is_refused_clearly():
    with pytest.raises(TypeError, match="dtype torch.quint8 is not supported"):
        torch.quantize_per_tensor(torch.ones(3, device="tpu"), 0.1, 5, torch.quint8)


@pytest.mark.parametrize(
    "index",
    [
        lambda d: [10],
        lambda d: torch.tensor([10]),  # a CPU index
        lambda d: torch.tensor([1, -11]).to(d),  # just uploaded: its values are on the host
        lambda d: (torch.tensor([0], device=d), torch.tensor([7], device=d)),
    ],
)
def test_out_of_range_indices_known_on_the_host_raise_at_once(index):
    # test_indexing's test_advancedindex: the IndexError at the call, as on the CPU
    # (an index computed on the device is checked when a value is next read).
    for device in ("cpu", "tpu"):
        x = torch.zeros(10, 7, device=device)
        with pytest.raises(IndexError, match="out of bounds for dimension") as info:
            x[index(device)]
        if device == "cpu":
            expected = str(info.value)
        else:
            assert str(info.value) == expected
        with pytest.raises(IndexError, match="out of bounds"):
            x[index(device)] = 1.0
    x = torch.zeros(10, device="tpu")
    i = torch.tensor([3], device="tpu")
    i.add_(7)  # written on the device: no longer known on the host
    y = x[i]
    with pytest.raises(IndexError, match="out of bounds"):
        y.cpu()


@pytest.mark.parametrize(
    "source, view",
    [(torch.float64, torch.complex64), (torch.complex64, torch.int64), (torch.int32, torch.float32)],
)
def test_a_0d_tensor_viewed_as_a_dtype_of_its_size_stays_0d(source, view):
    # (test_view_ops' test_view_dtype_new: a float64 scalar viewed as complex64 came
    # out with shape (1,) inside, and comparing it failed to broadcast.)
    cpu = (torch.randn(()) * 3).to(source)
    tpu = cpu.to("tpu").view(view)
    assert tpu.shape == () and tpu.cpu().view(source) == cpu
    assert (tpu.view(source) == cpu.to("tpu")).item()


@pytest.mark.parametrize(
    "shape, index",
    [
        ((10, 0), lambda d: (slice(None), [0, 1])),
        ((5,), lambda d: torch.tensor([1, 10], device=d)),
        ((3, 4), lambda d: (slice(None), torch.tensor([1, 7], device=d))),
        ((3, 4), lambda d: (torch.tensor([1], device=d), torch.tensor([9], device=d))),
    ],
)
def test_an_index_known_on_the_host_raises_the_cpu_message(shape, index):
    # The CPU kernel numbers the index tensors, not the dims they index, and words an
    # empty dim its own way (test_indexing's test_empty_ndim_index matches on it).
    with pytest.raises(IndexError) as cpu:
        torch.zeros(shape)[index("cpu")]
    with pytest.raises(IndexError) as tpu:
        torch.zeros(shape, device="tpu")[index("tpu")]
    assert str(tpu.value) == str(cpu.value)


def test_a_uint8_mask_assignment_warns_once_as_on_cpu():
    results = []
    for device in ("cpu", "tpu"):
        x = torch.arange(16.0, device=device).view(4, 4)
        mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x[mask] = torch.tensor([3.0, 4.0, 5.0, 6.0], device=device)
        # (the CPU's message ends with where in ATen it was raised)
        results.append(([str(w.message).split(" (Triggered")[0] for w in caught], x.cpu()))
    assert results[1][0] == results[0][0] and len(results[0][0]) == 1
    assert torch.equal(results[1][1], results[0][1])


def test_index_fill_with_indices_known_on_the_host_raises_at_once():
    # torch 2.15 makes ``x[[10]] = v`` an index_fill_: the CPU's IndexError at the call.
    for dim, index in ((0, [10]), (1, [-8]), (-1, [7])):
        errors = []
        for device in ("cpu", "tpu"):
            x = torch.zeros(10, 7, device=device)
            with pytest.raises(IndexError) as info:
                x.index_fill_(dim, torch.tensor(index).to(device), 1.0)
            errors.append(str(info.value).split("\n")[0])
        assert errors[1].startswith(errors[0])
