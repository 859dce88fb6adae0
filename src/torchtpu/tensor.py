"""TPUTensor: a torch tensor on the "tpu" device whose data is a JAX array.

A TPUTensor is a wrapper subclass: torch sees its metadata (shape, strides, dtype,
device) and routes every aten op to ``__torch_dispatch__``; the data lives in a
`Storage` (a mutable cell holding a JAX array) reached through a view chain
(see storage.py). Metadata never forces a computation.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import weakref

import torch
from torch._tensor_str import (
    PRINT_OPTS,
    _add_suffixes,
    _Formatter,
    _tensor_str,
    _tensor_str_with_formatter,
    get_summarized_data,
)
from torch.utils._pytree import tree_leaves, tree_map_only

from torchtpu import dtypes
from torchtpu.storage import Storage, ViewChain


class _Hooks:
    """What the layers above this module supply: the dispatcher (dispatch/core.py) and
    torch.compile's handles (compile/handles.py). Each installs its functions here when
    it is imported; the device module imports both before it makes the first tpu
    tensor (device.py ``load_runtime``). So this module, at the bottom of the package,
    imports neither (they import it), and ``import torch`` does not import JAX."""

    dispatch = None  # (func, args, kwargs) -> what the aten op returns
    dispatch_traced = None  # the same, for ops on traced wrappers under torch.compile
    handle_of = None  # TPUTensor -> its inner tensor for torch.compile
    unflatten = None  # (inner tensor, size, stride) -> TPUTensor
    dlpack_capsule = None  # (TPUTensor, kwargs) -> a DLPack capsule (interop/arrays.py)
    dlpack_device = None  # TPUTensor -> its DLPack device


hooks = _Hooks()

# torch.device objects, one per index, built once.
_DEVICES: dict[int, torch.device] = {}


def tpu_device(index: int) -> torch.device:
    dev = _DEVICES.get(index)
    if dev is None:
        dev = _DEVICES[index] = torch.device("tpu", index)
    return dev


class TPUTensor(torch.Tensor):
    """A tensor on the tpu device. Create one with ``torch.*(..., device="tpu")``,
    ``t.to("tpu")`` or ``torchtpu.to_tpu(t)``; never directly."""

    _storage: Storage
    _chain: ViewChain
    # (shape, strides, storage_offset, dtype, chain): what a compiled op needs to know
    # about this argument besides its base array. Hashable; part of cache keys.
    _meta: tuple
    # A traced wrapper's fake or functional inner tensor while torch.compile traces
    # (handles.py); None for every tensor that holds data.
    _inner: torch.Tensor | None = None

    @staticmethod
    def __new__(
        cls,
        storage: Storage,
        chain: ViewChain,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: torch.dtype,
        requires_grad: bool = False,
    ):
        if dtype not in dtypes.SUPPORTED:
            dtypes.check_supported(dtype)
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            storage_offset=offset,
            dtype=dtype,
            device=tpu_device(storage.device_index),
            requires_grad=requires_grad,
        )
        t._storage = storage
        t._chain = chain
        t._meta = (shape, strides, offset, dtype, chain)
        if storage.device_index and torch._C._is_multithreading_enabled():
            backward_on_calling_thread()
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if _tracing_seen and _any_traced(args, kwargs):
            return hooks.dispatch_traced(func, args, kwargs or {})
        if len(types) > 1 and not all(issubclass(t, TPUTensor) for t in types):
            return _with_foreign_tensors(func, types, args, kwargs or {})
        return hooks.dispatch(func, args, kwargs or {})

    # Note [Subclasses of tpu tensors]
    #     ``t.as_subclass(cls)`` gives the same C++ tensor a second Python object of type
    #     ``cls``; a tpu tensor's C++ tensor has its Python object already (this one),
    #     so torch refuses. Here the result is a new alias of the tensor, of a class
    #     deriving from both ``cls`` and TPUTensor (made once per ``cls``), whose
    #     ``__torch_function__`` is ``cls``'s: torchvision's tv_tensors (Image,
    #     BoundingBoxes, Mask), and any subclass that wraps its results, work on tpu as
    #     they do on the CPU. ``as_subclass(torch.Tensor)`` unwraps to a plain tpu tensor.
    def as_subclass(self, cls):
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise TypeError(f"as_subclass(): expected a Tensor subclass, got {cls!r}")
        alias = torch.ops.aten.alias.default(self)
        alias.__class__ = TPUTensor if issubclass(TPUTensor, cls) else _tpu_subclass(cls)
        return alias

    # -- torch.compile: a traceable wrapper subclass of one handle (handles.py) ----------

    def __tensor_flatten__(self):
        return ["_handle"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return hooks.unflatten(inner_tensors["_handle"], outer_size, outer_stride)

    @property
    def _handle(self):
        return hooks.handle_of(self)

    # ``t.data = new`` swaps torch's metadata in C++; the data must follow. (nn.Module
    # conversions such as ``model.half()`` assign ``param.data`` this way.)
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, TPUTensor):
            self._storage, self._chain, self._meta = new._storage, new._chain, new._meta

    # -- DLPack: the protocol of the tensor's jax array (interop/arrays.py) ------------

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        kwargs = {"stream": stream, "max_version": max_version, "dl_device": dl_device}
        return hooks.dlpack_capsule(self, {**kwargs, "copy": copy})

    def __dlpack_device__(self):
        return hooks.dlpack_device(self)

    # -- reading values ---------------------------------------------------------------

    def numpy(self, *, force: bool = False):
        if not force and self.requires_grad:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        return self.detach().cpu().numpy()

    def tolist(self):
        return self.detach().cpu().tolist()

    def __array__(self, dtype=None, copy=None):
        # As torch's own: refuses a tensor that requires grad, like a CPU one. The array
        # is a fresh host copy, so ``copy`` asks nothing more of it.
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __format__(self, format_spec: str) -> str:
        # torch formats a 0-d tensor as its number (``f"{loss:.4f}"``) only when its type
        # is exactly Tensor; a tpu tensor must do the same (torch's printer relies on it).
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None) -> str:
        if self._inner is not None:  # traced by torch.compile: it has no values
            return f"TPUTensor(traced={self._inner!r})"
        return _repr(self)

    # -- copying and pickling -----------------------------------------------------------

    # The attributes that say where the data is; everything else in __dict__ is copied as is.
    _DATA_FIELDS = frozenset(("_storage", "_chain", "_meta", "_handle_cache", "_addressed"))

    # -- addresses (Note [Storage addresses] in storage.py) -------------------------------

    def _take_storage_address(self) -> None:
        if self._inner is not None:  # a traced wrapper (torch.compile) has no Storage
            return
        storage = self._storage
        if self.__dict__.get("_addressed") is storage:
            return
        # Setting the TensorImpl's storage is generic TensorImpl code (the CPU kernel's);
        # the sizes, strides and offset stay as they are.
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYS,
            self,
            storage.torch_storage(),
            self.storage_offset(),
            self.shape,
            self.stride(),
        )
        self._addressed = storage

    def data_ptr(self) -> int:
        self._take_storage_address()
        return super().data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        if self._inner is not None:  # a traced wrapper (torch.compile) has no Storage
            from torch.fx.experimental.symbolic_shapes import guard_or_false

            storage = super().untyped_storage()
            # (a size read from values inside the graph is unknown: not known empty)
            if guard_or_false(storage.nbytes() == 0):
                # Fakifying an empty tensor resizes its storage to 0 bytes, which a tpu
                # storage cannot do (that needs C++ PrivateUse1 hooks); a meta one can.
                storage = self.__dict__.setdefault(
                    "_empty_storage", torch.UntypedStorage(0, device="meta")
                )
            return storage
        self._take_storage_address()
        return super().untyped_storage()

    def __deepcopy__(self, memo):
        # torch's default would copy a wrapper subclass through its (empty, fake) storage
        # whenever data_ptr() is nonzero, as it is for a view with an offset (``x[1:]``):
        # a segfault. Copying a Storage cell is cheap instead: the new cell holds the same
        # JAX array, which is immutable (a later write to either tensor rebinds only its
        # own cell). ``memo`` maps each Storage to its copy, so tensors that alias in the
        # original alias in the copy, as in torch's deepcopy of CPU tensors.
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user "
                "(graph leaves) support the deepcopy protocol at the moment.  "
                "If you were attempting to deepcopy a module, this may be because "
                "of a torch.nn.utils.weight_norm usage, "
                "see https://github.com/pytorch/pytorch/pull/103001"
            )
        old = self._storage
        storage = memo.get(id(old))
        if storage is None:
            storage = memo[id(old)] = Storage(
                old.array, old.shape, old.strides, old.dtype, old.device_index
            )
        new = TPUTensor(storage, self._chain, *self._meta[:4])
        if getattr(self, "_is_param", False):
            # As nn.Parameter.__deepcopy__: a Parameter of the copied data, no grad.
            new = torch.nn.Parameter(new, self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
            if self.grad is not None:
                new.grad = copy.deepcopy(self.grad, memo)
            for name, value in self.__dict__.items():
                if name not in self._DATA_FIELDS:
                    setattr(new, name, copy.deepcopy(value, memo))
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        # Saved as torch saves a CPU tensor, on an image of the whole storage (Note
        # [Saving views]) whose location is this device: plain torch loads it with
        # map_location="cpu" (Note [Saving tpu tensors] in serialization.py).
        from torchtpu.serialization import reduce_tpu_tensor

        rebuilt = reduce_tpu_tensor(_saved_values(self), str(self.device), self.requires_grad)
        if getattr(self, "_is_param", False):
            return (torch._utils._rebuild_parameter, (_Reduced(rebuilt), self.requires_grad, {}))
        return rebuilt


_torch_to_dlpack = torch._C._to_dlpack


def to_dlpack(tensor: torch.Tensor):
    """``torch.utils.dlpack.to_dlpack`` (the legacy capsule), which device.py installs in
    its place: for a tpu tensor, the capsule of its jax array (``tensor.__dlpack__()``);
    torch's C++ version would export the wrapper's empty storage, a null pointer."""
    if isinstance(tensor, TPUTensor):
        return tensor.__dlpack__()
    return _torch_to_dlpack(tensor)


# Note [Converting a module's tpu parameters]
#     torch converts a module's parameters in place (``model.to(...)``, ``.half()``,
#     ``.to(memory_format=torch.channels_last)``) with ``param.data = new`` where the new
#     tensor's TensorImpl type matches the old one's (CPU -> CPU, CUDA -> CUDA), and
#     with ``torch.utils.swap_tensors`` for traceable wrapper subclasses, which TPUTensor
#     is for torch.compile. Swapping TensorImpls refuses a parameter that a live autograd
#     graph has saved (a forward's output still held: "Couldn't swap Conv2d.weight") and
#     otherwise poisons the parameter's AccumulateGrad for that graph, where the CPU
#     converts and back-propagates. So between two tpu tensors, swap_tensors exchanges
#     their data as ``.data =`` does (the `TPUTensor.data` setter): each object keeps its
#     TensorImpl, autograd state, hooks and attributes, as a CPU parameter does. From
#     the CPU (``model.to("tpu")``) torch's swap remains: a CPU TensorImpl cannot take a
#     tpu tensor's data, so the Parameter objects are kept that way.

_torch_swap_tensors = torch.utils.swap_tensors


def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors``, which device.py installs in its place: between two
    tpu tensors, an exchange of their data (Note [Converting a module's tpu parameters])."""
    if (
        type(t1) is TPUTensor
        and type(t2) is TPUTensor
        and t1._inner is None
        and t2._inner is None
        and torch._has_compatible_shallow_copy_type(t1, t2)
    ):
        data = t1.data
        t1.data = t2.data
        t2.data = data
        return
    _torch_swap_tensors(t1, t2)


