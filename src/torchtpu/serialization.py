"""``torch.save`` / ``torch.load`` of tpu tensors, and ``torch.load(map_location=...)``.

A tpu tensor has no torch storage (its data is a JAX array), and torch cannot make a
storage on the tpu device either: ``torch.UntypedStorage(n, device="tpu")`` has no
allocator to call. torch's loader, though, restores every saved *storage* first
(``map_location`` names where) and only then builds tensors on them. So:

- Saving: a tpu tensor pickles as torch pickles a CPU tensor, on a host image of its
  storage whose saved location is the tpu device (Note [Saving tpu tensors]).
- Loading a CPU storage to tpu (``map_location="tpu"``, ``torch.device("tpu")``,
  ``{"cpu": "tpu"}``, a callable returning None for a tpu location): the storage
  deserializer registered here keeps the storage on the CPU and marks it with the
  tpu device it is meant for; torch's ``_rebuild_tensor`` is wrapped so that a tensor
  built on a marked storage moves there. (torch offers no hook between restoring a
  storage and building the tensor on it; the wrapper changes nothing for any other
  storage.)
- Either way, tensors that shared a storage in the file share one tpu storage after
  loading (`to_tpu_sharing`), as on the CPU: ``{"b": b, "v": b[2:]}`` loads as a tensor
  and its view.

Nothing here imports JAX.

Note [Saving tpu tensors]
    torch.save writes a tensor as its storage (saved once, with a *location* tag)
    and its offset, size and strides; torch.load restores each storage where
    ``map_location`` maps its location, then rebuilds the tensors on them. A tpu
    tensor is saved that way too: `reduce_tpu_tensor` gives torch's own
    ``_rebuild_tensor_v2`` call on the CPU image of its storage, and the tag of that
    image (`_tag`) is the tpu device. So the file holds nothing but torch's own
    globals and a storage at ``"tpu:0"``: a process without torchtpu (autoload
    off, or not installed) loads it with ``map_location="cpu"``, even with
    ``weights_only=True``, into plain CPU tensors; with torchtpu the storage goes to
    tpu as a CPU checkpoint's does with ``map_location="tpu"`` (below), whatever
    ``map_location`` says, a callable included. Files saved by earlier versions call
    `rebuild_tpu_tensor`, which is kept for them.
"""

from __future__ import annotations

import collections
import re

import torch

# Attribute of a restored CPU storage naming the tpu device its tensors belong on.
_TARGET = "_torchtpu_load_to"

_TPU_LOCATION = re.compile(r"tpu(:[0-9]+)?")


# Attribute of the CPU image of a tpu storage being saved: the tpu device it is saved from.
_SAVED_FROM = "_torchtpu_saved_from"


def reduce_tpu_tensor(values: torch.Tensor, device: str, requires_grad: bool) -> tuple:
    """How a tpu tensor pickles (Note [Saving tpu tensors]): ``values``, a CPU view of
    the host image of its storage, as torch pickles a CPU tensor, the image's storage
    saved with the location ``device``."""
    setattr(values.untyped_storage(), _SAVED_FROM, device)
    return (
        torch._utils._rebuild_tensor_v2,
        (
            values._typed_storage(),
            values.storage_offset(),
            tuple(values.size()),
            values.stride(),
            requires_grad,
            collections.OrderedDict(),
        ),
    )


