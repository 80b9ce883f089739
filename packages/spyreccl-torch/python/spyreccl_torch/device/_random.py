"""Random state of ``torch.spyre``: seeding, state get/set, the default generators.

Every device has a default generator, the C++ ``SpyreGeneratorImpl`` (counter-based like
CUDA's: its state is 16 bytes, seed then offset). The functions here work on those generator
objects only, through ``torch.Generator``'s methods, which call the C++ generator directly
(as ``torch.cuda.random`` does): no torch operator is dispatched on the state. So they work
under any active dispatch mode — ``FakeTensorMode``, DTensor's sharding propagation,
``LocalTensorMode`` (which saves and restores every accelerator's state around each rank's
step) — inside ``torch.compile`` tracing and in activation checkpointing's RNG preservation.
The generator's own ``get_state`` builds its tensor with the CPU allocator rather than a
dispatched ``empty``, so the state it returns is a real CPU tensor even under a fake mode.

spyre is also registered as a graph-safe RNG device with torch.compile: activation
checkpointing inside a compiled graph replays random ops (dropout, attention) in the backward
from generator states that it swaps in and out (graphsafe_get_state/set_state share one
(seed, offset) state object, as CUDA's do).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .._torch_compat import GRAPHSAFE_RNG_MINOR, TORCH_MINOR
from ._devices import _device_index, _DeviceLike, device_count
from ._import_hooks import after_import

__all__ = [
    "default_generators",
    "get_rng_state",
    "get_rng_state_all",
    "initial_seed",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "set_rng_state",
    "set_rng_state_all",
]

_U64 = 1 << 64

_generators: tuple[torch.Generator, ...] | None = None


def _fetch_generators() -> tuple[torch.Generator, ...]:
    """The default generator of every device, fetched once from the device library.

    The library hands them out through an operator (it has no Python bindings), so the
    fetch runs with Python dispatch disabled: a mode active at the first call must not
    intercept it. :func:`install` fetches them at registration, before any mode or
    compile can be active; the generator objects then live for the process.
    """
    global _generators
    if _generators is None:
        with torch._C._DisableTorchDispatch():
            fetch = torch.ops.spyreccl_device.default_generator
            _generators = tuple(fetch(index) for index in range(device_count()))
    return _generators


class _DefaultGenerators(Sequence[torch.Generator]):
    """``torch.spyre.default_generators``: the default generator of every device."""

    def __getitem__(self, index: int) -> torch.Generator:  # type: ignore[override]
        return _fetch_generators()[_device_index(index, optional=False)]

    def __len__(self) -> int:
        return device_count()

    def __iter__(self) -> Iterator[torch.Generator]:
        return iter(_fetch_generators())


default_generators = _DefaultGenerators()


def _get_generator(device: torch.device | int | str | None) -> torch.Generator:
    """The default generator of spyre ``device`` (its current device without an index)."""
    return _fetch_generators()[_device_index(device)]


def _to_unsigned(seed: int) -> int:
    """Maps a seed in [-2**63, 2**64) onto the uint64 a generator holds, with the
    wrap-around of torch.Generator.manual_seed (a negative seed is its two's complement)."""
    seed = int(seed)
    if not -(1 << 63) <= seed < _U64:
        raise RuntimeError(f"seed must be within [-2**63, 2**64), got {seed}")
    return seed % _U64


def manual_seed(seed: int) -> None:
    """Seeds the current device's default generator."""
    _get_generator(None).manual_seed(_to_unsigned(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the default generator of every spyre device."""
    value = _to_unsigned(seed)
    for generator in _fetch_generators():
        generator.manual_seed(value)


def seed() -> None:
    """Seeds the current device's default generator with a non-deterministic number."""
    _get_generator(None).seed()


def seed_all() -> None:
    """Seeds every device's default generator with one non-deterministic number."""
    first, *others = _fetch_generators()
    value = first.seed()
    for generator in others:
        generator.manual_seed(value)


def initial_seed() -> int:
    """The current device's default generator's seed."""
    return _get_generator(None).initial_seed()


def get_rng_state(device: _DeviceLike = "spyre") -> torch.Tensor:
    """State of ``device``'s default generator, as a CPU ``torch.uint8`` tensor of 16 bytes
    (uint64 seed, uint64 offset)."""
    return _get_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = "spyre") -> None:
    """Restores ``device``'s default generator from :func:`get_rng_state` output (a
    contiguous CPU ``torch.uint8`` tensor of 16 bytes; the generator checks it)."""
    # Handed to the generator as it is: converting it here (.to, .contiguous) would be a
    # torch operator, which an active dispatch mode intercepts.
    _get_generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    """:func:`get_rng_state` of every device."""
    return [generator.get_state() for generator in _fetch_generators()]


def set_rng_state_all(new_states: Sequence[torch.Tensor]) -> None:
    """:func:`set_rng_state` for devices 0, 1, ... from ``new_states``."""
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


def _register_graphsafe_rng() -> None:
    from torch._functorch._aot_autograd.utils import register_graphsafe_rng_device_type

    register_graphsafe_rng_device_type("spyre")


def install() -> None:
    """Fetches the default generators (see :func:`_fetch_generators`) and registers spyre
    as a graph-safe RNG device once compile's autograd utilities are imported."""
    _fetch_generators()
    if GRAPHSAFE_RNG_MINOR > TORCH_MINOR:
        return  # no graph-safe RNG devices before it (the user guide's torch versions table)
    after_import(
        "torch._functorch._aot_autograd.utils",
        _register_graphsafe_rng,
        "activation checkpointing of random ops in compiled spyre graphs",
    )
