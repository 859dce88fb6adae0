"""JAX interop (docs/jax-interop.md): tpu tensors to and from jax arrays, DLPack, and
``@torchtpu.jax_op`` functions and Pallas kernels as torch ops, checked against the
same computation in PyTorch on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu
from conftest import assert_same, tpu
from torchtpu.interop.pallas import softmax as pallas_softmax
from torchtpu.runtime import platform

# -- functions used by several tests (each jax_op is a torch op: defined once) -------------


@torchtpu.jax_op
def sin_mul(x, y, scale=2.0):
    return {"a": jnp.sin(x) * y * scale, "b": (x @ y.T).sum()}


def sin_mul_torch(x, y, scale=2.0):
    return {"a": torch.sin(x) * y * scale, "b": (x @ y.T).sum()}


@torchtpu.jax_op
def tanh_layer(x, w):
    return jnp.tanh(x @ w)


@torchtpu.jax_op(traced=("scale",))
def scaled(x, scale):
    return x * scale


@torchtpu.jax_op
def static_scaled(x, scale):
    return x * scale


@torchtpu.jax_op
def gather_rows(x, index):
    """An integer input (not differentiable) and an integer output."""
    rows = x[index]
    return rows * 2.0, jnp.argmax(rows, axis=1)


def _round_backward(grad_out, x):
    return (grad_out,)  # straight-through: the gradient of the identity


@torchtpu.jax_op(backward=_round_backward)
def round_ste(x):
    return jnp.round(x)


def _weighted_backward(grad_out, x, *rest, weight):
    return (grad_out * weight, *[2 * grad_out * weight for _ in rest])


@torchtpu.jax_op(backward=_weighted_backward)
def weighted_sum(x, *rest, weight):
    """Varargs and a keyword-only tensor: a user's backward covers the positional ones."""
    return (x + 2 * sum(rest)) * weight


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))


@torchtpu.jax_op
def clip_gradient(x):
    return _clip_gradient(x) * 1.0


@torchtpu.jax_op
def complex_square(z, c):
    return z * z * c, jnp.exp(1j * jnp.real(z))


@torchtpu.jax_op
def mismatched(x, y):
    return x * y


@torchtpu.jax_op
def gamma_cdf(x, shape, rate):
    """The regularized lower incomplete gamma function, differentiable in ``shape``:
    torch's ``special.gammainc`` has no gradient for it."""
    return jax.scipy.special.gammainc(shape, rate * x)


def _data(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _interop_counts():
    return torchtpu.metrics().get("interop", {})


# -- to_jax / from_jax ---------------------------------------------------------------------


def test_to_jax_hands_out_the_storage_array():
    x = tpu(_data(3, 4))
    y = x * 2
    a = torchtpu.to_jax(y)
    assert a is y._storage.array  # the array itself: nothing copied
    assert a.unsafe_buffer_pointer() == y._storage.array.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(a), (_data(3, 4) * 2).numpy())
    assert _interop_counts() == {"to_jax zero-copy": 1}


def test_from_jax_wraps_the_array():
    a = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    t = torchtpu.from_jax(a)
    assert t._storage.array is a
    assert torchtpu.to_jax(t) is a  # and back, still the same array
    assert_same(t, torch.arange(12.0).reshape(3, 4))
    assert t.is_contiguous() and t.device == torch.device("tpu", 0)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.complex64],
)
def test_round_trip_keeps_dtype_and_values(dtype):
    expected = (_data(5, 3) * 4).to(dtype)
    t = torchtpu.from_jax(torchtpu.to_jax(tpu(expected)))
    assert_same(t, expected)


def test_int64_is_not_narrowed():
    t = torchtpu.from_jax(jnp.asarray([2**40 + 7], dtype=jnp.int64))
    assert t.dtype == torch.int64 and t.item() == 2**40 + 7


