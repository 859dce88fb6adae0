"""What torchtpu knowingly does not support, with the reason: one table.

A lowering (or the dispatcher) that meets such a case calls `refuse`, which raises
``NotImplementedError`` naming the op and the reason from this table. (Whole dtypes
torchtpu cannot hold -- complex32, quantized -- are refused by dtypes.py.)
"""

from __future__ import annotations

UNSUPPORTED: dict[str, str] = {
    "_embedding_bag_backward: sparse": (
        "sparse gradients are not supported on tpu (use sparse=False: a dense gradient)"
    ),
    "_embedding_bag_backward: scale_grad_by_freq": (
        "scale_grad_by_freq=True is not supported on tpu: torch's CPU kernel does not "
        "divide each row by its own index's frequency (indices [0, 0, 1] halve row 1's "
        "gradient), and rather than differ from it torchtpu refuses"
    ),
    "_upsample_bilinear2d_aa: integer input": (
        "integer inputs are not supported on tpu: torch's uint8 kernel rounds "
        "fixed-point weights, which is not reproduced"
    ),
    "_grouped_mm: bias": "a bias is not supported on tpu (add it after the product)",
    "sparse layouts": (
        "sparse layouts ({layout}) are not supported on tpu: tpu tensors are strided. "
        "nn.Embedding(sparse=True) and F.embedding(..., sparse=True) make sparse "
        "gradients: use sparse=False (a dense gradient)"
    ),
    "nested tensors": (
        "nested tensors are not supported on tpu (XLA wants static shapes): pad the "
        "batch and pass a padding mask instead. nn.TransformerEncoder makes them only "
        "with mask_check=False; leave it True, or build it with enable_nested_tensor=False"
    ),
    "as_strided: dtype view": (
        "a tensor viewed as another dtype is not supported on tpu (take as_strided of "
        "the original tensor, then view it)"
    ),
}


def refuse(case: str, detail: str = "", *, op=None, **fields) -> None:
    """Raise NotImplementedError for ``case``, a key of `UNSUPPORTED` (``op: reason``
    keys name their op; others are given ``op``), its reason formatted with ``fields``."""
    if op is None:
        op = case.split(":", 1)[0]
    raise NotImplementedError(f"{op}: {UNSUPPORTED[case].format(**fields)}{detail}")