def rebuild_tpu_tensor(data: torch.Tensor, dtype, location: str, requires_grad: bool):
    """Unpickle a tensor saved from ``location`` (a tpu device) with values ``data`` (the
    format of files saved before Note [Saving tpu tensors])."""
    map_location = torch.serialization._serialization_tls.map_location
    if map_location is None:
        target = location
    elif isinstance(map_location, dict):
        target = map_location.get(location, location)
    elif isinstance(map_location, (str, bytes, torch.device)):
        target = map_location.decode() if isinstance(map_location, bytes) else map_location
    else:
        # As torch calls it for a storage saved at ``location``: the result is the
        # storage the tensor lives on, or None for the default (the saved device).
        storage = map_location(data.untyped_storage(), location)
        if isinstance(storage, torch.TypedStorage):
            storage = storage._untyped_storage
        if storage is None:
            target = location
        else:
            tensor = torch.empty(0, dtype=data.dtype, device=storage.device).set_(
                storage, data.storage_offset(), data.size(), data.stride()
            )
            tensor.requires_grad = requires_grad
            return tensor
    if data.device.type == "tpu":  # its storage was mapped to tpu: moved already
        tensor = data.to(dtype=dtype, device=target)
    elif torch.device(target).type == "tpu":
        tensor = to_tpu_sharing(data, target)
    else:
        tensor = data.to(dtype=dtype, device=target)  # on the CPU: views of the image
    tensor.requires_grad = requires_grad
    return tensor


# Attribute of a loaded CPU storage: its copy on tpu, per (device, dtype).
_ON_TPU = "_torchtpu_on_tpu"


def to_tpu_sharing(data: torch.Tensor, target) -> torch.Tensor:
    """The loaded CPU tensor ``data`` on tpu device ``target``, sharing a tpu storage
    with every other tensor loaded from the same storage, as they share theirs on the
    CPU (Note [Saving views] in tensor.py). A tensor that is its whole storage (a
    parameter) is moved as it is; the others are views of the storage's copy."""
    storage = data.untyped_storage()
    copies = getattr(storage, _ON_TPU, None)
    if copies is None:
        copies = {}
        setattr(storage, _ON_TPU, copies)
    key = (str(target), data.dtype)
    whole = copies.get(key)
    covers = (
        data.storage_offset() == 0
        and data.is_contiguous()
        and data.numel() * data.element_size() == storage.nbytes()
    )
    if whole is None and covers:
        whole = copies[key] = data.to(target)
        return whole
    if whole is None:
        flat = torch.empty(0, dtype=data.dtype).set_(
            storage, 0, (storage.nbytes() // data.element_size(),), (1,)
        )
        whole = copies[key] = flat.to(target)
    return whole.as_strided(data.shape, data.stride(), data.storage_offset()).detach()


def _tag(storage) -> str | None:
    """The location saved for ``storage``: a tpu device for the image of a tpu storage."""
    return getattr(storage, _SAVED_FROM, None)


def _deserialize(storage, location: str):
    """Restore a saved storage whose (mapped) location is a tpu device."""
    if not _TPU_LOCATION.fullmatch(location):
        return None
    target = torch.device(location)
    if target.index is not None:
        from torchtpu.runtime import devices

        def device_count() -> int:
            return len(devices())

        if target.index >= device_count():
            raise RuntimeError(
                f"Attempting to deserialize object on TPU device {target.index} but "
                f"torch.tpu.device_count() is {device_count()}. Please use torch.load with "
                "map_location to map your storages to an existing device."
            )
    untyped = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
    setattr(untyped, _TARGET, target)
    return storage


_torch_rebuild_tensor = None


def _rebuild_tensor(storage, storage_offset, size, stride):
    tensor = _torch_rebuild_tensor(storage, storage_offset, size, stride)
    target = getattr(storage._untyped_storage, _TARGET, None)
    return tensor if target is None else to_tpu_sharing(tensor, target)


def register() -> None:
    global _torch_rebuild_tensor
    if _torch_rebuild_tensor is not None:
        return
    # Before torch's CPU tagger (priority 10), which would tag the image of a tpu
    # storage "cpu", and its PrivateUse1 deserializer (23), which would ask for a
    # storage on the tpu device. Both return None for any other storage.
    torch.serialization.register_package(9, _tag, _deserialize)
    torch.serialization.add_safe_globals([rebuild_tpu_tensor])
    _torch_rebuild_tensor = torch._utils._rebuild_tensor
    torch._utils._rebuild_tensor = _rebuild_tensor
