"""The flight recorder of spyreccl groups, in the format torch's analyzer reads.

Every collective and point-to-point call of every spyreccl group is recorded in a
process-wide ring (``TORCH_FR_BUFFER_SIZE``, alias ``TORCH_NCCL_TRACE_BUFFER_SIZE``, default
2000 entries, 0 turns recording off): group, sequence numbers, op, sizes, dtypes, state and
timestamps, the Python stack with ``SPYRECCL_FR_STACKS=1``. torch's own
``torch._C._distributed_c10d._dump_fr_trace`` reads only torch's recorder, which a backend
outside torch cannot reach; :func:`dump` returns the same pickle for spyreccl's records, and
:func:`write_dump` writes it where torch writes its own dumps, so that
``python -m torch.distributed.flight_recorder.fr_trace <folder>`` (torchfrtrace) reads it.

spyreccl writes that dump by itself on every rank of a group that fails (timeout, mismatch,
peer failure, abort) when ``TORCH_FR_DUMP_TEMP_FILE`` or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``
is set. See docs/reliability.md, "Debugging a hung job".
"""

from __future__ import annotations

import os

import torch.distributed as dist

from . import _C

__all__ = ["dump", "dump_path", "reset", "write_dump"]

_DUMP_FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
# torch's default when neither variable is set.
_DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"


def dump(
    include_collectives: bool = True,
    include_stack_traces: bool = True,
    only_active: bool = False,
) -> bytes:
    """This process's records as torch's ``_dump_fr_trace`` returns NCCL's: a pickled dict
    with ``version``, ``pg_config``, ``pg_status``, ``comm_lib_version`` and ``entries``.
    Stacks are only present when they were recorded (``SPYRECCL_FR_STACKS=1``)."""
    return _C._dump_flight_recorder(include_collectives, include_stack_traces, only_active)


def dump_path(rank: int | None = None) -> str:
    """Where torch (and spyreccl) write the dump of global `rank` (default: this process's
    rank in the default group): the prefix from ``TORCH_FR_DUMP_TEMP_FILE`` /
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (torch's default ``/tmp/nccl_trace_rank_``) + rank."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    prefix = next(
        (os.environ[name] for name in _DUMP_FILE_VARIABLES if os.environ.get(name)),
        _DEFAULT_PREFIX,
    )
    return f"{prefix}{rank}"


def write_dump(rank: int | None = None, only_active: bool = False) -> str:
    """Writes :func:`dump` to :func:`dump_path` (creating its folder) and returns the path."""
    path = dump_path(rank)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    data = dump(only_active=only_active)
    with open(path, "wb") as out:
        out.write(data)
    return path


def reset() -> None:
    """Forgets the recorded entries of this process (the groups stay known); record ids
    start again at 0. Call it on every rank at the same point (the analyzer aligns the
    ranks' dumps by record id), e.g. between the phases of a job."""
    _C._reset_flight_recorder()