@pytest.mark.parametrize(
    "view", [lambda t: t.T, lambda t: t[1:, ::2], lambda t: t.view(-1), lambda t: t[0]]
)
def test_a_view_is_made_contiguous(view):
    x = tpu(_data(4, 6))
    a = torchtpu.to_jax(view(x))
    assert a is not x._storage.array
    np.testing.assert_array_equal(np.asarray(a), view(_data(4, 6)).numpy())
    assert _interop_counts() == {"to_jax copied": 1}


def test_to_jax_flushes_a_pending_value():
    x = tpu(_data(3, 3))
    with torchtpu.set_eager_mode("defer"):
        y = (x * 2).exp() + 1
        a = torchtpu.to_jax(y)
    assert torchtpu.metrics()["flushes"] == {"to_jax": 1}
    torch.testing.assert_close(torch.tensor(np.asarray(a)), (_data(3, 3) * 2).exp() + 1)


def test_writing_the_tensor_leaves_a_handed_out_array_alone():
    """Note [Aliasing between tensors and arrays]: arrays are immutable."""
    x = tpu(torch.zeros(3))
    a = torchtpu.to_jax(x)
    x.add_(1)
    np.testing.assert_array_equal(np.asarray(a), np.zeros(3, np.float32))
    assert_same(x, torch.ones(3))


def test_writing_a_tensor_from_jax_leaves_the_array_alone_but_views_follow():
    a = jnp.zeros((2, 3), dtype=jnp.float32)
    t = torchtpu.from_jax(a)
    row = t[0]
    t.add_(5)
    np.testing.assert_array_equal(np.asarray(a), np.zeros((2, 3), np.float32))
    assert_same(row, torch.full((3,), 5.0))  # a view of the tensor still aliases it


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="expected a tpu tensor, got a cpu tensor"):
        torchtpu.to_jax(torch.ones(2))
    with pytest.raises(TypeError, match="expected a jax.Array, got ndarray"):
        torchtpu.from_jax(np.ones(2))


# -- DLPack ----------------------------------------------------------------------------------


# JAX exports host and GPU memory through DLPack, not a TPU's.
_ON_A_TPU = platform() == "tpu"
_NO_DLPACK = "cannot be shared through DLPack"


def test_a_tpu_tensor_on_a_tpu_is_refused_clearly():
    x = tpu(_data(2, 3))
    if not _ON_A_TPU:
        assert x.__dlpack_device__()[0] == 1  # kDLCPU: the CPU backend's memory
        return
    for export in (x.__dlpack__, x.__dlpack_device__, lambda: torch.utils.dlpack.to_dlpack(x)):
        with pytest.raises(BufferError, match=_NO_DLPACK):
            export()
    with pytest.raises(BufferError, match=_NO_DLPACK):
        torch.from_dlpack(x)
    assert_same(torchtpu.from_dlpack(x), _data(2, 3))  # tpu to tpu: no DLPack needed


@pytest.mark.skipif(_ON_A_TPU, reason="JAX exports no TPU memory through DLPack")
def test_jax_dlpack_consumes_a_tpu_tensor_without_copy():
    x = tpu(_data(4, 5))
    a = jax.dlpack.from_dlpack(x)
    assert a.unsafe_buffer_pointer() == x._storage.array.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(a), _data(4, 5).numpy())


@pytest.mark.skipif(_ON_A_TPU, reason="JAX exports no TPU memory through DLPack")
def test_torch_from_dlpack_reads_a_tpu_tensor():
    # On the CPU backend a tpu tensor's array is host memory: torch makes a CPU tensor on it.
    x = tpu(_data(2, 3))
    c = torch.from_dlpack(x)
    assert c.device.type == "cpu"
    assert c.data_ptr() == x._storage.array.unsafe_buffer_pointer()
    torch.testing.assert_close(c, _data(2, 3))


