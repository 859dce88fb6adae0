"""Special functions (Bessel, orthogonal polynomials, incomplete gamma, zeta, ...)."""

from __future__ import annotations
