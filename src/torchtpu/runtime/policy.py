"""The platform policy: what each XLA platform is given to compile, decided in one place.

XLA's backends do not all accept the same programs. XLA:CPU runs everything torchtpu
lowers; XLA:TPU has no 64-bit floating-point hardware and rewrites 64-bit types into
pairs of 32-bit ones, which changes what float64 means and leaves gaps that end in a
Python error or, worse, a process abort. This module says, for the platform behind the
``tpu`` device, which dtypes a tensor's storage keeps on the host and which programs
must not reach the device's compiler; the dispatcher runs those on the host CPU, through
the same lowerings compiled by XLA:CPU (Note [64-bit types on TPU]).

Note [64-bit types on TPU]
    Measured on a TPU v5e (JAX 0.10.2, libtpu 0.0.42; docs/tpu.md has the figures):

    - float64 is a pair of float32s: about 49 bits of mantissa for arithmetic (1e-14
      relative error; 1e-10 for log, sin, tanh) but float32's exponent range: 1e300
      becomes inf and 1e-300 zero, even on the way onto the chip. A sort of float64 gave
      a wrong order; FFT and LU are UNIMPLEMENTED; floor division fails to compile; a
      cumulative sum took 131 s to compile.
    - complex128 is worse: XLA:TPU's 64-bit rewriter CHECK-fails -- kills the process --
      on conversions into complex128 (from int64, float64, bool) and on complex128
      ``abs``, division, ``diag`` and more. So does a singular value decomposition that
      computes singular vectors, in any dtype (found by compiling for a v5e without one:
      conformance/xla_tpu.py; docs/tpu-sweep.md).
    - int64 is exact (pairs of 32-bit words: values beyond 2**31 and 2**53 right),
      about 2.6x the time of int32 for elementwise work and the same for indexing and
      cross-entropy targets; but a matmul or convolution of 64-bit integers is
      UNIMPLEMENTED.

    So on a TPU: float64 and complex128 tensors keep their storage on the host (an
    XLA:CPU array; the tensor still says ``tpu``), and every op that reads or writes
    one, or whose program breaks a rule of `POLICIES` (float64 intermediates, a
    complex128 number, an int64 matmul, an SVD with vectors), runs on the host CPU --
    correct, counted, and warned about once per rule (``TPUHostComputeWarning``). int64
    stays on the chip. A compiled program (``torch.compile``, ``torchtpu.jit``) is one
    XLA:TPU program and cannot step out to the host: one that breaks a rule is refused
    with the rule's reason, before XLA sees it. Nothing is narrowed silently.

The policy applies when the ``tpu`` device is a TPU, or everywhere with
``TORCHTPU_PLATFORM_POLICY=tpu`` (tests and the compile check run it on the CPU backend:
the host is then the CPU backend's last device).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from torchtpu import config


class Rule(NamedTuple):
    """A kind of program a platform's compiler must not be given, and why."""

    name: str
    reason: str
    instead: str  # what runs on the device instead


COMPLEX128 = Rule(
    "complex128",
    "XLA:TPU has no complex128: its 64-bit rewriter aborts the process on conversions "
    "into complex128 and on several complex128 ops",
    "complex64",
)
FLOAT64 = Rule(
    "float64",
    "XLA:TPU computes float64 as pairs of float32 with float32's exponent range (1e300 "
    "becomes inf), sorts it wrongly and has no float64 FFT or LU",
    "float32",
)
FLOAT64_INSIDE = Rule(
    "float64 intermediates",
    "the op's lowering computes in float64 for accuracy, and XLA:TPU computes float64 as "
    "pairs of float32 with float32's exponent range",
    "",
)
INT64_MATMUL = Rule(
    "int64 matmul",
    "XLA:TPU does not implement matrix products or convolutions of 64-bit integers",
    "int32 or float32",
)
SVD = Rule(
    "svd",
    "XLA:TPU's compiler aborts the process on a singular value decomposition that "
    "computes singular vectors (torch.linalg.svd, pinv, lstsq)",
    "",
)
EIG = Rule(
    "eig",
    "JAX has a general (non-symmetric) eigendecomposition only on the CPU",
    "torch.linalg.eigh (for a symmetric matrix)",
)


class Policy(NamedTuple):
    """A platform's policy: the dtypes the host keeps, the rules of its programs, the
    ops run outside a program (data-dependent shapes: no program to check) that break a
    rule anyway, by name, and the JAX PRNG implementation random ops draw from (None:
    JAX's default, threefry)."""

    host_dtypes: frozenset
    rules: tuple
    host_ops: dict = {}
    prng_impl: str | None = None
    flash_attention: bool = False  # JAX's Pallas flash kernels run here (ops/flash_attention.py)
    cudnn_attention: bool = False  # cuDNN's through JAX (ops/cudnn_attention.py)


# Note [Random bits on TPU]
#     JAX's default PRNG, threefry, is a hash unrolled into hundreds of integer ops;
#     XLA:TPU compiles it slowly (compiled for a v5e on the CPU: a (512K,) uniform and a
#     (32K,) normal took 18-20 s against 6-8 s with "rbg"), and every new shape of a
#     random op, a dropout mask or a weight init, is a new program. "rbg" draws the bits
#     with XLA's RngBitGenerator, which a TPU has in hardware, and derives keys with
#     threefry, so seeds, offsets and torch.manual_seed behave as on every platform; the
#     values differ from the CPU backend's, as CUDA's differ from the CPU's.


