"""Random ops. Each takes ``key=``: a PRNG key the dispatcher derives from the
device's (seed, offset) state inside the compiled function (rng.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu import dtypes
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import flat_draw, opmath_dtype
from torchtpu.ops.value_checks import error_if

# 16-bit floats are drawn in float32, then rounded: as torch's CPU generator does.


@lowers(aten.normal_.default, random=True)
def normal_(self, mean=0.0, std=1.0, generator=None, *, key):
    work = opmath_dtype(self.dtype)
    return (mean + std * flat_draw(jax.random.normal, key, self.shape, dtype=work)).astype(
        self.dtype
    )


@lowers(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean, std=1.0, generator=None, *, key):
    work = opmath_dtype(mean.dtype)
    return mean + std * flat_draw(jax.random.normal, key, mean.shape, dtype=work)


def _check_stds(std):
    error_if(jnp.any(std < 0), RuntimeError, "normal expects all elements of std >= 0.0")


@lowers(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean, std, generator=None, *, key):
    _check_stds(std)
    work = opmath_dtype(std.dtype)
    return mean + std * flat_draw(jax.random.normal, key, std.shape, dtype=work)


@lowers(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean, std, generator=None, *, key):
    _check_stds(std)
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    work = opmath_dtype(jnp.result_type(mean, std))
    return mean + std * flat_draw(jax.random.normal, key, shape, dtype=work)


@lowers(aten.uniform_.default, random=True)
def uniform_(self, from_=0.0, to=1.0, generator=None, *, key):
    error_if(
        from_ > to,
        RuntimeError,
        "uniform_ expects to return a [from, to) range, but found from > to",
    )
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        # torch draws the real and imaginary parts each from [from, to)
        part = jnp.finfo(self.dtype).dtype
        pair = flat_draw(
            jax.random.uniform, key, self.shape + (2,), dtype=part, minval=from_, maxval=to
        )
        return lax.complex(pair[..., 0], pair[..., 1])
    work = opmath_dtype(self.dtype)
    draws = flat_draw(jax.random.uniform, key, self.shape, dtype=work, minval=from_, maxval=to)
    return draws.astype(self.dtype)


def _check_p(p):
    """torch's check of a probability argument (its meta kernels make none)."""
    outside = jnp.logical_not((p >= 0) & (p <= 1))  # (a Python bool's ~ is an int's)
    error_if(outside, RuntimeError, f"bernoulli_ expects p to be in [0, 1], but got p={p}")


def _check_probabilities(p):
    """torch's CPU check of a tensor of probabilities (a value check)."""
    error_if(
        jnp.any(~((p >= 0) & (p <= 1))),
        RuntimeError,
        "Expected p_in >= 0 && p_in <= 1 to be true, but got false.",
    )


def _probability(p, dtype):
    """A probability given as a number, in the precision its draws are compared in:
    float64 for a float64 result, float32 otherwise. (A Python float is a float64
    number, and ``jax.random`` would draw float64 uniforms against it: on a TPU those
    run on the host -- a dropout mask per layer copied over each step.)"""
    return jnp.asarray(p, jnp.float64 if dtype == jnp.float64 else jnp.float32)


@lowers(aten.bernoulli_.float, random=True)
def bernoulli_float_(self, p=0.5, generator=None, *, key):
    _check_p(p)
    p = _probability(p, self.dtype)
    return flat_draw(jax.random.bernoulli, key, self.shape, p=p).astype(self.dtype)


@lowers(aten.bernoulli_.Tensor, random=True)
def bernoulli_tensor_(self, p, generator=None, *, key):
    _check_probabilities(p)
    p = jnp.broadcast_to(p, self.shape).reshape(-1)
    return jax.random.bernoulli(key, p).reshape(self.shape).astype(self.dtype)


@lowers(aten.bernoulli.default, random=True)
def bernoulli(self, generator=None, *, key):
    _check_probabilities(self)
    return jax.random.bernoulli(key, self.reshape(-1)).reshape(self.shape).astype(self.dtype)


@lowers(aten.bernoulli.p, random=True)
def bernoulli_p(self, p, generator=None, *, key):
    _check_p(p)
    p = _probability(p, self.dtype)
    return flat_draw(jax.random.bernoulli, key, self.shape, p=p).astype(self.dtype)


@lowers(aten.exponential_.default, random=True)
def exponential_(self, lambd=1.0, generator=None, *, key):
    work = opmath_dtype(self.dtype)
    return (flat_draw(jax.random.exponential, key, self.shape, dtype=work) / lambd).astype(
        self.dtype
    )


@lowers(aten.geometric_.default, random=True)
def geometric_(self, p, generator=None, *, key):
    p = _probability(p, self.dtype)
    return flat_draw(jax.random.geometric, key, self.shape, p=p).astype(self.dtype)