# Note [Saving views]
#     torch.save keeps tensors that share a storage sharing it in the file (a CPU
#     tensor pickles as its storage, saved once, and its offset, size and strides), and
#     torch.load rebuilds them as views of one storage. A tpu tensor pickles as a CPU
#     tensor on a host *image* of its whole storage, made once per storage and write
#     (held weakly: only while the save runs), so its views share that image in the
#     file; serialization.py maps the loaded image back to one tpu storage (Note
#     [Saving tpu tensors] there).
_host_images: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saved_values(t: TPUTensor) -> torch.Tensor:
    """``t``'s values as a view of the CPU image of its storage (Note [Saving views])."""
    storage = t._storage
    entry = _host_images.get(storage)
    image = entry[1]() if entry is not None and entry[0] == storage.version else None
    if image is None:
        covers = (
            t.storage_offset() == 0
            and t.shape == storage.shape
            and t.is_contiguous()
            and storage.strides == tuple(t.stride())
        )
        if covers:
            image = t.detach().cpu().reshape(-1)
        else:
            # A storage is dense (Note [Storage strides]): its memory is its numel.
            extent = math.prod(storage.shape)
            base = TPUTensor(storage, (), storage.shape, storage.strides, 0, storage.dtype)
            image = base.detach().as_strided((extent,), (1,), 0).cpu()
        # The image's storage, not the tensor: torch.save holds the storages it wrote
        # until it ends, not the tensors on them.
        image = image.untyped_storage()
        _host_images[storage] = (storage.version, weakref.ref(image))
    return torch.empty(0, dtype=t.dtype).set_(image, t.storage_offset(), t.shape, t.stride())


