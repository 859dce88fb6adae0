"""Attention by JAX's Pallas flash kernels on a TPU, where the inputs allow.

``scaled_dot_product_attention``'s lowering (ops/attention.py) materialises the
[B, H, L, S] scores inside its program. On a TPU, JAX ships FlashAttention as Pallas
kernels (``jax.experimental.pallas.ops.tpu.flash_attention``: forward, and a backward
that recomputes the weights block by block), which never hold more than a block of
scores. ``applies`` says whether a call can take them; ``forward`` and ``backward`` run
them.

What the kernels take (anything else stays on the dense lowering, and
``torchtpu.metrics()["attention"]`` counts each program's choice with its reason):

- bfloat16 q, k and v of rank 4 [B, H, L, E] with one head size E of 64 or 128
  (``HEAD_SIZES``): the kernels multiply in the inputs' dtype at the default
  precision, which for float32 inputs on a TPU is one bfloat16 pass (torch's float32
  precision setting could not be honoured);
- no ``attn_mask`` (the kernels take an additive bias of the full [B, H, L, S], which
  would be the dense memory again); ``is_causal`` is theirs (top-left aligned, as
  torch's: a query at row i sees keys 0..i);
- L and S multiples of 128, the kernels' smallest block (``BLOCKS``).

``enable_gqa`` repeats the key and value heads first, as the dense lowering does.

``config.flash_attention``: "auto" takes the kernels on a TPU (runtime/policy.py says
which platforms have them); "on" takes them on any backend, in Pallas's interpret mode
off a TPU (how the tests check them on the CPU: slow); "off" never. The choice is made
when an op's program is built.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from torchtpu import config
from torchtpu.observe import metrics
from torchtpu.runtime import platform, policy

# Blocks of queries and keys, the largest the lengths allow; 128 is the kernels' smallest
# (and default). On a v5e (B 8, H 12, L 1024, E 64, causal) blocks of 128 took 2.41 ms
# forward and 8.66 ms forward and backward, against XLA's dense 1.86 and 4.94 ms;
# blocks of 512 took 1.07 and 3.59 ms.
BLOCKS = (512, 256, 128)
# Head sizes given to the kernels, which keep a whole head in a block's last dim: a size
# Mosaic refused would fail the whole program, so only these: 64 ran on a v5e (GPT-2's
# heads), 128 (a TPU lane's width, the kernels' own) has not yet.
HEAD_SIZES = (64, 128)


def applies(query, key, value, attn_mask) -> bool:
    """Whether this call takes the flash kernels; counts the choice and its reason."""
    reason = _why_not(query, key, value, attn_mask)
    metrics.count("attention", "flash" if reason is None else f"dense: {reason}")
    return reason is None


def layout_problem(query, key, value) -> str | None:
    """Why q, k and v (arrays or tensors) are not [batch, heads, length, head size] with
    one head size, as the fused kernels take them; None where they are."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return "not [batch, heads, length, head size]"
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        return "value's head size differs"
    return None


def offered() -> bool:
    """Whether JAX's Pallas kernels are offered here (``config.flash_attention``, the
    platform): the flash kernels for SDPA, the splash kernel for FlexAttention."""
    if config.flash_attention == "off":
        return False
    return config.flash_attention == "on" or (policy.flash_attention() and platform() == "tpu")


def _why_not(query, key, value, attn_mask) -> str | None:
    if config.flash_attention == "off":
        return "config.flash_attention is 'off'"
    if not offered():
        return "no Pallas flash kernel on this platform"
    if any(t.dtype != jnp.bfloat16 for t in (query, key, value)):
        return "not bfloat16"
    if attn_mask is not None:
        return "an attn_mask"
    layout = layout_problem(query, key, value)
    if layout is not None:
        return layout
    if query.shape[-1] not in HEAD_SIZES:
        return f"a head size other than {' or '.join(map(str, HEAD_SIZES))}"
    if query.shape[-2] % BLOCKS[-1] or key.shape[-2] % BLOCKS[-1]:
        return f"a length not a multiple of {BLOCKS[-1]}"
    return None


@contextlib.contextmanager
def kernels_context():
    """Where the kernels trace: in 32 bits (Note [Pallas kernels trace in 32 bits],
    interop/pallas.py), and interpreted off a TPU."""
    from jax.experimental.pallas import tpu as pltpu

    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.enable_x64(False))
        if platform() != "tpu":
            stack.enter_context(pltpu.force_tpu_interpret_mode())
        yield


def _flash(query, key, is_causal, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention

    q = next(b for b in BLOCKS if query.shape[-2] % b == 0)
    k = next(b for b in BLOCKS if key.shape[-2] % b == 0)
    blocks = flash_attention.BlockSizes(
        block_q=q,
        block_k_major=k,
        block_k=k,
        block_b=1,
        block_q_major_dkv=q,
        block_k_major_dkv=k,
        block_k_dkv=k,
        block_q_dkv=q,
        block_k_major_dq=k,
        block_k_dq=k,
        block_q_dq=q,
    )
    return functools.partial(
        flash_attention.flash_attention, causal=is_causal, sm_scale=scale, block_sizes=blocks
    )


def forward(query, key, value, is_causal, scale):
    with kernels_context():
        return _flash(query, key, is_causal, scale)(query, key, value)


def backward(grad_out, query, key, value, is_causal, scale):
    """(dq, dk, dv): the kernels' own backward, after a forward that keeps the softmax's
    row statistics (as the dense lowering's backward recomputes its weights)."""
    with kernels_context():
        _, pullback = jax.vjp(_flash(query, key, is_causal, scale), query, key, value)
        return pullback(grad_out.astype(query.dtype))
