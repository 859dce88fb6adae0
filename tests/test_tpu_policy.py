"""The platform policy (runtime/policy.py): on a TPU, float64 and complex128 live and
compute on the host, programs XLA:TPU refuses or aborts on never reach it, and
everything else stays on the device -- all matching the CPU.

On a TPU these tests run here. Elsewhere one test runs this file again in a subprocess
under the TPU's policy (TORCHTPU_PLATFORM_POLICY=tpu) with two XLA:CPU devices, the
second standing in for the host, so that an array left on the wrong device fails as it
would on a chip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu
from conftest import assert_same
from torchtpu.runtime import jax as configured_jax
from torchtpu.runtime import policy

configured_jax()  # int64 and float64 are real (x64), as torchtpu runs JAX

UNDER_POLICY = policy.host_dtypes() == policy.POLICIES["tpu"].host_dtypes
under_policy = pytest.mark.skipif(
    not UNDER_POLICY,
    reason="runs under the TPU policy: on a TPU, or in the subprocess of "
    "test_this_file_under_the_tpu_policy",
)


@pytest.mark.skipif(UNDER_POLICY, reason="the policy applies here: the tests ran in-process")
def test_this_file_under_the_tpu_policy():
    env = dict(
        os.environ,
        TORCHTPU_PLATFORM_POLICY="tpu",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed, 1 skipped" in run.stdout  # this test is the one skipped there


# -- the rules, on programs (no device needed) ------------------------------------------


def _rule(fn, *args, rules=policy.POLICIES["tpu"].rules):
    return policy._scan(jax.make_jaxpr(fn)(*args).jaxpr, rules)


@pytest.mark.parametrize(
    "fn, args, expected",
    [
        (lambda x: x * 2, (jnp.ones(3, jnp.float32),), None),
        (lambda x, s: x * s, (jnp.ones(3, jnp.float32), 0.5), None),  # a Python float
        (lambda a, b: a > b, (0.5, 0.25), None),  # arithmetic on numbers
        (lambda x: x.astype(jnp.float64).astype(jnp.float32), (jnp.ones(3),), None),
        (lambda x: x.astype(jnp.float64) * 2, (jnp.ones(3),), policy.FLOAT64_INSIDE),
        (lambda x: jnp.sort(x), (jnp.ones(3, jnp.float64),), policy.FLOAT64_INSIDE),
        (lambda x: x * 2, (jnp.ones(3, jnp.complex64),), None),
        (lambda x, s: x * s, (jnp.ones(3, jnp.complex64), 1j), policy.COMPLEX128),
        (lambda x: x.astype(jnp.complex128), (jnp.ones(3, jnp.int64),), policy.COMPLEX128),
        (lambda a, b: a @ b, (jnp.ones((2, 2), jnp.int32),) * 2, None),
        (lambda a, b: a @ b, (jnp.ones((2, 2), jnp.int64),) * 2, policy.INT64_MATMUL),
        (lambda a: a + 1, (jnp.ones((2, 2), jnp.int64),), None),
        (lambda a: jnp.linalg.eig(a)[0], (jnp.ones((2, 2), jnp.float32),), policy.EIG),
        (lambda a: jnp.linalg.svd(a)[0], (jnp.ones((3, 3), jnp.float32),), policy.SVD),
        (lambda a: jnp.linalg.svd(a, compute_uv=False), (jnp.ones((3, 3), jnp.float32),), None),
        # inside sub-programs
        (jax.jit(lambda a: jnp.cumsum(a)), (jnp.ones(3, jnp.float64),), policy.FLOAT64_INSIDE),
        (
            lambda p, a: jax.lax.cond(p, lambda a: a @ a, lambda a: a, a),
            (True, jnp.ones((2, 2), jnp.int64)),
            policy.INT64_MATMUL,
        ),
    ],
)
def test_rules(fn, args, expected):
    assert _rule(fn, *args) == expected


def test_gpu_policy_has_only_the_eig_rule():
    gpu = policy.POLICIES["gpu"]
    assert gpu.host_dtypes == frozenset()
    assert _rule(lambda x: jnp.sort(x), jnp.ones(3, jnp.float64), rules=gpu.rules) is None
    assert _rule(lambda a: jnp.linalg.eig(a)[0], jnp.ones((2, 2)), rules=gpu.rules) is policy.EIG


# -- the policy at work (under it) -------------------------------------------------------


def _devices(t: torch.Tensor) -> set:
    return t._storage.array.devices()


@under_policy
def test_float64_keeps_its_range_and_lives_on_the_host():
    cpu = torch.tensor([1e300, 1 / 3, -2.5e-300, 1e-307], dtype=torch.float64)
    x = cpu.to("tpu")
    assert _devices(x) == {policy.host_device()}
    assert x.device.type == "tpu"
    assert_same(x * 3 + 1e300, cpu * 3 + 1e300)
    assert_same(torch.sort(-x).values, torch.sort(-cpu).values)
    assert_same(x.sum(), cpu.sum())
    # results of device dtypes go back to the device
    gt = x > 0
    assert_same(gt, cpu > 0)
    assert (
        _devices(gt) != {policy.host_device()} or torchtpu.runtime.device(0) == policy.host_device()
    )
    assert_same(x.float(), cpu.float())
    assert_same(
        torch.zeros(3, dtype=torch.float64, device="tpu") + 1e300,
        torch.full((3,), 1e300, dtype=torch.float64),
    )


@under_policy
def test_float64_mixed_with_device_tensors():
    a = torch.randn(4, 3)
    b = torch.randn(4, 3, dtype=torch.float64)
    assert_same(a.to("tpu") + b.to("tpu"), a + b)
    assert_same(torch.where(a.to("tpu") > 0, b.to("tpu"), 1e300), torch.where(a > 0, b, 1e300))
    w = torch.zeros(4, 3, device="tpu")
    w.copy_(b.to("tpu"))  # float64 -> float32 written into a device storage
    assert_same(w, b.float())
    v = torch.zeros(4, 3, dtype=torch.float64, device="tpu")
    v[1:].add_(a[1:].to("tpu"))  # a device value written through a host view
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[1:] += a[1:]
    assert_same(v, expected)


@under_policy
def test_float64_view_of_device_int64():
    cpu = torch.tensor([4607182418800017408, 4611686018427387904], dtype=torch.int64)
    assert_same(cpu.to("tpu").view(torch.float64), cpu.view(torch.float64))


@under_policy
def test_complex128_and_int64_matmul():
    c = torch.tensor([1 + 2j, 3 - 1e200j, -0.5j], dtype=torch.complex128)
    d = c.to("tpu")
    assert_same((d * d).abs(), (c * c).abs())
    assert_same(d / (1 + 1j), c / (1 + 1j))
    i = torch.arange(12).reshape(3, 4) + 2**40
    s = torch.arange(8).reshape(4, 2)
    assert_same(i.to("tpu") @ s.to("tpu"), i @ s)
    a, b = torch.randn(5, 3), torch.randn(5, 2)
    solution = torch.linalg.lstsq(a.to("tpu"), b.to("tpu")).solution  # no program: by name
    assert_same(solution, torch.linalg.lstsq(a, b).solution, rtol=1e-4, atol=1e-5)
    assert set(torchtpu.metrics()["host_ops"]) >= {
        "aten.mm.default",
        "aten.abs.default",
        "aten.linalg_lstsq.default",
    }


@under_policy
def test_int64_stays_on_the_device():
    i = torch.tensor([2**40 + 7, -(2**50) + 3, 2**62], dtype=torch.int64)
    x = i.to("tpu")
    assert_same((x * 3 + 1) // 7 % 1000003, (i * 3 + 1) // 7 % 1000003)
    assert_same(torch.sort(x).values, torch.sort(i).values)
    assert_same(torch.arange(2**33, 2**33 + 5, device="tpu"), torch.arange(2**33, 2**33 + 5))
    assert not torchtpu.metrics().get("host_ops")


def _mlp_steps(device, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 8).to(device), torch.tensor([0, 3, 1, 2, 0]).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) + F.dropout(x, 0.0).mean() * 0
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@under_policy
@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_float32_training_never_leaves_the_device(mode):
    with torchtpu.set_eager_mode(mode):
        losses = _mlp_steps("tpu")
        torch.rand(10, device="tpu"), torch.randn(10, device="tpu")
        losses = losses.cpu()
    assert_same(losses.to("tpu"), _mlp_steps("cpu"), rtol=1e-5, atol=1e-5)
    assert not torchtpu.metrics().get("host_ops")


def _float32_programs():
    """float32 (and bfloat16) code of ordinary training and inference: every op here
    must run on the chip, none on the host because its lowering computes in float64."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype).to("tpu").requires_grad_()

    x, w, img = t(6, 8), t(8, 8), t(2, 3, 8, 8)
    labels = torch.tensor([0, 3, 1, 2, 7, 5], device="tpu")
    probs = torch.rand(6, 8, generator=g).to("tpu")
    q, k, v = t(2, 4, 16, 8), t(2, 4, 16, 8), t(2, 4, 16, 8)
    bq = t(2, 4, 16, 8, dtype=torch.bfloat16)
    conv, bn, gn = nn.Conv2d(3, 4, 3).to("tpu"), nn.BatchNorm2d(4).to("tpu"), nn.GroupNorm(2, 4)
    gn = gn.to("tpu")
    return {
        "linear, activations": lambda: [f(x @ w) for f in (F.gelu, F.silu, F.softplus,
                                                            F.logsigmoid, F.mish, F.elu)],
        "gelu tanh, erf, erfinv": lambda: [F.gelu(x, approximate="tanh"), x.erf(),
                                           (probs * 1.8 - 0.9).erfinv()],
        "norms": lambda: [F.layer_norm(x, (8,)), F.rms_norm(x, (8,)), gn(conv(img)),
                          bn(conv(img)), F.normalize(x)],
        "softmax, logsumexp": lambda: [x.softmax(-1), x.log_softmax(-1), x.logsumexp(-1)],
        "losses": lambda: [
            F.cross_entropy(x, labels, label_smoothing=0.1), F.nll_loss(x.log_softmax(-1), labels),
            F.mse_loss(x, w[:6]), F.smooth_l1_loss(x, w[:6]), F.huber_loss(x, w[:6]),
            F.binary_cross_entropy_with_logits(x, probs), F.binary_cross_entropy(x.sigmoid(), probs),
            F.kl_div(x.log_softmax(-1), probs.softmax(-1), reduction="batchmean"),
        ],
        "dropout, random": lambda: [F.dropout(x, 0.3), torch.rand(4, device="tpu"),
                                    torch.randn(4, device="tpu"), torch.randint(0, 9, (4,), device="tpu"),
                                    torch.multinomial(probs, 2), torch.bernoulli(probs)],
        "attention": lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True),
                              F.scaled_dot_product_attention(bq, bq, bq),
                              F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)],
        "pooling, resizing": lambda: [F.max_pool2d(img, 2), F.avg_pool2d(img, 2),
                                      F.adaptive_avg_pool2d(img, 3),
                                      F.interpolate(img, scale_factor=2, mode="bilinear"),
                                      F.interpolate(img, size=5, mode="nearest")],
        "reductions, scans": lambda: [x.mean(), x.var(0), x.std(), x.norm(), x.cumsum(0),
                                      x.topk(3).values, x.sort(-1).values, x.amax(1), x.prod(1),
                                      torch.histc(x.detach(), 5), torch.histc(labels, 8, 0, 7)],
        "factories": lambda: [torch.arange(0.0, 1.0, 0.1, device="tpu"),
                              torch.linspace(0, 1, 7, device="tpu"), torch.full((3,), 0.3, device="tpu"),
                              torch.logspace(0, 1, 5, device="tpu"), torch.eye(3, device="tpu")],
        "indexing": lambda: [x.gather(1, labels[:, None]), x.index_select(0, labels[:3]),
                             torch.zeros(6, 8, device="tpu").scatter_add(0, (labels % 6)[:, None].expand(6, 8), x),
                             x.masked_fill(x > 0, 0.5), F.one_hot(labels, 8).float() * x,
                             F.embedding(labels, w)],
        "elementwise math": lambda: [x.pow(2.5), x.abs().rsqrt(), torch.atan2(x, w[:6]),
                                     x.lerp(w[:6], 0.3), torch.addcmul(x, x, w[:6], value=0.5),
                                     x.clamp(-0.5, 0.5), x.tanh(), x.exp(), x.log1p().nan_to_num()],
        "products": lambda: [torch.einsum("bhqd,bhkd->bhqk", q, k), torch.bmm(x[None], w[None]),
                             torch.baddbmm(x[None], x[None], w[None]), bq @ bq.transpose(-1, -2)],
    }  # fmt: skip