@pytest.mark.skipif(_ON_A_TPU, reason="JAX exports no TPU memory through DLPack")
def test_legacy_capsule_round_trip():
    x = tpu(_data(3, 2))
    back = torchtpu.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    assert_same(back, _data(3, 2))
    assert (
        torchtpu.to_jax(back).unsafe_buffer_pointer() == torchtpu.to_jax(x).unsafe_buffer_pointer()
    )
    host = torch.utils.dlpack.from_dlpack(torch.to_dlpack(x))
    torch.testing.assert_close(host, _data(3, 2))
    # CPU tensors still take torch's own path.
    cpu = torch.arange(3)
    assert torch.from_dlpack(torch.utils.dlpack.to_dlpack(cpu)).data_ptr() == cpu.data_ptr()


def test_from_dlpack_takes_cpu_tensors_and_numpy():
    assert_same(torchtpu.from_dlpack(torch.arange(4)), torch.arange(4))
    assert_same(torchtpu.from_dlpack(np.ones(3, np.float32)), torch.ones(3))


def test_dlpack_refuses_a_tensor_that_requires_grad():
    x = tpu(_data(2)).requires_grad_()
    with pytest.raises(BufferError, match="require gradient"):
        x.__dlpack__()


# -- @jax_op ---------------------------------------------------------------------------------


def test_jax_op_is_a_torch_op():
    assert sin_mul.op is torch.ops.torchtpu_jax.sin_mul.default
    assert sin_mul.vjp_op is torch.ops.torchtpu_jax.sin_mul_vjp.default
    assert "Tensor[] tensors, Scalar[] numbers, str spec" in str(sin_mul.op._schema)


def test_jax_op_in_each_mode(mode):
    x, y = _data(3, 4), _data(3, 4, seed=1)
    out = sin_mul(tpu(x), tpu(y), scale=3.0)
    expected = sin_mul_torch(x, y, scale=3.0)
    assert set(out) == {"a", "b"}
    assert_same(out["a"], expected["a"])
    assert_same(out["b"], expected["b"], rtol=1e-5, atol=1e-5)


_precisions_seen = []


@torchtpu.jax_op
def product_at_traced_precision(x):
    _precisions_seen.append(jax.config.jax_default_matmul_precision)
    return x @ x


def test_products_in_a_jax_op_follow_torchs_matmul_precision():
    """Note [Matmul precision in JAX functions]: exact float32 at torch's default,
    where JAX's own default on a TPU is one bfloat16 pass."""
    x = tpu(_data(4, 4))
    product_at_traced_precision(x)
    try:
        torch.set_float32_matmul_precision("medium")
        product_at_traced_precision(x)  # a new key: traced again
        with torch.tpu.precision("high"):
            product_at_traced_precision(x)
    finally:
        torch.set_float32_matmul_precision("highest")
    product_at_traced_precision(x)  # the first plan again
    # (None: the shape-only trace of the fake kernel, which computes nothing)
    assert [p for p in _precisions_seen if p is not None] == ["highest", "default", "high"]


def test_strict_runs_one_jitted_call():
    x, w = tpu(_data(4, 3)), tpu(_data(3, 5))
    tanh_layer(x, w)
    torchtpu.reset_metrics()
    tanh_layer(x, w)
    metrics = torchtpu.metrics()
    assert metrics["ops"] == {"strict": 1}
    assert metrics["op_cache"] == {"hit": 1}


def test_defer_fuses_the_jax_op_into_the_chunk():
    x, w = _data(4, 3), _data(3, 5)
    with torchtpu.set_eager_mode("defer"):
        xt, wt = tpu(x), tpu(w)
        torchtpu.sync()
        torchtpu.reset_metrics()
        y = (tanh_layer(xt * 2, wt) + 1).sum()
        value = y.item()
    metrics = torchtpu.metrics()
    assert metrics["flushes"] == {"value read": 1}
    assert metrics["compiles"] == {"chunk": 1}  # the jax_op compiled inside the chunk
    assert value == pytest.approx((torch.tanh((x * 2) @ w) + 1).sum().item(), rel=1e-5)