@lowers(aten.log_normal_.default, random=True)
def log_normal_(self, mean=1.0, std=2.0, generator=None, *, key):
    work = opmath_dtype(self.dtype)
    return jnp.exp(mean + std * flat_draw(jax.random.normal, key, self.shape, dtype=work)).astype(
        self.dtype
    )


@lowers(aten.cauchy_.default, random=True)
def cauchy_(self, median=0.0, sigma=1.0, generator=None, *, key):
    work = opmath_dtype(self.dtype)
    return (median + sigma * flat_draw(jax.random.cauchy, key, self.shape, dtype=work)).astype(
        self.dtype
    )


def _random_bound(dtype) -> int:
    """torch's random_() without bounds: [0, 2**digits] for floats, the type's max for ints."""
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** jnp.finfo(dtype).nmant + 1
    if dtype == jnp.bool_:
        return 2
    return int(jnp.iinfo(dtype).max) + 1


def _randint(key, shape, low, high, dtype):
    draws = flat_draw(jax.random.randint, key, shape, minval=low, maxval=high, dtype=jnp.int64)
    return draws.astype(dtype)


@lowers(aten.random_.default, random=True)
def random_(self, generator=None, *, key):
    return _randint(key, self.shape, 0, _random_bound(self.dtype), self.dtype)


def _check_bounds_as_cpu(dtype, from_, to):
    """torch's checks of random_'s bounds (``from < to``, both within the dtype; its
    meta kernel makes none), raised by its CPU kernel on an empty tensor: torch's
    words, and its names of dtypes ("unsigned char")."""
    torch.empty(0, dtype=dtypes.to_torch(dtype)).random_(from_, to)


@lowers(aten.random_.to, random=True, static=("to",))
def random_to(self, to, generator=None, *, key):
    _check_bounds_as_cpu(self.dtype, 0, to)
    return _randint(key, self.shape, 0, to, self.dtype)


@lowers(getattr(aten.random_, "from"), random=True, static=("from", "to"))
def random_from(self, from_, to=None, generator=None, *, key):
    _check_bounds_as_cpu(self.dtype, from_, to)
    high = _random_bound(self.dtype) if to is None else to
    return _randint(key, self.shape, from_, high, self.dtype)


@lowers(aten.randperm.default, random=True)
def randperm(n, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.permutation(key, n).astype(jnp.int64)


@lowers(aten.randperm.generator, random=True)
def randperm_generator(
    n, generator=None, dtype=None, layout=None, device=None, pin_memory=None, *, key
):
    return randperm(n, key=key)


@lowers(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, *, key):
    if train is False or p == 0:  # train=None means training, as in torch
        return input, jnp.ones(input.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, jnp.bool_)
    keep = flat_draw(jax.random.bernoulli, key, input.shape, p=_probability(1.0 - p, input.dtype))
    scale = jnp.asarray(1.0 / (1.0 - p), input.dtype)
    return jnp.where(keep, input * scale, jnp.zeros((), input.dtype)), keep


@lowers(
    aten.native_dropout_backward.default, promote="default", promote_args=("grad_output", "scale")
)
def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask.astype(grad_output.dtype) * jnp.asarray(scale, grad_output.dtype)


def _check_multinomial(self, num_samples, replacement):
    """torch's checks of multinomial's arguments, and of the probabilities' values."""
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError(
            f"multinomial only supports floating-point dtypes for input, got: {self.dtype}"
        )
    if self.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    categories = self.shape[-1]
    if categories > 2**24:
        raise RuntimeError("number of categories cannot exceed 2^24")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > categories:
        raise RuntimeError(
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement"
        )
    error_if(
        jnp.any(~jnp.isfinite(self) | (self < 0)),
        RuntimeError,
        "probability tensor contains either `inf`, `nan` or element < 0",
    )
    error_if(
        jnp.any(jnp.sum(self, axis=-1) <= 0),
        RuntimeError,
        "invalid multinomial distribution (sum of probabilities <= 0)",
    )


@lowers(aten.multinomial.default, random=True)
def multinomial(self, num_samples, replacement=False, generator=None, *, key):
    _check_multinomial(self, num_samples, replacement)
    # In the input's compute dtype (float32 for the 16-bit floats): no float64
    # intermediates, which a TPU would have to run on the host (runtime/policy.py).
    work = opmath_dtype(self.dtype)
    logits = jnp.log(self.astype(work))
    if replacement:
        shape = (num_samples,) + self.shape[:-1]
        draws = jax.random.categorical(key, logits, axis=-1, shape=shape)
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    # Without replacement: Gumbel top-k.
    gumbel = flat_draw(jax.random.gumbel, key, self.shape, dtype=work)
    _, idx = jax.lax.top_k(logits + gumbel, num_samples)
    return idx.astype(jnp.int64)
