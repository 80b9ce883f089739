"""The Python-side differences between the torch releases spyreccl-torch supports (2.10 to
2.15), each decided here once from the running torch's version.

Each name says which release brought what it needs; what an older torch cannot do raises
:func:`require`'s error naming the release it needs (the user guide's "torch versions"
table lists them).
"""

from __future__ import annotations

import torch

# (major, minor) of the running torch, e.g. (2, 10) for "2.10.0+cu128".
TORCH_MINOR: tuple[int, int] = tuple(  # type: ignore[assignment]
    int(part) for part in torch.__version__.split("+")[0].split(".")[:2]
)

# Inductor's C++ wrapper (cpp_wrapper=True) for spyre graphs: written against the wrapper
# codegen of torch 2.13 (per-mode device headers, the collective shims it emits).
CPP_WRAPPER_MINOR = (2, 13)

# Graph-safe RNG devices (torch._functorch._aot_autograd.utils.register_graphsafe_rng_device_type),
# which compiled graphs that checkpoint random ops need: torch 2.13.
GRAPHSAFE_RNG_MINOR = (2, 13)


# Where inductor's C++ code generation learns a device's ATen device type (``at::k...``):
# up to torch 2.14 from the dict ``torch._inductor.codegen.cpp_utils.DEVICE_TO_ATEN``; from
# 2.15 from the device's registered ``DeviceOpOverrides.aten_device_type()`` (the dict is
# gone, and a device without the method cannot be compiled for at all).
ATEN_DEVICE_TYPE_FROM_OVERRIDES_MINOR = (2, 15)


def require(minor: tuple[int, int], what: str) -> None:
    """Raises a RuntimeError saying that `what` needs torch >= `minor` when torch is older."""
    if minor > TORCH_MINOR:
        raise RuntimeError(
            f"spyreccl: {what} needs torch >= {minor[0]}.{minor[1]}; this is torch "
            f"{torch.__version__}"
        )
