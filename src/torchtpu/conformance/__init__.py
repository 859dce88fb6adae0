"""Conformance against PyTorch's OpInfo database (``torch.testing._internal``).

``harness`` runs OpInfo samples on the CPU and on tpu and compares them;
``expectations`` is the one table of known failures and tolerance overrides;
``python -m torchtpu.conformance --out docs/conformance.md`` writes the report.
Needs the test extra (``expecttest``).
"""
