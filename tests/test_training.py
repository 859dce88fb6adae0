"""End-to-end training on tpu equals training on the CPU, step by step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu


def _train(make_model, batch, loss_fn, make_opt, device, steps, *, scheduler=None, clip=None):
    torch.manual_seed(0)
    model = make_model().to(device)
    batch = [t.to(device) for t in batch]
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, *batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _compare(*args, atol=1e-5, **kwargs):
    with warnings.catch_warnings(record=True) as cpu_warnings:
        warnings.simplefilter("always")
        cpu_losses, cpu_state = _train(*args, device="cpu", **kwargs)
    with warnings.catch_warnings(record=True) as tpu_warnings:
        warnings.simplefilter("always")
        tpu_losses, tpu_state = _train(*args, device="tpu", **kwargs)
    # tpu adds no warning of its own, except performance hints (test_transparency.py).
    tpu_warnings = [
        w for w in tpu_warnings if not issubclass(w.category, torchtpu.TPUPerformanceWarning)
    ]
    assert [str(w.message) for w in tpu_warnings] == [str(w.message) for w in cpu_warnings]
    torch.testing.assert_close(
        torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=0, atol=atol
    )
    for name, value in cpu_state.items():
        torch.testing.assert_close(
            tpu_state[name], value, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
    return tpu_losses


def _mlp():
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)


@pytest.mark.parametrize("foreach", [False, True])
def test_mlp_sgd_20_steps_matches_cpu(mode, foreach):
    """The seed's MLP (512 -> 1024 -> 10, SGD): losses equal CPU's to 1e-5."""
    losses = _compare(
        _mlp,
        _mlp_batch(),
        lambda m, x, y: F.cross_entropy(m(x), y),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=foreach),
        steps=20,
    )
    assert losses[-1] < losses[0]
    assert "fallback" not in torchtpu.metrics()


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would amplify.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.0)  # p=0: identical on both devices
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv1(x))))
        x = F.relu(self.conv2(x))
        return self.fc(self.drop(self.gap(x).flatten(1)))


def test_cnn_adam_matches_cpu(mode):
    g = torch.Generator().manual_seed(2)
    batch = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
    _compare(
        _CNN,
        batch,
        lambda m, x, y: F.cross_entropy(m(x), y),
        lambda p: torch.optim.Adam(p, lr=1e-2),
        steps=3,
    )
    assert "fallback" not in torchtpu.metrics()


class _Block(nn.Module):
    """A transformer block: embedding with padding_idx, LayerNorm, attention with a
    causal and a padding mask through scaled_dot_product_attention, GELU MLP."""

    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        keep = causal & (tokens != 0)[:, None, None, :] | torch.eye(
            T, dtype=torch.bool, device=x.device
        )
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, D))
        x = x + self.ff(self.ln2(x))
        return torch.softmax(self.head(x), dim=-1).log()


def test_transformer_block_adamw_clip_scheduler_matches_cpu(mode):
    tokens = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    tokens[0, :2] = 0  # padding
    _compare(
        _Block,
        (tokens,),
        lambda m, t: F.nll_loss(m(t).flatten(0, 1), t.flatten(), ignore_index=0),
        # The key bias gets a zero gradient (softmax ignores a constant per query), i.e.
        # rounding noise; a larger eps keeps AdamW from blowing the noise up to lr.
        lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-6),
        steps=3,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        clip=1.0,
    )
    assert "fallback" not in torchtpu.metrics()


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [False, True])
def test_recurrent_sgd_matches_cpu(rnn, batch_first):
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(4))
    _compare(
        lambda: rnn(6, 8, num_layers=2, batch_first=batch_first),
        (x,),
        lambda m, x: m(x)[0].pow(2).mean(),
        lambda p: torch.optim.SGD(p, lr=0.5),
        steps=3,
    )
    assert "fallback" not in torchtpu.metrics()


@pytest.mark.parametrize(
    "loss",
    [
        lambda out, y: F.cross_entropy(out, y),
        lambda out, y: F.nll_loss(F.log_softmax(out, -1), y),
        lambda out, y: F.mse_loss(out, F.one_hot(y, 10).float()),
        lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), F.one_hot(y, 10).float()),
        lambda out, y: F.binary_cross_entropy_with_logits(out, F.one_hot(y, 10).float()),
    ],
    ids=["cross_entropy", "nll", "mse", "bce", "bce_with_logits"],
)
def test_losses_train_like_cpu(loss):
    x, y = _mlp_batch()
    _compare(
        lambda: nn.Sequential(nn.Linear(512, 32), nn.Tanh(), nn.Linear(32, 10)),
        (x, y),
        lambda m, x, y: loss(m(x), y),
        lambda p: torch.optim.SGD(p, lr=0.1),
        steps=3,
    )


# -- fused optimizers (fused=True; the Hugging Face Trainer's default AdamW) ----------------


@pytest.mark.parametrize("mode", ["strict", "defer"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_matches_cpu(optimizer, amsgrad, mode):
    torch.manual_seed(0)
    initial = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in initial] for _ in range(3)]
    options = dict(lr=torch.tensor(0.01), amsgrad=amsgrad, maximize=True, weight_decay=0.1)

    def make_opt(params, device):
        return optimizer(
            params, fused=device == "tpu", foreach=False if device == "cpu" else None, **options
        )

    _assert_steps_like_cpu(initial, grads, make_opt, mode)


def _assert_steps_like_cpu(initial, grads, make_opt, mode="strict", tolerance=None):
    """Step copies of ``initial`` with ``grads`` on the CPU and (in ``mode``) on tpu, with
    ``make_opt(params, device)``: the parameters end equal (within ``tolerance``, 1e-5
    relative by default), with no CPU fallback."""
    results = []
    for device in ("cpu", "tpu"):
        params = [p.clone().to(device).requires_grad_() for p in initial]
        opt = make_opt(params, device)
        torchtpu.reset_metrics()
        with torch.tpu.set_eager_mode(mode if device == "tpu" else "strict"):
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = g.to(device)
                opt.step()
        results.append([p.detach().cpu() for p in params])
    assert "fallback" not in torchtpu.metrics()
    for ours, cpus in zip(results[1], results[0]):
        close = dict(rtol=1e-5, atol=1e-6) if tolerance is None else tolerance
        torch.testing.assert_close(ours, cpus, **close)


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_with_a_grad_scale_as_the_cpu_kernel(found_inf):
    torch.manual_seed(0)
    initial = [torch.randn(3, 4), torch.randn(5)]
    results = []
    for device in ("cpu", "tpu"):
        params = [p.clone().to(device) for p in initial]
        grads = [torch.full_like(p, 3.0) for p in params]
        exp_avgs = [torch.full_like(p, 0.1) for p in params]
        exp_avg_sqs = [torch.full_like(p, 0.2) for p in params]
        max_exp_avg_sqs = [torch.zeros_like(p) for p in params]
        steps = [torch.tensor(2.0, device=device) for _ in params]
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=True,
            maximize=False, grad_scale=torch.tensor(2.0, device=device),
            found_inf=torch.tensor(found_inf, device=device),
        )  # fmt: skip
        written = params + grads + exp_avgs + exp_avg_sqs + max_exp_avg_sqs + steps
        results.append([t.cpu() for t in written])
    for ours, cpus in zip(*results):
        torch.testing.assert_close(ours, cpus, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["strict", "defer"])
@pytest.mark.parametrize(
    "options",
    [
        dict(lr=0.1),
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        dict(lr=torch.tensor(0.1), momentum=0.9, dampening=0.1, maximize=True),
    ],
    ids=["plain", "nesterov", "dampening"],
)
def test_fused_sgd_matches_cpu(options, mode):
    torch.manual_seed(0)
    initial = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in initial] for _ in range(3)]
    _assert_steps_like_cpu(
        initial, grads, lambda params, device: torch.optim.SGD(params, fused=True, **options), mode
    )


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_sgd_with_a_grad_scale_as_the_cpu_kernel(found_inf):
    torch.manual_seed(0)
    initial = [torch.randn(3, 4), torch.randn(5)]
    results = []
    for device in ("cpu", "tpu"):
        params = [p.clone().to(device) for p in initial]
        grads = [torch.full_like(p, 3.0) for p in params]
        buffers = [torch.full_like(p, 0.5) for p in params]
        torch._fused_sgd_(
            params, grads, buffers, weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0,
            nesterov=False, maximize=False, is_first_step=False,
            grad_scale=torch.tensor(2.0, device=device),
            found_inf=torch.tensor(found_inf, device=device),
        )  # fmt: skip
        results.append([t.cpu() for t in params + grads + buffers])
    for ours, cpus in zip(*results):
        torch.testing.assert_close(ours, cpus, rtol=1e-5, atol=1e-6)


def test_fused_adamw_of_bfloat16_parameters_matches_cpu():
    """16-bit parameters update in float32 and are rounded once, as the CPU kernel does.
    torch's bfloat16 tolerance: on a TPU v5e one element of 128 rounded to the next
    bfloat16 after three steps (its float32 update differing in the last bits)."""
    torch.manual_seed(0)
    initial = [torch.randn(16, 8).bfloat16(), torch.randn(8).bfloat16()]
    grads = [[torch.randn_like(p) for p in initial] for _ in range(3)]
    _assert_steps_like_cpu(
        initial,
        grads,
        lambda params, device: torch.optim.AdamW(params, lr=0.01, fused=True),
        tolerance={},
    )


def test_a_fused_adamw_step_is_one_op_and_one_program():
    """``fused=True``: a step over a model's parameters dispatches one op (besides the
    optimizer's count of its steps), whose program compiles once; its moments are
    updated in place."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
    torchtpu.reset_metrics()
    opt.step()
    counts = torchtpu.metrics()["ops"]
    fused = torchtpu.metrics()["op_cache"]
    assert all(opt.state[p]["exp_avg"] is m for p, m in zip(model.parameters(), moments))
    # The step counts are _foreach_add_'s (one op); the update is the other.
    assert sum(counts.values()) == 2, counts
    assert fused == {"hit": 2}, fused
    torch.testing.assert_close(moments[0].cpu(), torch.full((16, 8), 0.19))


