"""The tpu random number generator: counter-based, like CUDA's Philox.

Each device has a ``(seed, offset)`` state. A random op draws from the key
``fold_in(key(seed), offset)`` and advances ``offset`` by one. Both numbers are
*inputs* of the compiled op, never constants, so a training loop with dropout runs
one compiled function with fresh randomness each step. ``torch.manual_seed(s)``
resets every device (through ``torch.tpu.manual_seed_all``).
"""

from __future__ import annotations

import contextlib
import secrets
import struct
import threading
import weakref

import torch

from torchtpu import tracing
from torchtpu.runtime.backend import current_index

# CUDA's default seed, so an unseeded run is reproducible as it is on a GPU.
DEFAULT_SEED = 67280421310721
_MAX_SEED = 0xFFFF_FFFF_FFFF_FFFF


class _State:
    __slots__ = ("seed", "offset")

    def __init__(self, seed: int):
        self.seed = seed
        self.offset = 0


_states: dict[int, _State] = {}
_default_seed = DEFAULT_SEED  # for devices whose state is not made yet


def _state(index: int) -> _State:
    state = _states.get(index)
    if state is None:
        state = _states[index] = _State(_default_seed)
    return state


def _normalise(seed) -> int:
    seed = int(seed)
    if not -0x8000_0000_0000_0000 <= seed <= _MAX_SEED:
        raise RuntimeError(f"Overflow when unpacking long long: seed {seed} is out of range")
    return seed + _MAX_SEED + 1 if seed < 0 else seed


def manual_seed(seed, index: int) -> None:
    state = _state(index)
    state.seed = _normalise(seed)
    state.offset = 0


def manual_seed_all(seed) -> None:
    """Reset every device, including those not used yet."""
    global _default_seed
    _default_seed = _normalise(seed)
    for state in _states.values():
        state.seed, state.offset = _default_seed, 0


def initial_seed(index: int) -> int:
    return _state(index).seed


def take(index: int) -> tuple[int, int]:
    """The (seed, offset) for the next random op on ``tpu:index``; advances the offset.
    Inside `drawing_from` they come from that generator instead.

    Inside a trace they are the program's traced inputs instead (tracing.py).
    """
    drawing = getattr(_thread, "drawing", None)
    if tracing._active is not None:
        if drawing is not None:
            raise NotImplementedError(
                "a torch.Generator(device='tpu') passed to a random op inside a compiled "
                "program (torch.compile / torchtpu.jit): compiled programs draw from the "
                "device's generator; seed it with torch.manual_seed instead"
            )
        return tracing._active.draw()
    state = drawing if drawing is not None else _state(index)
    drawn = _as_signed(state)
    state.offset += 1
    return drawn


def peek(index: int) -> tuple[int, int]:
    """The (seed, offset) the next random op on ``tpu:index`` will draw from."""
    return _as_signed(_state(index))


def _as_signed(state: _State) -> tuple[int, int]:
    # As int64: JIT arguments are signed; the key only needs the bits.
    seed = state.seed - (1 << 64) if state.seed >= 1 << 63 else state.seed
    return seed, state.offset


def advance(index: int, n: int) -> None:
    """Move past ``n`` draws (a compiled program's random ops, after it ran)."""
    _state(index).offset += n


def key(seed, offset):
    """The PRNG key for one random op (traced inside the op's compiled function)."""
    from torchtpu.runtime import jax, policy

    random = jax().random
    return random.fold_in(random.key(seed, impl=policy.prng_impl()), offset)


def get_state(index: int) -> torch.Tensor:
    """The state as a uint8 CPU tensor (16 bytes: seed and offset, little-endian)."""
    return _pack(_state(index))


def set_state(new_state: torch.Tensor, index: int) -> None:
    _unpack(new_state, _state(index))


def _pack(state: _State) -> torch.Tensor:
    raw = struct.pack("<QQ", state.seed, state.offset)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _unpack(new_state: torch.Tensor, state: _State) -> None:
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("RNG state must be a torch.ByteTensor")
    raw = bytes(new_state.cpu().contiguous().tolist())
    if len(raw) != 16:
        raise RuntimeError(f"tpu RNG state must have 16 bytes, got {len(raw)}")
    state.seed, state.offset = struct.unpack("<QQ", raw)


