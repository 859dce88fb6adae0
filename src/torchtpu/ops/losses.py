"""Losses: negative log-likelihood and cross entropy, the regression and margin losses,
CTC.

Where torch has a dedicated backward op, it is lowered as the JAX ``vjp`` of the
forward lowering, so forward and backward cannot disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu import _compat, dtypes
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import opmath
from torchtpu.ops.value_checks import error_if

# -- losses -------------------------------------------------------------------------------------

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(loss, reduction):
    if reduction == _MEAN:
        return jnp.mean(loss)
    if reduction == _SUM:
        return jnp.sum(loss)
    return loss


def _nll_parts(self, target, weight, ignore_index):
    """Per-element -w * x[target] and w, with the class dim at 1 (or 0 for 1-d)."""
    class_dim = 0 if self.ndim == 1 else 1
    n_classes = self.shape[class_dim]
    valid, safe = _checked_targets(target, ignore_index, n_classes)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe, class_dim), axis=class_dim).squeeze(
        class_dim
    )
    w = jnp.ones((n_classes,), self.dtype) if weight is None else weight.astype(self.dtype)
    w = jnp.where(valid, w[safe], 0)
    return -picked * w, w


def _checked_targets(target, ignore_index, n_classes):
    """(whether each target counts, the targets with the ignored ones made 0), having
    stated torch's error for a target out of range."""
    valid = target != ignore_index
    error_if(
        jnp.any(valid & ((target < 0) | (target >= n_classes))),
        IndexError,
        f"Target is out of bounds (must be in [0, {n_classes}))",
    )
    return valid, jnp.where(valid, target, 0)


def _reduce_weighted(loss, weights, reduction):
    """``_reduce``, but a mean divides by the sum of the elements' weights."""
    if reduction == _MEAN:
        return jnp.sum(loss) / jnp.sum(weights)
    return _reduce(loss, reduction)


def _nll_forward(self, target, weight, reduction, ignore_index):
    loss, w = _nll_parts(self, target, weight, ignore_index)
    return _reduce_weighted(loss, w, reduction), jnp.sum(w)


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, vjp = jax.vjp(lambda x: _nll_forward(x, target, weight, reduction, ignore_index)[0], self)
    return vjp(grad_output.astype(self.dtype))[0]


# -- linear + cross entropy -----------------------------------------------------------------
#
# torch's chunked linear_cross_entropy ops compute the loss of ``input @ W.T + b``
# batch chunk by batch chunk, so that the (N, C) logits never exist at once; the scalar
# one also returns its gradients, computed in the same pass. Here XLA sees the whole
# computation as one program and fuses it.

_REDUCTIONS = {"none": _NONE, "mean": _MEAN, "sum": _SUM}


def class_index_cross_entropy(
    logits, target, weight, reduction, ignore_index, label_smoothing, logsumexp=None
):
    """torch's cross_entropy of (N, C) logits and class-index targets.

    Note [Cross entropy without log-probabilities]
        A row's loss is ``logsumexp(x) - x[target]``: the (N, C) log-probabilities
        torch's composite makes are never made, so the forward reads the logits twice
        (their maximum, then the sum of exponentials) and needs no array of their size
        beyond them (XLA may keep a float32 copy of 16-bit logits); a language model's
        logits are its largest array (GPT-2 small at 8x1024 tokens: 1.6 GiB in
        float32). ``x[target]`` is taken as a masked sum rather than a
        gather, so its gradient is a compare in the same elementwise pass as the
        softmax's, not a scatter into zeros. Given the forward's ``logsumexp`` (the
        backward op: ops/cross_entropy.py), the gradient reads the logits once and
        writes its own (N, C) array, where recomputing it would read them twice more.
    """
    n_classes = logits.shape[1]
    if logsumexp is None:
        logsumexp = jax.nn.logsumexp(logits, axis=1)
    else:
        logsumexp = _known_logsumexp(logits, logsumexp)
    valid, safe = _checked_targets(target, ignore_index, n_classes)
    is_target = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == safe.astype(jnp.int32)[:, None]
    picked = jnp.sum(jnp.where(is_target, logits, 0), axis=1)
    w = jnp.ones((n_classes,), logits.dtype) if weight is None else weight.astype(logits.dtype)
    row_weight = jnp.where(valid, w[safe], 0)
    nll = _reduce_weighted((logsumexp - picked) * row_weight, row_weight, reduction)
    if not label_smoothing:
        return nll
    # -sum_c w_c * log p_c = logsumexp * sum_c w_c - sum_c w_c * x_c
    if weight is None:
        smooth = logsumexp * n_classes - jnp.sum(logits, axis=1)
    else:
        smooth = logsumexp * jnp.sum(w) - jnp.sum(logits * w, axis=1)
    smooth = _reduce_weighted(jnp.where(valid, smooth, 0), row_weight, reduction)
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


