"""What a task function can learn about the rank it runs on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankContext:
    """Passed as the keyword argument `ctx` to task functions that declare a `ctx` parameter.

    rank / world_size / local_rank: this worker's position (all ranks are local: one host).
    backend: the backend string given to init_process_group (None: torch's default for the
        accelerator), or None as well when the pool runs without torch.distributed.
    device: "spyre:<rank>" when the pool set the spyre device, else None.
    shared_dir: a directory private to this pool and visible to every rank (for files used
        to exchange ids in torch-free pools, dumps, ...); removed when the pool shuts down.
    generation: how many times the pool has been (re)started; changes after a failure.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: str | None
    shared_dir: str
    generation: int
    distributed: bool
