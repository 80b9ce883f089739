"""Random-number plumbing of ``torch.spyre`` beyond seeding and state (in spyre_module).

``default_generators`` and ``_get_generator`` expose the devices' default generators (the
C++ ``SpyreGeneratorImpl``, counter-based like CUDA's), and spyre is registered as a
graph-safe RNG device with torch.compile: activation checkpointing inside a compiled graph
replays random ops (dropout, attention) in the backward from generator states that it swaps
in and out, which spyre's generator supports (graphsafe_get_state/set_state share one
(seed, offset) state object, as CUDA's do).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from . import spyre_module
from ._import_hooks import after_import

__all__ = ["default_generators"]


class _DefaultGenerators(Sequence[torch.Generator]):
    """``torch.spyre.default_generators``: the default generator of every device, fetched
    from the device library on first use (it is not loaded yet when this module is)."""

    def __getitem__(self, index: int) -> torch.Generator:  # type: ignore[override]
        index = spyre_module._device_index(index, optional=False)
        return torch.ops.spyreccl_device.default_generator(index)

    def __len__(self) -> int:
        return spyre_module.device_count()

    def __iter__(self) -> Iterator[torch.Generator]:
        return (self[i] for i in range(len(self)))


default_generators = _DefaultGenerators()


def _get_generator(device: torch.device) -> torch.Generator:
    """The default generator of spyre ``device`` (its current device without an index)."""
    return default_generators[spyre_module._device_index(device)]


def _register_graphsafe_rng() -> None:
    from torch._functorch._aot_autograd.utils import register_graphsafe_rng_device_type

    register_graphsafe_rng_device_type("spyre")


def install() -> None:
    after_import(
        "torch._functorch._aot_autograd.utils",
        _register_graphsafe_rng,
        "activation checkpointing of random ops in compiled spyre graphs",
    )
