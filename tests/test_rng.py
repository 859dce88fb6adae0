"""Random numbers: reproducible under torch.manual_seed, fresh per call, never baked
into compiled code."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torchtpu


def _draws():
    x = torch.ones(1000, device="tpu")
    return [
        torch.randn(4, 5, device="tpu").cpu(),
        torch.rand(3, device="tpu").cpu(),
        torch.rand_like(x).cpu(),
        torch.randint(0, 100, (6,), device="tpu").cpu(),
        F.dropout(x, 0.5, training=True).cpu(),
        torch.empty(8, device="tpu").uniform_(-2, 2).cpu(),
        torch.empty(8, device="tpu").normal_(3, 0.5).cpu(),
        torch.bernoulli(torch.full((8,), 0.3, device="tpu")).cpu(),
        torch.randperm(10, device="tpu").cpu(),
        torch.multinomial(torch.tensor([0.1, 0.2, 0.7], device="tpu"), 5, replacement=True).cpu(),
    ]


def test_manual_seed_makes_runs_reproducible(mode):
    torch.manual_seed(1234)
    first = _draws()
    torch.manual_seed(1234)
    second = _draws()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    torch.manual_seed(4321)
    third = _draws()
    assert not torch.equal(first[0], third[0])


def test_each_call_draws_fresh_numbers_without_recompiling():
    x = torch.ones(1000, device="tpu")
    F.dropout(x, 0.5, training=True)  # compile once
    torchtpu.reset_metrics()
    masks = [F.dropout(x, 0.5, training=True).cpu() for _ in range(5)]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    assert "compiles" not in torchtpu.metrics()  # the key is an input, not a constant


def test_distributions_look_right():
    torch.manual_seed(0)
    n = torch.randn(200_000, device="tpu")
    assert abs(n.mean().item()) < 0.01 and abs(n.std().item() - 1) < 0.01
    u = torch.rand(200_000, device="tpu")
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    kept = F.dropout(torch.ones(200_000, device="tpu"), 0.25, training=True)
    assert abs((kept > 0).float().mean().item() - 0.75) < 0.01
    assert set(kept.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    ints = torch.randint(3, 7, (10_000,), device="tpu")
    assert ints.dtype == torch.int64 and ints.min().item() == 3 and ints.max().item() == 6


def test_random_like_factories_run_on_tpu():
    """rand_like (PhiMoE's router jitter in training) ran on the CPU fallback."""
    x = torch.ones(100_000, dtype=torch.bfloat16, device="tpu")
    torchtpu.reset_metrics()
    u = torch.rand_like(x)
    assert u.dtype == torch.bfloat16 and u.device == x.device
    assert 0 <= u.min().item() and u.max().item() <= 1 and abs(u.float().mean().item() - 0.5) < 0.01
    assert torch.rand_like(x, dtype=torch.float64).dtype == torch.float64
    assert "fallback" not in torchtpu.metrics()


def test_dropout_in_eval_mode_is_identity(mode):
    x = torch.randn(10, device="tpu")
    assert torch.equal(F.dropout(x, 0.5, training=False).cpu(), x.cpu())
    layer = torch.nn.Dropout(0.5).to("tpu").eval()
    assert torch.equal(layer(x).cpu(), x.cpu())


def test_seed_picks_a_new_random_seed_as_torch_cuda_seed_does():
    torch.tpu.seed()
    first = torch.tpu.initial_seed()
    torch.tpu.seed()
    assert torch.tpu.initial_seed() != first
    torch.tpu.seed_all()
    assert torch.tpu.initial_seed() != first


def test_draws_are_flat():
    """Note [Random draws are flat]: a tensor's draw is the flat draw of its numel,
    reshaped (the values do not depend on the shape), and its program draws rank-1
    arrays, which XLA compiles much faster than draws of the tensor's rank."""
    import jax

    from torchtpu.ops.random import normal_

    torch.manual_seed(7)
    shaped = torch.randn(2, 3, 4, 5, device="tpu").cpu()
    torch.manual_seed(7)
    flat = torch.randn(120, device="tpu").cpu()
    assert torch.equal(shaped, flat.view(2, 3, 4, 5))
    jaxpr = jax.make_jaxpr(lambda x, key: normal_(x, key=key))(
        jax.numpy.zeros((2, 3, 4, 5)), jax.random.key(0)
    )
    bits = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name in ("random_bits", "threefry2x32")]
    assert bits and all(len(e.outvars[0].aval.shape) == 1 for e in bits)


def _eqns(jaxpr):
    """The equations of ``jaxpr`` and of the jaxprs nested in it (jitted functions)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def test_rand_like_is_lowered():
    # (It ran on the CPU fallback: the conftest fails a test that falls back.)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.complex64):
        template = torch.zeros(3, 4, dtype=dtype).t()
        draws = torch.rand_like(template.to("tpu"))
        expected = torch.rand_like(template)
        assert (draws.dtype, draws.stride()) == (expected.dtype, expected.stride())
        parts = torch.view_as_real(draws.cpu()) if dtype.is_complex else draws.cpu()
        assert 0 <= parts.min() and parts.max() < 1
    assert torch.rand_like(torch.zeros(2, device="tpu"), dtype=torch.float64).dtype == torch.float64
