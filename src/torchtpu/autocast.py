"""``torch.autocast("tpu", dtype=torch.bfloat16)``: mixed precision on the tpu device.

torch routes ops inside an autocast region through the AutocastPrivateUse1 key. Ops
not listed here fall through unchanged; listed ops cast their floating tpu inputs
first, with the same op lists torch uses for CUDA: matmul-like ops to the autocast
dtype, numerically sensitive ops to float32.
"""

from __future__ import annotations

import torch

_KEY = "AutocastPrivateUse1"

# Run in the autocast dtype (torch's "lower_precision_fp" list).
LOWER_PRECISION = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "_convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "linalg_vecdot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
)  # fmt: skip

# Run in float32 (torch's "fp32" list).
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "softmax.int", "log_softmax.int", "cumsum", "cumprod", "prod",
    "sum", "linalg_vector_norm",
)  # fmt: skip

_library = None

# Ops that make their casts inside one op of their own (device.py fills it: ``linear``,
# ops/linear.py), called as ``fn(dtype, *args, **kwargs)``; None takes the casts.
casts_inside: dict = {}


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        if (
            value.device.type == "tpu"
            and value.is_floating_point()
            and value.dtype is not torch.float64
        ):
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _kernel(op, target, name):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("tpu") if target is None else target
        with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
        ):
            inside = casts_inside.get(name)
            if inside is not None:
                out = inside(dtype, *args, **kwargs)
                if out is not None:
                    return out
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return kernel


def register() -> None:
    """Register the autocast kernels (idempotent; cheap: no JAX)."""
    global _library
    if _library is not None:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    library = torch.library.Library("aten", "IMPL")
    for names, target in ((LOWER_PRECISION, None), (FLOAT32, torch.float32)):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            library.impl(name, _kernel(op, target, name), _KEY)
    _library = (fallback, library)
