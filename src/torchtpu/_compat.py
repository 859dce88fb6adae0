"""What differs between the torch and JAX releases torchtpu supports, in one place.

Every branch on a release lives here, named after the release and the change that
needs it; the rest of the package asks this module instead of testing versions or
probing torch's internals with ``hasattr``. docs/installation.md lists the releases,
docs/compatibility.md what each passed.
"""

from __future__ import annotations

import torch

#: The torch releases torchtpu supports: from the first (inclusive) to the second
#: (exclusive), as (major, minor). pyproject.toml states the same range.
TORCH_RANGE = ((2, 11), (2, 16))

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def torch_at_least(major: int, minor: int) -> bool:
    return _TORCH >= (major, minor)


def check_torch() -> None:
    """Raise one clear error on a torch release outside `TORCH_RANGE` (called when the
    tpu device is first used, before any op is registered)."""
    if not TORCH_RANGE[0] <= _TORCH < TORCH_RANGE[1]:
        first, end = (".".join(map(str, v)) for v in TORCH_RANGE)
        raise RuntimeError(
            f"torchtpu supports torch {first} up to (not including) {end}; this is torch "
            f"{torch.__version__}. Install a supported release (pip install 'torch>={first},"
            f"<{end}'), or a torchtpu release made for this one."
        )


#: aten ops that only some supported releases have: the overload's name -> why. An op
#: listed here is lowered where the running torch has it and simply not elsewhere, as
#: torch itself has it or not.
VARYING_OPS = {
    # torch 2.14 removed the deprecated torch.cholesky and its aten op
    # (torch.linalg.cholesky, aten.linalg_cholesky_ex, replaces it).
    "cholesky.default": "removed in torch 2.14",
}


def aten(name: str):
    """The aten op overload ``name`` (``"cholesky.default"``), or None where this torch
    lacks it. Only ops listed in `VARYING_OPS` may be absent."""
    if name not in VARYING_OPS:
        raise KeyError(f"{name} is not listed in torchtpu._compat.VARYING_OPS")
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    return None if packet is None else getattr(packet, overload or "default", None)


# -- JAX -------------------------------------------------------------------------------
# JAX's internals torchtpu reads, each behind one function here (checked: JAX 0.10.x;
# pyproject.toml pins that range). Nothing here imports JAX at module level: ``import
# torch`` loads torchtpu, and JAX starts only when a tpu tensor needs it.


def jax_backends_started() -> bool:
    """Whether JAX has initialised its backends (jax._src.xla_bridge, JAX 0.4 to 0.10)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def jaxprs_in_params(params):
    """The sub-jaxprs an equation's parameters hold (jax._src.core, JAX 0.4.36 to 0.10)."""
    from jax._src import core

    return core.jaxprs_in_params(params)
