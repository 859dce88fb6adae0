"""Ops torch computes with fused CPU and CUDA kernels and has no decomposition for,
written here as the aten ops they fuse, so that they run on tpu instead of on the CPU
fallback.

- The fast paths `nn.MultiheadAttention` and `nn.TransformerEncoderLayer` take in eval
  mode without grad: every transformer's inference reaches them. Each follows the CPU
  kernel (aten/src/ATen/native/transformers) and is tested against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    """Batch-first attention of (B, T, E) queries over (B, S, E) keys and values.

    ``mask`` is the merged mask of `nn.MultiheadAttention.merge_masks`: (B, S) for a
    key padding mask (``mask_type`` 1), (T, S) for an attention mask (0) or
    (B, H, T, S) for both (2). As the CPU kernel does, any nonzero (or True) entry
    masks its position out (a query whose keys are all masked gets NaN weights, as on
    the CPU)."""
    batch, target, _ = query.shape
    source = key.shape[1]
    head = embed_dim // num_head
    w_q, w_k, w_v = qkv_weight.chunk(3)
    b_q, b_k, b_v = qkv_bias.chunk(3)

    def heads(x, w, b, length):
        return F.linear(x, w, b).view(batch, length, num_head, head).transpose(1, 2)

    q = heads(query, w_q, b_q, target) / math.sqrt(head)
    k, v = heads(key, w_k, b_k, source), heads(value, w_v, b_v, source)
    scores = q @ k.transpose(-2, -1)  # (B, H, T, S)
    if mask is not None:
        masked = mask if mask.dtype == torch.bool else mask != 0
        if mask_type == 1:
            masked = masked.view(batch, 1, 1, source)
        scores = scores.masked_fill(masked, -math.inf)
    weights = scores.softmax(-1)
    context = (weights @ v).transpose(1, 2).reshape(batch, target, embed_dim)
    out = F.linear(context, proj_weight, proj_bias)
    if not need_weights:
        return out, None  # as the CPU kernel: no weights (the meta kernel says empty)
    return out, weights.mean(1) if average_attn_weights else weights


def transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    """One `nn.TransformerEncoderLayer` (self-attention, then the feed-forward block,
    each with its residual; layer norms before or after them)."""
    shape = (embed_dim,)

    def norm(x, weight, bias):
        return F.layer_norm(x, shape, weight, bias, eps)

    x = src
    attended = norm(x, norm_weight_1, norm_bias_1) if norm_first else x
    attended, _ = native_multi_head_attention(
        attended, attended, attended, embed_dim, num_heads, qkv_weight, qkv_bias,
        proj_weight, proj_bias, mask, False, True, mask_type,
    )  # fmt: skip
    x = x + attended
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    hidden = norm(x, norm_weight_2, norm_bias_2) if norm_first else x
    hidden = F.linear(hidden, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = x + F.linear(hidden, ffn_weight_2, ffn_bias_2)
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x


DECOMPOSITIONS = {
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
}