def backward_on_calling_thread() -> None:
    """Run this thread's backward passes on the thread itself, not on autograd's
    device threads (``torch.autograd.set_multithreading_enabled(False)``).

    autograd's engine keeps one ready queue per index of a device type, as many as the
    device guard's ``deviceCount()`` says; torch 2.13's Python device guard
    (``torch._C._acc.DeviceGuard``) cannot override it and answers 1, so the gradient
    of a tpu:1 tensor would hit an internal assert (``device_ready_queues_``). With
    multithreading off the engine uses the calling thread's queue for every device.
    Turned off the first time a thread makes a tensor on tpu:1 or above (``backward()``
    itself makes its seed gradient ``ones_like`` on the calling thread, so that thread
    is covered), leaving programs on tpu:0 alone.
    """
    torch._C._set_multithreading_enabled(False)


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@functools.cache
def _tpu_subclass(cls: type) -> type:
    """``cls`` on tpu: Note [Subclasses of tpu tensors]."""
    if issubclass(cls, TPUTensor):
        return cls
    impl = inspect.getattr_static(cls, "__torch_function__")
    impl = impl.__func__ if isinstance(impl, classmethod) else impl

    # A function of its own: torch disables a __torch_dispatch__ subclass's
    # __torch_function__ when it is torch.Tensor's own (a plain subclass's). Called as
    # ``cls``'s, so that results are made ``cls`` -- on tpu through as_subclass above,
    # and on the CPU (``.cpu()``) as torch makes them.
    def __torch_function__(klass, func, types, args=(), kwargs=None):
        types = tuple(getattr(t, "_tpu_subclass_of", t) for t in types)
        return impl(cls, func, types, args, kwargs)

    namespace = {"__torch_function__": classmethod(__torch_function__), "_tpu_subclass_of": cls}
    return type(cls.__name__, (cls, TPUTensor), namespace)


