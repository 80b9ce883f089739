"""Timing a tensor-parallel decode step: spyreccl, gloo and the compute floor side by side.

Used inside rank processes, with torch.distributed initialised, by the demo
(``examples/tp_llama.py``) and ``spyreccl-bench --mode decode`` (:mod:`.decode`).

A *variant* is one way to run the same decode step: the tensor-parallel model on spyre
tensors (its all_reduces go to spyreccl), the same on CPU tensors over a gloo group, and the
*compute floor*: the same per-rank shards run as a plain model with no collective (wrong
numbers, right timing; :func:`spyreccl_torch.models.llama.local_shard_model`). Each comes
eager and ``torch.compile``d. Variants are timed round by round in rotating order, so that
a change of machine load during the run touches all of them alike; a step's time is the
mean over the ranks of each rank's wall time of that step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..models.generate import generate
from ..models.llama import Llama

__all__ = [
    "InCallCosts",
    "Variant",
    "in_call_costs",
    "isolated_all_reduce_us",
    "mean_over_ranks",
    "percentile",
    "time_variants",
    "transferless_mesh",
]


@dataclass
class Variant:
    name: str  # e.g. "spyreccl eager", "floor compiled"
    model: Llama
    step: Callable[..., torch.Tensor]  # the model or its compiled form
    device: torch.device
    synchronize: Callable[[], None]
    ttft_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def _no_sync() -> None:
    return None


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "spyre":
        return torch.spyre.synchronize
    return _no_sync


def time_variants(
    variants: Sequence[Variant],
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    rounds: int,
    dtype: torch.dtype,
    barrier_group: Any,
    on_step: Callable[[], None] | None = None,
) -> None:
    """One untimed generation per variant (compiles the compiled ones, warms caches), then
    ``rounds`` timed generations of each, variants in rotating order; fills each variant's
    ``ttft_s`` and ``step_s`` with this rank's times. ``on_step`` is called after every
    decode step, outside its timed interval."""
    for v in variants:
        generate(
            v.model, prompts, new_tokens, device=v.device, dtype=dtype, step=v.step,
            synchronize=v.synchronize, on_step=on_step,
        )  # fmt: skip
    for r in range(rounds):
        order = list(variants[r % len(variants) :]) + list(variants[: r % len(variants)])
        for v in order:
            dist.barrier(group=barrier_group)
            g = generate(
                v.model, prompts, new_tokens, device=v.device, dtype=dtype, step=v.step,
                synchronize=v.synchronize, on_step=on_step,
            )  # fmt: skip
            v.ttft_s.append(g.ttft_s)
            v.step_s.extend(g.step_s)


# The backend name under which transferless_mesh's groups are made (this process only).
TRANSFERLESS_BACKEND = "spyreccl_bench_transferless"


def transferless_mesh(device_type: str, world_size: int) -> Any:
    """A DeviceMesh over all ``world_size`` ranks whose group moves nothing: torch's
    ``FakeProcessGroup`` (each collective returns at once, leaving its output as its input
    made it, every rank alone). A tensor-parallel model on it
    (:func:`spyreccl_torch.models.llama.rehome_tensor_parallel`) runs DTensor's whole eager
    dispatch, redistributions and the functional collectives' calls included, and compiled
    the same generated code (the same kernels, the collective calls in place), without any
    transfer or wait for a peer: the *DTensor floor*, the step with only the communication
    skipped (wrong numbers, right timing). Its collective calls take torch's generic path
    (c10d's dispatcher op) rather than spyreccl's lean one, which costs about what
    spyreccl's call costs without its transfer (docs/notes/tp-decode.md, *The DTensor
    floor*). Collective: every rank calls it at the same point. None where this torch has
    no FakeProcessGroup to build it from."""
    try:
        from torch._C._distributed_c10d import FakeProcessGroup

        create_internal = FakeProcessGroup._create_internal
    except (ImportError, AttributeError):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if TRANSFERLESS_BACKEND.upper() not in dist.Backend._plugins:

        def create(common_opts: Any, backend_opts: Any = None) -> Any:
            return create_internal(common_opts.group_rank, common_opts.group_size)

        # register_backend may make the new name a device's default where none is set yet;
        # this name is for explicit use only, so the defaults are put back as they were.
        defaults = dict(dist.Backend.default_device_backend_map)
        dist.Backend.register_backend(
            TRANSFERLESS_BACKEND, create, extended_api=True, devices=["cpu", device_type]
        )
        dist.Backend.default_device_backend_map.clear()
        dist.Backend.default_device_backend_map.update(defaults)
    group = dist.new_group(list(range(world_size)), backend=TRANSFERLESS_BACKEND)
    # A dimension name of its own: DeviceMesh equality ignores the groups, and DTensor caches
    # sharding decisions (the output specs, meshes included) by it, so an unnamed mesh over
    # the same ranks would be taken for the real one and get its collectives.
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(TRANSFERLESS_BACKEND,))


def mean_over_ranks(samples: Sequence[float], group: Any) -> list[float]:
    """Sample i averaged over the ranks (every rank has as many), through a CPU group."""
    t = torch.tensor(list(samples), dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile: no values")
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def isolated_all_reduce_us(
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    group: Any,
    form: str,
    barrier_group: Any,
    iters: int = 300,
    flush_bytes: int = 0,
) -> float:
    """Median latency (µs, this rank) of one all_reduce of ``numel`` elements as the decode
    step issues it, alone: ``functional`` is ``_c10d_functional.all_reduce`` +
    ``wait_tensor`` (what DTensor's eager redistribute calls); ``sync`` is
    ``dist.all_reduce`` (what a compiled graph's collective waited at once amounts to on
    spyre, see docs/user-guide.md).

    With ``flush_bytes``, every timed call follows a pass over a buffer of that many bytes
    on ``device`` (untimed, then a barrier): the caches hold none of the call's code or data,
    as in a decode step whose layer just streamed its weights through them. On the emulated
    device the model computes on the host's CPUs, so its collectives run cold; on a card the
    weights stream through the card's memory and the host's caches stay warm."""
    t = torch.randn(numel, dtype=torch.float32).to(device, dtype)
    functional = torch.ops._c10d_functional
    name = group.group_name
    if form == "functional":

        def call() -> object:
            return functional.wait_tensor(functional.all_reduce(t, "sum", name))
    elif form == "sync":

        def call() -> object:
            return dist.all_reduce(t, group=group)
    else:
        raise ValueError(f"isolated_all_reduce_us: unknown form {form!r}")
    for _ in range(20):
        call()
    flush = (
        torch.ones(flush_bytes // 4, dtype=torch.float32, device=device) if flush_bytes else None
    )
    dist.barrier(group=barrier_group)
    samples = []
    for _ in range(iters):
        if flush is not None:
            flush.mul_(1.0)
            dist.barrier(group=barrier_group)  # both ranks call at once, as alone above
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


@dataclass
class InCallCosts:
    """What each all_reduce of a decode step cost in the model, split by the ranks' records:
    ``in_call_us``, the median over calls of the time from the last rank's arrival to each
    rank's return (mean over the ranks): the collective itself, in the model's context; and
    ``wait_us``, the median over calls of the last arrival minus the first, the time a rank
    spent waiting for a slower one (rank skew: the ranks' compute differs, or one was
    descheduled). ``calls`` is how many calls of the decode size each rank recorded."""

    in_call_us: float
    wait_us: float
    calls: int


def in_call_costs(timelines: Sequence[Sequence[Sequence[int]]], numel: int) -> InCallCosts:
    """``timelines[r]`` holds rank r's (start ns, end ns, elements) per all_reduce, in call
    order (``manual_tensor_parallel(timeline=...)``), read on one clock shared by the ranks
    (CLOCK_MONOTONIC of one machine). Only calls of ``numel`` elements count (a decode
    step's, not a prefill's). Every rank makes the same calls in the same order; raises
    ValueError where the records disagree."""
    decode = [[c for c in t if c[2] == numel] for t in timelines]
    if not decode or any(len(t) != len(decode[0]) for t in decode):
        raise ValueError(
            f"in_call_costs: the ranks recorded {[len(t) for t in decode]} calls of {numel} "
            "elements; expected the same number on every rank"
        )
    if not decode[0]:
        raise ValueError(f"in_call_costs: no call of {numel} elements was recorded")
    in_call, wait = [], []
    for calls in zip(*decode):
        last = max(c[0] for c in calls)
        in_call.append(sum(c[1] - last for c in calls) / len(calls) / 1e3)
        wait.append((last - min(c[0] for c in calls)) / 1e3)
    return InCallCosts(statistics.median(in_call), statistics.median(wait), len(decode[0]))