#: Each platform's policy, by JAX platform name; a platform not listed has none.
POLICIES = {
    "tpu": Policy(
        frozenset({torch.float64, torch.complex128}),
        (COMPLEX128, FLOAT64_INSIDE, INT64_MATMUL, SVD, EIG),
        {"aten.linalg_lstsq.default": SVD},
        prng_impl="rbg",
        flash_attention=True,
    ),
    "gpu": Policy(frozenset(), (EIG,), cudnn_attention=True),
}
_NONE = Policy(frozenset(), ())


@functools.cache
def _current() -> Policy:
    choice = config.platform_policy
    if choice == "auto":
        from torchtpu.runtime import platform

        choice = platform()
    elif choice not in (*POLICIES, "cpu", "none"):
        raise ValueError(
            f"TORCHTPU_PLATFORM_POLICY={choice!r}: expected 'auto', 'none' or one of "
            f"{sorted(POLICIES)}"
        )
    return POLICIES.get(choice, _NONE)


def active() -> bool:
    """Whether a policy applies (decided once, when first asked)."""
    return bool(_current().rules)


def prng_impl() -> str | None:
    """The JAX PRNG implementation random ops use here (Note [Random bits on TPU])."""
    return _current().prng_impl


def flash_attention() -> bool:
    """Whether scaled_dot_product_attention may run JAX's Pallas flash kernels here."""
    return _current().flash_attention


def cudnn_attention() -> bool:
    """Whether scaled_dot_product_attention may run cuDNN's fused kernel here."""
    return _current().cudnn_attention


def host_dtypes() -> frozenset:
    """The dtypes whose storage the host keeps: empty unless a policy says otherwise."""
    return _current().host_dtypes


@functools.cache
def host_device():
    """The JAX device host-kept storages and host-run programs live on: the CPU
    backend's last device (its only one, unless tests ask XLA:CPU for more)."""
    from torchtpu.runtime import jax

    try:
        return jax().local_devices(backend="cpu")[-1]
    except RuntimeError as exc:
        raise RuntimeError(
            "torchtpu: some ops run on the host CPU on this device (float64 and complex128 "
            "on a TPU: runtime/policy.py), but JAX's CPU backend is not available here; "
            "leave 'cpu' in JAX_PLATFORMS (e.g. JAX_PLATFORMS=tpu,cpu)"
        ) from exc


def rule_for_dtypes(kinds) -> Rule | None:
    """The rule a call touching tensors of ``kinds`` (torch dtypes) breaks: one for a
    dtype the host keeps, or None."""
    kept = host_dtypes()
    if torch.complex128 in kinds and torch.complex128 in kept:
        return COMPLEX128
    if torch.float64 in kinds and torch.float64 in kept:
        return FLOAT64
    return None


def rule_for_op(op) -> Rule | None:
    """The rule an op run outside a program breaks on this platform, or None."""
    return _current().host_ops.get(str(op))


def broken_rule(closed_jaxpr) -> Rule | None:
    """The first rule of the current policy the program breaks, or None. Sub-programs
    (``jit``, ``cond``, ``scan``, custom derivatives) count."""
    rules = _current().rules
    if not rules:
        return None
    return _scan(closed_jaxpr.jaxpr, rules)


def _scan(jaxpr, rules) -> Rule | None:
    for v in jaxpr.invars:
        if COMPLEX128 in rules and _dtype(v.aval) == "complex128":
            return COMPLEX128
    for eqn in jaxpr.eqns:
        for rule in rules:
            if _BREAKS[rule](eqn):
                return rule
        for sub in _subjaxprs(eqn.params):
            rule = _scan(sub, rules)
            if rule is not None:
                return rule
    return None


def _dtype(aval) -> str | None:
    dtype = getattr(aval, "dtype", None)
    return None if dtype is None else str(dtype)


def _avals(eqn):
    return [v.aval for v in (*eqn.invars, *eqn.outvars)]


def _has_complex128(eqn) -> bool:
    return any(_dtype(a) == "complex128" for a in _avals(eqn))


def _computes_in_float64(eqn) -> bool:
    # Python floats are float64 numbers (0-d), used in arithmetic on other numbers (a
    # check that ``from <= to``) or converted to the op's dtype: fine. Arrays of
    # float64 are not.
    return eqn.primitive.name != "convert_element_type" and any(
        _dtype(a) == "float64" and a.ndim for a in _avals(eqn)
    )


def _multiplies_int64(eqn) -> bool:
    return eqn.primitive.name in ("dot_general", "conv_general_dilated") and any(
        _dtype(v.aval) in ("int64", "uint64") for v in eqn.invars
    )


def _is_svd_with_vectors(eqn) -> bool:
    return eqn.primitive.name == "svd" and eqn.params.get("compute_uv", False)


def _is_eig(eqn) -> bool:
    return eqn.primitive.name == "eig"


_BREAKS = {
    COMPLEX128: _has_complex128,
    FLOAT64_INSIDE: _computes_in_float64,
    INT64_MATMUL: _multiplies_int64,
    SVD: _is_svd_with_vectors,
    EIG: _is_eig,
}


def _subjaxprs(params):
    from torchtpu import _compat

    return _compat.jaxprs_in_params(params)