@jax.custom_vjp
def _known_logsumexp(logits, logsumexp):
    """``logsumexp``, the rows' logsumexp of ``logits`` computed already, with the
    gradient of computing it: the softmax (Note [Cross entropy without
    log-probabilities])."""
    return logsumexp


def _known_logsumexp_forward(logits, logsumexp):
    return logsumexp, (logits, logsumexp)


def _known_logsumexp_backward(saved, grad):
    logits, logsumexp = saved
    softmax = jnp.exp(logits - logsumexp[:, None])
    return grad[:, None] * softmax, jnp.zeros_like(logsumexp)


_known_logsumexp.defvjp(_known_logsumexp_forward, _known_logsumexp_backward)


def _linear_cross_entropy_fn(
    target, weight, reduction, ignore_index, label_smoothing, acc_dtype, precision
):
    """The loss as a function of (input, linear_weight, linear_bias), computed in
    ``acc_dtype`` (torch's accumulation dtype for 16-bit inputs) where given."""

    def loss(x, w, b):
        work = dtypes.to_jax(acc_dtype) if acc_dtype is not None else x.dtype
        logits = jnp.matmul(x.astype(work), w.astype(work).T, precision=precision)
        if b is not None:
            logits = logits + b.astype(work)
        return class_index_cross_entropy(
            logits, target, weight, reduction, ignore_index, label_smoothing
        )

    return loss


@lowers(_compat.op("torch_nn._linear_cross_entropy_batch_chunked.default"), precision=True)
def _linear_cross_entropy_batch_chunked(
    input,
    linear_weight,
    target,
    linear_bias,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    compute_input_grad,
    compute_linear_weight_grad,
    compute_linear_bias_grad,
    *,
    precision,
):
    """The loss, and its gradients with respect to input, weight and bias where asked
    for (the others empty)."""
    loss = _linear_cross_entropy_fn(
        target, weight, _REDUCTIONS[reduction], ignore_index, label_smoothing, acc_dtype, precision
    )
    value, vjp = jax.vjp(loss, input, linear_weight, linear_bias)
    grads = vjp(jnp.ones_like(value))
    asked = (compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad)
    empty = ((0, 0), (0, 0), (0,))
    return (value,) + tuple(
        g if want else jnp.zeros(shape, input.dtype) for g, want, shape in zip(grads, asked, empty)
    )


@lowers(
    _compat.op("torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default"), precision=True
)
def _linear_cross_entropy_batch_chunked_no_reduction(
    input,
    linear_weight,
    target,
    linear_bias,
    weight,
    ignore_index,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
    *,
    precision,
):
    loss = _linear_cross_entropy_fn(target, weight, _NONE, ignore_index, 0.0, acc_dtype, precision)
    return loss(input, linear_weight, linear_bias)


# -- margin losses ---------------------------------------------------------------------------
#
# Written out rather than decomposed: torch's decomposition of
# multilabel_margin_loss_forward also counts the target slots after the -1 that ends
# each row's target list (a wrong value), and neither backward has a decomposition.


def _multi_margin(self, target, p, margin, weight, reduction):
    x = opmath(jnp.atleast_2d(self))
    t = jnp.atleast_1d(target)
    n_classes = x.shape[1]
    error_if(jnp.any((t < 0) | (t >= n_classes)), RuntimeError, "target out of range")
    picked = jnp.take_along_axis(x, jnp.clip(t, 0, n_classes - 1)[:, None], axis=1)
    z = jnp.maximum(margin - picked + x, 0)
    z = z if p == 1 else z * z
    if weight is not None:
        z = z * opmath(weight)[jnp.clip(t, 0, n_classes - 1)][:, None]
    z = jnp.where(jnp.arange(n_classes)[None, :] == t[:, None], 0, z)
    loss = jnp.sum(z, axis=1) / n_classes
    if reduction == _NONE:
        return loss.reshape(target.shape).astype(self.dtype)
    return _reduce(loss, reduction).astype(self.dtype)


def _check_margin_p(p):
    if p not in (1, 2):
        raise ValueError("only p == 1 and p == 2 supported")


