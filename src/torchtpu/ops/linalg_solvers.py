"""Matrix decompositions and solvers (cholesky, lu, qr, svd, eigh, inverse, det, ...)."""

from __future__ import annotations
