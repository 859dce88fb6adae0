"""torch's fused optimizer steps (``Adam``/``AdamW``/``SGD`` with ``fused=True``) as one
op each: every parameter's update in one program.

``torch.optim.AdamW(params, fused=True)`` calls ``_fused_adamw_`` once per step over
lists of the parameters, gradients, moments and step counts (the Hugging Face
Trainer's ``adamw_torch_fused``; nanoGPT's choice on CUDA). Here it is one op, whose
program reads each list once and writes the new parameters, moments (and, with a
``grad_scale``, unscaled gradients) in place, their old buffers donated (Note [Strict
writes reuse their buffers] in dispatch/plans.py). Written as torch's foreach
algorithm instead, a step is a dozen ``_foreach_`` ops, each a launch in Strict that
takes every parameter's array again.

The arithmetic is the CPU and CUDA kernels' (aten/src/ATen/native/cpu/
FusedAdamKernel.cpp, FusedSGDKernel.cpp), in float32 for 16-bit parameters, per element:
a ``found_inf`` of 1 (an AMP step that overflowed) leaves every tensor as it was; a
``grad_scale`` divides the gradients, which are stored unscaled; ``maximize`` negates
them. The step counts are the optimizer's, counted already; their bias corrections are
computed on the device in float32 (the CPU kernel computes them in float64 on the host,
which would read the counts back every step).
"""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import opmath


def _number(value, dtype):
    """A scalar argument (a Python number's traced array, a 0-d or 1-element tensor's
    array) as a 0-d array of ``dtype``, the parameter's computing dtype."""
    return jnp.reshape(jnp.asarray(value), ()).astype(dtype)


def _unchanged_where_overflowed(found_inf, new, old):
    """``new``, or ``old`` wherever ``found_inf`` is 1 (each a list of arrays)."""
    if found_inf is None:
        return new
    skip = jnp.reshape(found_inf, ()) == 1
    return [jnp.where(skip, o, n) for n, o in zip(new, old)]


def _adam(decoupled_weight_decay: bool):
    def fused_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
        beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None,
    ):  # fmt: skip
        out = ([], [], [], [], [])
        for i, (p, g, m, v, step) in enumerate(
            zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)
        ):
            param, grad, exp_avg, exp_avg_sq = (opmath(t) for t in (p, g, m, v))
            lr_, beta1_, beta2_, eps_ = (_number(n, param.dtype) for n in (lr, beta1, beta2, eps))
            if grad_scale is not None:
                grad = grad / _number(grad_scale, param.dtype)
            stored_grad = grad
            if maximize:
                grad = -grad
            if weight_decay != 0:
                if decoupled_weight_decay:
                    param = param * (1 - lr_ * weight_decay)
                else:
                    grad = grad + weight_decay * param
            exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1_)
            exp_avg_sq = exp_avg_sq * beta2_ + (1 - beta2_) * grad * grad
            step = _number(step, param.dtype)
            bias_correction1 = 1 - beta1_**step
            bias_correction2_sqrt = jnp.sqrt(1 - beta2_**step)
            second = exp_avg_sq
            if amsgrad:
                second = jnp.maximum(opmath(max_exp_avg_sqs[i]), exp_avg_sq)
                out[4].append(second.astype(max_exp_avg_sqs[i].dtype))
            denom = jnp.sqrt(second) / bias_correction2_sqrt + eps_
            param = param - (lr_ / bias_correction1) * exp_avg / denom
            out[0].append(param.astype(p.dtype))
            out[1].append(stored_grad.astype(g.dtype))
            out[2].append(exp_avg.astype(m.dtype))
            out[3].append(exp_avg_sq.astype(v.dtype))
        if not amsgrad:
            out[4].extend(max_exp_avg_sqs)  # written as they are (torch passes none)
        before = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        return tuple(_unchanged_where_overflowed(found_inf, n, o) for n, o in zip(out, before))

    fused_adam.__name__ = "fused_adamw" if decoupled_weight_decay else "fused_adam"
    return fused_adam


_ADAM_STATIC = ("weight_decay", "amsgrad", "maximize")
lowers(aten._fused_adam.default, aten._fused_adam.tensor_lr, static=_ADAM_STATIC)(_adam(False))
lowers(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, static=_ADAM_STATIC)(_adam(True))


@lowers(
    aten._fused_sgd.default,
    aten._fused_sgd.tensor_lr,
    static=("weight_decay", "momentum", "nesterov", "maximize", "is_first_step"),
)
def fused_sgd(
    params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov,
    maximize, is_first_step, grad_scale=None, found_inf=None,
):  # fmt: skip
    """SGD's step; with ``momentum``, the buffers (made empty by torch before the first
    step) start as the first step's gradients."""
    out = ([], [], [])
    for i, (p, g) in enumerate(zip(params, grads)):
        param, grad = opmath(p), opmath(g)
        lr_, dampening_ = _number(lr, param.dtype), _number(dampening, param.dtype)
        if grad_scale is not None:
            grad = grad / _number(grad_scale, param.dtype)
        out[1].append(grad.astype(g.dtype))
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad + weight_decay * param
        if momentum != 0:
            buffer = grad
            if not is_first_step:
                buffer = opmath(momentum_buffer_list[i]) * momentum + (1 - dampening_) * grad
            out[2].append(buffer.astype(momentum_buffer_list[i].dtype))
            grad = grad + momentum * buffer if nesterov else buffer
        out[0].append((param - lr_ * grad).astype(p.dtype))
    if momentum == 0:
        out[2].extend(momentum_buffer_list)  # written as they are (torch passes none)
    before = (params, grads, momentum_buffer_list)
    return tuple(_unchanged_where_overflowed(found_inf, n, o) for n, o in zip(out, before))