def test_gradients_equal_torch_autograd(mode):
    x, y = _data(3, 4).requires_grad_(), _data(3, 4, seed=1).requires_grad_()
    xt, yt = tpu(x.detach()).requires_grad_(), tpu(y.detach()).requires_grad_()
    out = sin_mul(xt, yt)
    (out["a"].square().sum() + 3 * out["b"]).backward()
    expected = sin_mul_torch(x, y)
    (expected["a"].square().sum() + 3 * expected["b"]).backward()
    assert_same(xt.grad, x.grad, rtol=1e-5, atol=1e-5)
    assert_same(yt.grad, y.grad, rtol=1e-5, atol=1e-5)


def test_complex_gradients_follow_torch_convention():
    """Note [Complex gradients]: torch's are the conjugates of JAX's cotangents."""
    z, c = _data(4, dtype=torch.complex64), _data(4, dtype=torch.complex64, seed=1)
    g = _data(4, dtype=torch.complex64, seed=2)
    z.requires_grad_(), c.requires_grad_()
    zt, ct = tpu(z.detach()).requires_grad_(), tpu(c.detach()).requires_grad_()
    y, phase = complex_square(zt, ct)
    ((y * tpu(g)).abs().sum() + (phase * tpu(g)).real.sum()).backward()
    ((z * z * c * g).abs().sum() + (torch.exp(1j * z.real) * g).real.sum()).backward()
    assert_same(zt.grad, z.grad, rtol=1e-5, atol=1e-5)
    assert_same(ct.grad, c.grad, rtol=1e-5, atol=1e-5)


def test_an_unused_output_gets_a_zero_gradient():
    x = _data(3, 4).requires_grad_()
    xt = tpu(x.detach()).requires_grad_()
    sin_mul(xt, xt)["b"].backward()
    (x @ x.T).sum().backward()
    assert_same(xt.grad, x.grad, rtol=1e-5, atol=1e-5)


def test_integer_inputs_and_outputs_are_not_differentiated():
    x = _data(5, 3).requires_grad_()
    index = torch.tensor([4, 0, 4])
    xt = tpu(x.detach()).requires_grad_()
    rows, argmax = gather_rows(xt, tpu(index))
    assert argmax.dtype == torch.int64 and not argmax.requires_grad
    assert_same(argmax, torch.argmax(x[index], dim=1))
    rows.sum().backward()
    (x[index] * 2.0).sum().backward()
    assert_same(xt.grad, x.grad)


def test_static_numbers_compile_per_value_and_traced_ones_do_not():
    x = tpu(_data(4))
    for scale in (1.0, 2.0, 3.0):
        assert_same(scaled(x, scale), _data(4) * scale)
    assert torchtpu.metrics()["op_cache"]["miss"] == 1
    torchtpu.reset_metrics()
    for scale in (1.0, 2.0, 3.0):
        assert_same(static_scaled(x, scale), _data(4) * scale)
    assert torchtpu.metrics()["op_cache"]["miss"] == 3
    assert_same(static_scaled(x, 2), _data(4) * 2)  # 2 and 2.0 are different statics
    assert torchtpu.metrics()["op_cache"]["miss"] == 4


def test_gradient_through_a_function_with_traced_numbers():
    x = _data(4).requires_grad_()
    xt = tpu(x.detach()).requires_grad_()
    scaled(xt, 3.0).square().sum().backward()
    (x * 3.0).square().sum().backward()
    assert_same(xt.grad, x.grad)


def test_a_user_given_backward_is_used():
    xt = tpu(torch.tensor([0.2, 1.7, -2.6])).requires_grad_()
    y = round_ste(xt)
    assert_same(y, torch.tensor([0.0, 2.0, -3.0]))
    (y * torch.tensor([1.0, 2.0, 3.0], device="tpu")).sum().backward()
    assert_same(xt.grad, torch.tensor([1.0, 2.0, 3.0]))