# -- optimizers' default path on tpu: their _foreach_ kernels, as on CUDA -------------------

_OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=torch.tensor(0.01))),  # torch keeps its per-parameter loop
    (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
    (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adadelta, dict(lr=0.5, weight_decay=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.1, lr_decay=0.01)),
    (torch.optim.ASGD, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.NAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.RAdam, dict(lr=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)),
    (torch.optim.Rprop, dict(lr=0.01)),
]


@pytest.mark.parametrize(
    "optimizer, options", _OPTIMIZERS, ids=lambda v: v.__name__ if isinstance(v, type) else ""
)
def test_optimizers_default_path_matches_cpu(optimizer, options, mode):
    """Every optimizer left to choose its implementation (foreach=None, as users leave
    it) steps tpu parameters as the CPU's per-parameter loop does."""
    torch.manual_seed(0)
    initial = [torch.randn(4, 3), torch.randn(4), torch.randn(2, 4)]
    grads = [[torch.randn_like(p) for p in initial] for _ in range(3)]
    _assert_steps_like_cpu(
        initial,
        grads,
        lambda params, device: optimizer(
            params, foreach=False if device == "cpu" else None, **options
        ),
        mode,
    )


def test_optimizer_step_is_one_foreach_op_per_update():
    """torch picks the _foreach_ path for tpu parameters: an SGD step over three
    parameters dispatches one op, not one per parameter; clip_grad_norm_ computes the
    norms of all gradients with one _foreach_norm."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    from torchtpu.dispatch import core

    initial = [torch.randn(4, 3) for _ in range(3)]
    params = [p.to("tpu").requires_grad_() for p in initial]
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=0.5)
    seen = []
    dispatch = core.dispatch

    def counting(func, args, kwargs):
        seen.append(func)
        return dispatch(func, args, kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torchtpu.tensor.hooks, "dispatch", counting)
        opt.step()
        stepped = list(seen)
        total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert stepped == [torch.ops.aten._foreach_add_.List]
    assert torch.ops.aten._foreach_norm.Scalar in seen[len(stepped) :]
    for p, before in zip(params, initial):
        torch.testing.assert_close(p.detach().cpu(), before - 0.5)
    torch.testing.assert_close(total.cpu(), torch.tensor(6.0))


@pytest.mark.parametrize("how", ["strict", "debug", "defer", "torch.compile"])
def test_a_repeated_adamw_step_stops_compiling(how, xla_compiles):
    """From the second step on, a step compiles nothing more, by JAX's count. The
    moments AdamW makes with ``zeros_like`` were *uncommitted* JAX arrays, so its first
    update and every later one (on the committed moments the update made) were
    different signatures to JAX: Strict compiled its _foreach_ updates again at step 2,
    torch.compile its whole optimizer graph (Note [Every array is committed to its
    device]). DeferAndFuse recorded the zeros in the first step's chunk, which no later
    step reused: its second step compiled the whole step again (Note [An optimizer's
    new state is made apart])."""
    torch.manual_seed(0)
    hidden = {"strict": 11, "debug": 12, "defer": 14, "torch.compile": 15}[how]  # new programs
    model = nn.Sequential(nn.Linear(13, hidden), nn.Tanh(), nn.Linear(hidden, 5)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 13).to("tpu"), torch.randint(0, 5, (6,)).to("tpu")

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    mode = "strict" if how == "torch.compile" else how
    if how == "torch.compile":
        torch._dynamo.reset()
        step = torch.compile(step, backend="tpu")
    compiled_by_step = []
    with torchtpu.set_eager_mode(mode):
        for _ in range(4):
            before = xla_compiles[0]
            step().item()
            compiled_by_step.append(xla_compiles[0] - before)
    assert compiled_by_step[0] > 0
    assert compiled_by_step[1:] == [0, 0, 0], compiled_by_step


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "small"])
@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_a_compiled_models_backward_compiles_while_its_forward_compiles(
    mode, ahead, monkeypatch
):
    """torch.compile's backward program compiles on a worker thread from the forward's
    first call on, and the first backward uses it: two XLA compiles of graph programs,
    one of them off the calling thread, and gradients as on the CPU (Note [Compiling
    the backward while the forward compiles], compile/program.py). A backward graph of
    fewer than ``AHEAD_MIN_OPS`` ops (this one, by default) compiles when it runs."""
    import threading

    import jax.monitoring

    from torchtpu.compile import backend

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(9, 17), nn.GELU(), nn.Linear(17, 3))
    model = torch.compile(copy.deepcopy(cpu_model).to("tpu"), backend="tpu")
    x = torch.randn(5, 9)
    graph_compiles = []

    def listener(event, seconds, fun_name=None, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and fun_name == "jit(_traced)":
            graph_compiles.append(threading.current_thread().name)

    torch._dynamo.reset()
    if ahead:
        monkeypatch.setattr(backend, "AHEAD_MIN_OPS", 1)  # a small model's backward too
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with torchtpu.set_eager_mode(mode):
            model(x.to("tpu")).square().mean().backward()
            grads = [p.grad.cpu() for p in model.parameters()]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    cpu_model(x).square().mean().backward()
    for got, expected in zip(grads, [p.grad for p in cpu_model.parameters()], strict=True):
        torch.testing.assert_close(got, expected)
    assert len(graph_compiles) == 2, graph_compiles
    on_the_worker = sum(name.startswith("torchtpu-compile") for name in graph_compiles)
    assert on_the_worker == (1 if ahead else 0), graph_compiles


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.zeros_like(p),
        lambda p: torch.ones_like(p),
        lambda p: torch.zeros(3, device="tpu"),
        lambda p: torch.arange(4, device="tpu"),
        lambda p: torch.randn(2, device="tpu"),
        lambda p: torch.empty(5, device="tpu")[1:3],
    ],
    ids=["zeros_like", "ones_like", "zeros", "arange", "randn", "empty"],
)
def test_every_tpu_tensor_array_is_committed(make, mode):
    """A tpu tensor's JAX array is committed to its device, in every mode, factories
    included (Note [Every array is committed to its device])."""
    from torchtpu.dispatch.values import materialize

    p = torch.randn(4).to("tpu")
    with torchtpu.set_eager_mode(mode):
        t = make(p)
        assert materialize(t).committed
