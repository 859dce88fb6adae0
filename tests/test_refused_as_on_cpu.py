"""Input the CPU kernels refuse is refused on tpu too, never answered (issue #31): value
checks (raised at once in Debug, at the next read otherwise), arguments out of range,
complex tensors where torch implements no complex kernel, in-place writes over their
own input, and the out= forms of sequences, which fill a view as the CPU does."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same

MODES = ["strict", "debug", "defer"]


def _cpu_error(call) -> BaseException:
    try:
        call("cpu")
    except Exception as error:  # noqa: BLE001 - any error the CPU raises is the expectation
        return error
    raise AssertionError("the CPU accepted the call")


def _assert_refused_as_on_cpu(call, mode):
    expected = _cpu_error(call)
    with torch.tpu.set_eager_mode(mode), pytest.raises(type(expected)) as info:
        result = call("tpu")
        if isinstance(result, torch.Tensor):
            result.cpu()  # a value check raises at the next read
        torch.tpu.synchronize()
    return expected, info.value


def _t(values, device, dtype=None):
    return torch.tensor(values, dtype=dtype).to(device)


# Ops whose CPU kernel checks the values of its input.
VALUE_CHECKS = {
    "binary_cross_entropy input": lambda d: F.binary_cross_entropy(_t([1.5], d), _t([1.0], d)),
    "binary_cross_entropy nan": lambda d: F.binary_cross_entropy(
        _t([float("nan")], d), _t([1.0], d)
    ),
    "binary_cross_entropy target": lambda d: F.binary_cross_entropy(_t([0.5], d), _t([2.0], d)),
    "bernoulli": lambda d: torch.bernoulli(_t([0.5, 1.5], d)),
    "bernoulli_ tensor": lambda d: torch.zeros(2).to(d).bernoulli_(_t([1.5, 0.5], d)),
    "normal std tensor": lambda d: torch.normal(torch.zeros(2).to(d), _t([-1.0, 1.0], d)),
    "normal float mean": lambda d: torch.normal(0.0, _t([-1.0, 1.0], d)),
    "repeat_interleave": lambda d: torch.repeat_interleave(torch.zeros(2).to(d), _t([-1, 2], d)),
    "embedding_bag": lambda d: F.embedding_bag(_t([7], d), torch.zeros(3, 2).to(d), _t([0], d)),
    # torch's one_hot skips its checks for tensor subclasses (Note [one_hot's checks on tpu])
    "one_hot too large": lambda d: F.one_hot(_t([0, 3], d), 3),
    "one_hot negative": lambda d: F.one_hot(_t([0, -1], d), 3),
    "one_hot negative, classes counted": lambda d: F.one_hot(_t([0, -1], d)),
    "one_hot of nothing, classes counted": lambda d: F.one_hot(_t([], d, torch.long)),
    "one_hot of floats": lambda d: F.one_hot(_t([0.0], d), 3),
    # an index past its plane (torch's decomposition wrote it into the next plane)
    "max_unpool2d": lambda d: F.max_unpool2d(
        torch.ones(2, 1, 1, 1).to(d), _t([[[[4]]], [[[0]]]], d), 2
    ),
    "max_unpool3d": lambda d: F.max_unpool3d(
        torch.ones(1, 1, 1, 1, 1).to(d), _t([[[[[-1]]]]], d), 2
    ),
}

# Whose CPU message names the bad value, which a value check cannot: the words before it.
_WITHOUT_THE_VALUE = {"max_unpool2d": ":", "max_unpool3d": ":"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", VALUE_CHECKS)
def test_value_checks(name, mode):
    expected, actual = _assert_refused_as_on_cpu(VALUE_CHECKS[name], mode)
    words = str(expected).split("\n")[0].split("  ")[0]
    if name in _WITHOUT_THE_VALUE:
        words = words.split(_WITHOUT_THE_VALUE[name])[0]
    if "embedding_bag" not in name:  # (the CPU names the bad index and its value)
        assert words in str(actual)


# Scalar arguments the CPU kernels check (their meta kernels do not).
ARGUMENTS = {
    "bernoulli_ p": lambda d: torch.zeros(2).to(d).bernoulli_(1.5),
    "random_ from >= to": lambda d: torch.zeros(3).to(d).random_(5, 2),
    "random_ to beyond uint8": lambda d: torch.zeros(3, dtype=torch.uint8).to(d).random_(0, 1000),
    "random_ from below uint8": lambda d: torch.zeros(3, dtype=torch.uint8).to(d).random_(-1, 3),
    "random_ to beyond int8": lambda d: torch.zeros(3, dtype=torch.int8).to(d).random_(300),
    "random_ to beyond bool": lambda d: torch.zeros(3, dtype=torch.bool).to(d).random_(0, 3),
    "randint from >= to": lambda d: torch.randint(5, 2, (2,), device=d),
}


@pytest.mark.parametrize("name", ARGUMENTS)
def test_arguments_out_of_range(name):
    expected, actual = _assert_refused_as_on_cpu(ARGUMENTS[name], "strict")
    assert str(expected) in str(actual)


def _complex(device, n=2):
    return torch.ones(n, dtype=torch.complex64).to(device)


COMPLEX = {
    "maximum": lambda d: torch.maximum(_complex(d), _complex(d)),
    "minimum": lambda d: torch.minimum(_complex(d), _complex(d)),
    "fmax": lambda d: torch.fmax(_complex(d), _complex(d)),
    "fmin": lambda d: torch.fmin(_complex(d), _complex(d)),
    "max": lambda d: _complex(d).max(),
    "min": lambda d: _complex(d).min(),
    "max dim": lambda d: _complex(d).max(0),
    "amax": lambda d: _complex(d).amax(),
    "aminmax": lambda d: _complex(d).aminmax(),
    "clamp": lambda d: torch.clamp(_complex(d), 0, 1),
    "sort": lambda d: _complex(d).sort(),
    "cummax": lambda d: _complex(d).cummax(0),
    "kthvalue": lambda d: _complex(d).kthvalue(1),
}


@pytest.mark.parametrize("name", COMPLEX)
def test_no_complex_kernel_on_the_cpu_none_on_tpu(name):
    _assert_refused_as_on_cpu(COMPLEX[name], "strict")


def test_complex_ops_the_cpu_implements_still_run():
    x = torch.tensor([1 + 2j, -3 + 0.5j])
    for op in (torch.abs, torch.exp, lambda v: v * v, lambda v: v.sum(), torch.conj_physical):
        assert_same(op(x.to("tpu")), op(x))


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_op_over_its_own_input_is_refused(mode):
    def call(device):
        x = torch.arange(12.0).reshape(4, 3).to(device)
        x.narrow(0, 1, 2).add_(x.narrow(0, 0, 2))

    expected, actual = _assert_refused_as_on_cpu(call, mode)
    assert "memory location" in str(actual)
    x = torch.arange(12.0).reshape(4, 3)
    y = x.to("tpu")
    with torch.tpu.set_eager_mode(mode):
        x.narrow(0, 1, 2).add_(x.narrow(0, 1, 2))  # the same elements: allowed
        y.narrow(0, 1, 2).add_(y.narrow(0, 1, 2))
        x[:2].mul_(x[2:])  # apart: allowed
        y[:2].mul_(y[2:])
        assert_same(y, x)


def test_in_place_leaky_relu_with_a_negative_slope_refuses_its_backward():
    def call(device):
        a = torch.tensor([-1.0, 2.0], device=device, requires_grad=True)
        b = a * 1
        F.leaky_relu_(b, -2.0)
        b.sum().backward()

    _assert_refused_as_on_cpu(call, "strict")
    a = torch.tensor([-1.0, 2.0], device="tpu", requires_grad=True)
    b = a * 1
    F.leaky_relu_(b, 0.5)  # a positive slope: the sign survives, the backward runs
    b.sum().backward()
    assert_same(a.grad, torch.tensor([0.5, 1.0]))


SEQUENCES = {
    "arange": lambda out: torch.arange(0, 4, out=out),
    "linspace": lambda out: torch.linspace(0, 3, 4, out=out),
    "logspace": lambda out: torch.logspace(0, 3, 4, out=out),
    "range": lambda out: torch.range(0, 3, out=out),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SEQUENCES)
def test_sequences_fill_a_view_given_as_out(name, mode):
    """The CPU kernels keep an out tensor of the right number of elements as it is and
    write through its strides; a wrong number of elements resizes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.range is deprecated
        results = []
        for device in ("cpu", "tpu"):
            with torch.tpu.set_eager_mode(mode):
                x = torch.zeros(2, 3, device=device)
                SEQUENCES[name](x.narrow(1, 1, 2))
                resized = torch.zeros(3, device=device)
                SEQUENCES[name](resized)
                results.append((x, resized))
    assert_same(results[1][0], results[0][0])
    assert_same(results[1][1], results[0][1])