def test_a_user_backward_gets_varargs_and_keywords():
    x, y, z = (tpu(torch.full((3,), float(i))).requires_grad_() for i in (1, 2, 3))
    w = tpu(torch.tensor([1.0, 2.0, 3.0])).requires_grad_()
    out = weighted_sum(x, y, z, weight=w)
    assert_same(out, torch.tensor([11.0, 22.0, 33.0]))
    out.sum().backward()
    assert_same(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert_same(z.grad, torch.tensor([2.0, 4.0, 6.0]))
    assert_same(w.grad, torch.zeros(3))  # a keyword tensor: no gradient from a user backward


def test_the_custom_op_passes_torch_opcheck():
    """torch's own checks of a custom op: schema, fake kernel, autograd registration."""
    x, y = _data(3, 4).requires_grad_(), _data(3, 4, seed=1).requires_grad_()
    tensors, numbers, spec = sin_mul.jax_function._flatten((x, y), {"scale": 1.5})
    results = torch.library.opcheck(sin_mul.op, (tensors, numbers, spec))
    assert set(results.values()) == {"SUCCESS"}, results


def test_jax_custom_vjp_is_respected():
    xt = tpu(torch.ones(3)).requires_grad_()
    (clip_gradient(xt) * torch.tensor([0.1, 2.0, -3.0], device="tpu")).sum().backward()
    assert_same(xt.grad, torch.tensor([0.1, 0.5, -0.5]))


def test_cpu_tensors_run_on_jax_cpu():
    x, y = _data(3, 4).requires_grad_(), _data(3, 4, seed=1)
    out = sin_mul(x, y)
    assert out["a"].device.type == "cpu"
    out["a"].sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) * y * 2.0)


def test_names_are_unique():
    def twin(x):
        return x + 1

    first, second = torchtpu.jax_op(twin), torchtpu.jax_op(twin)
    assert first.op is not second.op
    assert str(second.op).startswith("torchtpu_jax.twin_")
    with pytest.raises(RuntimeError, match="defined already"):
        torchtpu.jax_op(twin, name="sin_mul")


def test_torch_compile_has_no_graph_break():
    import torchtpu.compile.backend  # noqa: F401  (what torch.compile(backend="tpu") loads)

    x, w = _data(4, 3), _data(3, 5)
    xt, wt = tpu(x), tpu(w).requires_grad_()

    def model(x, w, forward=tanh_layer, pair=sin_mul):
        h = forward(x, w)
        out = pair(h, h.flip(0), scale=0.5)  # a dict of outputs
        return out["a"].sum() + out["b"]

    explanation = torch._dynamo.explain(model)(xt, wt)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    loss = torch.compile(model, backend="tpu")(xt, wt)
    loss.backward()
    wc = w.clone().requires_grad_()
    expected = model(x, wc, lambda x, w: torch.tanh(x @ w), sin_mul_torch)
    expected.backward()
    assert_same(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    assert_same(wt.grad, wc.grad, rtol=1e-5, atol=1e-5)
    assert torchtpu.metrics()["compiles"]["graph"] == 2  # forward and backward


def test_torch_compile_with_changing_numbers():
    """Note [Numbers under torch.compile]: Dynamo's symbolic floats are specialized."""
    import torchtpu.compile.backend  # noqa: F401

    x = tpu(_data(4))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, s: scaled(x, s) + static_scaled(x, s), backend="tpu")
    for s in (2.0, 3.0, 0.5):
        assert_same(compiled(x, s), _data(4) * s * 2)


def test_torchtpu_jit_step():
    w0, x = _data(3, 5), _data(8, 3)
    wt, xt = tpu(w0).requires_grad_(), tpu(x)
    opt = torch.optim.SGD([wt], lr=0.1)

    @torchtpu.jit
    def step(x):
        opt.zero_grad()
        loss = tanh_layer(x, wt).square().mean()
        loss.backward()
        opt.step()
        return loss

    wc = w0.clone().requires_grad_()
    opt_c = torch.optim.SGD([wc], lr=0.1)

    def step_cpu(x):
        opt_c.zero_grad()
        loss = torch.tanh(x @ wc).square().mean()
        loss.backward()
        opt_c.step()
        return loss

    losses = [step(xt).item() for _ in range(3)]
    assert losses == pytest.approx([step_cpu(x).item() for _ in range(3)], rel=1e-5)
    assert torchtpu.metrics()["compiles"]["step"] == 1
    assert_same(wt.detach(), wc.detach(), rtol=1e-5, atol=1e-5)


