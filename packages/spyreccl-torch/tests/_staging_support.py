"""What the staged-path test modules share: memory the host cannot address, small chunks and
the pipeline forced on for every rank of their pools, and the backend's staging counters."""

from __future__ import annotations

CHUNK_BYTES = 4096
# Pipelines forced on: the staged-path tests prove what they do whatever the machine's core
# count (the default, auto, pipelines the emulated device's copies only given a spare core
# per rank; test_staged_path.py::test_auto_pipelines_where_a_core_is_spare checks that).
DISCRETE = {
    "SPYRECCL_SPYRE_MEMORY": "discrete",
    "SPYRECCL_STAGING_CHUNK_BYTES": str(CHUNK_BYTES),
    "SPYRECCL_STAGING_PIPELINE": "1",
}
POOL = {"backend": "cpu:gloo,spyre:spyreccl", "set_device": True}


def counters() -> dict[str, int]:
    """This process's staging counters (staging.h, StagingCounters)."""
    from spyreccl_torch import _C

    return _C._staging_counters()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}