@under_policy
@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_common_float32_ops_never_leave_the_device(mode):
    """The class "a float32 op whose lowering builds float64 inside" (a Python float
    made a float64 array, a float64 accumulation): on a TPU each ran on the host."""
    left = {}
    with torchtpu.set_eager_mode(mode):
        for name, program in _float32_programs().items():
            torchtpu.reset_metrics()
            outputs = program()
            loss = sum(o.float().sum() for o in outputs if o.dtype.is_floating_point)
            if loss.requires_grad:
                loss.backward()
            loss.cpu()
            if torchtpu.metrics().get("host_ops"):
                left[name] = torchtpu.metrics()["host_ops"]
    assert not left, left


@under_policy
def test_defer_runs_host_ops_at_once():
    cpu = torch.randn(6)
    with torchtpu.set_eager_mode("defer"):
        x = cpu.to("tpu") * 2  # queued
        y = x.double() * 1e300  # host: the queue is flushed first
        z = (y / 1e300).float() + x  # back on the device, queued
        result = z.cpu()
    assert torch.allclose(result, ((cpu * 2).double() * 1e300 / 1e300).float() + cpu * 2)
    assert torchtpu.metrics()["flushes"].get("host op", 0) >= 1


@under_policy
def test_one_warning_per_rule():
    from torchtpu.dispatch import host

    host._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.ones(3, dtype=torch.float64, device="tpu")
        (x + 1) * 2
        x.sum()
    texts = [str(w.message) for w in caught if issubclass(w.category, host.TPUHostComputeWarning)]
    assert len(texts) == 1 and "every op with float64" in texts[0] and "aten.ones" in texts[0]