# -- torch.Generator(device="tpu") -------------------------------------------------------
#
# Note [tpu generators from Python]
#     torch makes a device's generators through the PrivateUse1 hooks' getNewGenerator,
#     which torch 2.13's Python hooks cannot override. So a tpu generator is a
#     ``torch.Generator`` subclass built on a CPU generator that serves only as its
#     identity: torch hands a generator to kernels as a new Python object around the
#     same C++ generator (never the object the user made), so the C++ generator is
#     seeded with a random *tag* at creation, and ops look their tpu generator up by
#     ``initial_seed()``, which reads that tag. The generator's own state is a
#     (seed, offset) pair like the device's; its Python methods read and write it.
#     ``torch.Generator`` itself becomes a factory (device.py) that makes this class
#     for a tpu device and torch's own otherwise.

_TorchGenerator = torch._C.Generator
_by_tag: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class TPUGenerator(_TorchGenerator):
    """``torch.Generator(device="tpu")``: its own counter-based (seed, offset) state,
    drawn from by the random ops it is passed to."""

    def __new__(cls, device="tpu"):
        return super().__new__(cls, "cpu")

    def __init__(self, device="tpu"):
        device = torch.device(device)
        self._device = torch.device("tpu", device.index or 0)
        self._state = _State(_default_seed)
        tag = secrets.randbits(63) | 1 << 62  # far from the seeds people choose
        super().manual_seed(tag)
        _by_tag[tag] = self

    @property
    def device(self) -> torch.device:
        return self._device

    def manual_seed(self, seed) -> TPUGenerator:
        self._state.seed, self._state.offset = _normalise(seed), 0
        return self

    def seed(self) -> int:
        seed = secrets.randbits(63)
        self.manual_seed(seed)
        return seed

    def initial_seed(self) -> int:
        return self._state.seed

    def get_state(self) -> torch.Tensor:
        return _pack(self._state)

    def set_state(self, new_state: torch.Tensor) -> TPUGenerator:
        _unpack(new_state, self._state)
        return self

    def __reduce__(self):
        return _rebuild, (self._device.index, bytes(self.get_state().tolist()))

    def __repr__(self) -> str:
        return f"<torch.Generator device={self._device}>"


class _GeneratorFactory(type):
    """The metaclass of ``torch.Generator`` once tpu is registered: calling it makes a
    tpu generator for a tpu device and torch's own generator otherwise, and
    ``isinstance``/``issubclass`` answer for torch's class, so CPU code sees no
    change. (Note [tpu generators from Python] says why.)"""

    def __call__(cls, device=None):
        if device is not None and torch.device(device).type == "tpu":
            if isinstance(device, str) and ":" not in device:
                device = torch.device("tpu", current_index())
            return TPUGenerator(device)
        return _TorchGenerator() if device is None else _TorchGenerator(device)

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _TorchGenerator)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, _TorchGenerator)

    def __getattr__(cls, name):
        return getattr(_TorchGenerator, name)


class Generator(metaclass=_GeneratorFactory):
    __doc__ = torch._C.Generator.__doc__


def _rebuild(index: int, state: bytes) -> TPUGenerator:
    generator = TPUGenerator(torch.device("tpu", index))
    return generator.set_state(torch.tensor(list(state), dtype=torch.uint8))


def state_of(generator, op) -> _State:
    """The state of the tpu generator ``generator`` (as torch passed it to ``op``)."""
    found = _by_tag.get(_TorchGenerator.initial_seed(generator))
    if found is None:
        raise RuntimeError(
            f"{op}: Expected a 'tpu' device type for generator but found '{generator.device.type}'"
        )
    return found._state


_thread = threading.local()  # .drawing: the generator state random ops draw from


@contextlib.contextmanager
def drawing_from(state: _State):
    """Random ops inside (on this thread) draw from ``state``, a generator's, instead
    of the device's."""
    previous = getattr(_thread, "drawing", None)
    _thread.drawing = state
    try:
        yield
    finally:
        _thread.drawing = previous
