"""How a TPUTensor looks to torch.compile: a traceable wrapper subclass of a handle.

Dynamo treats a tensor subclass as a tensor (instead of graph-breaking on every op)
only if its ``__torch_dispatch__`` is torch's own or it is a *traceable wrapper
subclass*: one that ``__tensor_flatten__``s into inner tensors and is rebuilt from them
by ``__tensor_unflatten__``. So a TPUTensor flattens into one inner tensor, its
**handle**: a plain, storage-less torch tensor on the tpu device
(``torch._C._acc.create_empty_tensor``) that carries the JAX array of the tensor's
current value in its ``_jax`` attribute.

- Dynamo and AOTAutograd fakify the handle like any device tensor and trace the
  model's ops on the fake. A TPUTensor rebuilt around a fake (or functional) inner
  tensor is a **traced wrapper**: its ops run `dispatch_traced` — on the inner tensor,
  rewrapped — so the graph AOTAutograd hands the backend is plain aten ops on handles.
- At run time AOTAutograd flattens each TPUTensor argument into a fresh handle, calls
  the compiled function (compile/backend.py), which reads the ``_jax`` arrays and
  returns handles of its results, and unflattens those into new TPUTensors.

Note [Why handles, not the subclass itself]
    Dynamo must see something it can fakify: a wrapper subclass whose dispatch runs
    JAX code is opaque to it. A handle is a real tpu tensor with no storage, so every
    torch mechanism (fake tensors, functionalization, autograd's saved tensors) works
    on it unchanged, and the JAX array rides along as an attribute.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map_only

from torchtpu import tensor as tensor_module
from torchtpu.compile import fake_mode  # noqa: F401 - how fake tensors treat tpu
from torchtpu.dispatch import schema
from torchtpu.tensor import TPUTensor

# Ops whose result is the argument itself under another name: same sizes, same strides.
_SAME_TENSOR = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def make_handle(array, dtype: torch.dtype) -> torch.Tensor:
    """A storage-less tpu tensor of ``array``'s shape carrying ``array``."""
    handle = torch._C._acc.create_empty_tensor(tuple(array.shape), dtype)
    handle._jax = array
    return handle


def is_handle(t) -> bool:
    return type(t) is torch.Tensor and hasattr(t, "_jax")


def array_of(handle: torch.Tensor):
    return handle._jax


def handle_of(t: TPUTensor) -> torch.Tensor:
    """The inner tensor of ``t`` for torch.compile: its traced inner tensor if it is a
    traced wrapper, else a handle of its current value.

    The handle is cached on ``t`` while it reads the same array through the same view
    (``t.data = ...`` may change the view): Dynamo's
    guards read ``x._handle`` for each argument and tell distinct tensors apart by
    ``id()``, which a fresh, immediately freed handle would reuse. A write to the
    storage drops the cache (`Storage.set`), so the old array is not kept alive by it.
    """
    if t._inner is not None:
        return t._inner
    cached = t.__dict__.get("_handle_cache")
    if cached is not None and cached[0] is t._storage.array and cached[1] is t._meta:
        return cached[2]
    from torchtpu.dispatch import defer, modes
    from torchtpu.dispatch.values import materialize, queued_value

    if modes.is_deferring():
        # The value, perhaps Pending: the graph's call joins the queue that computes it
        # (Note [Compiled graphs in DeferAndFuse chunks] in program.py).
        handle = make_handle(queued_value(t), t.dtype)
    else:
        if defer.pending_count():
            defer.flush("compiled call")  # queued eager ops run before the compiled ones
        handle = make_handle(materialize(t), t.dtype)
    s = t._storage
    t._handle_cache = (s.array, t._meta, handle)
    holders = s.handle_holders
    if holders is None:
        holders = s.handle_holders = []
    elif len(holders) >= 8:  # fresh views of a storage never written: forget the dead
        holders[:] = [ref for ref in holders if ref() is not None]
    holders.append(weakref.ref(t))  # the cache is dropped when s is written
    return handle


def unflatten(inner: torch.Tensor, size, stride) -> TPUTensor:
    """A TPUTensor around ``inner``: a real one for a handle, else a traced wrapper."""
    size, stride = tuple(size), tuple(stride)
    if is_handle(inner):
        from torchtpu.storage import Storage

        s = Storage(inner._jax, size, stride, inner.dtype, 0)
        return TPUTensor(s, (), size, stride, 0, inner.dtype)
    return wrap_traced(inner, size, stride)


def wrap_traced(inner: torch.Tensor, size=None, stride=None) -> TPUTensor:
    tensor_module._tracing_seen = True  # from now on, ops look for traced wrappers
    t = torch.Tensor._make_wrapper_subclass(
        TPUTensor,
        inner.shape if size is None else size,
        strides=inner.stride() if stride is None else stride,
        storage_offset=inner.storage_offset(),
        dtype=inner.dtype,
        device=inner.device,
        requires_grad=inner.requires_grad,
    )
    t._inner = inner
    return t


def dispatch_traced(func, args, kwargs):
    """An op on traced wrappers: run on their inner tensors, wrap the results."""

    def inner(t: TPUTensor):
        if t._inner is None:
            raise RuntimeError(
                f"{func}: a tpu tensor that torch.compile did not trace as an input was "
                "used in a compiled region; pass it as an argument or make it a module "
                "parameter or buffer"
            )
        return t._inner

    inner_args, inner_kwargs = tree_map_only(TPUTensor, inner, (args, kwargs))
    out = func(*inner_args, **inner_kwargs)
    written = schema.info(func).returned_written(args, kwargs)
    if written is not None:
        return written  # an in-place or out= op returns the tensors it wrote
    if func in _SAME_TENSOR:
        # Note [A traced wrapper keeps its strides]
        #     A handle is made contiguous (`make_handle`), so a wrapper's strides are its
        #     own, not its inner tensor's. Fakifying a non-leaf tensor that requires grad
        #     detaches the fake wrapper (meta_utils' `_backward_error`) and then checks
        #     that its strides survived; from the inner tensor they would not, for any
        #     non-view, non-contiguous activation (a transposed head layout times a
        #     rotary embedding: Transformers' queries into flex_attention), and torch
        #     then fails with "Attempted to set the storage of a tensor on device tpu:0
        #     to a storage on different device meta".
        (self,) = args
        return wrap_traced(out, self.shape, self.stride())
    return tree_map_only(torch.Tensor, wrap_traced, out)


tensor_module.hooks.dispatch_traced = dispatch_traced
tensor_module.hooks.handle_of = handle_of
tensor_module.hooks.unflatten = unflatten
