"""Discrete Fourier transforms (_fft_c2c, _fft_r2c, _fft_c2r).

torch's transforms reach these three ops with the signal dims and an explicit scaling:
``normalization`` is 0 (none), 1 (1/sqrt(n)) or 2 (1/n), n the signal size, whatever the
direction. jnp.fft's ``norm`` names which direction carries the 1/n instead, so the
pair (direction, scaling) maps onto it.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.registry import aten, lowers

_NO_SCALING, _BY_ROOT_N, _BY_N = 0, 1, 2


def _jnp_norm(normalization: int, forward: bool) -> str:
    if normalization == _BY_ROOT_N:
        return "ortho"
    unscaled, scaled = ("backward", "forward") if forward else ("forward", "backward")
    return scaled if normalization == _BY_N else unscaled


@lowers(aten._fft_c2c.default)
def _fft_c2c(self, dim, normalization, forward):
    if not dim:
        return self
    transform = jnp.fft.fftn if forward else jnp.fft.ifftn
    return transform(self, axes=tuple(dim), norm=_jnp_norm(normalization, forward))


@lowers(aten._fft_r2c.default)
def _fft_r2c(self, dim, normalization, onesided):
    norm = _jnp_norm(normalization, forward=True)
    if onesided:
        # The last of ``dim`` is halved, as jnp.fft.rfftn halves its last axis.
        return jnp.fft.rfftn(self, axes=tuple(dim), norm=norm)
    return jnp.fft.fftn(self, axes=tuple(dim), norm=norm)


@lowers(aten._fft_c2r.default)
def _fft_c2r(self, dim, normalization, last_dim_size):
    sizes = [self.shape[d] for d in dim[:-1]] + [last_dim_size]
    norm = _jnp_norm(normalization, forward=False)
    return jnp.fft.irfftn(self, s=sizes, axes=tuple(dim), norm=norm)