# Whether a traced wrapper was ever made: until then no op needs to look for one.
_tracing_seen = False


def _any_traced(args, kwargs) -> bool:
    for a in args:
        if type(a) is TPUTensor:
            if a._inner is not None:
                return True
        elif type(a) in (list, tuple):
            if any(type(x) is TPUTensor and x._inner is not None for x in a):
                return True
    return bool(kwargs) and _any_traced(tuple(kwargs.values()), None)


# Note [Tpu tensors among fake tensors]
#     Tracing code that makes a tensor with a factory while its inputs are fake — as
#     FlexAttention's backward does when it traces score_mod's gradient with fake
#     tpu tensors, where the gradient of an index starts from ``torch.zeros(device=)``
#     — mixes a real tpu tensor into an op on fake ones. A fake tensor of a real one
#     needs only its metadata, so the tpu tensor joins as a fake of the same shape,
#     strides and dtype in the fake tensors' mode, and the op runs there. Other
#     subclasses get the usual answer: NotImplemented, their turn.
def _with_foreign_tensors(func, types, args, kwargs):
    from torch._subclasses.fake_tensor import FakeTensor

    fakes = [a for a in tree_leaves((args, kwargs)) if isinstance(a, FakeTensor)]
    if not fakes:
        return NotImplemented
    mode = fakes[0].fake_mode

    def as_fake(t: TPUTensor):
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(mode, meta, t.device)

    args, kwargs = tree_map_only(TPUTensor, as_fake, (args, kwargs))
    return func(*args, **kwargs)


