"""Ops of their own kind: distances, histograms, searchsorted, segment and index reductions, ..."""

from __future__ import annotations