# -- errors ----------------------------------------------------------------------------------


def test_a_shape_error_names_the_function_and_the_line(mode):
    x, y = tpu(_data(3, 4)), tpu(_data(5, 4))
    with pytest.raises(TypeError) as info:
        mismatched(x, y)  # the line the error names
    message = str(info.value)
    assert "jax_op mismatched (defined at " in message
    assert "test_jax_interop.py:" in message and "incompatible shapes" in message
    assert f"test_jax_interop.py:{_line_of('mismatched(x, y)  # the line')}" in message


def _line_of(text: str) -> int:
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def test_other_mistakes_are_explained():
    x = tpu(_data(3))

    @torchtpu.jax_op
    def returns_a_number(x):
        return 1.0

    with pytest.raises(TypeError, match="output leaf 0 is a float"):
        returns_a_number(x)
    with pytest.raises(TypeError, match="needs at least one tensor argument"):
        static_scaled(1.0, 2.0)
    with pytest.raises(TypeError, match="neither a tensor, a number nor hashable"):
        static_scaled(x, np.ones(2))
    with pytest.raises(TypeError, match="jax_op static_scaled: missing a required argument"):
        static_scaled(x)
    with pytest.raises(TypeError, match="not arguments of"):
        torchtpu.jax_op(lambda x: x, traced=("y",))


# -- a Pallas kernel and a jax.scipy routine -------------------------------------------------


@pytest.mark.parametrize("dim", [-1, 0])
def test_pallas_softmax_forward_and_backward(dim):
    x = _data(13, 6).requires_grad_()
    grad = _data(13, 6, seed=2)
    xt = tpu(x.detach()).requires_grad_()
    y = pallas_softmax(xt, dim=dim)
    (y * tpu(grad)).sum().backward()
    expected = torch.softmax(x, dim)
    (expected * grad).sum().backward()
    assert_same(y, expected.detach(), rtol=1e-6, atol=1e-6)
    assert_same(xt.grad, x.grad, rtol=1e-6, atol=1e-6)


def test_jax_scipy_gammainc_in_a_training_loop():
    """Fit a Gamma distribution's shape and rate to samples by matching its CDF: the
    gradient in the shape is one torch does not have."""
    torch.manual_seed(0)
    samples = torch.distributions.Gamma(3.0, 2.0).sample((256,)).sort().values
    empirical = (torch.arange(256) + 0.5) / 256
    with pytest.raises(NotImplementedError):
        torch.special.gammainc(torch.tensor(1.0, requires_grad=True), samples).sum().backward()

    x, target = tpu(samples), tpu(empirical)
    log_shape = torch.zeros((), device="tpu", requires_grad=True)
    log_rate = torch.zeros((), device="tpu", requires_grad=True)
    opt = torch.optim.Adam([log_shape, log_rate], lr=0.2)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = (gamma_cdf(x, log_shape.exp(), log_rate.exp()) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    assert losses[-1].item() < losses[0].item() / 100
    assert log_shape.exp().item() == pytest.approx(3.0, rel=0.1)
    assert log_rate.exp().item() == pytest.approx(2.0, rel=0.1)
    # Its forward is torch's where torch has one.
    assert_same(
        gamma_cdf(x, torch.tensor(2.0, device="tpu"), torch.tensor(1.5, device="tpu")),
        torch.special.gammainc(torch.tensor(2.0), 1.5 * samples),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_process_first_tensor_from_jax_runs_ops():
    """``from_jax`` before any other tpu tensor (a JAX user's first call) loads the
    dispatcher that tensor's ops need (it raised "'NoneType' object is not callable")."""
    import os
    import subprocess
    import sys

    code = (
        "import jax.numpy as jnp, torchtpu\n"
        "t = torchtpu.from_jax(jnp.arange(3.0))\n"
        "print((t[1] + 1).item())\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2.0"