def empty_tensor(shape, strides, dtype: torch.dtype, device: int) -> TPUTensor:
    """A new tensor on an uninitialised storage (reads as zeros; allocates nothing)."""
    shape, strides = tuple(shape), tuple(strides)
    return TPUTensor(Storage(None, shape, strides, dtype, device), (), shape, strides, 0, dtype)


class _Reduced:
    """Pickles as the object a reduce tuple rebuilds (for nesting in a Parameter)."""

    def __init__(self, reduce_tuple):
        self._reduce_tuple = reduce_tuple

    def __reduce__(self):
        return self._reduce_tuple


# Up to this size a summarised tensor is printed from one copy of all of it: that costs
# less than compiling the ops that gather its edges on the device (~0.1 s each).
_REPR_HOST_COPY_BYTES = 16 << 20


def _repr(t: TPUTensor) -> str:
    """PyTorch's text for the same tensor on the CPU, with ``device='tpu:i'`` added.

    Mirrors ``torch._tensor_str._str_intern`` for strided dense tensors; the values are
    formatted by torch's own code.
    """
    prefix = "tensor("
    indent = len(prefix)
    suffixes = [f"device='{t.device}'"]
    default = torch.get_default_dtype()
    default_complex = torch.cdouble if default == torch.double else torch.cfloat
    has_default_dtype = t.dtype in (default, default_complex, torch.int64, torch.bool)
    with torch.no_grad():
        if t.numel() == 0:
            if t.dim() != 1:
                suffixes.append(f"size={tuple(t.shape)}")
            if t.dtype != default:
                suffixes.append(f"dtype={t.dtype}")
            contents = "[]"
        else:
            if not PRINT_OPTS.edgeitems:
                suffixes.append(f"size={tuple(t.shape)}")
            if not has_default_dtype:
                suffixes.append(f"dtype={t.dtype}")
            summarized = t.numel() > PRINT_OPTS.threshold
            if summarized and t.numel() * t.element_size() > _REPR_HOST_COPY_BYTES:
                contents = _summarized_str(t.detach(), indent)
            else:
                contents = _tensor_str(t.detach().cpu(), indent)
    try:
        grad_fn = t.grad_fn
        grad_fn_name = None if grad_fn is None else type(grad_fn).__name__
    except RuntimeError:
        grad_fn_name = "Invalid"
    if grad_fn_name == "CppFunction":
        grad_fn_name = t.grad_fn.name().rsplit("::", 1)[-1]
    if grad_fn_name is not None:
        suffixes.append(f"grad_fn=<{grad_fn_name}>")
    elif t.requires_grad:
        suffixes.append("requires_grad=True")
    text = _add_suffixes(prefix + contents, suffixes, indent, force_newline=False)
    if getattr(t, "_is_param", False):
        text = "Parameter containing:\n" + text
    return text


def _summarized_str(t: TPUTensor, indent: int) -> str:
    """torch's summarised text ("...") for a tensor over the print threshold.

    torch's printer reads only the first and last ``edgeitems`` entries of each long dim,
    but walking a device tensor element by element costs an op (and a compile) per
    entry. So gather those entries on the device and copy them to the host at once,
    keeping one filler entry in the middle so each long dim stays longer than
    ``2 * edgeitems`` and is still summarised; then format it as torch's ``_tensor_str``
    does, with summarising forced (the small copy itself may be under the threshold).
    """
    edge = PRINT_OPTS.edgeitems
    for dim, size in enumerate(t.shape):
        if size > 2 * edge:
            kept = [*range(edge), edge, *range(size - edge, size)]
            t = t.index_select(dim, torch.tensor(kept, device=t.device))
    host = t.cpu()
    if host.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        host = host.half()
    if host.dtype.is_complex:
        real = _Formatter(get_summarized_data(host.real))
        imag = _Formatter(get_summarized_data(host.imag))
        return _tensor_str_with_formatter(host, indent, True, real, imag)
    return _tensor_str_with_formatter(host, indent, True, _Formatter(get_summarized_data(host)))
