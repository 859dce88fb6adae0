"""The tpu random number generator: counter-based, like CUDA's Philox.

Each device has a ``(seed, offset)`` state. A random op draws from the key
``fold_in(key(seed), offset)`` and advances ``offset`` by one. Both numbers are
*inputs* of the compiled op, never constants, so a training loop with dropout runs
one compiled function with fresh randomness each step. ``torch.manual_seed(s)``
resets every device (through ``torch.tpu.manual_seed_all``).
"""

from __future__ import annotations

import struct

import torch

from torchtpu import tracing

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

    Inside a trace they are the program's traced inputs instead (tracing.py).
    """
    if tracing._active is not None:
        return tracing._active.draw()
    drawn = peek(index)
    advance(index, 1)
    return drawn


def peek(index: int) -> tuple[int, int]:
    """The (seed, offset) the next random op on ``tpu:index`` will draw from."""
    state = _state(index)
    # As int64: JIT arguments are signed; the key only needs the bits.
    seed = state.seed - (1 << 64) if state.seed >= 1 << 63 else state.seed
    return seed, state.offset


def advance(index: int, n: int) -> None:
    """Move past ``n`` draws (a compiled program's random ops, after it ran)."""
    _state(index).offset += n


def key(seed, offset):
    """The PRNG key for one random op (traced inside the op's compiled function)."""
    from torchtpu.runtime import jax

    random = jax().random
    return random.fold_in(random.key(seed), offset)


def get_state(index: int) -> torch.Tensor:
    """The state as a uint8 CPU tensor (16 bytes: seed and offset, little-endian)."""
    state = _state(index)
    raw = struct.pack("<QQ", state.seed, state.offset)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def set_state(new_state: torch.Tensor, index: int) -> None:
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("RNG state must be a torch.ByteTensor")
    raw = bytes(new_state.cpu().contiguous().tolist())
    if len(raw) != 16:
        raise RuntimeError(f"tpu RNG state must have 16 bytes, got {len(raw)}")
    seed, offset = struct.unpack("<QQ", raw)
    state = _state(index)
    state.seed, state.offset = seed, offset
