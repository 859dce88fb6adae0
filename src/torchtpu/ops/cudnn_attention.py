"""Attention by cuDNN's fused kernel on a GPU, through ``jax.nn.dot_product_attention``.

On a GPU, JAX's ``dot_product_attention(..., implementation="cudnn")`` runs cuDNN's
flash attention, forward and backward, and never holds the [B, H, L, S] scores. It is
``scaled_dot_product_attention``'s kernel there (ops/attention.py), as the Pallas flash
kernels are on a TPU (ops/flash_attention.py), where the call allows:

- bfloat16 or float16 q, k and v of rank 4, one head size, a multiple of 8 up to 128
  (cuDNN's);
- no ``attn_mask`` (as the flash kernels; a mask keeps the dense lowering);
- ``is_causal`` with as many keys as queries (torch's causal mask is top-left aligned,
  JAX's cuDNN path leaves the alignment of a longer key sequence to cuDNN).

``config.flash_attention`` decides it as for the flash kernels: "auto" or "on" on a GPU
(runtime/policy.py), "off" never. Not measured on a GPU (none was available to this
project); the choice and the call are tested on the CPU backend with JAX choosing its
own implementation (``IMPLEMENTATION`` set to None).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchtpu import config
from torchtpu.observe import metrics
from torchtpu.ops.flash_attention import layout_problem
from torchtpu.runtime import platform, policy

# jax.nn.dot_product_attention's implementation; the tests set None (JAX's choice).
IMPLEMENTATION: str | None = "cudnn"


def offered() -> bool:
    """Whether this platform's fused attention is cuDNN's."""
    return config.flash_attention != "off" and policy.cudnn_attention() and platform() == "gpu"


def applies(query, key, value, attn_mask, is_causal: bool) -> bool:
    """Whether this call takes the kernel; counts the choice and its reason."""
    reason = _why_not(query, key, value, attn_mask, is_causal)
    metrics.count("attention", "cudnn" if reason is None else f"dense: {reason}")
    return reason is None


def _why_not(query, key, value, attn_mask, is_causal) -> str | None:
    if any(t.dtype not in (jnp.bfloat16, jnp.float16) for t in (query, key, value)):
        return "not bfloat16 or float16"
    if attn_mask is not None:
        return "an attn_mask"
    layout = layout_problem(query, key, value)
    if layout is not None:
        return layout
    if query.shape[-1] % 8 or query.shape[-1] > 128:
        return "a head size not a multiple of 8 up to 128"
    if is_causal and query.shape[-2] != key.shape[-2]:
        return "causal with more or fewer keys than queries"
    return None


def _attend(query, key, value, is_causal, scale):
    heads_second = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  torch's [B, H, L, E] <-> JAX's [B, L, H, E]
    out = jax.nn.dot_product_attention(
        heads_second(query), heads_second(key), heads_second(value),
        scale=scale, is_causal=is_causal, implementation=IMPLEMENTATION,
    )  # fmt: skip
    return heads_second(out)


def forward(query, key, value, is_causal, scale):
    return _attend(query, key, value, is_causal, scale)


def backward(grad_out, query, key, value, is_causal, scale):
    """(dq, dk, dv): the kernel's own backward."""
    _, pullback = jax.vjp(lambda q, k, v: _attend(q, k, v, is_causal, scale), query, key, value)
    return pullback(grad_out.astype(query.dtype))
