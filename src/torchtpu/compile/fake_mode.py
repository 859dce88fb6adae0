"""How torch's fake tensors (which torch.compile traces on) treat the tpu device.

Two things differ from torch's defaults, both so that tracing never runs tpu code:

- Note [Tracing never makes a real tpu tensor]: ``FakeTensorMode.avoid_device_init``
  is what torch uses for a device it must not touch (CUDA on a machine without a
  GPU). Without it a fake mode runs ``.to("tpu")`` of a small constant CPU tensor for
  real, to keep a constant, and ``torch.tensor(data, device="tpu")`` makes a real tpu
  tensor before lifting it; either way a real TPUTensor, a tensor subclass, reaches a
  fake mode, which cannot make a constant of it ("fake_tensor must be a FakeTensor
  with a constant", a hard error: Transformers' sliding-window and dynamic caches do
  both inside ``forward``). With it, ``torch.tensor`` makes a CPU tensor and moves it
  as a traced ``_to_copy``, and ``.to("tpu")`` of a constant is traced too. The
  property is torch's, per fake mode, not per device: with torchtpu loaded, CUDA
  tensors in a fake mode are treated the same way (traced, not run), which changes
  no result.
- Fake kernels for ops whose torch meta kernel carries a CUDA-only restriction (the
  lowering is registered with ``meta="skip"``, ops/registry.py): eager tpu runs the op
  but tracing it would fail, so it gets a fake kernel here, for tpu tensors only
  (torch's FakeTensorMode tries these before the meta kernel; ``NotImplemented``
  passes the op on to it).
"""

from __future__ import annotations

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

aten = torch.ops.aten

# Note [Tracing never makes a real tpu tensor]
FakeTensorMode.avoid_device_init = property(lambda self: True)


def _on_tpu(*tensors) -> bool:
    return all(t is None or t.device.type == "tpu" for t in tensors)


@fake_impls.register_op_impl(lambda func: func is aten._grouped_mm.default)
def _grouped_mm(fake_mode, func, self, mat2, offs=None, bias=None, out_dtype=None):
    """Sizes as the lowering (ops/linalg.py ``_grouped_mm``) makes them, for every
    dtype: torch's meta kernel takes only bfloat16 (and 16-byte aligned strides)."""
    if not _on_tpu(self, mat2, offs, bias):
        return NotImplemented
    if self.dim() == 2 and mat2.dim() == 3:  # (M, K) x (G, K, N): rows grouped
        shape = (self.shape[0], mat2.shape[-1])
    elif self.dim() == 2:  # (M, K) x (K, N): one product per group of K
        shape = (offs.shape[0], self.shape[0], mat2.shape[-1])
    elif mat2.dim() == 2:  # (G, M, K) x (K, N): columns grouped
        shape = (self.shape[1], mat2.shape[-1])
    else:  # (G, M, K) x (G, K, N): a batched product
        shape = (self.shape[0], self.shape[1], mat2.shape[-1])
    with in_kernel_invocation_manager(fake_mode):
        out = torch.empty(shape, dtype=out_dtype or self.dtype, device="meta")
    return FakeTensor(fake_mode, out, self.device)