def test_integer_logspace_truncates_its_exponents_first():
    for args, kwargs in [
        ((0.25, 0.9, 8), {"dtype": torch.int32}),
        ((0.25, 3.9, 8), {"base": 3, "dtype": torch.int64}),
        ((-1.5, 2.5, 5), {"base": 2, "dtype": torch.int64}),
    ]:
        assert_same(torch.logspace(*args, **kwargs, device="tpu"), torch.logspace(*args, **kwargs))


@pytest.mark.parametrize("mode", MODES)
def test_one_hot_in_range_eager_and_compiled(mode):
    x = torch.tensor([[0, 2], [1, 1]])
    with torch.tpu.set_eager_mode(mode):
        for n in (-1, 3, 5):
            assert_same(F.one_hot(x.to("tpu"), n), F.one_hot(x, n))
        compiled = torch.compile(lambda t: F.one_hot(t, 4) * 2, backend="tpu")
        assert_same(compiled(x.to("tpu")), F.one_hot(x, 4) * 2)
        with pytest.raises(RuntimeError, match="smaller than num_classes"):
            compiled(torch.tensor([4]).to("tpu")).cpu()


_CTC_BAD_LENGTHS = {
    "a target longer than its row": (torch.tensor([[1, 2], [1, 1]]), [6, 6], [3, 2]),
    "an input longer than the log-probs": (torch.tensor([[1, 2], [1, 1]]), [7, 6], [2, 2]),
    "a negative input length": (torch.tensor([[1, 2], [1, 1]]), [-1, 6], [2, 2]),
    "a negative target length": (torch.tensor([[1, 2], [1, 1]]), [6, 6], [-1, 2]),
    "concatenated targets too few": (torch.tensor([1, 2, 3]), [6, 6], [2, 2]),
    "concatenated targets too many": (torch.tensor([1, 2, 3, 1, 2]), [6, 6], [2, 2]),
}


@pytest.mark.parametrize("lengths_on", ["cpu", "tpu"])
@pytest.mark.parametrize("name", _CTC_BAD_LENGTHS)
def test_ctc_loss_lengths_checked_as_on_cpu(name, lengths_on):
    # Lengths on the CPU (the documented usage) are checked on the host, in the CPU's
    # words; lengths on the device by value checks, without the offending value.
    targets, input_lengths, target_lengths = _CTC_BAD_LENGTHS[name]
    log_probs = torch.randn(6, 2, 4).log_softmax(-1)

    def call(d):
        lengths = "cpu" if d == "cpu" else lengths_on
        return F.ctc_loss(
            log_probs.to(d),
            targets.to(d),
            torch.tensor(input_lengths).to(lengths),
            torch.tensor(target_lengths).to(lengths),
            reduction="none",
        )

    expected, actual = _assert_refused_as_on_cpu(call, "strict")
    words = str(expected).split("\n")[0]
    if lengths_on == "cpu":
        assert words in str(actual)
    else:
        assert words.split(", but")[0].split(" at dimension")[0].split(" size ")[0] in str(actual)