# meta="checks_only": the meta kernel gives one 1-d sample a loss of shape (1,)
# where the CPU's is 0-d; it runs for its checks of the arguments.
@lowers(aten.multi_margin_loss.default, static=("p",), meta="checks_only")
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=_MEAN):
    _check_margin_p(p)
    return _multi_margin(self, target, p, margin, weight, reduction)


@lowers(aten.multi_margin_loss_backward.default, static=("p",))
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=_MEAN):
    _check_margin_p(p)
    _, vjp = jax.vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), self)
    return vjp(grad_output.astype(self.dtype))[0]


def _multilabel_margin(self, target, reduction):
    """(loss, is_target): each row's targets are its leading entries up to a -1."""
    x = opmath(jnp.atleast_2d(self))
    t = jnp.atleast_2d(target)
    n_classes = x.shape[1]
    position = jnp.arange(n_classes)
    end = jnp.min(jnp.where(t == -1, position, n_classes), axis=1, keepdims=True)
    listed = position[None, :] < end  # (N, slots)
    error_if(
        jnp.any(listed & ((t < 0) | (t >= n_classes))),
        RuntimeError,
        "argument #2 'target' is out of range",
    )
    safe = jnp.where(listed, t, 0)
    is_target = jnp.any(listed[:, :, None] & (safe[:, :, None] == position), axis=1)
    picked = jnp.take_along_axis(x, safe, axis=1)  # (N, slots)
    z = jnp.maximum(1 - picked[:, :, None] + x[:, None, :], 0)  # (N, slots, classes)
    z = jnp.where(listed[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = jnp.sum(z, axis=(1, 2)) / n_classes
    loss = loss.reshape(target.shape[:-1]) if reduction == _NONE else _reduce(loss, reduction)
    return loss.astype(self.dtype), is_target.astype(self.dtype).reshape(target.shape)


@lowers(aten.multilabel_margin_loss_forward.default, meta="checks_only")
def multilabel_margin_loss_forward(self, target, reduction):
    return _multilabel_margin(self, target, reduction)


@lowers(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x: _multilabel_margin(x, target, reduction)[0], self)
    return vjp(grad_output.astype(self.dtype))[0]


@lowers(aten.mse_loss.default, promote="default")
def mse_loss(self, target, reduction=_MEAN):
    return _reduce(jnp.square(self - target), reduction)


@lowers(aten.mse_loss_backward.default, promote="default")
def mse_loss_backward(grad_output, self, target, reduction):
    scale = 2.0 / self.size if reduction == _MEAN else 2.0
    return scale * (self - target) * grad_output


def _bce(self, target, weight):
    # torch clamps the logs at -100 so that 0 * log(0) stays finite.
    log_p = jnp.maximum(jnp.log(self), -100.0)
    log_1mp = jnp.maximum(jnp.log1p(-self), -100.0)
    loss = -(target * log_p + (1 - target) * log_1mp)
    return loss if weight is None else loss * weight


@lowers(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=_MEAN):
    # torch's CPU kernel checks each element, input first (NaN fails too)
    for name, value in (("input", self), ("target", target)):
        error_if(
            jnp.any(~((value >= 0) & (value <= 1))),
            RuntimeError,
            f"all elements of {name} should be between 0 and 1",
        )
    x = opmath(self)
    return _reduce(_bce(x, opmath(target), weight), reduction)


@lowers(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=_MEAN):
    eps = 1e-12
    x, t = opmath(self), opmath(target)
    grad = (x - t) / jnp.maximum((1 - x) * x, eps)
    if weight is not None:
        grad = grad * weight
    if reduction == _MEAN:
        grad = grad / self.size
    return grad * grad_output


@lowers(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=_MEAN):
    x, t = opmath(self), opmath(target)
    log_sig = jax.nn.log_sigmoid(x)
    log_one_minus = jax.nn.log_sigmoid(-x)
    if pos_weight is not None:
        loss = -(pos_weight * t * log_sig + (1 - t) * log_one_minus)
    else:
        loss = -(t * log_sig + (1 - t) * log_one_minus)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@lowers(aten.smooth_l1_loss.default, promote="default")
def smooth_l1_loss(self, target, reduction=_MEAN, beta=1.0):
    diff = jnp.abs(self - target)
    loss = (
        diff - 0.5 * beta
        if beta == 0
        else jnp.where(diff < beta, 0.5 * diff * diff / beta, diff - 0.5 * beta)
    )
    return _reduce(loss, reduction)


@lowers(
    aten.smooth_l1_loss_backward.default,
    promote="default",
    promote_args=("grad_output", "self", "target"),
)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    x = self - target
    norm = 1.0 / x.size if reduction == _MEAN else 1.0
    if beta == 0:
        # torch's kernel takes x >= beta first: the slope at x = 0 is +1, not 0.
        slope = jnp.where(x < 0, -1.0, 1.0)
    else:
        slope = jnp.clip(x / beta, -1.0, 1.0)
    return (norm * slope).astype(x.dtype) * grad_output


@lowers(aten.huber_loss.default, promote="default")
def huber_loss(self, target, reduction=_MEAN, delta=1.0):
    diff = jnp.abs(self - target)
    loss = jnp.where(diff < delta, 0.5 * diff * diff, delta * (diff - 0.5 * delta))
    return _reduce(loss, reduction)


@lowers(
    aten.huber_loss_backward.default,
    promote="default",
    promote_args=("grad_output", "self", "target"),
)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    x = self - target
    norm = 1.0 / x.size if reduction == _MEAN else 1.0
    slope = jnp.clip(x, -delta, delta)
    return (norm * slope).astype(x.dtype) * grad_output


# -- CTC loss ------------------------------------------------------------------------------
#
# The forward (alpha) recursion of Graves et al. over the targets interleaved with
# blanks, one lax.scan step per time step. log_alpha is (N, T, 2 * S + 1) with S the
# padded target width -- torch sizes it by the longest target; only the backward
# reads it, and ours recomputes the recursion instead.


def _ctc_padded_targets(targets, target_lengths, width=None):
    """(N, width) targets: as given, or cut from the concatenated 1-d form. ``width``
    (the longest target, as torch sizes log_alpha) is known where the lengths are
    Python ints; else it is the widest the targets allow."""
    if targets.ndim == 2:
        return targets if width is None else targets[:, :width]
    if width is None:
        width = targets.shape[0]
    starts = jnp.cumsum(target_lengths) - target_lengths
    index = starts[:, None] + jnp.arange(width)[None, :]
    return targets[jnp.clip(index, 0, max(targets.shape[0] - 1, 0))]


def _log_add(a, b):
    """log(exp(a) + exp(b)) whose gradient is 0, not NaN, where both are -inf
    (alignments that cannot happen), as jnp.logaddexp's is not."""
    top = jnp.maximum(a, b)
    finite = jnp.isfinite(top)
    shift = jnp.where(finite, top, 0)
    total = jnp.where(finite, jnp.exp(a - shift) + jnp.exp(b - shift), 1)
    return jnp.where(finite, shift + jnp.log(total), top)


def _ctc_alphas(log_probs, targets, input_lengths, target_lengths, blank, width=None):
    """The log_alpha of every step (T, N, L) and the loss (N,) of (T, N, C) log_probs."""
    targets = _ctc_padded_targets(targets, target_lengths, width)
    n, width = targets.shape
    extended = jnp.full((n, 2 * width + 1), blank, targets.dtype).at[:, 1::2].set(targets)
    position = jnp.arange(extended.shape[1])
    lengths = 2 * target_lengths[:, None] + 1
    valid = position[None, :] < lengths
    before_previous = jnp.pad(extended, ((0, 0), (2, 0)), constant_values=blank)[:, :-2]
    # A label may follow the previous label directly unless the two are equal.
    can_skip = (position % 2 == 1) & (position >= 2) & (extended != before_previous)
    emissions = jnp.take_along_axis(
        log_probs, jnp.broadcast_to(extended, (log_probs.shape[0],) + extended.shape), axis=2
    )
    neg_inf = jnp.asarray(-jnp.inf, log_probs.dtype)
    first = jnp.where(valid & (position < 2), emissions[0], neg_inf)

    def step(alpha, inputs):
        t, emission = inputs
        stay = alpha
        advance = jnp.pad(alpha, ((0, 0), (1, 0)), constant_values=-jnp.inf)[:, :-1]
        skip = jnp.where(
            can_skip, jnp.pad(alpha, ((0, 0), (2, 0)), constant_values=-jnp.inf)[:, :-2], neg_inf
        )
        new = _log_add(_log_add(stay, advance), skip) + emission
        new = jnp.where(valid, new, neg_inf)
        # Past an input's length its alphas stay those of its last step.
        new = jnp.where((t < input_lengths)[:, None], new, alpha)
        return new, new

    steps = jnp.arange(1, log_probs.shape[0])
    last, rest = lax.scan(step, first, (steps, emissions[1:]))
    alphas = jnp.concatenate([first[None], rest], axis=0)
    end = lengths - 1
    final = jnp.take_along_axis(last, end, axis=1)[:, 0]
    before_end = jnp.take_along_axis(last, jnp.maximum(end - 1, 0), axis=1)[:, 0]
    before_end = jnp.where(end[:, 0] > 0, before_end, neg_inf)
    return alphas, -_log_add(final, before_end)


def _as_batched(log_probs):
    return log_probs if log_probs.ndim == 3 else log_probs[:, None, :]


_CTC_CHECKING = " (while checking arguments for ctc_loss_allocate_outputs)"


def _check_ctc_lengths(log_probs, targets, input_lengths, target_lengths):
    """The CPU kernel's checks of the lengths, on the device (lengths given on the CPU
    are checked on the host first, with the values in the message: device.py)."""
    error_if(
        jnp.any(target_lengths < 0),
        RuntimeError,
        "Expected target_lengths to have value at least 0" + _CTC_CHECKING,
    )
    if targets.ndim == 1:
        error_if(
            jnp.sum(target_lengths) != targets.shape[0],
            RuntimeError,
            "Expected tensor to have size sum(target_lengths) at dimension 0, but got size "
            f"{targets.shape[0]} for argument #2 'targets'" + _CTC_CHECKING,
        )
    else:
        error_if(
            jnp.any(target_lengths > targets.shape[1]),
            RuntimeError,
            "Expected tensor to have size at least max(target_lengths) at dimension 1, but "
            f"got size {targets.shape[1]} for argument #2 'targets'" + _CTC_CHECKING,
        )
    error_if(
        jnp.any(input_lengths < 0),
        RuntimeError,
        "Expected input_lengths to have value at least 0" + _CTC_CHECKING,
    )
    error_if(
        jnp.any(input_lengths > log_probs.shape[0]),
        RuntimeError,
        f"Expected input_lengths to have value at most {log_probs.shape[0]}" + _CTC_CHECKING,
    )


@lowers(aten._ctc_loss.Tensor)
def _ctc_loss_Tensor(
    log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False, width=None
):
    _check_ctc_lengths(log_probs, targets, input_lengths, target_lengths)
    alphas, loss = _ctc_alphas(
        _as_batched(log_probs), targets, input_lengths, target_lengths, blank, width
    )
    if log_probs.ndim == 2:
        loss = loss[0]
    return loss, jnp.moveaxis(alphas, 0, 1)


@lowers(aten._ctc_loss.default)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # The lengths as lists of ints (F.ctc_loss given tuples): the same, as arrays.
    return _ctc_loss_Tensor(
        log_probs,
        targets,
        _lengths(input_lengths),
        _lengths(target_lengths),
        blank,
        width=max(target_lengths, default=0),
    )


def _lengths(lengths):
    return jnp.asarray(lengths, dtype=jnp.int64)


@lowers(aten._ctc_loss_backward.default)
def _ctc_loss_backward(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    neg_log_likelihood,
    log_alpha,
    blank,
    zero_infinity=False,
):
    return _ctc_loss_backward_Tensor(
        grad,
        log_probs,
        targets,
        _lengths(input_lengths),
        _lengths(target_lengths),
        neg_log_likelihood,
        log_alpha,
        blank,
        zero_infinity,
    )


@lowers(aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward_Tensor(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    neg_log_likelihood,
    log_alpha,
    blank,
    zero_infinity=False,
):
    batched = _as_batched(log_probs)

    def total_loss(lp):
        return jnp.sum(_ctc_alphas(lp, targets, input_lengths, target_lengths, blank)[1])

    # torch's kernel returns the gradient with respect to the logits under a
    # log_softmax (exp(log_probs) - posterior), which log_softmax's backward then
    # leaves unchanged; so does this one.
    result = jnp.exp(batched) + jax.grad(total_loss)(batched)
    result = result * jnp.reshape(grad, (1, -1, 1))
    result = jnp.where(
        jnp.arange(batched.shape[0])[:, None, None] < input_lengths[None, :, None], result, 0
    )
    if zero_infinity:
        infinite = jnp.isinf(jnp.reshape(neg_log_likelihood, (-1,)))
        result = jnp.where(infinite[None, :, None], 0, result)
    return result.reshape(log_probs.shape)