@under_policy
def test_compiled_programs_refuse_host_ops_naming_the_rule():
    x = torch.randn(3, device="tpu")

    @torch.compile(backend="tpu")
    def f(a):
        return (a.double() * 2).sum()

    with pytest.raises(Exception, match="float64 as pairs of float32"):
        f(x)

    @torchtpu.jit
    def g(a):
        return (a.double() * 2).sum()

    with pytest.raises(RuntimeError, match="cannot"):
        g(x), g(x)  # the first call runs eagerly; the trace refuses


@under_policy
def test_compiled_programs_take_a_changing_python_float():
    # Dynamo passes a float that changes between calls as a 0-d float64 tensor: a number
    # on the device, as a constant float is, not a float64 tensor for the host.
    torch._dynamo.reset()
    scaled = torch.compile(lambda x, s: (x * s).softmax(-1) / s, backend="tpu")
    x = torch.randn(3, 5)
    torchtpu.reset_metrics()
    for temperature in (0.5, 0.7, 1.3):
        expected = (x * temperature).softmax(-1) / temperature
        assert_same(scaled(x.to("tpu"), temperature), expected)
    assert not torchtpu.metrics().get("host_ops")


@under_policy
def test_random_ops_draw_with_the_tpus_bit_generator():
    # Note [Random bits on TPU]: keys are "rbg" keys; seeding reproduces, and the draws
    # have their distributions.
    from torchtpu import rng

    assert "rbg" in str(jax.random.key_impl(rng.key(0, 0)))
    torch.manual_seed(0)
    u, n = torch.rand(50_000, device="tpu"), torch.randn(50_000, device="tpu")
    torch.manual_seed(0)
    assert torch.equal(torch.rand(50_000, device="tpu").cpu(), u.cpu())
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert abs(n.mean().item()) < 0.02 and abs(n.std().item() - 1) < 0.02
    kept = F.dropout(torch.ones(50_000, device="tpu"), 0.3).ne(0).float().mean().item()
    assert abs(kept - 0.7) < 0.01
